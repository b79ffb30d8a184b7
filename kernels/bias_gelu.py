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
in backward from (seed, offset) by the Philox counter-based generator instead of stored.

Precision: computed in fp32 for 16-bit and fp32 tensors and in float64 when x is float64; the dropout rate is a
constexpr so that 1 / (1 - p) is exact in a float64 kernel (a runtime float argument reaches a GPU kernel as fp32).
"""
import torch
import torch.nn.functional as F

from kernels.backend import (HAS_TRITON, block_offsets, compute_dtype, compute_type, maybe_compiled, tl, triton,
                             use_triton)

BLOCK = 1024

if HAS_TRITON:
    @triton.jit
    def _bias_gelu_fwd(X, Bias, Y, numel, N, BLOCK: tl.constexpr, ACC: tl.constexpr):
        offs = block_offsets(tl.program_id(0), BLOCK)
        mask = offs < numel
        z = tl.load(X + offs, mask=mask, other=0.0).to(ACC) + tl.load(Bias + offs % N, mask=mask, other=0.0).to(ACC)
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd(X, Bias, DY, DX, numel, N, BLOCK: tl.constexpr, ACC: tl.constexpr):
        offs = block_offsets(tl.program_id(0), BLOCK)
        mask = offs < numel
        z = tl.load(X + offs, mask=mask, other=0.0).to(ACC) + tl.load(Bias + offs % N, mask=mask, other=0.0).to(ACC)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327          # 1 / sqrt(2 pi)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
        tl.store(DX + offs, (dy * (cdf + z * pdf)).to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_dropout_add_fwd(X, Bias, R, Y, numel, N, seed, P: tl.constexpr, BLOCK: tl.constexpr,
                              DROPOUT: tl.constexpr, ACC: tl.constexpr):
        offs = block_offsets(tl.program_id(0), BLOCK)
        mask = offs < numel
        z = tl.load(X + offs, mask=mask, other=0.0).to(ACC) + tl.load(Bias + offs % N, mask=mask, other=0.0).to(ACC)
        if DROPOUT:
            keep = tl.rand(seed, offs) >= P       # same (seed, offset) -> same mask in backward
            z = tl.where(keep, z / (1.0 - P), 0.0)
        y = tl.load(R + offs, mask=mask, other=0.0).to(ACC) + z
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _dropout_bwd(DY, DX, numel, seed, P: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
        offs = block_offsets(tl.program_id(0), BLOCK)
        mask = offs < numel
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
        keep = tl.rand(seed, offs) >= P
        tl.store(DX + offs, tl.where(keep, dy / (1.0 - P), 0.0).to(DX.dtype.element_ty), mask=mask)


def _grid(numel):
    return (triton.cdiv(numel, BLOCK),)


def _sum_to_bias(g, bias):
    return g.reshape(-1, bias.numel()).sum(0, dtype=compute_dtype(g)).to(bias.dtype)


class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x = x.contiguous()
        y = torch.empty_like(x)
        _bias_gelu_fwd[_grid(x.numel())](x, bias, y, x.numel(), bias.numel(), BLOCK=BLOCK, ACC=compute_type(x))
        ctx.save_for_backward(x, bias)        # z = x + b is recomputed, not stored
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx = torch.empty_like(x)
        _bias_gelu_bwd[_grid(x.numel())](x, bias, dy.contiguous(), dx, x.numel(), bias.numel(), BLOCK=BLOCK,
                                         ACC=compute_type(x))
        return dx, _sum_to_bias(dx, bias)


class BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, training):
        x, residual = x.contiguous(), residual.contiguous()
        y = torch.empty_like(residual)
        dropout = training and p > 0
        # a fresh seed from torch's generator: --seed makes runs reproducible, the mask is never stored
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,))) if dropout else 0
        # computed in the residual stream's precision (fp32 under autocast, where x is 16-bit; float64 in float64)
        _bias_dropout_add_fwd[_grid(x.numel())](x, bias, residual, y, x.numel(), bias.numel(), seed, P=float(p),
                                                BLOCK=BLOCK, DROPOUT=dropout, ACC=compute_type(residual))
        ctx.dropout, ctx.p, ctx.seed, ctx.x_dtype = dropout, p, seed, x.dtype
        ctx.save_for_backward(bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        bias, = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dy
        if ctx.dropout:
            dx = torch.empty_like(dy)
            _dropout_bwd[_grid(dy.numel())](dy, dx, dy.numel(), ctx.seed, P=float(ctx.p), BLOCK=BLOCK,
                                            ACC=compute_type(dy))
        return dx.to(ctx.x_dtype), _sum_to_bias(dx, bias), dy, None, None


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

