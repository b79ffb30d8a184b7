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
    delayed     Transformer Engine: tensorwise, scale from the max over a history of past amaxes (no
                extra pass over the tensor before the GEMM); the current amax is pushed afterwards
What stays in high precision (playbook / DeepSeek-V3): embedding, LM head, LayerNorms, attention softmax,
routers, master weights and the optimizer. The bias add is in high precision after the GEMM.

CUDA's _scaled_mm refuses what the CPU kernel takes (tests/cuda_scaled_mm.py checks every FP8 test against its
rules): the contraction dim K and the output columns N multiples of 16, row scales only for e4m3 operands with a
bf16 output. dW's K is the token count, which for an MoE expert is rarely a multiple of 16: on a GPU the
operands are padded with zero rows to the next multiple (of 16, or 128 for native block scales). Zeros change
neither a GEMM's result nor an amax, so the padded product is exactly the unpadded one. An expert that received
no tokens gets an empty output and a zero dW without quantizing anything.
"""
import torch
import torch.nn as nn

RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")
E4M3 = getattr(torch, "float8_e4m3fn", None)
E5M2 = getattr(torch, "float8_e5m2", None)
BLOCK = 128                   # DeepSeek-V3's tile / block edge
AMAX_EPS = 1e-12              # amax floor: an all-zero tensor gets a finite scale


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


def fp8_max(dtype):
    return torch.finfo(dtype).max


def sqnr_db(ref, approx):
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - approx||)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - approx).norm().clamp_min(1e-30)))


def amax(t, granularity):
    """|t| maxima of a 2-D tensor [R, K] over: the whole tensor ('tensor') -> [], each row ('row') -> [R, 1],
    1 x 128 tiles along K ('tile') -> [R, ceil(K/128)], or 128 x 128 blocks ('block') -> [ceil(R/128), ceil(K/128)]."""
    a = t.detach().abs().float()
    if granularity == "tensor":
        return a.amax()
    if granularity == "row":
        return a.amax(dim=1, keepdim=True)
    R, K = a.shape
    a = nn.functional.pad(a, (0, -K % BLOCK, 0, -R % BLOCK if granularity == "block" else 0))
    if granularity == "tile":
        return a.view(R, -1, BLOCK).amax(dim=2)
    return a.view(a.shape[0] // BLOCK, BLOCK, -1, BLOCK).amax(dim=(1, 3))


def per_element(scale, granularity, shape):
    """Broadcast a scale from amax()'s layout to one value per element of a [R, K] tensor."""
    if granularity in ("tensor", "row"):
        return scale
    R, K = shape
    if granularity == "block":
        scale = scale.repeat_interleave(BLOCK, dim=0)[:R]
    return scale.repeat_interleave(BLOCK, dim=1)[:, :K]


def quantize(t, dtype, granularity, amax_value=None):
    """(fp8 tensor, scale) with t * scale -> fp8 (saturating); amax_value overrides the measured amax (delayed)."""
    a = amax(t, granularity) if amax_value is None else amax_value
    scale = fp8_max(dtype) / a.clamp_min(AMAX_EPS)
    q = (t.float() * per_element(scale, granularity, t.shape)).clamp(-fp8_max(dtype), fp8_max(dtype))
    return q.to(dtype), scale


def dequantize(q, scale, granularity):
    return q.float() / per_element(scale, granularity, q.shape)


def _scaled_mm(qa, qb, inv_a, inv_b, out_dtype):
    """qa [M, K] row-major times qb [N, K]^T (column-major, as cuBLASLt wants), scales passed as laid out by the
    caller: a thin wrapper that names the shapes when torch refuses them."""
    try:
        return torch._scaled_mm(qa.contiguous(), qb.contiguous().t(), scale_a=inv_a, scale_b=inv_b,
                                out_dtype=out_dtype)
    except RuntimeError as e:
        raise RuntimeError(f"torch._scaled_mm rejected {qa.dtype} {tuple(qa.shape)} x {qb.dtype} {tuple(qb.shape)}^T "
                           f"with scales {tuple(inv_a.shape)} x {tuple(inv_b.shape)} on {qa.device} "
                           f"(torch {torch.__version__}): {e}") from e


def _tensorwise_mm(qa, qb, inv_a, inv_b, out_dtype, kind):
    """_scaled_mm with one scale per operand (inv_a, inv_b: one element each)."""
    if kind == "cpu":
        # CPU (torch 2.13): the per-tensor path is ~1000x slower than the per-row one; equal per-row scales
        # give the identical product
        inv_a = inv_a.reshape(1, 1).expand(qa.shape[0], 1).contiguous()
        inv_b = inv_b.reshape(1, 1).expand(1, qb.shape[0]).contiguous()
    return _scaled_mm(qa, qb, inv_a, inv_b, out_dtype)


