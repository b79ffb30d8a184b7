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
