"""
The Triton launches kernels/ makes, recorded as a GPU would receive them, without running a kernel: what the
GPU-rule tests (tests/test_gpu_rules.py) compile ahead of time and check against CUDA's launch limits.

    with recorded_launches() as launches:          # every launch in the block: kernel, arguments, grid
        layer_norm(x, w, b, backend="triton")
    model_launches("bfloat16")                     # a tiny GPT's forward + backward with --kernels triton

Inside the block every tensor reports is_cuda (and the device an H100's 132 SMs), so the kernel wrappers choose
what they choose on a GPU (one row per program, no interpreter upcasts, ...), and each launch is recorded
instead of run: outputs stay uninitialized, which no recorded launch reads.
"""
import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
import re
import types
from unittest import mock

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# What a script can send the kernels: --dtype float32 / bfloat16 / float16 (autocast) / float64 (exactness runs)
DTYPES = ("float32", "bfloat16", "float16", "float64")
H100_SMS = 132
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # CPU: the conftest put Triton in interpreter mode


@dataclasses.dataclass
class Launch:
    kernel: str             # "module:name" of the launched @triton.jit or @triton.autotune object
    args: dict              # argument name -> value (a tensor as {"tensor": dtype}, a tl.dtype as {"tl": name})
    options: dict           # num_warps / num_stages given at the launch (autotuned kernels: in their configs)
    grids: list             # the grid, once per tile config (the autotuner's configs, or the one launch)
    autotune_key: tuple     # the autotuner's cache key from these arguments; () for a plain kernel


def python_function(kernel):
    """The Python function under a kernel object (Autotuner -> JITFunction / InterpretedFunction -> function)."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def describe(value):
    """A JSON-able stand-in for a launch argument: enough to rebuild the kernel's signature."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, triton.language.dtype):
        return {"tl": value.name}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"cannot describe a launch argument of type {type(value).__name__}")


def _grid_of(grid, meta):
    grid = grid(meta) if callable(grid) else grid
    return tuple(grid) + (1,) * (3 - len(grid))


def _named(kernel, args, kwargs):
    names = list(inspect.signature(python_function(kernel)).parameters)
    named = dict(zip(names, args))
    named.update({k: v for k, v in kwargs.items() if k in names})
    return named


def _recorder(log):
    """A replacement for kernel[grid]: the launch it returns records itself in `log` instead of running."""
    def getitem(self, grid):
        def launch(*args, **kwargs):
            log.append(_launch(self, grid, args, kwargs))
        return launch
    return getitem


def _launch(kernel, grid, args, kwargs):
    named = _named(kernel, args, kwargs)
    described = {k: describe(v) for k, v in named.items()}
    if isinstance(kernel, Autotuner):
        grids = [_grid_of(grid, {**named, **config.kwargs}) for config in kernel.configs]
        return Launch(_name(kernel), described, {}, grids, tuple(named[k] for k in kernel.keys))
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return Launch(_name(kernel), described, options, [_grid_of(grid, named)], ())


def _name(kernel):
    fn = python_function(kernel)
    return f"{fn.__module__}:{fn.__name__}"


def all_kernels():
    """'module:name' of every Triton kernel in kernels/: each @triton.jit (or autotuned) function that no other
    one calls (those are device functions, compiled into the kernels that call them)."""
    import kernels
    found = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, (JITFunction, InterpretedFunction, Autotuner)):
                fn = python_function(obj)
                found[f"{fn.__module__}:{fn.__name__}"] = inspect.getsource(fn)
    called = {name for name in found for other, src in found.items()
              if other != name and re.search(rf"\b{name.split(':')[1]}\(", src)}
    return sorted(set(found) - called)


@contextlib.contextmanager
def recorded_launches():
    """Record (not run) every Triton launch in the block, with the tensors looking like CUDA tensors."""
    log = []
    gpu = types.SimpleNamespace(multi_processor_count=H100_SMS, name="NVIDIA H100 80GB HBM3")
    # kernel[grid](...) on each kind of kernel object (InterpretedFunction: TRITON_INTERPRET=1)
    with mock.patch.object(JITFunction, "__getitem__", _recorder(log)), \
            mock.patch.object(InterpretedFunction, "__getitem__", _recorder(log)), \
            mock.patch.object(Autotuner, "__getitem__", _recorder(log)), \
            mock.patch.object(torch.Tensor, "is_cuda", property(lambda self: True), create=True), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda *device: gpu):
        yield log


# the Llama family's fields (--arch llama): RMSNorm and the gated MLP's kernels instead of LayerNorm and bias + GeLU
LLAMA = dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=48, bias=False, qkv_bias=False, tied=False)


def tiny_gpt(dtype, dropout=0.0, family=None):
    """A 1-layer GPT (family: model fields, LLAMA) with --kernels triton applied (float64 parameters for the float64
    runs)."""
    from kernels import apply_kernels
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=dropout,
                          **(family or {})), seed=0)
    model = model.to(DEVICE, torch.float64 if dtype == "float64" else torch.float32)
    apply_kernels(model, "triton")
    return model


def model_launches(dtype):
    """Every launch of one training micro-step of a tiny GPT under --dtype `dtype` with --kernels triton, once
    without dropout (flash attention, the fused MLP), once with (the dropout kernels; attention keeps sdpa), and
    once in the Llama family's layout (RMSNorm, the gated MLP).
    16-bit runs use autocast (on a CPU it casts this model's Linears as CUDA's autocast does)."""
    launches = []
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for dropout, family in ((0.0, None), (0.1, None), (0.0, LLAMA)):
        model = tiny_gpt(dtype, dropout, family)
        low_precision = dtype in ("bfloat16", "float16")
        with recorded_launches() as log:
            with torch.autocast(DEVICE, dtype=getattr(torch, dtype), enabled=low_precision):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        launches += log
    return launches + fp8_launches(dtype)


def fp8_launches(dtype):
    """The FP8 cast kernels' launches: one Float8Linear forward + backward per recipe, x in `dtype` (under
    autocast for 16-bit dtypes), on the H100 path; _scaled_mm answers with an empty tensor (nothing runs).
    Every recipe where a GPU runs FP8 (fp32 weights, bf16 autocast); delayed alone, which reaches all three
    kernels, for float16 and float64 (each distinct launch is one more ahead-of-time compile)."""
    import kernels.fp8 as fp8
    launches = []
    x_dtype = torch.float64 if dtype == "float64" else torch.float32
    low_precision = dtype in ("bfloat16", "float16")

    def no_gemm(a, b, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **_):
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)
    for recipe in fp8.RECIPES if dtype in ("float32", "bfloat16") else ("delayed",):
        layer = fp8.Float8Linear.from_float(torch.nn.Linear(256, 128).to(x_dtype), recipe)
        x = torch.randn(40, 256, dtype=x_dtype, requires_grad=True)
        with recorded_launches() as log, mock.patch.object(fp8, "gemm_kind", lambda t: "cuda_blocks"), \
                mock.patch.object(torch, "_scaled_mm", no_gemm):
            with torch.autocast(DEVICE, dtype=getattr(torch, dtype), enabled=low_precision):
                y = layer(x)
            y.backward(torch.ones_like(y))
        launches += log
    return launches
