"""
Compile recorded Triton launches ahead of time for NVIDIA GPUs, with no GPU here: the type checks, layouts and
resource use of a real compile, which Triton's CPU interpreter skips (it runs the kernel's Python with numpy).

    python tests/triton_aot.py < launches.json > results.json      # TRITON_INTERPRET must be unset

Input: {"targets": [80, 90], "launches": [{"kernel": "kernels.layer_norm:_ln_fwd", "args": {...},
"options": {...}}, ...]} (tests/triton_launches.py's Launch fields). Each launch is compiled for each target
(sm_80 = A100, sm_90 = H100) with triton.compile down to the cubin (ptxas included). An autotuned kernel's tile
configs are compiled in order until one fits the target's shared memory, as the autotuner on a GPU skips a
config that does not fit and fails only when none does. Output: one JSON object per (launch, target): ok, error
(the compiler's message), fits, the configs tried (shared memory bytes, seconds), and for sm_90 the TTIR of the
first compile, for checks on the generated code.
"""
import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

WARP_SIZE = 32
# Shared memory one program may use (cudaDevAttrMaxSharedMemoryPerBlockOptin, which Triton compares a kernel's
# shared memory with before launching it): 163 KiB on compute capability 8.0, 227 KiB on 9.0 (CUDA C++
# Programming Guide, technical specifications per compute capability).
SHARED_MEMORY = {80: 166912, 90: 232448}

def decode(value):
    """The launch argument described by tests/triton_launches.describe, as a constexpr value."""
    if isinstance(value, dict) and "tl" in value:
        return tl.dtype(value["tl"])
    return value


def scalar_type(value):
    """Triton's signature type for a runtime argument (what the JIT derives from a Python value or tensor)."""
    if isinstance(value, dict) and "tensor" in value:
        return "*" + triton._utils.canonicalize_dtype(value["tensor"])
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a runtime argument {value!r}")


def source(fn, args):
    """triton.compile's input: the signature (a type or 'constexpr' per argument) and the constexpr values."""
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    signature = {name: "constexpr" if name in constexprs else scalar_type(args[name]) for name in fn.arg_names}
    values = {name: decode(args[name]) for name in fn.arg_names if name in constexprs}
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=values)


def tile_configs(kernel, launch):
    """(constexpr overrides, options) per compile: each autotuner config, or the launch's own options."""
    if isinstance(kernel, Autotuner):
        return [(config.kwargs, dict(num_warps=config.num_warps, num_stages=config.num_stages))
                for config in kernel.configs]
    return [({}, launch.get("options", {}))]


def compile_one(fn, args, target, options):
    """(result, TTIR): the compile's shared memory and time, or the compiler's error."""
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(source(fn, args), target=GPUTarget("cuda", target, WARP_SIZE), options=options)
    except Exception as e:          # the compiler's own message (a CompilationError names the line and the rule)
        return dict(error=f"{type(e).__name__}: {e}"[-3000:], seconds=time.perf_counter() - t0), None
    return dict(shared=compiled.metadata.shared, seconds=time.perf_counter() - t0), compiled.asm["ttir"]


def compile_launch(kernel, launch, target):
    """Compile the launch's tile configs in order until one fits the target (or one fails to compile)."""
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    report = dict(target=target, ok=False, fits=False, error=None, tried=[])
    for overrides, options in tile_configs(kernel, launch):
        result, ttir = compile_one(fn, {**launch["args"], **overrides}, target, options)
        report["tried"].append(dict(result, tile=overrides, options=options))
        if target == 90 and "ttir" not in report:
            report["ttir"] = ttir
        if "error" in result:
            report["error"] = result["error"]
            return report
        if result["shared"] <= SHARED_MEMORY[target]:
            report.update(ok=True, fits=True)
            return report
    report["error"] = f"no tile config fits the {SHARED_MEMORY[target]} bytes of shared memory of sm_{target}"
    return report


# Kernels that only run on newer GPUs: FP8 casts exist from compute capability 8.9 (kernels/fp8.py's
# check_fp8_support refuses older GPUs before any launch), so they are compiled for sm_90 only
MIN_TARGET = {"kernels.fp8_cast": 89}


def main():
    request = json.load(sys.stdin)
    for i, launch in enumerate(request["launches"]):
        module, name = launch["kernel"].split(":")
        kernel = getattr(importlib.import_module(module), name)
        for target in [t for t in request["targets"] if t >= MIN_TARGET.get(module, 0)]:
            print(json.dumps(dict(compile_launch(kernel, launch, target), launch=i)), flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("tests/triton_aot.py compiles for a GPU: run it without TRITON_INTERPRET=1")
    main()
