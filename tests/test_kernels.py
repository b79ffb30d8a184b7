"""
Fused kernels (kernels/) against float64 references: forward and every gradient, odd shapes, non-contiguous
inputs, random upstream gradients. With a GPU the tensors live on it and the compiled kernels run; without one
the Triton code runs on CPU tensors in the interpreter (conftest sets TRITON_INTERPRET=1), so shapes stay tiny.
Then: the int64 offset arithmetic at sizes past 2^31 elements, and a model with apply_kernels trains like
train_single.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
import kernels  # noqa: E402
from kernels import (attention_reference, bias_dropout_add, bias_gelu, flash_attention, layer_norm,  # noqa: E402
                     linear_cross_entropy, rms_norm, swiglu)
from kernels.swiglu import swiglu_reference  # noqa: E402
from kernels.backend import block_offsets, tl, triton  # noqa: E402
from kernels.flash_attention import _dense_head_start, _head_start  # noqa: E402
from kernels.linear_cross_entropy import linear_cross_entropy_reference  # noqa: E402

FP32_RTOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"    # CPU: the conftest put Triton in interpreter mode


def randn(*shape, **kwargs):
    return torch.randn(*shape, device=DEVICE, **kwargs)


def rel_err(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def grads(fn, inputs, upstream):
    """Output and gradients of every input, for a random upstream gradient (not ones, under which some wrong
    gradients look right)."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    return [out.detach()] + list(torch.autograd.grad(out, inputs, upstream.to(out.dtype)))


def check_against_float64(fn_kernel, fn_ref, inputs, upstream, rtol=FP32_RTOL):
    got = grads(fn_kernel, inputs, upstream)
    ref = grads(fn_ref, [t.double() for t in inputs], upstream.double())
    for i, (g, r) in enumerate(zip(got, ref)):
        assert rel_err(g, r) <= rtol, f"{'output' if i == 0 else f'grad of input {i - 1}'}: {rel_err(g, r):.2e}"


def check_bf16(fn_kernel, fn_torch, inputs):
    """A bf16 kernel is no worse than 2x PyTorch's own bf16 result, both against float64."""
    ref = fn_torch(*[t.double() for t in inputs])
    ours = fn_kernel(*[t.bfloat16() if t.is_floating_point() else t for t in inputs])
    theirs = fn_torch(*[t.bfloat16() if t.is_floating_point() else t for t in inputs])
    assert rel_err(ours, ref) <= 2 * rel_err(theirs, ref) + 1e-6, (rel_err(ours, ref), rel_err(theirs, ref))


def test_layer_norm_fp32_odd_shapes_noncontiguous():
    torch.manual_seed(0)
    x = randn(37, 3, 5).transpose(0, 2)            # [5, 3, 37]: non-contiguous, 15 rows of 37 (odd)
    w, b = randn(37), randn(37)
    check_against_float64(lambda *a: layer_norm(*a, backend="triton"), lambda *a: layer_norm(*a, backend="torch"),
                          [x, w, b], randn(5, 3, 37))
    x = randn(150, 37)                              # several row tiles per program, a ragged last one
    check_against_float64(lambda *a: layer_norm(*a, backend="triton"), lambda *a: layer_norm(*a, backend="torch"),
                          [x, w, b], randn(150, 37))
    check_bf16(lambda x, w, b: layer_norm(x, w, b, backend="triton"),
               lambda x, w, b: F.layer_norm(x, (37,), w, b), [randn(19, 37), w, b])


def test_bias_gelu_fp32_and_bf16():
    torch.manual_seed(1)
    x, b = randn(6, 53)[:, 1:50], randn(49)    # non-contiguous rows of 49
    check_against_float64(lambda *a: bias_gelu(*a, backend="triton"), lambda x, b: F.gelu(x + b),
                          [x, b], randn(6, 49))
    wide = [randn(70, 200), randn(200)]              # several row and column tiles, ragged in both
    check_against_float64(lambda *a: bias_gelu(*a, backend="triton"), lambda x, b: F.gelu(x + b),
                          wide, randn(70, 200))
    check_bf16(lambda x, b: bias_gelu(x, b, backend="triton"), lambda x, b: F.gelu(x + b),
               [randn(7, 49) * 3, b])


