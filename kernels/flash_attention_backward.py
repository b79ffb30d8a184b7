"""
kernels/flash_attention_backward.py: the backward of kernels/flash_attention.py, as Triton's fused-attention
tutorial (06-fused-attention) makes it: a pre-pass for delta, then one kernel that makes dK, dV and dQ.

    dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, causal=True)

The probabilities are rebuilt tile by tile from the saved lse, in base 2 (p = 2^(s2 - lse * log2 e), s2 the scores
times log2(e) / sqrt(D)); no T x T matrix is stored:
    pre-pass kernel:  delta = rowsum(do * o)                       (= rowsum(p * dp): one read of o and do)
    one kernel, program (head, block j):
        dK, dV of keys [j*BLOCK_N, +BLOCK_N) over query tiles of BLOCK_M:
            dv += p^T do;   ds = p * (do v^T - delta);   dk += ds^T q / sqrt(D)
        dQ of queries [j*BLOCK_N, +BLOCK_N) over key tiles of BLOCK_M:
            dq += ds k / sqrt(D)
Each loop runs the tiles that need a mask apart from those that don't: for dK, dV the diagonal query tiles
(masked), those below them (no mask), the ragged tail past a multiple of BLOCK_M (masked); for dQ the key tiles
left of the diagonal (no mask), then the diagonal and the tail (masked). Queries before a key block never see it
(causal), so its loop starts at the block. Every program owns the rows it writes: no atomics. dK, dV are kept
transposed ([keys, queries] tiles) so p^T is computed, not transposed.
do and o are read through their strides (the model hands do as a [B, T, H, D] tensor seen as [B, H, T, D]: no
copy); dq, dk, dv are written dense [B, H, T, D]. Precision as the forward: fp32 (float64 for float64 inputs).
"""
import torch

from kernels.attention_tiles import (INTERPRET, check_dtype, dense_last, launch_args, strides, tile_configs,
                                     tile_grid)
from kernels.backend import HAS_TRITON, compute_dtype, tl, triton

