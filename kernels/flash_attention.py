"""
kernels/flash_attention.py: FlashAttention-2 style tiled attention in Triton, forward and backward, returning
the log-sum-exp so context parallelism can merge partial results (train_cp.py's ring). Replaces model.py's
AttentionCore (F.scaled_dot_product_attention) via apply_kernels.

    o, lse = flash_attention(q, k, v, causal=True)      # q [B, H, Tq, D], k, v [B, H, Tk, D]; lse [B, H, Tq]

Forward, per (batch*head, block of BLOCK_M queries), streaming over blocks of BLOCK_N keys (online softmax;
the tile shape is autotuned on a GPU):
    s = q k^T / sqrt(D);  m' = max(m, rowmax s);  l = l * e^(m - m') + rowsum e^(s - m');
    acc = acc * e^(m - m') + e^(s - m') v;   at the end  o = acc / l,  lse = m + log l
Backward recomputes p = e^(s - lse) tile by tile from the saved lse (no T x T matrix is ever stored):
    delta = rowsum(do * o);  dv = p^T do;  dp = do v^T;  ds = p * (dp - delta)
    dq = ds k / sqrt(D);  dk = ds^T q / sqrt(D)
(one kernel per key block for dk, dv and one per query block for dq: no atomics).

Memory: eager attention writes and re-reads the [Tq, Tk] scores and probabilities per head (and keeps the
probabilities for backward: B*H*T^2 values); this kernel keeps O(T*D) per head in HBM, only o and lse.
Causal masking is top-left aligned (key j visible to query i when j <= i), as F.scaled_dot_product_attention's
is_causal; ragged tails (T not a multiple of the block) and head dims that are not a power of two are masked.

Precision: 16-bit and fp32 inputs are computed in fp32 (lse in fp32); float64 inputs (the exactness runs) in
float64 throughout, lse included. On a GPU: one program per (head, block of rows) on grid axis 0 (axes 1 and 2
stop at 65535, so B*H there would cap the batch); row offsets in int64 (rows * stride passes 2^31 in a long
sequence of the model's [B, T, H, D] layout); the autotuner's key rounds Tq and Tk up to a power of two, so
sampling, whose length grows by one token a step, tunes about log2(T) times instead of T times.
"""
import math
import os

import torch

from kernels.backend import HAS_TRITON, compute_dtype, compute_type, next_pow2, tl, triton, use_triton


