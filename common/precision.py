"""
precision.py: --dtype made concrete for every script: the compute dtype, the parameters' dtype, the autocast
context that runs matmuls in 16 bits, and TF32 for fp32 matmuls on a GPU.
"""
import contextlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(cfg, device):
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.dtype]


def param_dtype(dtype):
    """Parameters, gradients and optimizer state: fp32 (16-bit compute comes from autocast), or float64 for
    the exactness check (docs/parity.md), where every tensor of the run is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_context(dtype, device):
    """Mixed precision by autocast: matmuls in 16 bits, parameters and optimizer state stay fp32."""
    if dtype in (torch.float32, torch.float64):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def enable_tf32(device):
    """fp32 matmuls on a CUDA GPU in TF32 (tensor cores, 10-bit mantissa), the same in every script; no-op on CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
