"""
torch._scaled_mm under CUDA's rules, on a CPU: the CPU kernel multiplies shapes, layouts and scale formats that
CUDA refuses, so an FP8 test that passes here could crash on the first GPU step. The fixture below makes
kernels/fp8.py take its GPU paths (gemm_kind: an H100 with cuBLAS >= 12.9) and checks every _scaled_mm call
against the checks CUDA makes before computing it on the CPU.

    from cuda_scaled_mm import scaled_mm_under_cuda_rules          # in a test module: the fixture by name
    pytestmark = pytest.mark.usefixtures("scaled_mm_under_cuda_rules")

The rules, from PyTorch's CUDA sources (aten/src/ATen/native/cuda/ScaledBlas.cpp, _scaled_mm_out_cuda and
get_joint_scaling; RowwiseScaledMM.cu, the row-scaled CUTLASS kernel), taking the strictest across the builds
torch 2.11 to 2.13 ship:
  - a [M, K] and b [K, N] are 2-D float8 (e4m3fn or e5m2), and not both e5m2 (cuBLASLt has no e5m2 x e5m2);
  - a row-major and b column-major, the only layout cuBLASLt's FP8 GEMM takes on sm_90 ("TN");
  - K and N multiples of 16 (mat1's trailing dim, mat2's two dims); M is free (16-byte aligned rows suffice);
  - float32 scales, as one of the pairs:
      tensorwise  one element each
      rowwise     scale_a [M, 1] and scale_b [1, N], contiguous; b in e4m3 (the CUTLASS kernel's check) and a
                  too (older builds), and a bf16 output (the one output type every build accepts for row scales)
      blockwise   1x128 x 1x128: scale_a [M, ceil(K/128)] outer-dim-major (strides (1, M)), scale_b
                  [ceil(K/128), N] row-major; e4m3 operands; compute capability 9.x with cuBLAS >= 12.9 only
  - an fp32, bf16 or fp16 output (fp8 outputs are not used here).
Anything else raises, as CUDA would, with the broken rule named.
"""
import pytest
import torch

import kernels.fp8 as fp8

REAL_SCALED_MM = torch._scaled_mm
GEMM_KIND = fp8.gemm_kind
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUTPUTS = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 128


