"""bench/mixture_share.py draws what the loader draws; bench/fragmentation.py replays every mode and refuses a GPU
run without a GPU in one line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))


def _corpus(path, n=5_000):
    os.makedirs(path, exist_ok=True)
    for split in ("train", "val"):
        (np.arange(n) % 64).astype(np.uint16).tofile(os.path.join(path, f"{split}.bin"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(dict(vocab_size=64, tokenizer="synthetic"), f)
    return path


def test_mixture_share_draws_the_loaders_sources(tmp_path):
    import mixture_share
    from common.data_mix import MixtureLoader
    weights = [0.5, 0.3, 0.2]
    dirs = [_corpus(str(tmp_path / f"s{k}")) for k in range(3)]
    loader = MixtureLoader(list(zip(dirs, weights)), 8, 16, seed=7)
    counts = mixture_share.drawn_counts(weights, 7, 16, 40)
    for step in range(40):
        assert (counts[step] == np.bincount(loader.global_batch(step)[0], minlength=3)).all()
    mixture_share.write_outputs(["a", "b", "c"], weights, counts, str(tmp_path / "out"), "test")
    table = open(tmp_path / "out" / "mixture_share.md").read()
    assert os.path.getsize(tmp_path / "out" / "mixture_share.png") > 0 and table.count("| yes |") == 3


def test_fragmentation_replays_every_mode():
    import fragmentation
    for mode, flags in fragmentation.MODES.items():
        peaks = fragmentation.replay("cpu", n_layer=2, n_embd=32, tokens=64, steps=1, **flags)
        assert peaks["held"] > 0, mode


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_fragmentation_gpu_variant_without_gpu_is_one_line():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fragmentation.py"), "--device", "cuda"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.strip().startswith("error:") and "\n" not in proc.stderr.strip()