# BLOCK_M per step, BLOCK_N keys (dK, dV) and queries (dQ) per program (a multiple of BLOCK_M), warps, stages
BWD_SHAPES = ((32, 128, 4, 3), (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (16, 64, 4, 2))
DELTA_ROWS = 32 if INTERPRET else 64        # the pre-pass's rows per program

if HAS_TRITON:
    from kernels.attention_tiles import (KEY, LOG2E, _dense_head_start, _dot, _head_start, _key_range, _offsets,
                                         _program_tile, _tile)

    @triton.jit
    def _attn_bwd_delta(O, DO, Delta, sob, soh, sot, sdb, sdh, sdt, H, Tq, D, BLOCK_M: tl.constexpr,
                        BLOCK_D: tl.constexpr, ACC: tl.constexpr):
        """The pre-pass: delta = rowsum(do * o) per query, in ACC, from o and do in any strided layout."""
        bh, pid_m = _program_tile(Tq, BLOCK_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        o = _tile(O + _head_start(bh, H, sob, soh), rows, d, Tq, D, sot).to(ACC)
        do = _tile(DO + _head_start(bh, H, sdb, sdh), rows, d, Tq, D, sdt).to(ACC)
        tl.store(Delta + _dense_head_start(bh, Tq, 1) + rows, tl.sum(o * do, axis=1), mask=rows < Tq)

    @triton.jit
    def _dkdv_steps(dk, dv, k, v, Q, DO, LSE, Delta, cols, d, lo, hi, Tq, Tk, D, sqt, sdt, QK2: tl.constexpr,
                    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr):
        """dK, dV of one key block over query tiles [lo, hi), transposed ([keys, queries]) so no tile is transposed
        twice; MASK: tiles that cross the diagonal, Tq or Tk."""
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _tile(Q, rows, d, Tq, D, sqt)
            do = _tile(DO, rows, d, Tq, D, sdt)
            lse2 = tl.load(LSE + rows, mask=rows < Tq, other=0.0) * LOG2E
            p_t = tl.exp2(_dot(k, tl.trans(q), PREC, UPCAST) * QK2 - lse2[None, :])
            if MASK:
                valid = (rows[None, :] < Tq) & (cols[:, None] < Tk)
                if CAUSAL:
                    valid = valid & (cols[:, None] <= rows[None, :])
                p_t = tl.where(valid, p_t, 0.0)
            dv += _dot(p_t.to(do.dtype), do, PREC, UPCAST)
            delta = tl.load(Delta + rows, mask=rows < Tq, other=0.0)
            ds_t = p_t * (_dot(v, tl.trans(do), PREC, UPCAST) - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, PREC, UPCAST)
        return dk, dv

    @triton.jit
    def _dq_steps(dq, q, do, lse2, delta, K, V, rows, d, lo, hi, Tk, D, skt, svt, QK2: tl.constexpr,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
                  UPCAST: tl.constexpr):
        """dQ of one query block over key tiles [lo, hi) (rows past Tq are computed but never stored)."""
        for start_n in range(lo, hi, BLOCK_M):
            cols = start_n + tl.arange(0, BLOCK_M)
            k = _tile(K, cols, d, Tk, D, skt)
            p = tl.exp2(_dot(q, tl.trans(k), PREC, UPCAST) * QK2 - lse2[:, None])
            if MASK:
                valid = cols[None, :] < Tk
                if CAUSAL:
                    valid = valid & (cols[None, :] <= rows[:, None])
                p = tl.where(valid, p, 0.0)
            ds = p * (_dot(do, tl.trans(_tile(V, cols, d, Tk, D, svt)), PREC, UPCAST) - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, PREC, UPCAST)
        return dq

    @triton.autotune(configs=tile_configs(BWD_SHAPES, (32, 32, 4, 1)), key=KEY)
    @triton.jit
    def _attn_bwd(Q, K, V, DO, LSE, Delta, DQ, DK, DV, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                  H, Tq, Tk, D, Tq_bucket, Tk_bucket, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                  UPCAST: tl.constexpr, ACC: tl.constexpr):
        tl.static_assert(BLOCK_N % BLOCK_M == 0)
        bh, j = _program_tile(tl.maximum(Tq, Tk), BLOCK_N)
        Q, K, V = Q + _head_start(bh, H, sqb, sqh), K + _head_start(bh, H, skb, skh), V + _head_start(bh, H, svb, svh)
        DO = DO + _head_start(bh, H, sdb, sdh)
        LSE, Delta = LSE + _dense_head_start(bh, Tq, 1), Delta + _dense_head_start(bh, Tq, 1)
        d = tl.arange(0, BLOCK_D)
        n0 = j * BLOCK_N
        if n0 < Tk:             # dK, dV of keys [n0, n0 + BLOCK_N): diagonal tiles, then unmasked, then ragged
            cols = n0 + tl.arange(0, BLOCK_N)
            k, v = _tile(K, cols, d, Tk, D, skt), _tile(V, cols, d, Tk, D, svt)
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
            diag = tl.minimum(n0 + BLOCK_N, Tq) if CAUSAL else 0      # queries after it see every key of the block
            lo = n0 if CAUSAL else 0                                   # queries before n0 see none of them
            full = tl.maximum((Tq // BLOCK_M) * BLOCK_M, diag) if n0 + BLOCK_N <= Tk else diag
            dk, dv = _dkdv_steps(dk, dv, k, v, Q, DO, LSE, Delta, cols, d, lo, diag, Tq, Tk, D, sqt, sdt,
                                 SCALE * LOG2E, True, CAUSAL, BLOCK_M, PREC, UPCAST)
            dk, dv = _dkdv_steps(dk, dv, k, v, Q, DO, LSE, Delta, cols, d, diag, full, Tq, Tk, D, sqt, sdt,
                                 SCALE * LOG2E, False, CAUSAL, BLOCK_M, PREC, UPCAST)
            dk, dv = _dkdv_steps(dk, dv, k, v, Q, DO, LSE, Delta, cols, d, full, Tq, Tq, Tk, D, sqt, sdt,
                                 SCALE * LOG2E, True, CAUSAL, BLOCK_M, PREC, UPCAST)
            out = _dense_head_start(bh, Tk, D) + _offsets(cols, d, D)
            m = (cols[:, None] < Tk) & (d[None, :] < D)
            tl.store(DK + out, (dk * SCALE).to(DK.dtype.element_ty), mask=m)
            tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=m)
        if n0 < Tq:             # dQ of queries [n0, n0 + BLOCK_N): unmasked key tiles, then diagonal and ragged
            rows = n0 + tl.arange(0, BLOCK_N)
            q, do = _tile(Q, rows, d, Tq, D, sqt), _tile(DO, rows, d, Tq, D, sdt)
            lse2 = tl.load(LSE + rows, mask=rows < Tq, other=0.0) * LOG2E
            delta = tl.load(Delta + rows, mask=rows < Tq, other=0.0)
            dq = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
            unmasked, hi = _key_range(n0, Tk, CAUSAL, BLOCK_N, BLOCK_M)
            dq = _dq_steps(dq, q, do, lse2, delta, K, V, rows, d, 0, unmasked, Tk, D, skt, svt, SCALE * LOG2E,
                           False, CAUSAL, BLOCK_M, PREC, UPCAST)
            dq = _dq_steps(dq, q, do, lse2, delta, K, V, rows, d, unmasked, hi, Tk, D, skt, svt, SCALE * LOG2E,
                           True, CAUSAL, BLOCK_M, PREC, UPCAST)
            tl.store(DQ + _dense_head_start(bh, Tq, D) + _offsets(rows, d, D), (dq * SCALE).to(DQ.dtype.element_ty),
                     mask=(rows[:, None] < Tq) & (d[None, :] < D))


def flash_attention_backward(do, q, k, v, o, lse, causal=True):
    """The Triton backward alone: (dq, dk, dv) given the output gradient, the inputs, o and lse.
    (lse may come from a merge of several partial attentions: then o must be the merged output.)"""
    check_dtype(q, k, v)
    q, k, v, do, o = dense_last(q), dense_last(k), dense_last(v), dense_last(do), dense_last(o)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    qkv_strides, shape, meta = launch_args(q, k, v)
    delta = torch.empty(B, H, Tq, device=q.device, dtype=compute_dtype(q))
    _attn_bwd_delta[(B * H * triton.cdiv(Tq, DELTA_ROWS),)](o, do, delta, *strides(o, do), H, Tq, D,
                                                            BLOCK_M=DELTA_ROWS, BLOCK_D=meta["BLOCK_D"],
                                                            ACC=meta["ACC"])
    dq = torch.empty(B, H, Tq, D, device=q.device, dtype=q.dtype)
    dk, dv = torch.empty(k.shape, device=q.device, dtype=k.dtype), torch.empty(v.shape, device=q.device, dtype=v.dtype)
    lse = lse.to(delta.dtype).contiguous()
    _attn_bwd[tile_grid(B * H, max(Tq, Tk), "BLOCK_N")](q, k, v, do, lse, delta, dq, dk, dv, *qkv_strides, *strides(do),
                                                     *shape, CAUSAL=causal, **meta)
    return dq, dk, dv