def test_rms_norm_and_swiglu_fp32_odd_shapes_and_bf16():
    """The Llama family's kernels: RMSNorm on 15 non-contiguous rows of 37, SwiGLU on [gate | up] rows of 2 x 23."""
    torch.manual_seed(8)
    x, w = randn(37, 3, 5).transpose(0, 2), randn(37)
    check_against_float64(lambda x, w: rms_norm(x, w, 1e-6, backend="triton"),
                          lambda x, w: F.rms_norm(x, (37,), w, 1e-6), [x, w], randn(5, 3, 37))
    check_bf16(lambda x, w: rms_norm(x, w, 1e-6, backend="triton"), lambda x, w: F.rms_norm(x, (37,), w, 1e-6),
               [randn(19, 37), w])
    h = randn(7, 50)[:, 2:48]                      # non-contiguous rows of 46: gate 23 | up 23
    check_against_float64(lambda h: swiglu(h, backend="triton"), swiglu_reference, [h], randn(7, 23))
    check_bf16(lambda h: swiglu(h, backend="triton"), swiglu_reference, [randn(9, 46) * 3])


def test_bias_dropout_add():
    torch.manual_seed(2)
    x, b, r, g = randn(5, 41), randn(41), randn(5, 41), randn(5, 41)
    for training in (True, False):   # p = 0 or eval: exactly the reference
        check_against_float64(lambda x, b, r: bias_dropout_add(x, b, r, 0.0 if training else 0.5, training,
                                                               backend="triton"),
                              lambda x, b, r: r + x + b, [x, b, r], g)
    # p > 0: kept elements scaled by 1/(1-p), dropped ones zero, and backward regenerates the same mask
    xs, bs, rs = (t.clone().requires_grad_() for t in (x, b, r))
    y = bias_dropout_add(xs, bs, rs, 0.25, True, backend="triton")
    dx, db, dr = torch.autograd.grad(y, (xs, bs, rs), g)
    keep = (y - r).detach() != 0
    assert 0.6 < keep.float().mean() < 0.9, keep.float().mean()
    torch.testing.assert_close((y - r).detach()[keep], ((x + b) / 0.75)[keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, g * keep / 0.75, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(db, dx.sum(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dr, g)


# (100, 100): on the interpreter's 32 x 32 tile, every stage of both kernels runs (the forward's unmasked key
# blocks, the backward's diagonal, unmasked and ragged query tiles)
@pytest.mark.parametrize("B,H,Tq,Tk,D,causal", [(1, 2, 37, 37, 32, True), (1, 1, 21, 45, 64, False),
                                                (1, 1, 19, 19, 128, True), (2, 1, 23, 23, 24, False),
                                                (1, 1, 100, 100, 16, True)])
def test_flash_attention_fp32(B, H, Tq, Tk, D, causal):
    torch.manual_seed(3)
    q = randn(B, Tq, H, D).transpose(1, 2)           # the model's layout: a non-contiguous view
    k, v = randn(B, H, Tk, D), randn(B, Tk, H, D).transpose(1, 2)
    check_against_float64(lambda *a: flash_attention(*a, causal, backend="triton"),
                          lambda *a: attention_reference(*a, causal), [q, k, v], randn(B, H, Tq, D))
    _, lse = flash_attention(q, k, v, causal, backend="triton")
    _, lse_ref = attention_reference(q.double(), k.double(), v.double(), causal)
    assert lse.dtype == torch.float32 and rel_err(lse, lse_ref) <= FP32_RTOL


def test_flash_attention_bf16():
    torch.manual_seed(4)
    q, k, v = (randn(1, 2, 29, 32) for _ in range(3))
    check_bf16(lambda q, k, v: flash_attention(q, k, v, True, backend="triton")[0],
               lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_linear_cross_entropy(backend):
    torch.manual_seed(5)
    N, C, V = 45, 19, 101
    h, w, t = randn(N, C), randn(V, C), torch.randint(0, V, (N,), device=DEVICE)
    t[[3, 17]] = -100                                        # ignored, as F.cross_entropy's ignore_index
    check_against_float64(lambda h, w: linear_cross_entropy(h, w, t, chunk=16, backend=backend),
                          lambda h, w: linear_cross_entropy_reference(h, w, t), [h, w], randn(()))


def test_linear_cross_entropy_float64_end_to_end():
    """The float64 exactness runs (docs/parity.md) keep the fused head in float64: loss and dW sums too."""
    torch.manual_seed(5)
    h, w, t = randn(45, 19, dtype=torch.float64), randn(101, 19, dtype=torch.float64), torch.randint(0, 101, (45,))
    t = t.to(DEVICE)
    check_against_float64(lambda h, w: linear_cross_entropy(h, w, t, chunk=16, backend="torch"),
                          lambda h, w: linear_cross_entropy_reference(h, w, t), [h, w], randn(()), rtol=1e-12)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_linear_cross_entropy_defers_dw_to_a_zero_bubble_w_step(backend):
    """Under zb1 / zbv / dualpipev the fused head leaves dW to W (pipeline/weight_grads.py), which computes
    the logits again: the loss, dh and dW equal the undeferred head's bit for bit (same ops, same order)."""
    from pipeline.weight_grads import WeightGradStore
    torch.manual_seed(6)
    h, w, t = randn(45, 19), randn(101, 19), torch.randint(0, 101, (45,), device=DEVICE)
    t[7] = -100
    upstream, store = randn(()), WeightGradStore()
    ref = grads(lambda h, w: linear_cross_entropy(h, w, t, chunk=16, backend=backend), [h, w], upstream)
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, t, chunk=16, backend=backend, defer=(store, w))
    loss.backward(upstream)
    assert w.grad is None and torch.equal(h.grad, ref[1]) and torch.equal(loss.detach(), ref[0])
    store.close("mb")
    store.compute("mb")
    assert torch.equal(w.grad, ref[2])


F64_RTOL = 1e-12           # float64 rounding and reordering stay ~1e-15; a step through fp32 costs ~1e-7
F64_CASES = {
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b, backend="triton"),
                   lambda x, w, b: F.layer_norm(x, (37,), w, b), [(15, 37), (37,), (37,)], (15, 37)),
    "bias_gelu": (lambda x, b: bias_gelu(x, b, backend="triton"), lambda x, b: F.gelu(x + b),
                  [(6, 49), (49,)], (6, 49)),
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6, backend="triton"), lambda x, w: F.rms_norm(x, (37,), w, 1e-6),
                 [(15, 37), (37,)], (15, 37)),
    "swiglu": (lambda h: swiglu(h, backend="triton"), swiglu_reference, [(6, 2 * 49)], (6, 49)),
    "bias_dropout_add": (lambda x, b, r: bias_dropout_add(x, b, r, 0.0, True, backend="triton"),
                         lambda x, b, r: r + x + b, [(5, 41), (41,), (5, 41)], (5, 41)),
    "flash_attention": (lambda q, k, v: flash_attention(q, k, v, True, backend="triton"),
                        lambda q, k, v: attention_reference(q, k, v, True), [(1, 2, 37, 24)] * 3, (1, 2, 37, 24)),
    "linear_cross_entropy": (lambda h, w: linear_cross_entropy(h, w, TARGETS_45, chunk=16, backend="triton"),
                             lambda h, w: linear_cross_entropy_reference(h, w, TARGETS_45), [(45, 19), (101, 19)], ()),
}
TARGETS_45 = torch.randint(0, 101, (45,), generator=torch.Generator().manual_seed(5)).to(DEVICE)


