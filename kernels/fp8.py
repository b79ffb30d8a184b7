"""
kernels/fp8.py: FP8 training for the big Linear layers, with torch._scaled_mm doing the matmuls.

    from kernels.fp8 import Float8Linear, convert_to_float8
    layer = Float8Linear.from_float(nn.Linear(512, 512), recipe="tensorwise")   # same parameters, FP8 GEMMs
    convert_to_float8(model, recipe="blockwise")      # every block's c_attn, c_proj, c_fc in place

The three GEMMs of a Linear y = x W^T + b, operands quantized on the fly, accumulated in fp32:
    forward   y  = x  W^T   x: e4m3, W: e4m3        (e4m3: 3 mantissa bits, max 448, for values)
    backward  dx = dy W     dy: e5m2, W: e4m3       (e5m2: 2 mantissa bits, max 57344, for gradients'
              dW = dy^T x   dy: e5m2, x: e4m3        wider range)
    quantize:  q = clamp(v * s, -max, max) -> fp8,  s = fp8_max / amax (amax clamped away from 0);
               _scaled_mm(qa, qb^T, 1/s_a, 1/s_b) = a b^T up to rounding
Recipes (how many scales, over what):
    tensorwise  one scale per tensor, from its current amax (dynamic scaling)
    rowwise     one per row along the contraction dim (a [M,1] x b [1,N] scale pair)
    blockwise   DeepSeek-V3: activations and gradients in 1x128 tiles, weights in 128x128 blocks. On an
                H100 (sm_90, cuBLAS >= 12.9) one _scaled_mm with native 1x128 scales (a weight block's
                scale repeated on its 128 rows: the same numbers). Elsewhere (CPU, Ada, older cuBLAS) a
                reference implementation: one row-scaled _scaled_mm per 128-wide slice of the contraction
                dim, partial sums added in fp32: K/128 GEMMs, correct but slow
    delayed     Transformer Engine: tensorwise, scale from the max over a history of past amaxes; the
                current amax is measured and pushed into the history
Per forward + backward each operand (x, W, dy) is quantized once, amax and cast fused, into both layouts its
two GEMMs read (kernels/fp8_cast.py; the GEMM call is kernels/fp8_gemm.py); the output comes in the autocast
dtype, as nn.Linear's; only the forward GEMM asks for fast accumulation. docs/kernels.md has the op counts.
What stays in high precision (playbook / DeepSeek-V3): embedding, LM head, LayerNorms, attention softmax,
routers, master weights and the optimizer. The bias is added by the forward GEMM's epilogue where its output is the
Linear's 16-bit output (bf16 autocast on a GPU: kernels/fp8_gemm.takes_bias), else in high precision after it.
Which layers: an FP8 GEMM pays only when its arithmetic outweighs quantizing x, W and dy (three memory passes).
With size_filter (the training scripts' converter call), a GPU keeps the Linears too small to gain in high
precision, by the thresholds of torchao's auto-filter, measured per recipe on H100 (too_small_for_fp8): at
GPT-2-small (C = 768) every block Linear stays bf16 under row scales, all but MLP.c_proj under tensor scales.

CUDA's _scaled_mm refuses what the CPU kernel takes (tests/cuda_scaled_mm.py checks every FP8 test against its
rules): the contraction dim K and the output columns N multiples of 16, row scales only for e4m3 operands with a
bf16 output. dW's K is the token count, which for an MoE expert is rarely a multiple of 16: on a GPU the
operands are padded with zero rows to the next multiple (of 16, or 128 for native block scales). Zeros change
neither a GEMM's result nor an amax, so the padded product is exactly the unpadded one. An expert that received
no tokens gets an empty output and a zero dW without quantizing anything.
"""
import functools
import os

import torch
import torch.nn as nn

from kernels.backend import HAS_TRITON, compute_dtype
from kernels.fp8_cast import GROUPS, delayed_source, fp8_amax, fp8_cast
from kernels.fp8_gemm import BLOCK, scaled_gemm, takes_bias, unpadded
from kernels.fp8_quant import AMAX_EPS, E4M3, E5M2, amax, dequantize, fp8_max, per_element, quantize  # noqa: F401

RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")


