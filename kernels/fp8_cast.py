"""
kernels/fp8_cast.py: an operand's FP8 quantization in one fused pass, in both layouts its GEMMs read.

    c = fp8_cast(x2, E4M3, GROUPS["rowwise"]["activation"])     # x [M, K] -> c.q [M, K], c.qt [K, M], scales
    torch._scaled_mm(c.q, w.q.t(), c.inv, w.inv.t(), ...)        # y = x W^T

Each operand of a Linear is read by two of its three GEMMs, once as is and once transposed (x: y = x W^T and
dW = dy^T x; W: y and dx = dy W; dy: dx and dW), and cuBLASLt's FP8 GEMM takes only row-major A times
column-major B, both contracted along their rows. So each operand is quantized once per step into q (t's rows
along its columns) and qt (t^T, rows along t's rows), which is what the unfused path did in 4-5 torch passes
per quantization, twice per operand:

    unfused, per quantization: abs -> amax -> clamp -> divide -> multiply -> clamp -> cast -> (transpose copy)
    fused, per operand:        _fp8_amax: |t| maxima per scale group (one read, atomic max per group)
                               _fp8_cast: scale = fp8_max / amax, clamp, cast, written as q and as qt, and each
                                          group's 1/scale in the layout _scaled_mm takes (one read)

Scale groups, in t's coordinates (rows, columns) as 1 (each), 128 (DeepSeek-V3's tiles and blocks) or 0 (the
whole dimension), per layout (q's, qt's); GROUPS lists them per recipe and operand kind:
    tensorwise, delayed   (0, 0)      one scale, shared by q and qt
    rowwise               (1, 0)      per row of t for q; (0, 1) per column of t (row of t^T) for qt
    blockwise             (1, 128)    1x128 tiles along K; (128, 1) for qt. A weight: (128, 128) blocks, shared
1/scale comes per row of the operand and group along K, stored K-group-major (a weight's block scale repeated
on its 128 rows): the layouts cuBLASLt's row and 1x128 scales want, with no copy before the GEMM.

On a GPU (and in the tests, under Triton's interpreter) the Triton kernels run; on a CPU the torch reference
below does the same with kernels/fp8_quant.py's quantize(), the definition both are tested against. Padding: on a
GPU both dims are padded with zeros to `pad` (16, or 128 for native block scales; cuBLASLt's K and N rules),
zeros that change no amax and no product.
"""
from collections import namedtuple

import torch
import torch.nn.functional as F

from kernels.backend import HAS_TRITON, block_offsets, next_pow2, tl, triton
from kernels.fp8_quant import AMAX_EPS, amax, quantize

ACTIVATION = {"tensorwise": ((0, 0), (0, 0)), "delayed": ((0, 0), (0, 0)), "rowwise": ((1, 0), (0, 1)),
              "blockwise": ((1, 128), (128, 1))}
GROUPS = {recipe: {"activation": groups, "weight": ((128, 128), (128, 128)) if recipe == "blockwise" else groups}
          for recipe, groups in ACTIVATION.items()}
GRANULARITY = {(0, 0): "tensor", (1, 0): "row", (1, 128): "tile", (128, 128): "block"}   # quantize()'s names
TILE = 64                    # a program's [TILE, TILE] piece of t (divides 128: a tile lies in one group)

# q [RP, CP] / qt [CP, RP]: FP8 data, padded; inv / inv_t: 1/scale, [operand rows, K groups], ready for
# _scaled_mm as operand A (operand B takes inv.t())
Fp8Cast = namedtuple("Fp8Cast", "q inv qt inv_t")


