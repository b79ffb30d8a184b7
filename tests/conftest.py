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
import triton_interpreter  # noqa: E402,F401  (the interpreter without its repeated patching: speed only)


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
def text_reference_for(text_data, tmp_path_factory):
    """text_reference_for(model) -> train_single's float64 exactness-check run of train_helpers.MODELS[model] on
    text_data (one micro-batch of 8): ((losses, grad norms), {name: final parameter}), run once per session."""
    from train_helpers import MODELS, run_single, text_argv
    cache = {}

    def reference(model="L2"):
        if model not in cache:
            out = str(tmp_path_factory.mktemp(f"text_reference_{model}"))
            cache[model] = run_single(text_argv(text_data, out, micro_batch_size=8, **MODELS[model]), both_curves=True)
        return cache[model]
    return reference


@pytest.fixture(scope="session")
def text_reference(text_reference_for):
    """The float64 reference of the default tiny model (MODELS["L2"]), what most parity tests compare against."""
    return text_reference_for("L2")


@pytest.fixture(scope="session")
def text_reference_triton(text_data, tmp_path_factory):
    """train_single --kernels triton (interpreted, float64) on text_data, 2 steps in micro-batches of 2: (losses,
    grad norms), the reference of the fused kernels under the other layouts (TRITON_TWO_STEPS), run once."""
    from train_helpers import TRITON_TWO_STEPS, run_single, text_argv
    out = str(tmp_path_factory.mktemp("text_reference_triton"))
    return run_single(text_argv(text_data, out, kernels="triton", **TRITON_TWO_STEPS), both_curves=True)[0]


@pytest.fixture(autouse=True)
def release_out_dir_locks():
    """A run's main() called in this process holds its out_dir lock until the process ends; a test's runs end
    with the test, so a later test's subprocess may write the same directory."""
    yield
    from common.checkpoint.files import release_out_dir_locks
    release_out_dir_locks()
