"""
kernels/layer_norm.py: fused LayerNorm, forward in one pass over each row, backward with the weight and
bias gradients reduced in Triton. Replaces model.py's nn.LayerNorm (ln_1, ln_2, ln_f) via apply_kernels.

    y = (x - mean) * rstd * w + b,   rstd = 1 / sqrt(var + eps)        (G programs looping over row tiles)
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w,   xhat = (x - mean) * rstd
    dw = sum_rows dy * xhat,  db = sum_rows dy    (per-program partial sums [G, N], then a column reduction)

Memory traffic (bytes of M*N values, s bytes each): eager PyTorch's LayerNorm forward already fuses mean,
var and the affine into one kernel (read x, write y: 2s); the win of writing it by hand is the backward:
one kernel reads x, dy once and writes dx (3s) while the G x N partials for dw/db stay tiny, instead of
separate passes for dx, dw, db. Only the per-row mean and rstd (8 bytes a row) are saved for backward.
Both kernels run G = 4 x SMs programs that loop over tiles of ROWS rows: w and b are loaded once per program (not
once per row), and the backward's dw, db partials are per program ([G, N], reduced by one small kernel each).
A tile's start is one int64 scalar and the offsets inside it int32: no 64-bit arithmetic per element.

    from kernels import layer_norm
    y = layer_norm(x, weight, bias, eps=1e-5)              # backend: auto | triton | torch | compile

Precision: 16-bit and fp32 rows are normalized in fp32, float64 rows in float64 (mean, rstd and the dw/db
partials too); eps is a constexpr so that a float64 kernel adds it in float64 (a runtime float argument reaches
a GPU kernel as fp32).
"""
import torch
import torch.nn.functional as F

from kernels.backend import (HAS_TRITON, block_offsets, compute_dtype, compute_type, maybe_compiled, next_pow2, tl,
                             triton, use_triton)

