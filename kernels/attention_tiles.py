"""
kernels/attention_tiles.py: what the flash attention kernels (kernels/flash_attention.py, forward, and
kernels/flash_attention_backward.py) share: the tile addressing of a strided [B, H, T, D] tensor, the tile
configs the autotuner chooses among, the two-stage key range, and the launch arguments.

    _tile(ptr, rows, d, T, D, stride_t)    a [rows, BLOCK_D] tile of one head, zero outside [T, D]
    _key_range(row0, Tk, ...)              (end of the unmasked key blocks, end of the masked ones)

Addressing: one program per (head, block of rows) on grid axis 0 (axes 1 and 2 stop at 65535, so B*H there would
cap the batch); head and row offsets in int64 (rows * stride passes 2^31 in a long sequence of the [B, T, H, D]
layout, whose row stride is H*D). The autotuner's key rounds Tq and Tk up to a power of two, so sampling, whose
length grows by one token a step, tunes about log2(T) times instead of T times.
"""
import math
import os

from kernels.backend import HAS_TRITON, compute_type, next_pow2, tl, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def tile_configs(shapes, small):
    """Tile shapes (BLOCK_M, BLOCK_N, warps, stages) to try: on a GPU the autotuner times each once per (Tq and Tk
    rounded up to a power of two, D, causal, dtypes) and keeps the fastest (a shape that exceeds shared memory or
    registers is skipped, not fatal); the interpreter, which runs programs one by one in Python and pays per
    operation, not per element, gets one 32 x 32 tile: a float64 test's 32 positions in one program per head
    (tests/test_kernels.py's longer sequences take every masked and unmasked stage)."""
    shapes = [small] if INTERPRET else shapes
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in shapes]


if HAS_TRITON:
    # Tq_bucket and Tk_bucket (next_pow2 of Tq and Tk) are kernel arguments only for this key
    KEY = ["Tq_bucket", "Tk_bucket", "D", "CAUSAL"]
    # scores in base 2 (exp2, the GPU's native exponential): s2 = s * LOG2E; the stored lse is natural: lse2 * LN2.
    # constexprs, so a float64 kernel multiplies by them in float64
    LOG2E, LN2 = tl.constexpr(1.0 / math.log(2.0)), tl.constexpr(math.log(2.0))

    @triton.jit
    def _head_start(bh, H, stride_b, stride_h):
        """Offset of head bh = b*H + h in a strided [B, H, T, D] tensor, in int64: program ids are int32 and
        b * stride_b wraps around once the tensor has 2^31 elements."""
        bh = tl.cast(bh, tl.int64)
        return (bh // H) * stride_b + (bh % H) * stride_h

    @triton.jit
    def _dense_head_start(bh, T, D):
        """Offset of head bh in a contiguous [B*H, T, D] tensor (o, dq, dk, dv; lse and delta: D = 1), int64."""
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
    def _key_range(row0, Tk, CAUSAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """(end of the unmasked stage, end of the masked one) over the keys for the rows from row0: stage 1 holds
        the whole BLOCK_N-blocks inside Tk and, causal, left of row0 (seen by every row); stage 2 the rest
        up to the diagonal."""
        full = (Tk // BLOCK_N) * BLOCK_N
        if CAUSAL:
            return tl.minimum((row0 // BLOCK_N) * BLOCK_N, full), tl.minimum(Tk, row0 + BLOCK_ROWS)
        return full, Tk


def launch_args(q, k, v):
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
    return strides(q, k, v), (H, Tq, Tk, D, next_pow2(Tq), next_pow2(Tk)), meta


def strides(*tensors):
    """(batch, head, time) strides of each [B, H, T, D] tensor, flattened: the kernels' addressing."""
    return [s for t in tensors for s in t.stride()[:3]]


def tile_grid(n_heads, T, block):
    """The launch grid of one program per (head, block of `block` rows): a single axis (see _program_tile)."""
    def per_config(tile):
        return (n_heads * triton.cdiv(T, tile[block]),)
    return per_config


def dense_last(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def check_dtype(q, k, v):
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flash_attention's Triton kernel needs q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; cast them first or use backend='torch'")