@pytest.mark.parametrize("kernel", F64_CASES)
def test_float64_is_computed_in_float64(kernel):
    """--dtype float64 --kernels triton (the exactness runs): each kernel's output and gradients equal the float64
    reference to float64 rounding; a kernel that computed float64 in fp32 would be ~1e-7 off."""
    torch.manual_seed(6)
    fn_kernel, fn_ref, shapes, out_shape = F64_CASES[kernel]
    inputs = [randn(*shape, dtype=torch.float64) for shape in shapes]
    upstream = torch.randn(out_shape, device=DEVICE, dtype=torch.float64)
    check_against_float64(fn_kernel, fn_ref, inputs, upstream, rtol=F64_RTOL)


def test_float64_attention_lse_and_dropout_scale():
    """The float64 kernels' side outputs: the attention lse is float64 (a merge in train_cp.py and the backward
    rebuild probabilities from it), and dropout's 1 / (1 - p) is exact."""
    torch.manual_seed(7)
    q, k, v = (randn(1, 2, 37, 24, dtype=torch.float64) for _ in range(3))
    _, lse = flash_attention(q, k, v, True, backend="triton")
    assert lse.dtype == torch.float64 and rel_err(lse, attention_reference(q, k, v, True)[1]) <= F64_RTOL
    x, b, r = randn(5, 41, dtype=torch.float64), randn(41, dtype=torch.float64), randn(5, 41, dtype=torch.float64)
    y = bias_dropout_add(x, b, r, 0.1, True, backend="triton")
    keep = (y - r) != 0
    torch.testing.assert_close((y - r)[keep], ((x + b) / 0.9)[keep], rtol=1e-14, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_kernels_refuse_dtypes_they_do_not_compute(dtype):
    """A dtype a kernel does not compute is a clear error before any launch, naming it and what to use instead."""
    x = randn(4, 32).to(dtype)
    for call in (lambda: layer_norm(x, randn(32), randn(32), backend="triton"),
                 lambda: bias_gelu(x, randn(32), backend="triton"),
                 lambda: rms_norm(x, randn(32), backend="triton"), lambda: swiglu(x, backend="triton"),
                 lambda: flash_attention(x[None, None], x[None, None], x[None, None], backend="triton")):
        with pytest.raises(ValueError, match=rf"{str(dtype).removeprefix('torch.')}.*backend='torch'"):
            call()
    with pytest.raises(ValueError, match="one dtype"):
        q = randn(1, 1, 16, 16)
        flash_attention(q, q.double(), q, backend="triton")


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor (in bytes) any op produces (the interpreter's byte-storage copies included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel() * o.element_size())
        return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_linear_cross_entropy_never_materializes_logits(backend):
    N, C, V = 64, 16, 128
    h, w = randn(N, C, requires_grad=True), randn(V, C, requires_grad=True)
    t = torch.randint(0, V, (N,), device=DEVICE)
    with LargestAllocation() as fused:
        loss = linear_cross_entropy(h, w, t, chunk=16, backend=backend)
        loss.backward()
    with LargestAllocation() as unfused:                      # the check itself can fail: the reference trips it
        linear_cross_entropy_reference(h, w, t).backward()
    logits_bytes = N * V * 4
    assert unfused.largest >= logits_bytes
    assert fused.largest <= logits_bytes // 4, f"largest tensor {fused.largest} bytes, logits are {logits_bytes}"
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.t(), t), rtol=1e-6, atol=1e-6)


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (.item(), int(), bool(): aten._local_scalar_dense), each of
    which waits for the GPU to finish all queued work when the tensor lives there."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_linear_cross_entropy_never_waits_for_the_device(backend):
    h, w = randn(40, 16, requires_grad=True), randn(96, 16, requires_grad=True)
    t = torch.randint(0, 96, (40,), device=DEVICE)
    t[5] = -100
    with HostReads() as reads:
        loss = linear_cross_entropy(h, w, t, chunk=16, backend=backend)
        loss.backward()
    assert reads.count == 0
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.t(), t), rtol=1e-6, atol=1e-6)


