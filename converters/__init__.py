"""
converters/: what a script's main applies to its model by flag, before training, in one call: the fused kernels
(--kernels), FP8 GEMMs (--fp8) in model.py's Linear layers and inside train_tp's layers, ZeRO-3's gathers of FP8
weights, --compile, CP's fused block attention, and ZeRO-R's partitioned activations under TP. A rung's building
blocks never import it; it imports no rung (train_tp's layers are met by class name), so it sits below them.

    apply.py                   apply_kernels_and_fp8 (the one call), compiled, the FP8 all-gather's check
    fp8_tp.py                  FP8 GEMMs inside tensor-parallel layers (amax reductions over tp)
    tp_gemms.py                train_tp's layers given slots for other GEMMs (FP8) and a deferred dW (zero-bubble)
    fp8_gather.py              ZeRO-3's all-gather in FP8
    cp_kernels.py              CP's block attention on the fused kernels (aten's flash pair, Triton's, the CPU's)
    partition_activations.py   ZeRO-R's Pa under TP: 1/tp of each recomputed block's input kept, gathered back
"""
import importlib.util
import os
import sys


def _take_back_kernels_name():
    """Hugging Face's `kernels` package (transformers >= 5.25) has our kernels/'s name. Where it was imported
    before this repository's root was on sys.path, put ours in its place: ours answers for both (kernels/hub_name.py),
    and keeps the loaded one as `kernels._hub`, whose classes transformers already holds."""
    loaded = sys.modules.get("kernels")
    if loaded is None or hasattr(loaded, "apply_kernels"):
        return
    sys.modules["kernels._hub"] = loaded
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    spec = importlib.util.spec_from_file_location("kernels", os.path.join(ours, "__init__.py"),
                                                  submodule_search_locations=[ours])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


_take_back_kernels_name()
