"""Shared pytest setup: the repo root on sys.path, Triton in interpreter mode when there is no GPU."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# must be set before triton is first imported (kernel tests run the Triton code on CPU tensors)
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A directory with train.bin / val.bin / meta.json of synthetic tokens (vocab 64)."""
    from train_helpers import make_tiny_dataset
    return make_tiny_dataset(str(tmp_path_factory.mktemp("tiny_data")))


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """Real text (a few standard-library modules as bytes, vocab 256): the exactness checks' data."""
    from train_helpers import make_text_dataset
    return make_text_dataset(str(tmp_path_factory.mktemp("text_data")))


@pytest.fixture(scope="session")
def text_reference(text_data, tmp_path_factory):
    """train_single's float64 exactness-check run on text_data (one micro-batch of 8): ((losses, grad norms),
    {name: final parameter}), what every technique's float64 parity test compares against."""
    from train_helpers import run_single, text_argv
    out = str(tmp_path_factory.mktemp("text_reference"))
    return run_single(text_argv(text_data, out, micro_batch_size=8), both_curves=True)
