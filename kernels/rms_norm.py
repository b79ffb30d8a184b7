"""
kernels/rms_norm.py: fused RMSNorm, the Llama family's norm (ln_1, ln_2, ln_f under --arch llama | qwen2 |
mixtral): layer_norm.py's kernels without the mean and the bias. Replaces model.py's nn.RMSNorm via apply_kernels.

    y = x * rstd * w,   rstd = 1 / sqrt(mean(x^2) + eps)
    dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * w,   xhat = x * rstd
    dw = sum_rows dy * xhat      (per-program partial sums [G, N], then layer_norm.py's column reduction)

Tiles, programs and warps are layer_norm.py's (its helpers, imported): G programs loop over row tiles, w is loaded
once per program, the backward's dw partials are per program. Only rstd (a value per row) is saved for backward.

    from kernels import rms_norm
    y = rms_norm(x, weight, eps=1e-5)              # backend: auto | triton | torch | compile

Precision: as layer_norm.py's, 16-bit and fp32 rows are normalized in fp32, float64 rows in float64 (rstd and the
dw partials too), with eps a constexpr.
"""
import torch
import torch.nn.functional as F

from kernels.backend import HAS_TRITON, compute_dtype, compute_type, maybe_compiled, next_pow2, tl, triton, use_triton
from kernels.layer_norm import (_backward_tile, _n_programs, _num_warps, _row_tile, _rows_per_tile, backward_buffers,
                                column_sums)

if HAS_TRITON:
    @triton.jit
    def _rms_fwd(X, Y, W, Rstd, M, N, EPS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 ACC: tl.constexpr):
        # program p normalizes row tiles p, p + G, p + 2G, ... (G programs): w is loaded once per program
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
        for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
            x_ptrs, mask, rows = _row_tile(X, tile, M, N, ROWS, BLOCK_N)
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(ACC)         # the ragged tail loads as 0: adds nothing
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + EPS)
            y_ptrs, _, _ = _row_tile(Y, tile, M, N, ROWS, BLOCK_N)
            tl.store(y_ptrs, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)
            tl.store(Rstd + rows, rstd, mask=rows < M)

    @triton.jit
    def _rms_bwd(X, DY, DX, W, Rstd, DWp, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
        # program p handles row tiles p, p+G, p+2G, ... and keeps its share of dw in registers
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
        dw = tl.zeros([BLOCK_N], dtype=ACC)
        for tile in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
            x, dy, dx_ptrs, mask, rows = _backward_tile(X, DY, DX, tile, M, N, ROWS, BLOCK_N, ACC)
            rstd = tl.load(Rstd + rows, mask=rows < M, other=0.0)
            xhat = x * rstd[:, None]
            g = dy * w[None, :]
            c = tl.sum(xhat * g, axis=1) / N
            tl.store(dx_ptrs, ((g - xhat * c[:, None]) * rstd[:, None]).to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(DWp + pid * N + cols, dw, mask=cols < N)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape, N = x.shape, x.shape[-1]
        x2 = x.reshape(-1, N).contiguous()
        M = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(M, device=x.device, dtype=compute_dtype(x))
        R = _rows_per_tile(x2, next_pow2(N))
        _rms_fwd[(_n_programs(triton.cdiv(M, R), x2.device),)](
            x2, y, weight.contiguous(), rstd, M, N, EPS=eps, ROWS=R, BLOCK_N=next_pow2(N), ACC=compute_type(x),
            num_warps=_num_warps(R * next_pow2(N)))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2, dx, R, G, (dw_part,) = backward_buffers(x2, dy, 1)
        _rms_bwd[(G,)](x2, dy2, dx, weight.contiguous(), rstd, dw_part, M, N, ROWS=R, BLOCK_N=next_pow2(N),
                       ACC=compute_type(x2), num_warps=_num_warps(R * next_pow2(N)))
        return dx.view(ctx.shape), column_sums(dw_part, weight), None


def rms_norm_reference(x, weight, eps=1e-5):
    """The definition: PyTorch's own RMSNorm over the last dimension."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(x, weight, eps=1e-5, backend="auto"):
    """RMSNorm over the last dimension of x with weight [N] (no bias, no mean subtracted)."""
    if use_triton(x, backend):
        return RMSNormFunction.apply(x, weight, eps)
    return maybe_compiled(rms_norm_reference, backend)(x, weight, eps)