@triton.jit
def _store_block_offsets(Out, pid, BLOCK: tl.constexpr):
    tl.store(Out + tl.arange(0, BLOCK), block_offsets(pid, BLOCK))


@triton.jit
def _store_head_starts(Out, bh, H, stride_b, stride_h, T, D):
    tl.store(Out, _head_start(bh, H, stride_b, stride_h))
    tl.store(Out + 1, _dense_head_start(bh, T, D))


def test_offsets_past_2_31_elements_do_not_wrap():
    """The kernels' offset helpers at the program ids of tensors with more than 2^31 elements (too big to
    allocate here): int32 products would wrap around, on a GPU and in the interpreter alike."""
    pid, BLOCK = 2 ** 22 + 5, 1024          # a late block of bias_gelu on [2^20 tokens, 4h = 4096]: 2^32 elements
    out = torch.zeros(BLOCK, dtype=torch.int64, device=DEVICE)
    _store_block_offsets[(1,)](out, pid, BLOCK=BLOCK)
    assert out.tolist() == list(range(pid * BLOCK, (pid + 1) * BLOCK)) and pid * BLOCK > 2 ** 31
    # flash attention: head bh = b*H + h of q [B, H, T, D] stored as the model's [B, T, H, D], and of the
    # contiguous outputs [B*H, T, D]; B*H*T*D = 2^35 at B = 2^11
    bh, H, T, D = 40001, 16, 8192, 128
    out = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    _store_head_starts[(1,)](out, bh, H, T * H * D, D, T, D)
    assert out.tolist() == [(bh // H) * T * H * D + (bh % H) * D, bh * T * D]
    assert min(out.tolist()) > 2 ** 31


def test_kernels_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch, tiny_data, tmp_path, capsys):
    import train_single
    from train_helpers import tiny_argv
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        train_single.main(tiny_argv(tiny_data, str(tmp_path), kernels="triton", max_steps=1))
    assert e.value.code == 2 and "TRITON_INTERPRET" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["triton", "compile", "head"])
