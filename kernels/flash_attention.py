"""
kernels/flash_attention.py: FlashAttention-2 style tiled attention in Triton, forward and backward, returning
the log-sum-exp so context parallelism can merge partial results (train_cp.py's ring). Replaces model.py's
AttentionCore (F.scaled_dot_product_attention) via apply_kernels. It follows the design of Triton's fused-attention
tutorial (06-fused-attention), on any shape: ragged lengths, Tq != Tk, head dims that are not a power of two.

    o, lse = flash_attention(q, k, v, causal=True)      # q [B, H, Tq, D], k, v [B, H, Tk, D]; lse [B, H, Tq]

Scores in base 2: s2 = q k^T * (log2(e) / sqrt(D)), one multiply, and exp2 (the GPU's native exponential)
throughout, so e^(s - m) = 2^(s2 - m2); the stored lse is natural (lse = ln 2 * (m2 + log2 l)) for CP's merge.
Forward, one program per (head, block of BLOCK_M queries), streaming over blocks of BLOCK_N keys (online softmax):
    m' = max(m, rowmax s2);  l = l * 2^(m - m') + rowsum 2^(s2 - m');  acc = acc * 2^(m - m') + 2^(s2 - m') v
    at the end  o = acc / l
in two stages: the key blocks wholly left of the causal diagonal and inside Tk need no mask (most of them), then
the blocks on the diagonal and the ragged tail are masked:
    keys ->  [ stage 1: no mask, no where() per tile ... | stage 2: diagonal, tail ]   (non-causal: only the tail)
Backward: kernels/flash_attention_backward.py (a delta pre-pass, then one kernel for dK, dV and dQ).
q, k, v are read through their strides: the model's [B, T, H, D] layout seen as [B, H, T, D] needs no copy;
tile addressing and tile configs: kernels/attention_tiles.py. Forward and backward are autotuned separately.

Memory: eager attention writes and re-reads the [Tq, Tk] scores and probabilities per head (and keeps the
probabilities for backward: B*H*T^2 values); this kernel keeps O(T*D) per head in HBM, only o and lse.
Causal masking is top-left aligned (key j visible to query i when j <= i), as F.scaled_dot_product_attention's
is_causal. Precision: 16-bit and fp32 inputs are computed in fp32 (lse in fp32); float64 inputs (the exactness
runs) in float64 throughout, lse included.
"""
import math

import torch

from kernels.attention_tiles import check_dtype, dense_last, launch_args, tile_configs, tile_grid
from kernels.backend import HAS_TRITON, compute_dtype, tl, triton, use_triton
from kernels.flash_attention_backward import flash_attention_backward

# BLOCK_M queries per program, BLOCK_N keys per step (BLOCK_M a multiple of BLOCK_N), warps, pipeline stages
FWD_SHAPES = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2))

if HAS_TRITON:
    from kernels.attention_tiles import (KEY, LN2, LOG2E, _dense_head_start, _dot, _head_start, _key_range,
                                         _offsets, _program_tile, _tile)

    @triton.jit
    def _fwd_steps(acc, l_i, m_i, q, K, V, rows, d, lo, hi, Tk, D, skt, svt, QK2: tl.constexpr, MASK: tl.constexpr,
                   CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
        """The online softmax over key blocks [lo, hi), scores in base 2; MASK: blocks that cross the diagonal or Tk.
        m stays finite: each row's first block holds a key it sees (key lo <= row0, lo < Tk)."""
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            s = _dot(q, tl.trans(_tile(K, cols, d, Tk, D, skt)), PREC, UPCAST) * QK2
            if MASK:
                valid = cols[None, :] < Tk
                if CAUSAL:
                    valid = valid & (cols[None, :] <= rows[:, None])
                s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _tile(V, cols, d, Tk, D, svt)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
            m_i = m_new
        return acc, l_i, m_i

    @triton.autotune(configs=tile_configs(FWD_SHAPES, (32, 32, 4, 1)), key=KEY)
    @triton.jit
    def _attn_fwd(Q, K, V, O, LSE, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, H, Tq, Tk, D, Tq_bucket, Tk_bucket,
                  SCALE: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
        tl.static_assert(BLOCK_M % BLOCK_N == 0)
        bh, pid_m = _program_tile(Tq, BLOCK_M)
        Q, K, V = Q + _head_start(bh, H, sqb, sqh), K + _head_start(bh, H, skb, skh), V + _head_start(bh, H, svb, svh)
        O, LSE = O + _dense_head_start(bh, Tq, D), LSE + _dense_head_start(bh, Tq, 1)     # this head's rows
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q = _tile(Q, rows, d, Tq, D, sqt)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
        l_i = tl.zeros([BLOCK_M], dtype=ACC)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
        unmasked, hi = _key_range(pid_m * BLOCK_M, Tk, CAUSAL, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, K, V, rows, d, 0, unmasked, Tk, D, skt, svt, SCALE * LOG2E,
                                   False, CAUSAL, BLOCK_N, PREC, UPCAST)
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, K, V, rows, d, unmasked, hi, Tk, D, skt, svt, SCALE * LOG2E,
                                   True, CAUSAL, BLOCK_N, PREC, UPCAST)
        tl.store(O + _offsets(rows, d, D), (acc / l_i[:, None]).to(O.dtype.element_ty),
                 mask=(rows[:, None] < Tq) & (d[None, :] < D))
        tl.store(LSE + rows, (m_i + tl.log2(l_i)) * LN2, mask=rows < Tq)


def flash_attention_forward(q, k, v, causal=True):
    """The Triton forward alone: (o [B, H, Tq, D] contiguous, lse [B, H, Tq] in fp32, float64 for float64 inputs).
    For callers with their own backward (ring attention)."""
    check_dtype(q, k, v)
    q, k, v = dense_last(q), dense_last(k), dense_last(v)
    B, H, Tq, D = q.shape
    o = torch.empty(B, H, Tq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Tq, device=q.device, dtype=compute_dtype(q))
    qkv_strides, shape, meta = launch_args(q, k, v)
    _attn_fwd[tile_grid(B * H, Tq, "BLOCK_M")](q, k, v, o, lse, *qkv_strides, *shape, CAUSAL=causal, **meta)
    return o, lse


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_attention_forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)       # lse is an output for merging, its gradient is not propagated
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return (*flash_attention_backward(do, q, k, v, o, lse, ctx.causal), None)


def attention_reference(q, k, v, causal=True):
    """The definition, with the full [Tq, Tk] scores: (softmax(q k^T / sqrt(D)) v, logsumexp of the scores)."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        Tq, Tk = q.shape[-2], k.shape[-2]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    s = s if s.dtype == torch.float64 else s.float()          # softmax in fp32 at least (float64 stays)
    return torch.softmax(s, dim=-1).to(q.dtype) @ v, torch.logsumexp(s, dim=-1)


def flash_attention(q, k, v, causal=True, backend="auto"):
    """(softmax(q k^T / sqrt(D)) v, lse): q [B, H, Tq, D], k, v [B, H, Tk, D]; lse [B, H, Tq] in fp32 (float64
    for float64 inputs)."""
    if use_triton(q, backend):
        return FlashAttentionFunction.apply(q, k, v, causal)
    return attention_reference(q, k, v, causal)