def gemm_kind(t):
    """Which torch._scaled_mm the GEMMs of t go to, and so whose rules they follow: "cpu"; "cuda" (cuBLASLt /
    CUTLASS: K and N multiples of 16, row scales with e4m3 and a bf16 output); "cuda_blocks": "cuda" plus native
    1x128 block scales (compute capability 9.x with cuBLAS >= 12.9, the DeepSeek-style scaling of torch >= 2.9).
    The one place fp8.py asks about the device (tests take the CUDA paths on a CPU by replacing it)."""
    if not t.is_cuda:
        return "cpu"
    cuda = tuple(int(part) for part in (torch.version.cuda or "0").split(".")[:2])
    if torch.cuda.get_device_capability(t.device)[0] == 9 and cuda >= (12, 9):
        return "cuda_blocks"
    return "cuda"


def check_fp8_support(device):
    """A clear error instead of a failing kernel deep inside training."""
    if E4M3 is None or not hasattr(torch, "_scaled_mm"):
        raise RuntimeError(f"FP8 needs torch.float8_e4m3fn and torch._scaled_mm; torch {torch.__version__} lacks them")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError("FP8 matmuls need a GPU with compute capability >= 8.9 (Ada, Hopper or newer)")


def sqnr_db(ref, approx):
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - approx||)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - approx).norm().clamp_min(1e-30)))


def fused_cast(t):
    """True where operands are quantized by kernels/fp8_cast.py's Triton kernels: GPU tensors with Triton
    installed (and, in the tests, CPU tensors that take the GPU path under Triton's interpreter)."""
    return HAS_TRITON and gemm_kind(t) != "cpu" and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def cast(t, dtype, recipe, role, amax=None, transposed=True):
    """fp8_cast of a 2-D operand ('activation' or 'weight' groups of the recipe), zero-padded as its GPU GEMMs
    want: K and N multiples of 16, whole 128-blocks of K for native block scales."""
    kind = gemm_kind(t)
    pad = 1 if kind == "cpu" else BLOCK if recipe == "blockwise" and kind == "cuda_blocks" else 16
    return fp8_cast(t, dtype, GROUPS[recipe][role], amax, transposed, pad, use_triton=fused_cast(t))