def test_apply_kernels_trains_like_train_single(mode, tiny_data, tmp_path):
    """The swapped model (same parameter names and init) reproduces train_single's curve and weights."""
    from train_helpers import assert_same_losses, assert_same_weights, run_single, tiny_argv
    small = dict(n_layer=1, global_batch_size=4, micro_batch_size=2, max_steps=4, warmup_steps=2, device=DEVICE)
    ref_losses, ref_state = run_single(tiny_argv(tiny_data, str(tmp_path / "ref"), kernels="torch", **small))
    losses, state = run_single(tiny_argv(tiny_data, str(tmp_path / mode), kernels=mode, **small))
    assert_same_losses(ref_losses, losses)
    assert_same_weights(ref_state, state)


def test_apply_kernels_keeps_parameters():
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)).to(DEVICE)
    before = dict(model.named_parameters())
    assert kernels.apply_kernels(model, "triton") == "triton"
    after = dict(model.named_parameters())
    assert list(before) == list(after) and all(before[n] is after[n] for n in before)
    assert type(model.transformer.h[0]).__name__ == "FusedBlock"
    assert type(model.transformer.h[1].ln_2).__name__ == "FusedLayerNorm"
    assert type(model.transformer.ln_f).__name__ == "FusedLayerNorm"
    assert type(model.lm_head).__name__ == "FusedLMHead"
    assert type(model.transformer.h[0].attn.core).__name__ == "FlashAttentionCore"


