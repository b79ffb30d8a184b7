"""data.py: deterministic global batches, fixed slices per DP rank / micro-step, and preparation."""
import json
import os

import numpy as np
import torch

from data import GlobalBatchLoader, encode, write_dataset


def test_same_step_same_batch_and_different_steps_differ(tiny_data):
    a = GlobalBatchLoader(tiny_data, 16, 8, seed=5)
    b = GlobalBatchLoader(tiny_data, 16, 8, seed=5)
    x1, y1 = a.micro_batch(3, 0, 8)
    x2, y2 = b.micro_batch(3, 0, 8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, a.micro_batch(4, 0, 8)[0])
    assert not torch.equal(x1, GlobalBatchLoader(tiny_data, 16, 8, seed=6).micro_batch(3, 0, 8)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])          # targets are the inputs shifted by one


def test_slices_tile_the_global_batch(tiny_data):
    loader = GlobalBatchLoader(tiny_data, 16, 12, seed=1)
    full, _ = loader.micro_batch(7, 0, 12)
    for dp in (1, 2, 3):
        for mbs in (1, 2):
            per_rank = 12 // dp
            pieces = [loader.micro_batch(7, m, mbs, dp_rank=r, dp_size=dp)[0]
                      for r in range(dp) for m in range(per_rank // mbs)]
            assert torch.equal(torch.cat(pieces), full), (dp, mbs)


def test_val_split_is_separate(tiny_data):
    loader = GlobalBatchLoader(tiny_data, 16, 4, seed=1)
    assert not torch.equal(loader.micro_batch(0, 0, 4)[0], loader.micro_batch(0, 0, 4, split="val")[0])


def test_write_dataset_roundtrip(tmp_path):
    tokens, vocab = encode("héllo world\n".encode() * 50, "byte")
    assert vocab == 256 and tokens.dtype == np.uint16
    meta = write_dataset(str(tmp_path), tokens, vocab, "byte", "test")
    train = np.memmap(os.path.join(tmp_path, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(tmp_path, "val.bin"), dtype=np.uint16, mode="r")
    assert np.array_equal(np.concatenate([train, val]), tokens)
    assert json.load(open(os.path.join(tmp_path, "meta.json"))) == meta
    assert meta["train_tokens"] + meta["val_tokens"] == len(tokens)
