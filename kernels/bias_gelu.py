"""
kernels/bias_gelu.py: the two Megatron elementwise fusions, bias + GeLU and bias + dropout + residual add.
They replace the bias add of MLP.c_fc, its nn.GELU, and the bias add + dropout + residual add after MLP.c_proj
(apply_kernels swaps model.py's Block for FusedBlock); the seeds cite about +11% throughput for such fusions.

    bias_gelu(x, b)                    = gelu(x + b),  gelu(z) = z * Phi(z) = z/2 * (1 + erf(z / sqrt 2))  (exact)
        d/dz gelu(z) = Phi(z) + z * exp(-z^2 / 2) / sqrt(2 pi)
    bias_dropout_add(x, b, r, p, train) = r + dropout_p(x + b)

Memory traffic for a tensor of E values of s bytes: eager does x + b (read 2 write 1), then gelu (read 1 write
1) and keeps both x + b and the GeLU input for backward: 5E*s moved, 2E*s kept. Fused: read x, write y (2E*s),
and only x is kept (z = x + b is recomputed in backward). bias_dropout_add: eager moves 3 + 2 + 3 = 8E*s and
keeps a byte mask; fused moves 3E*s (read x and r, write y) and keeps nothing: the dropout mask is regenerated
in backward from (seed, tile, offset) by the Philox counter-based generator instead of stored.

Grid: 2-D, a program per tile of ROWS rows x BLOCK_N columns of x viewed as [M, N] (backend.row_tile): the bias
slice is loaded once per program and broadcast over its rows, offsets inside a tile are int32 (no per-element
64-bit `% N`). The bias gradient comes from the backward kernel itself: each program also writes the column sums
of its dx tile (partials [M / ROWS, N] in fp32, 1/16 of dx's bytes or less), then one sum over the partials: no
second pass over dx. The dropout seed is drawn on the device (a one-element tensor the kernels read), so a step
never waits for the GPU to hand the host a number.

Precision: computed in fp32 for 16-bit and fp32 tensors and in float64 when x is float64; the dropout rate is a
constexpr so that 1 / (1 - p) is exact in a float64 kernel (a runtime float argument reaches a GPU kernel as fp32).
"""
import torch
import torch.nn.functional as F

from kernels.backend import (HAS_TRITON, compute_dtype, compute_type, maybe_compiled, next_pow2, row_tile, tl, triton,
                             use_triton)