def fp8_matmul(a, b, a_dtype, b_dtype, recipe, a_amax=None, b_amax=None, b_is_weight=True, k_reduce=None):
    """a [M, K] @ b [N, K]^T in fp32 with both operands quantized to FP8 along K, the recipe's way: one GEMM of
    its own operands (converters/fp8_tp.py; Float8Linear shares quantized operands between its GEMMs).
    k_reduce: K is split over ranks (tensor parallelism), a function maxing the rowwise amaxes of both operands
    over them (tensorwise amaxes come whole as a_amax / b_amax; blockwise tiles lie in one rank)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {RECIPES}")
    M, N, K = a.shape[0], b.shape[0], a.shape[1]
    if not (M and N and K):
        # an empty GEMM (an expert that received no tokens): nothing to quantize (an amax over nothing is an
        # error); the sum over an empty K is zero
        return torch.zeros(M, N, device=a.device, dtype=torch.float32)
    if recipe == "rowwise" and k_reduce is not None:
        a_amax, b_amax = k_reduce(fp8_amax(a, (1, 0), fused_cast(a)), fp8_amax(b, (1, 0), fused_cast(b)))
    qa = cast(a, a_dtype, recipe, "activation", a_amax, transposed=False)
    qb = cast(b, b_dtype, recipe, "weight" if b_is_weight else "activation", b_amax, transposed=False)
    return unpadded(scaled_gemm(qa[:2], qb[:2], torch.float32, recipe, gemm_kind(a)), M, N).float()


def delayed_amax(history, t, current=None):
    """Scale source of delayed scaling: the history's max (the current amax at the very first step);
    then push t's amax (or `current`, when given: a tensor-parallel layer's amax of the whole tensor). No host
    synchronisation."""
    # an empty tensor (an expert without tokens this step) has amax 0: it never raises the history's max
    if current is None:
        current = fp8_amax(t, (0, 0), fused_cast(t)) if t.numel() else history.new_zeros(())
    return delayed_source(history, current, fused_cast(t))


def out_dtype_of(x):
    """A Linear's output dtype: the autocast dtype under autocast (as nn.Linear), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _Float8LinearFunction(torch.autograd.Function):
    """y = x W^T with each operand quantized once per forward + backward, in both layouts (fp8_cast): the
    forward keeps x^T's and W^T's FP8 copies for dW and dx, instead of quantizing x and W again."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, history, gathered=None):
        """gathered: (W's Fp8Cast, W's amax) quantized already (ZeRO-3's FP8 all-gather, converters/fp8_gather.py).
        bias: None, or added by the GEMM where it can (takes_bias), else after it."""
        x2 = x.reshape(-1, x.shape[-1])
        M, N, kind = x2.shape[0], weight.shape[0], gemm_kind(x2)
        in_gemm = bias is not None and takes_bias(out_dtype_of(x), recipe, kind)
        x_amax = w_amax = None
        if recipe == "delayed":
            x_amax = delayed_amax(history[0], x2)
            w_amax = delayed_amax(history[1], weight, None if gathered is None else gathered[1])
        if not M:
            y = x2.new_zeros(0, N, dtype=out_dtype_of(x))
            ctx.save_for_backward(x2, weight)
        else:
            qx = cast(x2, E4M3, recipe, "activation", x_amax)
            qw = cast(weight, E4M3, recipe, "weight", w_amax) if gathered is None else gathered[0]
            y = scaled_gemm(qx[:2], qw[:2], out_dtype_of(x), recipe, kind, fast_accum=True,
                            bias=bias if in_gemm else None)
            y = unpadded(y, M, N).to(out_dtype_of(x))
            # a gathered W^T lives in ZeRO-3's unit, freed after this forward: dgrad keeps a copy
            ctx.save_for_backward(qx.qt, qx.inv_t, qw.qt if gathered is None else qw.qt.clone(), qw.inv_t)
        if bias is not None and not in_gemm:
            y = y + bias.to(y.dtype)
        ctx.recipe, ctx.history, ctx.shapes, ctx.dtypes = recipe, history, (x.shape, M, N), (x.dtype, weight.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        dx, weight_grad = float8_backward_split(ctx, dy)
        return dx, weight_grad(), bias_grad(ctx, dy), None, None, None


def bias_grad(ctx, dy):
    """db = the sum of dy over tokens (None without a bias), accumulated in fp32 at least."""
    if ctx.bias_dtype is None:
        return None
    return dy.reshape(-1, dy.shape[-1]).sum(0, dtype=compute_dtype(dy)).to(ctx.bias_dtype)


def float8_backward_split(ctx, dy):
    """_Float8LinearFunction's backward in two parts: dx = dy W now (dy quantized once, in both layouts), and a
    function that returns dW = dy^T x from that quantized dy and the forward's quantized x^T whenever it is called:
    at once (the backward above), or in a zero-bubble pipeline's W step (_Float8LinearInputGradOnly). The same
    GEMM on the same operands either way: the same dW, bit for bit."""
    (x_shape, M, N), (x_dtype, w_dtype), recipe = ctx.shapes, ctx.dtypes, ctx.recipe
    dy2 = dy.reshape(-1, N)
    dy_amax = delayed_amax(ctx.history[2], dy2) if recipe == "delayed" else None
    if not M:       # an expert without tokens: an empty input gradient, a zero weight gradient
        x2, weight = ctx.saved_tensors
        return x2.new_zeros(x_shape), functools.partial(torch.zeros_like, weight)
    xt, xt_inv, wt, wt_inv = ctx.saved_tensors
    K, kind = x_shape[-1], gemm_kind(dy)
    # cuBLASLt's row-scaled FP8 GEMMs take e4m3 operands only (torchao's rowwise recipe does the same)
    g = E4M3 if kind != "cpu" and recipe in ("rowwise", "blockwise") else E5M2
    qdy = cast(dy2, g, recipe, "activation", dy_amax)
    dx = unpadded(scaled_gemm(qdy[:2], (wt, wt_inv), x_dtype, recipe, kind), M, K)
    dyt = qdy[2:]                   # dy^T's layout: all that dW needs of dy (the closure keeps no more)

    def weight_grad():
        return unpadded(scaled_gemm(dyt, (xt, xt_inv), w_dtype, recipe, kind), N, K).to(w_dtype)
    return dx.to(x_dtype).reshape(x_shape), weight_grad


class _Float8LinearInputGradOnly(torch.autograd.Function):
    """_Float8LinearFunction whose backward returns only dx and defers dW to a zero-bubble pipeline's W step:
    `store` is pipeline/weight_grads.WeightGradStore (Float8Linear.weight_grad_store)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, history, gathered, store):
        ctx.weight, ctx.store = weight, store            # the Parameter itself, for W
        return _Float8LinearFunction.forward(ctx, x, weight, bias, recipe, history, gathered)

    @staticmethod
    def backward(ctx, dy):
        dx, weight_grad = float8_backward_split(ctx, dy)
        weight = ctx.weight
        ctx.store.defer(lambda: [(weight, weight_grad())])
        return dx, None, bias_grad(ctx, dy), None, None, None, None


