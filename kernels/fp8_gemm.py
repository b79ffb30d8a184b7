"""
kernels/fp8_gemm.py: the FP8 GEMM itself, torch._scaled_mm on operands kernels/fp8_cast.py quantized.

    y = scaled_gemm((qx.q, qx.inv), (qw.q, qw.inv), torch.bfloat16, "tensorwise", gemm_kind(x), fast_accum=True)

_scaled_mm multiplies a row-major A [M, K] by a column-major B (given here as its row-major transpose [N, K]),
each with 1/scales: one per tensor, one per row (A [M, 1], B [1, N]) or per row and 128-block of K (1x128,
sm_90 with cuBLAS >= 12.9). `kind` is kernels/fp8.py's gemm_kind: whose rules the call follows ("cpu", "cuda",
"cuda_blocks"); where no native block scales exist, blockwise runs as one row-scaled GEMM per 128-slice of K.
"""
import torch

BLOCK = 128                   # DeepSeek-V3's tile / block edge


def gemm_dtype(out_dtype, recipe, kind):
    """The output dtype _scaled_mm is asked for: bf16 for row and block scales on a GPU (the one every torch
    build's row-scaled kernels accept), else out_dtype where _scaled_mm can write it, else fp32."""
    if kind != "cpu" and recipe in ("rowwise", "blockwise"):
        return torch.bfloat16
    return out_dtype if out_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def takes_bias(out_dtype, recipe, kind):
    """Whether the GEMM adds a Linear's bias in its epilogue (no separate pass over y): it returns the Linear's own
    output dtype, 16-bit (CUDA's _scaled_mm refuses a bias with an fp32 output and wants it in the output's dtype),
    in one _scaled_mm (not blockwise's K/128 slices)."""
    out = gemm_dtype(out_dtype, recipe, kind)
    return out == out_dtype and out in (torch.bfloat16, torch.float16) and not _by_slices(recipe, kind)


def _by_slices(recipe, kind):
    return recipe == "blockwise" and kind != "cuda_blocks"


def scaled_gemm(a, b, out_dtype, recipe, kind, fast_accum=False, bias=None):
    """a = (qa [M, K], 1/scales) times b = (qb [N, K], 1/scales)^T, the scales as fp8_cast lays them out (an
    Fp8Cast's first two fields, or its last two: the transposed operand), accumulated in fp32,
    returned as gemm_dtype gives (padded rows and columns included). fast_accum: the Hopper FP8 tensor cores'
    faster, less precise accumulation (the forward GEMM only; gradients keep full accumulation, as torchao).
    bias [N] (only where takes_bias): added to every row by the GEMM itself, zero-padded to qb's rows."""
    out = gemm_dtype(out_dtype, recipe, kind)
    if _by_slices(recipe, kind):
        return _blockwise_by_slices(a, b, out)
    (qa, inv_a), (qb, inv_b) = a, b
    inv_b = inv_b.t()
    if kind == "cpu" and inv_a.numel() == 1:
        # CPU (torch 2.13): the per-tensor path is ~1000x slower than the per-row one; equal per-row scales
        # give the identical product
        inv_a = inv_a.expand(qa.shape[0], 1).contiguous()
        inv_b = inv_b.expand(1, qb.shape[0]).contiguous()
    # no fast accumulation for blockwise: DeepSeek-V3's recipe exists to keep the accumulation accurate
    if bias is not None:
        bias = torch.nn.functional.pad(bias.to(out), (0, qb.shape[0] - bias.shape[0]))
    return _scaled_mm(qa, qb, inv_a, inv_b, out, fast_accum and recipe != "blockwise", bias)


def _scaled_mm(qa, qb, inv_a, inv_b, out_dtype, fast_accum=False, bias=None):
    """qa [M, K] row-major times qb [N, K]^T (column-major, as cuBLASLt wants), scales passed as laid out by the
    caller: a thin wrapper that names the shapes when torch refuses them."""
    try:
        return torch._scaled_mm(qa, qb.t(), scale_a=inv_a, scale_b=inv_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    except RuntimeError as e:
        raise RuntimeError(f"torch._scaled_mm rejected {qa.dtype} {tuple(qa.shape)} x {qb.dtype} {tuple(qb.shape)}^T "
                           f"with scales {tuple(inv_a.shape)} x {tuple(inv_b.shape)} on {qa.device} "
                           f"(torch {torch.__version__}): {e}") from e


def _blockwise_by_slices(a, b, out_dtype):
    """Blockwise where no native 1x128 scales exist: per 128-wide slice of K the scales are per row of a and per
    row of b, a row-scaled GEMM; the K/128 partial products are added in fp32."""
    (qa, inv_a), (qb, inv_b) = a, b
    out = torch.zeros(qa.shape[0], qb.shape[0], device=qa.device, dtype=torch.float32)
    for kb, k0 in enumerate(range(0, qa.shape[1], BLOCK)):
        out += _scaled_mm(qa[:, k0:k0 + BLOCK].contiguous(), qb[:, k0:k0 + BLOCK].contiguous(),
                          inv_a[:, kb].unsqueeze(1), inv_b[:, kb].unsqueeze(0), out_dtype).float()
    return out


def unpadded(t, rows, cols):
    """t without the padding rows / columns a GPU GEMM's operands had (t itself when there were none)."""
    return t if t.shape == (rows, cols) else t[:rows, :cols]