if HAS_TRITON:
    @triton.jit
    def _row_tile(X, tile, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Row tile `tile` of a row-major [M, N] tensor at X: (its pointers, the mask, the row indices). The tile's
        start is one int64 scalar (rows * N passes 2^31 at scale), the offsets inside it int32."""
        rows = block_offsets(tile, ROWS)
        r, cols = tl.arange(0, ROWS), tl.arange(0, BLOCK_N)
        ptrs = X + tl.cast(tile, tl.int64) * ROWS * N + r[:, None] * N + cols[None, :]
        return ptrs, (rows[:, None] < M) & (cols[None, :] < N), rows

    @triton.jit
    def _backward_tile(X, DY, DX, tile, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
        """What a norm's backward reads of row tile `tile`: (x, dy in ACC, dx's pointers, the mask, the rows)."""
        x_ptrs, mask, rows = _row_tile(X, tile, M, N, ROWS, BLOCK_N)
        dy_ptrs, _, _ = _row_tile(DY, tile, M, N, ROWS, BLOCK_N)
        dx_ptrs, _, _ = _row_tile(DX, tile, M, N, ROWS, BLOCK_N)
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(ACC)
        return x, dy, dx_ptrs, mask, rows

    @triton.jit
    def _ln_fwd(X, Y, W, B, Mean, Rstd, M, N, EPS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                ACC: tl.constexpr):
        # program p normalizes row tiles p, p + G, p + 2G, ... (G programs): w and b are loaded once per program
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
        b = tl.load(B + cols, mask=cols < N, other=0.0).to(ACC)
        for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
            x_ptrs, mask, rows = _row_tile(X, tile, M, N, ROWS, BLOCK_N)
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(ACC)
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(mask, x - mean[:, None], 0.0)       # the ragged tail must not count in the variance
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + EPS)
            y_ptrs, _, _ = _row_tile(Y, tile, M, N, ROWS, BLOCK_N)
            tl.store(y_ptrs, (xc * rstd[:, None] * w[None, :] + b[None, :]).to(Y.dtype.element_ty), mask=mask)
            tl.store(Mean + rows, mean, mask=rows < M)
            tl.store(Rstd + rows, rstd, mask=rows < M)

    @triton.jit
    def _ln_bwd(X, DY, DX, W, Mean, Rstd, DWp, DBp, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                ACC: tl.constexpr):
        # program p handles row tiles p, p+G, p+2G, ... and keeps its share of dw, db in registers
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
        dw = tl.zeros([BLOCK_N], dtype=ACC)
        db = tl.zeros([BLOCK_N], dtype=ACC)
        for tile in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
            x, dy, dx_ptrs, mask, rows = _backward_tile(X, DY, DX, tile, M, N, ROWS, BLOCK_N, ACC)
            mean = tl.load(Mean + rows, mask=rows < M, other=0.0)
            rstd = tl.load(Rstd + rows, mask=rows < M, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            g = dy * w[None, :]
            c1 = tl.sum(xhat * g, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
        tl.store(DWp + pid * N + cols, dw, mask=cols < N)
        tl.store(DBp + pid * N + cols, db, mask=cols < N)

    @triton.jit
    def _sum_rows(P, Out, G, N, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
        # Out[c] = sum_g P[g, c]: the final reduction of the per-program partials
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        acc = tl.zeros([BLOCK_C], dtype=ACC)
        for g0 in range(0, G, BLOCK_G):
            rows = g0 + tl.arange(0, BLOCK_G)
            m = (rows[:, None] < G) & (cols[None, :] < N)
            acc += tl.sum(tl.load(P + rows[:, None] * N + cols[None, :], mask=m, other=0.0), axis=0)
        tl.store(Out + cols, acc.to(Out.dtype.element_ty), mask=cols < N)


def _rows_per_tile(x, block_n):
    """Rows a program normalizes at once: 2048 values on a GPU (2 rows at C = 768, 1 from C = 2048 up); under the
    interpreter, where each step costs Python time, 32 (a float64 test's 64 rows in two programs; its cost is per
    operation, not per element)."""
    return max(1, 2048 // block_n) if x.is_cuda else 32


def _num_warps(tile):
    """Warps sharing one row tile. A tile is held in registers: with a fixed 4 warps, h = 4096 puts 32 values of
    each live tensor in every thread, enough to spill; scaling the warps keeps it at 8 up to h = 4096 (16 at 8192)."""
    return min(16, max(4, tile // 256))


def _n_programs(n_tiles, device):
    """Programs, each looping over row tiles: enough to fill a GPU (4 per SM), few on the (serial) interpreter;
    w and b (forward) and the dw, db partials (backward) cost once per program, not once per row."""
    if device.type == "cuda":
        return max(1, min(n_tiles, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n_tiles, 2))


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        shape, N = x.shape, x.shape[-1]
        x2 = x.reshape(-1, N).contiguous()
        M = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(M, device=x.device, dtype=compute_dtype(x))
        rstd = torch.empty(M, device=x.device, dtype=compute_dtype(x))
        R = _rows_per_tile(x2, next_pow2(N))
        _ln_fwd[(_n_programs(triton.cdiv(M, R), x2.device),)](
            x2, y, weight.contiguous(), bias.contiguous(), mean, rstd, M, N, EPS=eps, ROWS=R, BLOCK_N=next_pow2(N),
            ACC=compute_type(x), num_warps=_num_warps(R * next_pow2(N)))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2, dx, R, G, (dw_part, db_part) = backward_buffers(x2, dy, 2)
        _ln_bwd[(G,)](x2, dy2, dx, weight.contiguous(), mean, rstd, dw_part, db_part, M, N,
                      ROWS=R, BLOCK_N=next_pow2(N), ACC=compute_type(x2), num_warps=_num_warps(R * next_pow2(N)))
        return dx.view(ctx.shape), column_sums(dw_part, weight), column_sums(db_part, weight), None


def backward_buffers(x2, dy, n_partials):
    """What a norm's backward launches with (here and kernels/rms_norm.py): (dy as x2's [M, N] rows, dx, rows per
    tile, programs G, n_partials per-program partial sums [G, N] in the compute dtype)."""
    M, N = x2.shape
    R = _rows_per_tile(x2, next_pow2(N))
    G = _n_programs(triton.cdiv(M, R), x2.device)
    partials = [torch.empty(G, N, device=x2.device, dtype=compute_dtype(x2)) for _ in range(n_partials)]
    return dy.reshape(-1, N).contiguous(), torch.empty_like(x2), R, G, partials


def column_sums(partials, like):
    """The sum over programs of a backward's partials [G, N]: [N], like `like` (a weight), by one small kernel."""
    G, N = partials.shape
    out = torch.empty_like(like)
    BLOCK_C = min(128, next_pow2(N))
    _sum_rows[(triton.cdiv(N, BLOCK_C),)](partials, out, G, N, BLOCK_G=min(32, next_pow2(G)), BLOCK_C=BLOCK_C,
                                         ACC=compute_type(partials))
    return out


def layer_norm_reference(x, weight, bias, eps=1e-5):
    """The definition: PyTorch's own LayerNorm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm(x, weight, bias, eps=1e-5, backend="auto"):
    """LayerNorm over the last dimension of x with affine weight and bias [N]."""
    if use_triton(x, backend):
        return LayerNormFunction.apply(x, weight, bias, eps)
    return maybe_compiled(layer_norm_reference, backend)(x, weight, bias, eps)