def _tile_configs():
    """Tile shapes to try: on a GPU the autotuner times each once per (Tq and Tk rounded up to a power of two, D,
    causal, dtypes) and keeps the fastest (a shape that exceeds shared memory or registers there is skipped, not
    fatal); the interpreter, which runs programs one by one in Python, gets one small tile."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4)]
    shapes = ((128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2))
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in shapes]


if HAS_TRITON:
    # Tq_bucket and Tk_bucket (next_pow2 of Tq and Tk) are kernel arguments only for this key
    autotune = triton.autotune(configs=_tile_configs(), key=["Tq_bucket", "Tk_bucket", "D", "CAUSAL"])

    @triton.jit
    def _head_start(bh, H, stride_b, stride_h):
        """Offset of head bh = b*H + h in a strided [B, H, T, D] tensor, in int64: program ids are int32 and
        b * stride_b wraps around once the tensor has 2^31 elements."""
        bh = tl.cast(bh, tl.int64)
        return (bh // H) * stride_b + (bh % H) * stride_h

    @triton.jit
    def _dense_head_start(bh, T, D):
        """Offset of head bh in a contiguous [B*H, T, D] tensor (o, do, dq, dk, dv; lse and delta: D = 1), int64."""
        return tl.cast(bh, tl.int64) * T * D

    @triton.jit
    def _program_tile(T, BLOCK: tl.constexpr):
        """(head bh, block index) of this program. The grid is one axis of B*H*cdiv(T, BLOCK) programs (CUDA
        allows 2^31 - 1 programs on axis 0 but 65535 on axes 1 and 2), head-major, so a head's blocks run side by
        side and share its K and V in L2."""
        n_blocks = tl.cdiv(T, BLOCK)
        pid = tl.program_id(0)
        return pid // n_blocks, pid % n_blocks

    @triton.jit
    def _offsets(rows, d, stride_t):
        """rows * stride_t + d as a [rows, d] tile of int64 offsets: row offsets pass 2^31 long before a tensor
        has 2^31 elements per head (the model's [B, T, H, D] layout strides rows by H*D)."""
        return tl.cast(rows, tl.int64)[:, None] * stride_t + d[None, :]

    @triton.jit
    def _tile(ptr, rows, d, T, D, stride_t):
        """A [rows, BLOCK_D] tile of one head's [T, D] matrix, zero outside it."""
        return tl.load(ptr + _offsets(rows, d, stride_t), mask=(rows[:, None] < T) & (d[None, :] < D), other=0.0)

    @triton.jit
    def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
        """a @ b accumulated in fp32 (float64 for float64 inputs). UPCAST (CPU interpreter, 16-bit inputs only:
        its bf16 dot is wrong): compute on the fp32 copies, which is exact for 16-bit inputs, as the tensor
        cores' products are."""
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision=PREC)

    @triton.jit
    def _probs(q, k, lse, rows, cols, Tq, Tk, SCALE: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
               UPCAST: tl.constexpr):
        """p = exp(q k^T * scale - lse), zero where masked: the probabilities rebuilt in backward."""
        s = _dot(q, tl.trans(k), PREC, UPCAST) * SCALE
        valid = (rows[:, None] < Tq) & (cols[None, :] < Tk)
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        return tl.where(valid, tl.exp(s - lse[:, None]), 0.0)

    @autotune
    @triton.jit
    def _attn_fwd(Q, K, V, O, LSE, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, H, Tq, Tk, D, Tq_bucket, Tk_bucket,
                  SCALE: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
        bh, pid_m = _program_tile(Tq, BLOCK_M)
        Q, K, V = Q + _head_start(bh, H, sqb, sqh), K + _head_start(bh, H, skb, skh), V + _head_start(bh, H, svb, svh)
        O, LSE = O + _dense_head_start(bh, Tq, D), LSE + _dense_head_start(bh, Tq, 1)     # this head's rows
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q = _tile(Q, rows, d, Tq, D, sqt)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
        l_i = tl.zeros([BLOCK_M], dtype=ACC)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
        hi = tl.minimum(Tk, (pid_m + 1) * BLOCK_M) if CAUSAL else Tk     # causal: skip blocks above the diagonal
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k = _tile(K, cols, d, Tk, D, skt)
            v = _tile(V, cols, d, Tk, D, svt)
            s = _dot(q, tl.trans(k), PREC, UPCAST) * SCALE
            valid = cols[None, :] < Tk
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))      # finite: every row sees key 0 in the first block
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(O + _offsets(rows, d, D), o.to(O.dtype.element_ty), mask=(rows[:, None] < Tq) & (d[None, :] < D))
        tl.store(LSE + rows, m_i + tl.log(l_i), mask=rows < Tq)

    @autotune
    @triton.jit
    def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                       H, Tq, Tk, D, Tq_bucket, Tk_bucket, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                       UPCAST: tl.constexpr, ACC: tl.constexpr):
        bh, pid_n = _program_tile(Tk, BLOCK_N)
        Q, K, V = Q + _head_start(bh, H, sqb, sqh), K + _head_start(bh, H, skb, skh), V + _head_start(bh, H, svb, svh)
        DO = DO + _dense_head_start(bh, Tq, D)
        LSE, Delta = LSE + _dense_head_start(bh, Tq, 1), Delta + _dense_head_start(bh, Tq, 1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        k = _tile(K, cols, d, Tk, D, skt)
        v = _tile(V, cols, d, Tk, D, svt)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0    # causal: queries before this block can't see it
        for start_m in range(lo, Tq, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _tile(Q, rows, d, Tq, D, sqt)
            do = _tile(DO, rows, d, Tq, D, D)
            lse = tl.load(LSE + rows, mask=rows < Tq, other=0.0)
            delta = tl.load(Delta + rows, mask=rows < Tq, other=0.0)
            p = _probs(q, k, lse, rows, cols, Tq, Tk, SCALE, CAUSAL, PREC, UPCAST)
            dv += _dot(tl.trans(p.to(do.dtype)), do, PREC, UPCAST)
            dp = _dot(do, tl.trans(v), PREC, UPCAST)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, PREC, UPCAST)
        out = _dense_head_start(bh, Tk, D) + _offsets(cols, d, D)
        m = (cols[:, None] < Tk) & (d[None, :] < D)
        tl.store(DK + out, (dk * SCALE).to(DK.dtype.element_ty), mask=m)
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=m)

    @autotune
    @triton.jit
    def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                     H, Tq, Tk, D, Tq_bucket, Tk_bucket, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                     UPCAST: tl.constexpr, ACC: tl.constexpr):
        bh, pid_m = _program_tile(Tq, BLOCK_M)
        Q, K, V = Q + _head_start(bh, H, sqb, sqh), K + _head_start(bh, H, skb, skh), V + _head_start(bh, H, svb, svh)
        DO, DQ = DO + _dense_head_start(bh, Tq, D), DQ + _dense_head_start(bh, Tq, D)
        LSE, Delta = LSE + _dense_head_start(bh, Tq, 1), Delta + _dense_head_start(bh, Tq, 1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q = _tile(Q, rows, d, Tq, D, sqt)
        do = _tile(DO, rows, d, Tq, D, D)
        lse = tl.load(LSE + rows, mask=rows < Tq, other=0.0)
        delta = tl.load(Delta + rows, mask=rows < Tq, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
        hi = tl.minimum(Tk, (pid_m + 1) * BLOCK_M) if CAUSAL else Tk
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k = _tile(K, cols, d, Tk, D, skt)
            v = _tile(V, cols, d, Tk, D, svt)
            p = _probs(q, k, lse, rows, cols, Tq, Tk, SCALE, CAUSAL, PREC, UPCAST)
            ds = p * (_dot(do, tl.trans(v), PREC, UPCAST) - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, PREC, UPCAST)
        tl.store(DQ + _offsets(rows, d, D), (dq * SCALE).to(DQ.dtype.element_ty),
                 mask=(rows[:, None] < Tq) & (d[None, :] < D))


def _launch_args(q, k, v):
    """Strides (batch, head, time) of q, k, v, the sizes (with the autotuner's power-of-two buckets of Tq and Tk),
    and the kernel meta-parameters other than the tile shape (which the autotuner picks); the last dim must be
    dense."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    meta = dict(BLOCK_D=max(16, next_pow2(D)),
                SCALE=1.0 / math.sqrt(D),           # a constexpr: float64 kernels multiply by it in float64
                PREC="ieee" if q.element_size() >= 4 else "tf32",    # fp32 stays fp32 (no TF32 rounding)
                UPCAST=not q.is_cuda and q.element_size() == 2,
                ACC=compute_type(q))
    strides = [s for t in (q, k, v) for s in t.stride()[:3]]
    return strides, (H, Tq, Tk, D, next_pow2(Tq), next_pow2(Tk)), meta


def _grid(n_heads, T, block):
    """The launch grid of one program per (head, block of `block` rows): a single axis (see _program_tile)."""
    def grid(tile):
        return (n_heads * triton.cdiv(T, tile[block]),)
    return grid


def _dense_last(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_dtype(q, k, v):
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flash_attention's Triton kernel needs q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; cast them first or use backend='torch'")


def flash_attention_forward(q, k, v, causal=True):
    """The Triton forward alone: (o [B, H, Tq, D] contiguous, lse [B, H, Tq] in fp32, float64 for float64 inputs).
    For callers with their own backward (ring attention)."""
    _check_dtype(q, k, v)
    q, k, v = _dense_last(q), _dense_last(k), _dense_last(v)
    B, H, Tq, D = q.shape
    o = torch.empty(B, H, Tq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Tq, device=q.device, dtype=compute_dtype(q))
    strides, shape, meta = _launch_args(q, k, v)
    _attn_fwd[_grid(B * H, Tq, "BLOCK_M")](q, k, v, o, lse, *strides, *shape, CAUSAL=causal, **meta)
    return o, lse


def flash_attention_backward(do, q, k, v, o, lse, causal=True):
    """The Triton backward alone: (dq, dk, dv) given the output gradient, the inputs, o and lse.
    (lse may come from a merge of several partial attentions: then o must be the merged output.)"""
    _check_dtype(q, k, v)
    q, k, v = _dense_last(q), _dense_last(k), _dense_last(v)
    do = do.contiguous()
    B, H, Tq, D = q.shape
    acc = compute_dtype(q)
    delta = (o.to(acc) * do.to(acc)).sum(-1).contiguous()    # rowsum(do * o) = rowsum(p * dp)
    dq = torch.empty(B, H, Tq, D, device=q.device, dtype=q.dtype)
    dk, dv = torch.empty(k.shape, device=q.device, dtype=k.dtype), torch.empty(v.shape, device=q.device, dtype=v.dtype)
    strides, shape, meta = _launch_args(q, k, v)
    lse = lse.to(acc).contiguous()
    _attn_bwd_dkdv[_grid(B * H, k.shape[2], "BLOCK_N")](q, k, v, do, lse, delta, dk, dv, *strides, *shape,
                                                          CAUSAL=causal, **meta)
    _attn_bwd_dq[_grid(B * H, Tq, "BLOCK_M")](q, k, v, do, lse, delta, dq, *strides, *shape, CAUSAL=causal, **meta)
    return dq, dk, dv


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
