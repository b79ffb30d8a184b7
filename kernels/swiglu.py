"""
kernels/swiglu.py: the gated MLP's activation in one pass, silu(gate) * up, from c_fc's output whose rows hold
[gate | up] (model.py's SwiGLU MLP, the Llama family; apply_kernels swaps the gated MLP for FusedGatedMLP).

    y = silu(g) * u = g * s * u,   s = sigmoid(g) = 1 / (1 + exp(-g))          h = [g | u]: [M, 2F] -> y [M, F]
    du = dy * g * s,   dg = dy * u * s * (1 + g * (1 - s))                     dh = [dg | du]

Memory traffic for y of E values of s bytes: eager splits h (views), runs silu (read E, write E), multiplies
(read 2E, write E) and keeps gate, up and silu(gate) for backward: 5E*s moved, 3E*s kept. Fused: read 2E, write E,
and only h (2E) is kept; the backward reads h and dy, writes dh (5E*s) where eager moves about 9E*s.

Grid: bias_gelu.py's 2-D row tiles over y [M, F] (its tile sizes, imported); row r of h starts at 2F * r, so a
tile's gate and up are two loads F apart. Under tensor parallelism c_fc's column shard holds this rank's slice of
each half ([gate_r | up_r]), which this kernel takes as it is.

Precision: computed in fp32 for 16-bit and fp32 tensors and in float64 when h is float64 (backend.py).
"""
import torch
import torch.nn.functional as F

from kernels.backend import HAS_TRITON, compute_type, maybe_compiled, row_tile, tl, triton, use_triton
from kernels.bias_gelu import _tiles

if HAS_TRITON:
    @triton.jit
    def _gate_up(M, F, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """The tile of y [M, F] this program computes: (y's start and offsets, its mask, the same tile's gate in
        h [M, 2F] as a start and offsets); its up is F further. Row r of h starts at 2F * r."""
        start, offs, mask, cols = row_tile(M, F, ROWS, BLOCK_N)
        r = tl.arange(0, ROWS)
        return start, offs, mask, 2 * start, offs + r[:, None] * F

    @triton.jit
    def _swiglu_fwd(H, Y, M, F, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
        start, offs, mask, h_start, h_offs = _gate_up(M, F, ROWS, BLOCK_N)
        g = tl.load(H + h_start + h_offs, mask=mask, other=0.0).to(ACC)
        u = tl.load(H + h_start + F + h_offs, mask=mask, other=0.0).to(ACC)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(Y + start + offs, (g * s * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(H, DY, DH, M, F, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
        start, offs, mask, h_start, h_offs = _gate_up(M, F, ROWS, BLOCK_N)
        g = tl.load(H + h_start + h_offs, mask=mask, other=0.0).to(ACC)
        u = tl.load(H + h_start + F + h_offs, mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + start + offs, mask=mask, other=0.0).to(ACC)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(DH + h_start + h_offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + h_start + F + h_offs, (dy * g * s).to(DH.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        y = torch.empty(h2.shape[0], h2.shape[1] // 2, device=h.device, dtype=h.dtype)
        rows, block_n, options, grid = _tiles(y)
        _swiglu_fwd[grid](h2, y, *y.shape, ROWS=rows, BLOCK_N=block_n, ACC=compute_type(h2), **options)
        ctx.save_for_backward(h2)              # silu(gate) is recomputed, not stored
        ctx.shape = h.shape
        return y.view(*h.shape[:-1], y.shape[1])

    @staticmethod
    def backward(ctx, dy):
        (h2,) = ctx.saved_tensors
        dy2 = dy.reshape(h2.shape[0], -1).contiguous()
        dh = torch.empty_like(h2)
        rows, block_n, options, grid = _tiles(dy2)
        _swiglu_bwd[grid](h2, dy2, dh, *dy2.shape, ROWS=rows, BLOCK_N=block_n, ACC=compute_type(h2), **options)
        return dh.view(ctx.shape)


def swiglu_reference(h):
    """The definition, as model.py's MLP computes it: h's last dimension is [gate | up]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(h, backend="auto"):
    """silu(gate) * up of h [..., 2F] = [gate | up] -> [..., F]."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu takes [gate | up] rows of an even width, got {h.shape[-1]}")
    if use_triton(h, backend):
        return SwiGLUFunction.apply(h)
    return maybe_compiled(swiglu_reference, backend)(h)