def cuda_addmm_dtype_out(self, mat1, mat2, *, out_dtype, out):
    """torch.addmm(self, mat1, mat2, out_dtype=, out=) held to what CUDA's _addmm_dtype_out_cuda checks
    (aten/src/ATen/native/cuda/Blas.cpp, with pytorch/pytorch#167931), then computed on the CPU. out may be self:
    the in-place C = AB + C of addmm_; it must not overlap mat1 or mat2, and must have the result's shape (a
    resized out is deprecated)."""
    assert mat1.dim() == mat2.dim() == 2 and mat1.shape[1] == mat2.shape[0], "shapes cannot be multiplied"
    assert mat1.dtype == mat2.dtype, "mat1 and mat2 must have the same dtype"
    assert out_dtype == mat1.dtype or (out_dtype == torch.float32 and mat1.dtype in (torch.float16, torch.bfloat16)), \
        "out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs"
    assert out.dtype == out_dtype, "out_dtype must be the same as the dtype of the provided out tensor"
    assert self.dtype in (out_dtype, mat1.dtype), "self dtype must match either out_dtype or mat1 dtype"
    assert out.shape == (mat1.shape[0], mat2.shape[1]) and self.shape == out.shape
    storages = {t.untyped_storage().data_ptr() for t in (mat1, mat2)}
    assert out.untyped_storage().data_ptr() not in storages, "out overlaps an operand"
    return out.copy_(self.to(out_dtype) + mat1.to(out_dtype) @ mat2.to(out_dtype))


def test_lm_head_weight_gradient_gemm_meets_cuda_addmm_rules(monkeypatch):
    """The fused head's dW on a GPU: bf16 chunks accumulated into one fp32 buffer by addmm(out_dtype=fp32, out=dw),
    dw being self. CPU has no such kernel, so CUDA's path runs here with addmm held to CUDA's checks, and gives the
    CPU path's dW (bf16 GEMM then fp32 add) within bf16 rounding; one GEMM per chunk, no weight-sized cast."""
    import importlib
    lce = importlib.import_module("kernels.linear_cross_entropy")     # (kernels exports a function of that name)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g).to(torch.bfloat16).requires_grad_()
    w = (0.1 * torch.randn(96, 32, generator=g)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 96, (64,), generator=g)
    lce.linear_cross_entropy(h, w, targets, chunk=16, backend="torch").backward()
    cpu_path = w.grad.clone()
    calls = []

    def checked(*args, **kwargs):
        calls.append(None)
        return cuda_addmm_dtype_out(*args, **kwargs)
    monkeypatch.setattr(lce, "MIXED_DTYPE_GEMM", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "addmm", checked)
    w.grad = None
    lce.linear_cross_entropy(h, w, targets, chunk=16, backend="torch").backward()
    assert len(calls) == 64 // 16
    torch.testing.assert_close(w.grad.float(), cpu_path.float(), rtol=2e-2, atol=1e-3)


def test_kernels_head_swaps_the_lm_head_alone():
    """--kernels head: the Triton LM head and nothing else (what the fused head gains by itself, bench's perf-head)."""
    from model import GPT, Block, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)).to(DEVICE)
    assert kernels.apply_kernels(model, "head") == "head"
    assert type(model.lm_head).__name__ == "FusedLMHead" and model.lm_head.backend == "triton"
    assert all(type(m) is Block for m in model.transformer.h) and type(model.transformer.ln_f) is torch.nn.LayerNorm
    assert type(model.transformer.h[0].attn.core).__name__ == "AttentionCore"