def _apply(function, *args):
    return function.apply(*args)


class Float8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8; parameters (names, values, dtype) are the Linear's own."""

    def __init__(self, in_features, out_features, bias=True, recipe="tensorwise", history_len=16,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {RECIPES}")
        self.recipe = recipe
        # how matmul applies its Function. The delayed recipe's GEMMs stay eager under torch.compile: its amax
        # history is updated in place by every forward and backward, and a compiled graph saves that buffer for its
        # backward, so a second micro-batch's forward before the first one's backward (any pipeline schedule) fails
        # autograd's version check. Wrapped here, not at import: torch.compiler.disable imports torch._dynamo (1.3 s),
        # which a run refused for bad input never needs (a training run imports it with torch.optim's optimizer).
        self.run = torch.compiler.disable(_apply) if recipe == "delayed" else _apply
        self.weight_grad_store = None            # zero-bubble pipelines: dW deferred (pipeline/weight_grads.py)
        # amax histories of x, W, dy for delayed scaling (unused by the dynamic recipes)
        self.register_buffer("amax_history", torch.zeros(3, history_len, device=device), persistent=False)
        self.gathered_weight = None     # set while ZeRO-3 holds this W gathered in FP8 (converters/fp8_gather.py)

    @classmethod
    def from_float(cls, linear, recipe="tensorwise", history_len=16):
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, history_len,
                  device="meta")
        new.weight, new.bias = linear.weight, linear.bias           # the same Parameter objects: no copy
        new.amax_history = torch.zeros(3, history_len, device=linear.weight.device)
        return new

    def matmul(self, x, bias=None):
        """x W^T (+ bias) in FP8; without the bias for a fused kernel that adds it itself (kernels/apply.py's
        FusedBlock), so FP8 and the fused kernels compose."""
        if self.weight_grad_store is not None:
            return self.run(_Float8LinearInputGradOnly, x, self.weight, bias, self.recipe, self.amax_history,
                            self.gathered_weight, self.weight_grad_store)
        return self.run(_Float8LinearFunction, x, self.weight, bias, self.recipe, self.amax_history,
                        self.gathered_weight)

    def forward(self, x):
        return self.matmul(x, self.bias)

    def extra_repr(self):
        return f"{super().extra_repr()}, recipe={self.recipe}"


def too_small_for_fp8(linear, recipe):
    """True for a Linear whose FP8 GEMMs would not beat bf16 on an H100, by the thresholds of torchao's auto-filter
    (its per-recipe benchmarks, on in_features K and out_features N): with one scale per tensor FP8 pays once K >
    1024 or N > 4096; row (and block) scales cost more per GEMM, so they need K > 2048, N > 1024 and not both
    K <= 4096 and N <= 2048."""
    K, N = linear.in_features, linear.out_features
    if recipe in ("tensorwise", "delayed"):
        return K <= 1024 and N <= 4096
    return K <= 2048 or N <= 1024 or (K <= 4096 and N <= 2048)


def convert_to_float8(model, recipe="tensorwise", skip=("lm_head", "wte", "router", "gate"), size_filter=False):
    """Swap every nn.Linear whose name has no `skip` part for a Float8Linear, in place; returns the names.
    On GPU only layers with both dims multiples of 16 are swapped (cuBLASLt's FP8 requirement; fp8_matmul could
    pad the others, but that would copy their weight at every GEMM), and with size_filter only those big enough
    to gain (too_small_for_fp8). A CPU has no FP8 speed to gain or lose: there every layer is swapped, so CPU runs
    check the FP8 numerics of every layer."""
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or any(s in full for s in skip):
                continue
            on_gpu = gemm_kind(child.weight) != "cpu"
            if on_gpu and (child.in_features % 16 or child.out_features % 16 or
                           size_filter and too_small_for_fp8(child, recipe)):
                continue
            check_fp8_support(child.weight.device)
            setattr(module, child_name, Float8Linear.from_float(child, recipe))
            swapped.append(full)
    return swapped
