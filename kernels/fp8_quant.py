"""
kernels/fp8_quant.py: FP8 quantization by definition, in plain torch: the |x| maxima per scaling group and the
saturating cast they scale (kernels/fp8.py's recipes; kernels/fp8_cast.py's fused Triton kernels are tested
against this bit for bit, and it is their CPU path).

    granularity  one scale per                      amax shape of a [R, K] tensor
    tensor       the whole tensor                   []
    row          row                                [R, 1]
    tile         1 x 128 tile along K               [R, ceil(K/128)]
    block        128 x 128 block                    [ceil(R/128), ceil(K/128)]

    scale s = fp8_max / max(amax, AMAX_EPS),   q = clamp(x * s, -fp8_max, fp8_max) -> fp8,   x ~ q / s
"""
import torch
import torch.nn as nn

from kernels.fp8_gemm import BLOCK

E4M3 = getattr(torch, "float8_e4m3fn", None)
E5M2 = getattr(torch, "float8_e5m2", None)
AMAX_EPS = 1e-12              # amax floor: an all-zero tensor gets a finite scale


def fp8_max(dtype):
    return torch.finfo(dtype).max


def amax(t, granularity):
    """|t| maxima of a 2-D tensor [R, K] over: the whole tensor ('tensor') -> [], each row ('row') -> [R, 1],
    1 x 128 tiles along K ('tile') -> [R, ceil(K/128)], or 128 x 128 blocks ('block') -> [ceil(R/128), ceil(K/128)]."""
    a = t.detach().abs().float()
    if granularity == "tensor":
        return a.amax()
    if granularity == "row":
        return a.amax(dim=1, keepdim=True)
    R, K = a.shape
    a = nn.functional.pad(a, (0, -K % BLOCK, 0, -R % BLOCK if granularity == "block" else 0))
    if granularity == "tile":
        return a.view(R, -1, BLOCK).amax(dim=2)
    return a.view(a.shape[0] // BLOCK, BLOCK, -1, BLOCK).amax(dim=(1, 3))


def per_element(scale, granularity, shape):
    """Broadcast a scale from amax()'s layout to one value per element of a [R, K] tensor."""
    if granularity in ("tensor", "row"):
        return scale
    R, K = shape
    if granularity == "block":
        scale = scale.repeat_interleave(BLOCK, dim=0)[:R]
    return scale.repeat_interleave(BLOCK, dim=1)[:, :K]


def scale_of(a, dtype):
    """The scale that maps an amax (any layout) to the format's largest value."""
    return fp8_max(dtype) / a.clamp_min(AMAX_EPS)


def quantize(t, dtype, granularity, amax_value=None):
    """(fp8 tensor, scale) with t * scale -> fp8 (saturating); amax_value overrides the measured amax (delayed)."""
    a = amax(t, granularity) if amax_value is None else amax_value
    scale = scale_of(a, dtype)
    q = (t.float() * per_element(scale, granularity, t.shape)).clamp(-fp8_max(dtype), fp8_max(dtype))
    return q.to(dtype), scale


def dequantize(q, scale, granularity):
    return q.float() / per_element(scale, granularity, q.shape)