if HAS_TRITON:
    @triton.jit
    def _gelu_parts(z):
        """(Phi(z), z * phi(z)): gelu(z) = z * Phi(z), gelu'(z) = Phi(z) + z * phi(z)."""
        return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)), z * tl.exp(-0.5 * z * z) * 0.3989422804014327

    @triton.jit
    def _bias_gelu_fwd(X, Bias, Y, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
        start, offs, mask, cols = row_tile(M, N, ROWS, BLOCK_N)
        b = tl.load(Bias + cols, mask=cols < N, other=0.0).to(ACC)           # once per program, for ROWS rows
        z = tl.load(X + start + offs, mask=mask, other=0.0).to(ACC) + b[None, :]
        cdf, _ = _gelu_parts(z)
        tl.store(Y + start + offs, (z * cdf).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd(X, Bias, DY, DX, DBp, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
        start, offs, mask, cols = row_tile(M, N, ROWS, BLOCK_N)
        b = tl.load(Bias + cols, mask=cols < N, other=0.0).to(ACC)
        z = tl.load(X + start + offs, mask=mask, other=0.0).to(ACC) + b[None, :]
        cdf, zpdf = _gelu_parts(z)
        dx = tl.load(DY + start + offs, mask=mask, other=0.0).to(ACC) * (cdf + zpdf)     # 0 outside [M, N]
        tl.store(DX + start + offs, dx.to(DX.dtype.element_ty), mask=mask)
        _store_column_sums(DBp, dx, cols, N)

    @triton.jit
    def _store_column_sums(DBp, dx, cols, N):
        """Row tile i's share of the bias gradient: DBp[i, cols] = sum over its rows of dx."""
        tl.store(DBp + tl.cast(tl.program_id(0), tl.int64) * N + cols, tl.sum(dx, axis=0), mask=cols < N)

    @triton.jit
    def _keep(Seed, offs, P: tl.constexpr):
        """The dropout mask of one tile: Philox counters (offset in the tile, row tile, column tile) are unique per
        element, so the backward regenerates the same mask from the same seed on the same grid."""
        c0 = offs.to(tl.uint32)
        zero = c0 * 0
        r, _, _, _ = tl.philox(tl.load(Seed), c0, zero + tl.program_id(0), zero + tl.program_id(1), zero)
        return tl.uint_to_uniform_float(r) >= P

    @triton.jit
    def _bias_dropout_add_fwd(X, Bias, R, Y, Seed, M, N, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                              DROPOUT: tl.constexpr, ACC: tl.constexpr):
        start, offs, mask, cols = row_tile(M, N, ROWS, BLOCK_N)
        b = tl.load(Bias + cols, mask=cols < N, other=0.0).to(ACC)
        z = tl.load(X + start + offs, mask=mask, other=0.0).to(ACC) + b[None, :]
        if DROPOUT:
            z = tl.where(_keep(Seed, offs, P), z / (1.0 - P), 0.0)
        y = tl.load(R + start + offs, mask=mask, other=0.0).to(ACC) + z
        tl.store(Y + start + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _dropout_bwd(DY, DX, DBp, Seed, M, N, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     ACC: tl.constexpr):
        start, offs, mask, cols = row_tile(M, N, ROWS, BLOCK_N)
        dy = tl.load(DY + start + offs, mask=mask, other=0.0).to(ACC)
        dx = tl.where(_keep(Seed, offs, P), dy / (1.0 - P), 0.0)
        tl.store(DX + start + offs, dx.to(DX.dtype.element_ty), mask=mask)
        _store_column_sums(DBp, dx, cols, N)


def _tiles(x2):
    """(ROWS, BLOCK_N, launch options, grid) for x2 [M, N]: on a GPU 32 x 256 elements a program on 8 warps
    (32 values a thread); under the interpreter, where each program costs Python time (per operation, not per
    element), 32 x 128."""
    M, N = x2.shape
    block_n = min(256 if x2.is_cuda else 128, next_pow2(N))
    rows = 8192 // block_n if x2.is_cuda else 32
    return rows, block_n, dict(num_warps=8 if x2.is_cuda else 4), (triton.cdiv(M, rows), triton.cdiv(N, block_n))


def _rows(t, n):
    return t.reshape(-1, n).contiguous()


def _partials(x2, rows):
    """The per-row-tile column sums a backward kernel writes: [row tiles, N] in the compute dtype."""
    return torch.empty(triton.cdiv(x2.shape[0], rows), x2.shape[1], device=x2.device, dtype=compute_dtype(x2))


def _sum_to_bias(g, bias):
    return g.reshape(-1, bias.numel()).sum(0, dtype=compute_dtype(g)).to(bias.dtype)


class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x2 = _rows(x, bias.numel())
        y = torch.empty_like(x2)
        rows, block_n, options, grid = _tiles(x2)
        _bias_gelu_fwd[grid](x2, bias, y, *x2.shape, ROWS=rows, BLOCK_N=block_n, ACC=compute_type(x2), **options)
        ctx.save_for_backward(x2, bias)        # z = x + b is recomputed, not stored
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx = torch.empty_like(x2)
        rows, block_n, options, grid = _tiles(x2)
        db = _partials(x2, rows)
        _bias_gelu_bwd[grid](x2, bias, _rows(dy, x2.shape[1]), dx, db, *x2.shape, ROWS=rows, BLOCK_N=block_n,
                             ACC=compute_type(x2), **options)
        return dx.view(ctx.shape), db.sum(0).to(bias.dtype)


class BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, training):
        x2, r2 = _rows(x, bias.numel()), _rows(residual, bias.numel())
        y = torch.empty_like(r2)
        dropout = training and p > 0
        # a fresh seed from torch's generator on x's device (--seed makes runs reproducible; the mask is never
        # stored), left there: the kernels read it, the host never waits for it
        seed = torch.randint(0, 2 ** 31 - 1, (1,), device=x.device) if dropout else \
            torch.zeros(1, device=x.device, dtype=torch.int64)
        rows, block_n, options, grid = _tiles(x2)
        # computed in the residual stream's precision (fp32 under autocast, where x is 16-bit; float64 in float64)
        _bias_dropout_add_fwd[grid](x2, bias, r2, y, seed, *x2.shape, P=float(p), ROWS=rows, BLOCK_N=block_n,
                                    DROPOUT=dropout, ACC=compute_type(residual), **options)
        ctx.dropout, ctx.p, ctx.x_dtype, ctx.shape = dropout, p, x.dtype, residual.shape
        ctx.save_for_backward(bias, seed)
        return y.view(residual.shape)

    @staticmethod
    def backward(ctx, dy):
        bias, seed = ctx.saved_tensors
        if not ctx.dropout:         # dx = dy: the bias gradient is the one pass there is to make
            return dy.to(ctx.x_dtype), _sum_to_bias(dy, bias), dy, None, None
        dy2 = _rows(dy, bias.numel())
        dx = torch.empty(dy2.shape, device=dy.device, dtype=ctx.x_dtype)
        rows, block_n, options, grid = _tiles(dy2)
        db = _partials(dy2, rows)
        _dropout_bwd[grid](dy2, dx, db, seed, *dy2.shape, P=float(ctx.p), ROWS=rows, BLOCK_N=block_n,
                           ACC=compute_type(dy2), **options)
        return dx.view(ctx.shape), db.sum(0).to(bias.dtype), dy, None, None


def bias_gelu_reference(x, bias):
    return F.gelu(x + bias)


def bias_dropout_add_reference(x, bias, residual, p, training):
    return residual + F.dropout(x + bias, p, training)


def bias_gelu(x, bias, backend="auto"):
    """gelu(x + bias) with the exact erf GeLU; bias [N] broadcasts over the last dimension of x."""
    if use_triton(x, backend):
        return BiasGeluFunction.apply(x, bias)
    return maybe_compiled(bias_gelu_reference, backend)(x, bias)


def bias_dropout_add(x, bias, residual, p=0.0, training=True, backend="auto"):
    """residual + dropout(x + bias, p) (dropout only when training and p > 0)."""
    if use_triton(x, backend):
        return BiasDropoutAddFunction.apply(x, bias, residual, p, training)
    return maybe_compiled(bias_dropout_add_reference, backend)(x, bias, residual, p, training)