def test_apply_kernels_on_the_llama_family_is_the_same_model_in_float64():
    """RMSNorm and the gated MLP (dense and experts) swapped for the fused kernels: the same parameters, and in
    float64 the same loss and gradients as model.py's modules to float64 rounding."""
    from model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, norm="rmsnorm", norm_eps=1e-6,
                    mlp="swiglu", ffn_hidden=40, n_kv_head=2, bias=False, qkv_bias=False, tied=False, n_experts=2,
                    moe_every=2, router_renorm=True)
    ref, ours = (GPT(cfg, seed=3).to(DEVICE, torch.float64) for _ in range(2))
    before = dict(ours.named_parameters())
    kernels.apply_kernels(ours, "triton")
    assert dict(ours.named_parameters()) == before
    assert type(ours.transformer.h[0].ln_1).__name__ == "FusedRMSNorm"
    assert type(ours.transformer.ln_f).__name__ == "FusedRMSNorm"
    assert type(ours.transformer.h[0].mlp).__name__ == "FusedGatedMLP"
    assert {type(e).__name__ for e in ours.transformer.h[1].mlp.experts} == {"FusedGatedMLP"}
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    losses = [model(idx[:, :-1], idx[:, 1:])[1] for model in (ref, ours)]
    for loss in losses:
        loss.backward()
    a, b = (float(loss.detach()) for loss in losses)
    assert abs(b - a) <= 1e-13 * a, (a, b)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert rel_err(q.grad, p.grad) <= F64_RTOL, name


class OpInputs(TorchDispatchMode):
    """Records (op name, largest input numel) of every op in the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        sizes = [a.numel() for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self.ops.append((func.__name__, max(sizes, default=0)))
        return func(*args, **(kwargs or {}))


def test_bias_gradients_come_from_the_backward_kernels_partials():
    """bias_gelu's and dropout's bias gradients are sums of the backward kernel's per-tile partials: no op after
    the kernel reads a tensor of dx's size (a second pass over dx), and drawing the dropout seed reads nothing back
    to the host."""
    torch.manual_seed(8)
    x, b, r = randn(40, 48, requires_grad=True), randn(48, requires_grad=True), randn(40, 48)
    for fn in (lambda: bias_gelu(x, b, backend="triton"), lambda: bias_dropout_add(x, b, r, 0.3, backend="triton")):
        y = fn()
        with OpInputs() as record, HostReads() as reads:
            dx, db = torch.autograd.grad(y, (x, b), torch.ones_like(y))
        sums = [n for name, n in record.ops if name.startswith("sum")]
        assert sums and max(sums) < x.numel() // 8, record.ops
        torch.testing.assert_close(db, dx.sum(0), rtol=1e-5, atol=1e-5)
        assert reads.count == 0
    with HostReads() as reads:
        bias_dropout_add(x, b, r, 0.3, backend="triton")
    assert reads.count == 0


def test_flash_attention_reads_the_model_layout_without_copies():
    """q, k, v and do in the model's [B, T, H, D] layout seen as [B, H, T, D]: the backward launches its kernels on
    them as they are (no .contiguous() copy of do), and causal tiles past the diagonal (T = 50: an unmasked
    stage in every loop) and Tq != Tk agree with the float64 reference."""
    from triton_launches import recorded_launches
    torch.manual_seed(9)
    for Tq, Tk in ((50, 50), (35, 50)):
        q = randn(1, Tq, 2, 16, dtype=torch.float64).transpose(1, 2)
        k, v = (randn(1, Tk, 2, 16, dtype=torch.float64).transpose(1, 2) for _ in range(2))
        check_against_float64(lambda *a: flash_attention(*a, True, backend="triton"),
                              lambda *a: attention_reference(*a, True), [q, k, v],
                              randn(1, Tq, 2, 16, dtype=torch.float64).transpose(1, 2), rtol=F64_RTOL)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = flash_attention(q, k, v, True, backend="triton")
    do = randn(1, Tq, 2, 16, dtype=torch.float64).transpose(1, 2)
    with recorded_launches() as launches, OpInputs() as record:
        torch.autograd.grad(o, (q, k, v), do)
    assert [launch.kernel.split(":")[1] for launch in launches] == ["_attn_bwd_delta", "_attn_bwd"]
    assert not [name for name, _ in record.ops if name in ("clone", "copy_", "contiguous")], record.ops
