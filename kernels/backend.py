"""
kernels/backend.py: which implementation of a kernel runs, decided in one place.

    backend="auto"    the plain-torch reference, on GPUs too: no Triton kernel has yet been measured faster
                      than torch on a GPU (kernels/apply.py's docstring); auto is where that choice will live
    backend="triton"  always the Triton kernel (CPU tensors need TRITON_INTERPRET=1, set before triton imports)
    backend="torch"   always the plain-torch reference (the definition the kernel is tested against)
    backend="compile" the plain-torch reference through torch.compile (a fused path where Triton can't run)

triton is imported here, guarded, so every kernel file works on a machine without it.

Dtypes: a kernel computes what it is given. float16, bfloat16 and float32 tensors are computed in fp32 (the
tensor cores' accumulation; outputs rounded back to the input dtype), float64 tensors in float64 (the exactness
runs, --dtype float64 --kernels triton); any other dtype is refused with a ValueError. A compiled GPU kernel
enforces types the interpreter does not check, so tests/test_gpu_rules.py compiles every kernel for sm_80 and
sm_90 in each of these dtypes.
"""
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:        # CPU-only installs: every kernel falls back to its torch reference
    triton, tl = None, None
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch", "compile")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def use_triton(x, backend):
    """True when `backend` selects the Triton kernel for tensor x; raises a clear error when it can't run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return False
    if backend != "triton":
        return False
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' but triton is not installed (pip install triton)")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the Triton kernels compute float16, bfloat16, float32 and float64 tensors, not {x.dtype}; "
                         f"use backend='torch' (or --kernels torch) for {x.dtype}")
    return True


def compute_dtype(x):
    """The torch dtype a kernel computes x in (and keeps its statistics in): float64 for float64, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def compute_type(x):
    """compute_dtype(x) as the Triton type the kernels take as their ACC constexpr."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def maybe_compiled(fn, backend):
    """fn itself, or fn through torch.compile for backend='compile' (compiled once, on first use)."""
    if backend != "compile" or torch.compiler.is_compiling():   # inside a compiled region: already fused
        return fn
    return _compiled(fn)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def next_pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


if HAS_TRITON:
    @triton.jit
    def block_offsets(pid, BLOCK: tl.constexpr):
        """pid * BLOCK + [0, BLOCK) in int64. Program ids and int arguments are int32 in Triton, so the plain
        product wraps around once a tensor has 2^31 elements (tokens * 4h of the MLP passes that at scale)."""
        return tl.cast(pid, tl.int64) * BLOCK + tl.arange(0, BLOCK)

    @triton.jit
    def row_tile(M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (i, j) of a 2-D grid over a row-major [M, N] tensor: rows [i*ROWS, +ROWS), columns
        [j*BLOCK_N, +BLOCK_N). Returns (start, offs, mask, cols): the tile's first element as one int64 scalar
        (M*N may pass 2^31), the [ROWS, BLOCK_N] offsets from it in int32 (ROWS*N stays far below 2^31: no 64-bit
        arithmetic per element, and no `% N` to find an element's column), the mask of [M, N], the columns."""
        row0 = tl.cast(tl.program_id(0), tl.int64) * ROWS
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, ROWS)
        return row0 * N, r[:, None] * N + cols[None, :], (r[:, None] < M - row0) & (cols[None, :] < N), cols
else:
    block_offsets, row_tile = None, None