def scaling_kind(a, b, scale_a, scale_b):
    """'tensorwise', 'rowwise' or 'blockwise' (1x128 x 1x128) as CUDA's get_joint_scaling would match the pair;
    None when no pair matches ("Invalid scaling configuration")."""
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return None
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    if scale_a.shape == (M, 1) and scale_b.shape == (1, N) and scale_a.is_contiguous() and scale_b.is_contiguous():
        return "rowwise"
    blocks = -(-K // BLOCK)
    if (scale_a.shape == (M, blocks) and scale_b.shape == (blocks, N)
            and strides_match(scale_a, (1, M)) and strides_match(scale_b, (N, 1))):
        return "blockwise"
    return None


def strides_match(t, strides):
    """CUDA's size/stride check, which ignores the stride of a dimension of size 1."""
    return all(size <= 1 or stride == want for size, stride, want in zip(t.shape, t.stride(), strides))


def broken_rules(a, b, scale_a, scale_b, out_dtype, native_blocks=True):
    """The CUDA rules the call breaks (empty: CUDA runs it)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return [f"shapes {tuple(a.shape)} x {tuple(b.shape)} are not [M, K] x [K, N]"]
    broken = []
    if a.dtype not in FLOAT8 or b.dtype not in FLOAT8:
        broken.append(f"operands {a.dtype} x {b.dtype} are not float8")
    if a.dtype == b.dtype == torch.float8_e5m2:
        broken.append("e5m2 x e5m2 (cuBLASLt multiplies no two e5m2 matrices)")
    if a.stride(1) != 1 or b.stride(0) != 1:
        broken.append(f"layout: a must be row-major and b column-major, got strides {a.stride()} x {b.stride()}")
    K, N = a.shape[1], b.shape[1]
    if K % 16 or N % 16:
        broken.append(f"K = {K} and N = {N} must be multiples of 16")
    if out_dtype not in OUTPUTS:
        broken.append(f"output {out_dtype}")
    kind = scaling_kind(a, b, scale_a, scale_b)
    if kind is None:
        broken.append(f"invalid scaling configuration: scales {tuple(scale_a.shape)} {scale_a.stride()} "
                      f"{scale_a.dtype} x {tuple(scale_b.shape)} {scale_b.stride()} {scale_b.dtype}")
    if kind in ("rowwise", "blockwise") and not (a.dtype == b.dtype == torch.float8_e4m3fn):
        broken.append(f"{kind} scales need e4m3 operands, got {a.dtype} x {b.dtype}")
    if kind == "rowwise" and out_dtype != torch.bfloat16:
        broken.append(f"rowwise scales need a bf16 output, got {out_dtype}")
    if kind == "blockwise" and not native_blocks:
        broken.append("1x128 block scales need compute capability 9.x and cuBLAS >= 12.9")
    return broken


def broken_bias_rules(bias, N, out_dtype):
    """CUDA's rules for a bias added by _scaled_mm's epilogue: a 16-bit bias of the output's dtype, N values, and
    no fp32 output (torch's ScaledBlas checks)."""
    broken = []
    if out_dtype == torch.float32:
        broken.append("a bias with an fp32 output")
    if bias.dtype != out_dtype or bias.dtype not in (torch.bfloat16, torch.float16):
        broken.append(f"a {bias.dtype} bias for a {out_dtype} output (CUDA takes a bf16 or fp16 bias of the output's "
                      f"dtype)")
    if bias.shape != (N,):
        broken.append(f"bias of shape {tuple(bias.shape)} for N = {N}")
    return broken


def dequantized_product(a, b, scale_a, scale_b, out_dtype):
    """What CUDA computes for 1x128 block scales, by dequantizing (the CPU kernel takes no block scales), in fp32."""
    K = a.shape[1]
    a32 = a.float() * scale_a.repeat_interleave(BLOCK, dim=1)[:, :K]
    b32 = b.float() * scale_b.repeat_interleave(BLOCK, dim=0)[:K]
    return a32 @ b32


def cuda_rules_scaled_mm(native_blocks=True):
    """A torch._scaled_mm that refuses what CUDA refuses, then computes on the CPU (CUDA tensors go to the real
    kernel, whose rules are the real ones). torch.compile runs it eagerly, outside the graph, as the check it is."""
    @torch.compiler.disable
    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False,
                  out=None):
        """out=: a compiled graph (inductor's extern kernel) passes its output buffer; the result is written there."""
        result = checked(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
        return result if out is None else out.copy_(result)

    def checked(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum):
        if a.is_cuda:
            return REAL_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, scale_result=scale_result,
                                 out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        out_dtype = out_dtype or a.dtype
        broken = broken_rules(a, b, scale_a, scale_b, out_dtype, native_blocks)
        if bias is not None:
            broken += broken_bias_rules(bias, b.shape[1], out_dtype)
        if scale_result is not None:
            broken.append("scale_result (unchecked here: kernels/fp8.py passes none)")
        if broken:
            raise RuntimeError("torch._scaled_mm on CUDA would refuse this: " + "; ".join(broken))
        kind = scaling_kind(a, b, scale_a, scale_b)
        if kind == "blockwise":
            product = dequantized_product(a, b, scale_a, scale_b, out_dtype)
        else:
            if kind == "tensorwise":        # as row scales: the same product, and the CPU kernel's fast path
                scale_a = scale_a.reshape(1, 1).expand(a.shape[0], 1).contiguous()
                scale_b = scale_b.reshape(1, 1).expand(1, b.shape[1]).contiguous()
            if bias is None:
                return REAL_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
            product = REAL_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        # the epilogue adds the bias to the fp32 accumulator, then rounds once to the output dtype
        return (product if bias is None else product + bias.float()).to(out_dtype)
    return scaled_mm


def simulated_gpu(kind):
    """gemm_kind with CPU tensors answering `kind` (CUDA tensors keep the real answer)."""
    def gemm_kind(t):
        return GEMM_KIND(t) if t.is_cuda else kind
    return gemm_kind


@pytest.fixture
def scaled_mm_under_cuda_rules(monkeypatch):
    """kernels/fp8.py on its H100 path (native block scales), every _scaled_mm call checked by CUDA's rules."""
    monkeypatch.setattr(fp8, "gemm_kind", simulated_gpu("cuda_blocks"))
    monkeypatch.setattr(torch, "_scaled_mm", cuda_rules_scaled_mm(native_blocks=True))
    yield from fresh_compiles()


@pytest.fixture
def scaled_mm_under_cuda_rules_without_blocks(monkeypatch):
    """The same on a GPU without native block scales (Ada, or cuBLAS < 12.9): blockwise by K-slices."""
    monkeypatch.setattr(fp8, "gemm_kind", simulated_gpu("cuda"))
    monkeypatch.setattr(torch, "_scaled_mm", cuda_rules_scaled_mm(native_blocks=False))
    yield from fresh_compiles()


def fresh_compiles():
    """No torch.compile graph crosses the fixture's border, in memory or in the on-disk caches: one traced
    outside it took the CPU's GEMM choices (an fp32 output for row scales), one traced under it the simulated
    GPU's; a reused graph would replay them (seen in the full suite, not in this file alone)."""
    import torch._functorch.config
    import torch._inductor.config
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()