def _groups_count(n, g):
    return 1 if g == 0 else -(-n // g)


def _transposed(groups):
    return groups[1], groups[0]


def _inv_buffer(rows, k, groups, device):
    """1/scale per operand row (one for a tensorwise scale) and K-group, K-group-major: [rows, K groups] with
    strides (1, rows)."""
    per_row, k_groups = 1 if groups == (0, 0) else rows, _groups_count(k, groups[1])
    if k_groups == 1:       # [rows, 1] with unit strides, as the CPU kernel checks
        return torch.empty(per_row, 1, device=device)
    return torch.empty(k_groups, per_row, device=device).t()


def fp8_cast(t, dtype, groups, amax=None, transposed=True, pad=1, use_triton=False):
    """t [R, C] (any float dtype) quantized to `dtype` with groups = (q's groups, qt's groups); qt only when
    `transposed`. amax: q's group maxima given (tensorwise from a history or maxed over ranks; rowwise maxed
    over ranks) instead of measured; qt then shares them (tensorwise only)."""
    groups_q, groups_t = groups
    R, C = t.shape
    RP, CP = R + -R % pad, C + -C % pad
    if use_triton:
        return _cast_triton(t, dtype, groups_q, groups_t, amax, transposed, RP, CP)
    return _cast_reference(t, dtype, groups_q, groups_t, amax, transposed, RP, CP)


def fp8_amax(t, groups, use_triton=False):
    """|t| maxima per group [rows' groups, columns' groups] (fp32), without quantizing."""
    if not use_triton:
        return amax(t, GRANULARITY[groups]).reshape(_groups_count(t.shape[0], groups[0]), -1)
    R, C = t.shape
    out = torch.zeros(_groups_count(R, groups[0]), _groups_count(C, groups[1]), device=t.device)
    _launch_amax(t, R, C, out, groups, None)
    return out


def delayed_source(history, current, use_triton=False):
    """Delayed scaling's amax for this step: the history's max (the current amax while the history is still
    all zero), and the current amax pushed into the history, one small kernel on a GPU."""
    if not use_triton:
        past = history.max()
        history.copy_(torch.roll(history, 1))
        history[0] = current
        return torch.where(past > 0, past, current)
    source = torch.empty(1, 1, device=history.device)
    _fp8_delayed[(1,)](history, current, source, history.numel(), LEN=next_pow2(history.numel()))
    return source


def _cast_reference(t, dtype, groups_q, groups_t, amax, transposed, RP, CP):
    """The definition: kernels/fp8_quant.py's quantize() of t (zero-padded) and of its transpose."""
    R, C = t.shape
    tp = F.pad(t, (0, CP - C, 0, RP - R)) if (RP, CP) != (R, C) else t
    given = None if amax is None else _padded_amax(amax, groups_q, RP)
    q, scale = quantize(tp, dtype, GRANULARITY[groups_q], given)
    inv = _inv_layout(scale.reciprocal(), groups_q, RP)
    if not transposed:
        return Fp8Cast(q, inv, None, None)
    shared = given if groups_t == (0, 0) else None
    qt, scale_t = quantize(tp.t().contiguous(), dtype, GRANULARITY[_transposed(groups_t)], shared)
    return Fp8Cast(q, inv, qt, _inv_layout(scale_t.reciprocal(), _transposed(groups_t), CP))


def _padded_amax(amax, groups, RP):
    """A given amax (one, or one per row) in the group layout, with zero rows for t's padding rows."""
    if groups == (0, 0):
        return amax if amax.dim() == 2 else amax.reshape(1, 1)
    return F.pad(amax, (0, 0, 0, RP - amax.shape[0])) if RP > amax.shape[0] else amax


def _inv_layout(inv, groups, rows):
    """quantize()'s 1/scale (per tensor, row, tile or block) in _inv_buffer's layout."""
    if groups == (0, 0):
        return inv.reshape(1, 1)
    if groups[0] == 128:
        inv = inv.repeat_interleave(128, dim=0)[:rows]
    return inv.t().contiguous().t()


def _cast_triton(t, dtype, groups_q, groups_t, amax, transposed, RP, CP):
    R, C = t.shape
    if amax is None:
        # q's group maxima, then (when its groups differ) qt's, in one buffer: qt's start at offset t_off
        q_shape = _groups_count(RP, groups_q[0]), _groups_count(CP, groups_q[1])
        t_shape = _groups_count(RP, groups_t[0]), _groups_count(CP, groups_t[1])
        second = transposed and groups_t != groups_q
        amax = torch.zeros(q_shape[0] * q_shape[1] + (t_shape[0] * t_shape[1] if second else 0), device=t.device)
        t_part = (q_shape[0] * q_shape[1], t_shape[1], groups_t) if second else (0, q_shape[1], groups_q)
        _launch_amax(t, RP, CP, amax, groups_q, t_part if second else None)
        a_sr, (t_off, t_sr, _) = q_shape[1], t_part
    else:
        amax = _padded_amax(amax, groups_q, RP)
        a_sr, t_off, t_sr = amax.stride(0), 0, amax.stride(0)
    q = torch.empty(RP, CP, device=t.device, dtype=dtype)
    inv = _inv_buffer(RP, CP, groups_q, t.device)
    qt = torch.empty(CP, RP, device=t.device, dtype=dtype) if transposed else q
    inv_t = _inv_buffer(CP, RP, _transposed(groups_t), t.device) if transposed else inv
    grid = (triton.cdiv(RP, TILE), triton.cdiv(CP, TILE))
    _fp8_cast[grid](t, R, C, t.stride(0), t.stride(1), RP, CP,
                    amax, a_sr, q, inv, inv.stride(0), inv.stride(1),
                    t_off, t_sr, qt, inv_t, inv_t.stride(0), inv_t.stride(1),
                    GQ_R=groups_q[0], GQ_C=groups_q[1], IQ=int(groups_q != (0, 0)),
                    GT_R=groups_t[0], GT_C=groups_t[1], IT=int(groups_t != (0, 0)),
                    WRITE_T=transposed, FP8=_tl_fp8(dtype), FP8_MAX=torch.finfo(dtype).max, EPS=AMAX_EPS, TILE=TILE)
    if not transposed:
        qt, inv_t = None, None
    return Fp8Cast(q, inv, qt, inv_t)


def _launch_amax(t, RP, CP, amax, groups, second):
    """The amax kernel over t (padded to [RP, CP]) into amax (row stride: its groups' count along columns);
    second = (offset, row stride, groups) of a second grouping in the same buffer, or None."""
    t_off, t_sr, groups_t = second or (0, 1, groups)
    grid = (triton.cdiv(RP, TILE), triton.cdiv(CP, TILE))
    _fp8_amax[grid](t, t.shape[0], t.shape[1], t.stride(0), t.stride(1), RP, CP, amax,
                    _groups_count(CP, groups[1]), t_off, t_sr, GA_R=groups[0], GA_C=groups[1], GB_R=groups_t[0],
                    GB_C=groups_t[1], TWO=second is not None, TILE=TILE)


def _tl_fp8(dtype):
    return tl.float8e4nv if dtype == torch.float8_e4m3fn else tl.float8e5


if HAS_TRITON:
    @triton.jit
    def _group(idx, G: tl.constexpr):
        """The scale group of index idx along a dimension whose groups are G wide (0: one group)."""
        if G == 0:
            return idx * 0
        return idx // G

    @triton.jit
    def _first(idx, G: tl.constexpr):
        """True where idx starts its group."""
        if G == 0:
            return idx == 0
        return idx % G == 0

    @triton.jit
    def _amax_into(a, rows, cols, RP, CP, ptr, stride, GR: tl.constexpr, GC: tl.constexpr, TILE: tl.constexpr):
        """Atomic max of the tile's |t| into each group it touches (the tile lies in one group along an axis
        whose groups span more than one index)."""
        if GR == 1:
            m = tl.max(a, axis=1)
            idx = rows * stride + _group(tl.program_id(1) * TILE, GC)
            tl.atomic_max(ptr + idx, m, mask=rows < RP)
        elif GC == 1:
            m = tl.max(a, axis=0)
            idx = _group(tl.program_id(0) * TILE, GR) * stride + cols
            tl.atomic_max(ptr + idx, m, mask=cols < CP)
        else:
            m = tl.max(tl.max(a, axis=1), axis=0)
            idx = _group(tl.program_id(0) * TILE, GR) * stride + _group(tl.program_id(1) * TILE, GC)
            tl.atomic_max(ptr + idx, m)

    @triton.jit
    def _load_tile(x, R, C, sr, sc, TILE: tl.constexpr):
        rows = block_offsets(tl.program_id(0), TILE)
        cols = block_offsets(tl.program_id(1), TILE)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        v = tl.load(x + rows[:, None] * sr + cols[None, :] * sc, mask=mask, other=0.0).to(tl.float32)
        return v, rows, cols

    @triton.jit
    def _fp8_amax(x, R, C, sr, sc, RP, CP, a, a_sr, b_off, b_sr, GA_R: tl.constexpr, GA_C: tl.constexpr,
                  GB_R: tl.constexpr, GB_C: tl.constexpr, TWO: tl.constexpr, TILE: tl.constexpr):
        """|t| maxima per group of one or two groupings, from one read of t."""
        v, rows, cols = _load_tile(x, R, C, sr, sc, TILE)
        v = tl.abs(v)
        _amax_into(v, rows, cols, RP, CP, a, a_sr, GA_R, GA_C, TILE)
        if TWO:
            _amax_into(v, rows, cols, RP, CP, a + b_off, b_sr, GB_R, GB_C, TILE)

    @triton.jit
    def _fp8_grid(v, FP8: tl.constexpr):
        """v rounded to the FP8 format's grid (nearest, ties to even), so the cast after it is exact: Triton's
        CPU interpreter rounds a value whose mantissa carries into the next power of two the wrong way (31.03
        -> 16 in e4m3), the GPU does not; the rounding is done here the same way for both. Normal numbers:
        the fp32 bits past the format's mantissa rounded off; below the smallest normal 2^MIN_EXP the grid's
        step is 2^(MIN_EXP - MANT), rounded to by adding and subtracting 1.5 * 2^(23 + MIN_EXP - MANT)."""
        MANT: tl.constexpr = 3 if FP8 == tl.float8e4nv else 2
        MIN_EXP: tl.constexpr = -6 if FP8 == tl.float8e4nv else -14
        DROP: tl.constexpr = 23 - MANT
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
        MAGIC: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_EXP - MANT)
        small = (v + MAGIC) - MAGIC
        return tl.where(tl.abs(v) < 2.0 ** MIN_EXP, small, bits.to(tl.float32, bitcast=True)).to(FP8)

    @triton.jit
    def _scaled(v, rows, cols, amax, a_sr, GR: tl.constexpr, GC: tl.constexpr, FP8_MAX: tl.constexpr,
                EPS: tl.constexpr):
        """(v * scale clamped to the FP8 range, scale) per element, scale = FP8_MAX / its group's amax."""
        idx = _group(rows, GR)[:, None] * a_sr + _group(cols, GC)[None, :]
        # as torch computes fp8_max / amax (a reciprocal, then a product): the same scale bit for bit
        scale = (1.0 / tl.maximum(tl.load(amax + idx), EPS)) * FP8_MAX
        return tl.minimum(tl.maximum(v * scale, -FP8_MAX), FP8_MAX), scale

    @triton.jit
    def _fp8_cast(x, R, C, sr, sc, RP, CP, a, a_sr, q, inv, inv_sr, inv_sk, b_off, b_sr, qt, inv_t, inv_t_sr, inv_t_sk,
                  GQ_R: tl.constexpr, GQ_C: tl.constexpr, IQ: tl.constexpr, GT_R: tl.constexpr,
                  GT_C: tl.constexpr, IT: tl.constexpr, WRITE_T: tl.constexpr, FP8: tl.constexpr,
                  FP8_MAX: tl.constexpr, EPS: tl.constexpr, TILE: tl.constexpr):
        """q = t * scale in FP8 ([RP, CP], zero padding) and, with WRITE_T, qt = the same with qt's scales,
        stored transposed ([CP, RP]); each group's 1/scale written by the program holding its first element."""
        v, rows, cols = _load_tile(x, R, C, sr, sc, TILE)
        inside = (rows < RP)[:, None] & (cols < CP)[None, :]
        s, scale = _scaled(v, rows, cols, a, a_sr, GQ_R, GQ_C, FP8_MAX, EPS)
        tl.store(q + rows[:, None] * CP + cols[None, :], _fp8_grid(s, FP8), mask=inside)
        # 1/scale per operand row (IQ = 1) or once (IQ = 0), per group along K (t's columns)
        first = inside & _first(rows, IQ)[:, None] & _first(cols, GQ_C)[None, :]
        idx = _group(rows, IQ)[:, None] * inv_sr + _group(cols, GQ_C)[None, :] * inv_sk
        tl.store(inv + idx, 1.0 / scale, mask=first)
        if WRITE_T:
            s, scale = _scaled(v, rows, cols, a + b_off, b_sr, GT_R, GT_C, FP8_MAX, EPS)
            tl.store(qt + cols[None, :] * RP + rows[:, None], _fp8_grid(s, FP8), mask=inside)
            # qt's operand rows are t's columns (IT), its K groups t's row groups
            first = inside & _first(cols, IT)[None, :] & _first(rows, GT_R)[:, None]
            idx = _group(cols, IT)[None, :] * inv_t_sr + _group(rows, GT_R)[:, None] * inv_t_sk
            tl.store(inv_t + idx, 1.0 / scale, mask=first)

    @triton.jit
    def _fp8_delayed(history, current, source, N, LEN: tl.constexpr):
        """source = max(history), or current while that is 0; then history = [current, history[:-1]]."""
        offs = tl.arange(0, LEN)
        past = tl.load(history + offs, mask=offs < N, other=0.0)
        now = tl.load(current)
        tl.store(source, tl.where(tl.max(past, axis=0) > 0, tl.max(past, axis=0), now))
        tl.store(history + offs + 1, past, mask=offs + 1 < N)
        tl.store(history, now)
else:
    _fp8_amax = _fp8_cast = _fp8_delayed = None