def _pad_rows(t, multiple, dim):
    """t with zero rows (dim 0) or columns (dim 1) appended up to a multiple of `multiple`; t itself if none."""
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    return nn.functional.pad(t, (0, extra) if dim == 1 else (0, 0, 0, extra))


def fp8_matmul(a, b, a_dtype, b_dtype, recipe, a_amax=None, b_amax=None, b_is_weight=True, k_reduce=None):
    """a [M, K] @ b [N, K]^T in fp32 with both operands quantized to FP8 along K, the recipe's way. k_reduce: K is
    split over ranks (tensor parallelism, kernels/fp8_parallel.py), a function maxing the rowwise amaxes of both
    operands over them (tensorwise amaxes come whole as a_amax / b_amax; blockwise tiles lie in one rank)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {RECIPES}")
    M, N, K = a.shape[0], b.shape[0], a.shape[1]
    if not (M and N and K):
        # an empty GEMM (an expert that received no tokens): nothing to quantize (an amax over nothing is an
        # error); the sum over an empty K is zero
        return torch.zeros(M, N, device=a.device, dtype=torch.float32)
    kind = gemm_kind(a)
    if kind != "cpu":
        # cuBLASLt: K and N multiples of 16 (native block scales: whole 128-blocks of K). Zero rows change
        # neither the product nor any amax
        k_multiple = BLOCK if recipe == "blockwise" and kind == "cuda_blocks" else 16
        a, b = _pad_rows(a, k_multiple, 1), _pad_rows(_pad_rows(b, k_multiple, 1), 16, 0)
    # rowwise and blockwise on a GPU: a bf16 output, the one every torch build's row-scaled kernels accept
    out_dtype = torch.bfloat16 if kind != "cpu" and recipe in ("rowwise", "blockwise") else torch.float32
    if recipe in ("tensorwise", "delayed"):
        qa, sa = quantize(a, a_dtype, "tensor", a_amax)
        qb, sb = quantize(b, b_dtype, "tensor", b_amax)
        out = _tensorwise_mm(qa, qb, sa.reciprocal(), sb.reciprocal(), out_dtype, kind)
    elif recipe == "rowwise":
        a_amax, b_amax = amax(a, "row"), amax(b, "row")
        if k_reduce is not None:
            a_amax, b_amax = k_reduce(a_amax, b_amax)
        qa, sa = quantize(a, a_dtype, "row", a_amax)
        qb, sb = quantize(b, b_dtype, "row", b_amax)
        out = _scaled_mm(qa, qb, sa.reciprocal(), sb.reciprocal().t().contiguous(), out_dtype)
    elif kind == "cuda_blocks":
        out = _blockwise_native(a, b, a_dtype, b_dtype, b_is_weight, out_dtype)
    else:
        out = _blockwise_by_slices(a, b, a_dtype, b_dtype, b_is_weight, out_dtype)
    return out[:, :N].float()


def _block_scales(a, b, a_dtype, b_dtype, b_is_weight):
    """(qa, 1x128 scales of a [M, K/128], qb, scales of b per row and 128-block of K [N, K/128]): a weight's
    128x128 block scale repeated on each of its rows, the same numbers as 1x128 scales."""
    qa, sa = quantize(a, a_dtype, "tile")
    qb, sb = quantize(b, b_dtype, "block" if b_is_weight else "tile")
    if b_is_weight:
        sb = sb.repeat_interleave(BLOCK, dim=0)[:b.shape[0]]
    return qa, sa, qb, sb


def _blockwise_native(a, b, a_dtype, b_dtype, b_is_weight, out_dtype):
    """One _scaled_mm with cuBLASLt's 1x128 x 1x128 block scales (K padded to whole blocks by the caller).
    Layouts its checks want: a's scales [M, K/128] outer-dim-major (strides (1, M)), b's as [K/128, N]
    row-major (b enters transposed). The 128x128 weight format is not used: its scale layout differs between
    torch versions and must be 16-byte aligned, while repeating the block scale per row costs nothing."""
    qa, sa, qb, sb = _block_scales(a, b, a_dtype, b_dtype, b_is_weight)
    return _scaled_mm(qa, qb, sa.reciprocal().t().contiguous().t(), sb.reciprocal().t().contiguous(), out_dtype)


def _blockwise_by_slices(a, b, a_dtype, b_dtype, b_is_weight, out_dtype):
    """The reference implementation: per 128-wide slice of K the scales are per row of a and per row of b, a
    row-scaled GEMM; the K/128 partial products are added in fp32."""
    qa, sa, qb, sb = _block_scales(a, b, a_dtype, b_dtype, b_is_weight)
    out = torch.zeros(a.shape[0], b.shape[0], device=a.device, dtype=torch.float32)
    for kb, k0 in enumerate(range(0, a.shape[1], BLOCK)):
        out += _scaled_mm(qa[:, k0:k0 + BLOCK], qb[:, k0:k0 + BLOCK], sa[:, kb:kb + 1].reciprocal(),
                          sb[:, kb][None, :].reciprocal().contiguous(), out_dtype).float()
    return out


def delayed_amax(history, t, current=None):
    """Scale source of delayed scaling: the history's max (the current amax at the very first step);
    then push t's amax (or `current`, when given: a tensor-parallel layer's amax of the whole tensor). No host
    synchronisation."""
    # an empty tensor (an expert without tokens this step) has amax 0: it never raises the history's max
    if current is None:
        current = t.detach().abs().amax().float() if t.numel() else history.new_zeros(())
    past = history.max()
    history.copy_(torch.roll(history, 1))
    history[0] = current
    return torch.where(past > 0, past, current)


class _Float8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe, history):
        x2 = x.reshape(-1, x.shape[-1])
        x_amax = w_amax = None
        if recipe == "delayed":
            x_amax, w_amax = delayed_amax(history[0], x2), delayed_amax(history[1], weight)
        y = fp8_matmul(x2, weight, E4M3, E4M3, recipe, x_amax, w_amax)
        ctx.save_for_backward(x2, weight)
        ctx.recipe, ctx.history, ctx.amaxes, ctx.x_shape = recipe, history, (x_amax, w_amax), x.shape
        return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        x_amax, w_amax = ctx.amaxes
        dy_amax = delayed_amax(ctx.history[2], dy2) if ctx.recipe == "delayed" else None
        # cuBLASLt's row-scaled FP8 GEMMs take e4m3 operands only (torchao's rowwise recipe does the same)
        g = E4M3 if gemm_kind(dy) != "cpu" and ctx.recipe in ("rowwise", "blockwise") else E5M2
        dx = fp8_matmul(dy2, weight.t(), g, E4M3, ctx.recipe, dy_amax, w_amax)
        dw = fp8_matmul(dy2.t(), x2.t(), g, E4M3, ctx.recipe, dy_amax, x_amax, b_is_weight=False)
        return dx.to(x2.dtype).view(ctx.x_shape), dw.to(weight.dtype), None, None


class Float8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8; parameters (names, values, dtype) are the Linear's own."""

    def __init__(self, in_features, out_features, bias=True, recipe="tensorwise", history_len=16,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {RECIPES}")
        self.recipe = recipe
        # amax histories of x, W, dy for delayed scaling (unused by the dynamic recipes)
        self.register_buffer("amax_history", torch.zeros(3, history_len, device=device), persistent=False)

    @classmethod
    def from_float(cls, linear, recipe="tensorwise", history_len=16):
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, history_len,
                  device="meta")
        new.weight, new.bias = linear.weight, linear.bias           # the same Parameter objects: no copy
        new.amax_history = torch.zeros(3, history_len, device=linear.weight.device)
        return new

    def matmul(self, x):
        """x W^T in FP8, without the bias: for a fused kernel that adds the bias itself (kernels/apply.py's
        FusedBlock), so FP8 and the fused kernels compose."""
        return _Float8LinearFunction.apply(x, self.weight, self.recipe, self.amax_history)

    def forward(self, x):
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self):
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert_to_float8(model, recipe="tensorwise", skip=("lm_head", "wte", "router", "gate")):
    """Swap every nn.Linear whose name has no `skip` part for a Float8Linear, in place; returns the names.
    On GPU only layers with both dims multiples of 16 are swapped (cuBLASLt's FP8 requirement; fp8_matmul could
    pad the others, but that would copy their weight at every GEMM)."""
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or any(s in full for s in skip):
                continue
            if gemm_kind(child.weight) != "cpu" and (child.in_features % 16 or child.out_features % 16):
                continue
            check_fp8_support(child.weight.device)
            setattr(module, child_name, Float8Linear.from_float(child, recipe))
            swapped.append(full)
    return swapped
