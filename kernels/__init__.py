"""
kernels/: fused Triton kernels and FP8, each with a plain-torch reference path (see each file's docstring).

    from kernels import layer_norm, rms_norm, swiglu, bias_gelu, bias_dropout_add, flash_attention, linear_cross_entropy
    from kernels import apply_kernels, Float8Linear, convert_to_float8
    apply_kernels(model, "triton")      # swap model.py's modules for the fused ones, parameters unchanged

Every function takes backend="auto" | "triton" | "torch" | "compile" (auto: torch until a Triton kernel is
measured faster on a GPU; see apply.py).

Hugging Face's `kernels` package has the same name; this package answers for it too (hub_name.py).
"""
from kernels import hub_name
from kernels.apply import MODES, apply_kernels, resolve_mode
from kernels.backend import HAS_TRITON
from kernels.bias_gelu import bias_dropout_add, bias_gelu
from kernels.flash_attention import (attention_reference, flash_attention, flash_attention_backward,
                                     flash_attention_forward)
from kernels.fp8 import RECIPES, Float8Linear, convert_to_float8, fp8_matmul, sqnr_db
from kernels.layer_norm import layer_norm
from kernels.linear_cross_entropy import linear_cross_entropy
from kernels.rms_norm import rms_norm
from kernels.swiglu import swiglu

__all__ = ["MODES", "apply_kernels", "resolve_mode", "HAS_TRITON", "bias_dropout_add", "bias_gelu",
           "attention_reference", "flash_attention", "flash_attention_backward", "flash_attention_forward",
           "RECIPES", "Float8Linear", "convert_to_float8", "fp8_matmul", "sqnr_db", "layer_norm",
           "linear_cross_entropy", "rms_norm", "swiglu"]

# Hugging Face's package of the same name, when installed: its files join this package's, its names are looked up
_HUB = hub_name.hub_spec()
if _HUB is not None:
    __path__.extend(_HUB.submodule_search_locations)


def __getattr__(name):
    return hub_name.lookup(name, _HUB is not None)
