"""
FP8 that pays (kernels/fp8.py, kernels/fp8_cast.py), counted on a CPU: the operations one Float8Linear's forward
+ backward sends a GPU, as its H100 path runs them (tests/cuda_scaled_mm.py's fixture, Triton in its
interpreter). A TorchDispatchMode counts every aten op; each torch._scaled_mm call and each Triton launch
counts as one more (their insides, the CUDA-rules check and the interpreter's numpy, are not what a GPU runs).

    unfused (before): each of the three GEMMs quantized both its operands, 4-5 torch passes each (abs, amax,
    clamp, divide, multiply, clamp, cast, transpose copies): x, W and dy twice each per step
    fused (after): each operand quantized once, in one amax launch and one cast launch writing both layouts

The bars are half of what the unfused path counted on this test (in parentheses).
"""
import collections
import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from cuda_scaled_mm import scaled_mm_under_cuda_rules  # noqa: F401
from kernels.fp8 import Float8Linear

pytestmark = pytest.mark.usefixtures("scaled_mm_under_cuda_rules")
triton = pytest.importorskip("triton")

UNFUSED = {"tensorwise": 85, "rowwise": 91, "blockwise": 165, "delayed": 100}   # ops before the fused path


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_ops(monkeypatch):
    """A Counter of what runs in the block: aten ops, plus one per _scaled_mm call and per Triton launch."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    counter = OpCounter()
    scaled_mm = torch._scaled_mm

    def opaque(name, fn):
        def run(*args, **kwargs):
            counter.ops[name] += 1
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return run

    def launcher(getitem):
        def patched(kernel, grid):
            return opaque(f"triton {kernel.fn.__name__}", getitem(kernel, grid))
        return patched

    monkeypatch.setattr(torch, "_scaled_mm", opaque("aten._scaled_mm", scaled_mm))
    for cls in (InterpretedFunction, JITFunction):
        monkeypatch.setattr(cls, "__getitem__", launcher(cls.__getitem__))
    with counter:
        yield counter.ops


def layer_and_input(recipe):
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(256, 256), recipe)
    return layer, torch.randn(4, 40, 256, requires_grad=True), torch.randn(4, 40, 256)


@pytest.mark.parametrize("recipe", sorted(UNFUSED))
def test_float8_linear_sends_at_most_half_the_ops(recipe, monkeypatch):
    layer, x, dy = layer_and_input(recipe)
    layer(x).backward(dy)                      # delayed: a history to read; every recipe: nothing lazy left
    with counted_ops(monkeypatch) as ops:
        layer(x).backward(dy)
    total = sum(ops.values())
    assert total <= UNFUSED[recipe] // 2, f"{recipe}: {total} ops (unfused: {UNFUSED[recipe]}): {dict(ops)}"
    assert ops["aten._scaled_mm.default"] + ops["aten._scaled_mm"] >= 3


@pytest.mark.parametrize("recipe", sorted(UNFUSED))
def test_fused_operands_match_the_unfused_definition(recipe, monkeypatch):
    """The fused path's y, dx and dW are the torch reference's (kernels/fp8_cast.py computes the same FP8 values
    and scales, bit for bit), so each recipe keeps the bounds tests/test_fp8.py holds it to."""
    import kernels.fp8 as fp8
    results = []
    for fused in (True, False):
        monkeypatch.setattr(fp8, "fused_cast", lambda t, fused=fused: fused)
        layer, x, dy = layer_and_input(recipe)
        for _ in range(2):
            x.grad = layer.weight.grad = None
            y = layer(x)
            y.backward(dy)
        results.append((y.detach(), x.grad, layer.weight.grad))
    for name, a, b in zip(("y", "dx", "dW"), *results):
        assert torch.equal(a, b), f"{recipe} {name}: fused and reference differ by {(a - b).abs().max()}"


def test_output_in_the_autocast_dtype_and_fast_accumulation_forward_only(monkeypatch):
    """Under bf16 autocast the FP8 GEMM writes bf16, as nn.Linear under autocast does (the next op reads half
    the bytes of fp32); only the forward GEMM asks for fast accumulation."""
    calls = []
    scaled_mm = torch._scaled_mm

    def recording(*args, **kwargs):
        calls.append((kwargs["out_dtype"], kwargs["use_fast_accum"]))
        return scaled_mm(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    layer, x, dy = layer_and_input("tensorwise")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy.bfloat16())
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert calls == [(torch.bfloat16, True), (torch.float32, False), (torch.float32, False)], calls


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_bias_added_by_the_forward_gemm_under_autocast(recipe, monkeypatch):
    """Under bf16 autocast the forward _scaled_mm adds the bias in its epilogue (checked against CUDA's bias rules:
    a bf16 bias for a bf16 output); in fp32 it cannot (CUDA refuses a bias with an fp32 output) and the bias is
    added after. Either way y and the bias gradient are nn.Linear's, to bf16 rounding."""
    biases = []
    scaled_mm = torch._scaled_mm

    def recording(*args, **kwargs):
        biases.append(kwargs.get("bias"))
        return scaled_mm(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(64, 32), recipe)
    x, dy = torch.randn(2, 16, 64, requires_grad=True), torch.randn(2, 16, 32)
    for autocast in (True, False):
        biases.clear()
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
            unfused = layer.matmul(x.detach()) + layer.bias.detach().to(y.dtype)
        y.backward(dy.to(y.dtype))
        assert (biases[0] is not None) == autocast and all(b is None for b in biases[1:])
        torch.testing.assert_close(y, unfused, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(layer.bias.grad, dy.to(y.dtype).sum((0, 1)).float(), rtol=1e-2, atol=1e-2)
