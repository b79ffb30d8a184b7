"""bench/peer_nanogpt.py's working directory for nanoGPT: the dataset's vocabulary read from meta.json or from a
directory nanoGPT's own prepare.py wrote (meta.pkl only), so both run on the same prepared data."""
import argparse
import os
import pickle
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import peer_nanogpt  # noqa: E402


def test_workdir_from_a_nanogpt_prepared_directory(tmp_path):
    data, nanogpt, work = tmp_path / "shakespeare_char", tmp_path / "nanoGPT", tmp_path / "work"
    for d in (data, nanogpt, work):
        d.mkdir()
    chars = sorted(set("First Citizen:\nBefore we proceed"))
    for split in ("train", "val"):
        (np.arange(100) % len(chars)).astype(np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:           # what nanoGPT's data/shakespeare_char/prepare.py writes
        pickle.dump(dict(vocab_size=len(chars), itos=dict(enumerate(chars)),
                         stoi={c: i for i, c in enumerate(chars)}), f)
    (nanogpt / "configurator.py").write_text("")
    a = argparse.Namespace(data_dir=str(data), nanogpt_dir=str(nanogpt))
    assert peer_nanogpt.make_workdir(a, str(work)) == len(chars)
    with open(work / "data" / "nanoscale" / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {"vocab_size": len(chars)}
    assert os.path.realpath(work / "data" / "nanoscale" / "train.bin") == os.path.realpath(data / "train.bin")


NANOGPT_STDOUT = """tokens per iteration will be: 768
step 0: train loss 4.1676, val loss 4.1649
iter 0: loss 4.1819, time 40.00ms, mfu -100.00%
iter 1: loss 3.9000, time 20.00ms, mfu -100.00%
step 2: train loss 3.5000, val loss 3.6000
iter 2: loss 3.4000, time 25.00ms, mfu 0.01%
"""


def test_log_rows_with_evaluations():
    a = argparse.Namespace(global_batch_size=12, micro_batch_size=12, block_size=64, max_steps=2, eval_interval=2,
                           eval_iters=20, n_layer=4, n_head=4, n_embd=128, dropout=0.0, lr=1e-3, min_lr=1e-4,
                           warmup_steps=100, weight_decay=0.1, grad_clip=1.0)
    rows = peer_nanogpt.parse_log(NANOGPT_STDOUT, a, flops_per_token_over_peak=1e-6, peak_mem=1)
    assert [r["step"] for r in rows if "loss" in r] == [0, 1]                # iteration max_steps left out
    assert [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r] == [(0, 4.1649), (2, 3.6)]
    assert rows[1]["tokens_per_s"] == 12 * 64 / 0.040
    cmd = peer_nanogpt.nanogpt_command(argparse.Namespace(nanogpt_dir="n", **vars(a)), "t")
    assert "--max_iters=2" in cmd and "--eval_interval=2" in cmd and "--eval_iters=20" in cmd
    a.eval_interval = 0
    assert [r["step"] for r in peer_nanogpt.parse_log(NANOGPT_STDOUT, a, 1e-6, 1)] == [0, 1]
    cmd = peer_nanogpt.nanogpt_command(argparse.Namespace(nanogpt_dir="n", **vars(a)), "t")
    assert "--max_iters=1" in cmd and "--eval_iters=1" in cmd
