"""
GPU rules for the Triton kernels, checked on a CPU (DESIGN.md, "Tests"): the interpreter that runs the kernel
tests here skips what a GPU enforces, so these tests take the launches the kernels make as on a GPU
(tests/triton_launches.py) and check them the GPU's way:

  - every kernel compiles ahead of time for sm_80 (A100) and sm_90 (H100) in every dtype a script can send it
    (--dtype float32 / bfloat16 / float16 / float64 with --kernels triton), down to the cubin, and one of its
    tile configs fits the GPU's shared memory (tests/triton_aot.py); a float64 kernel never rounds to fp32;
  - every launch grid fits CUDA's limits (2^31 - 1 programs on axis 0, 65535 on axes 1 and 2) and every
    program at most 1024 threads, at a batch * heads past 65535;
  - flash attention addresses its tiles with 64-bit offsets, and its autotuner keys on power-of-two length
    buckets, so sampling (one more token a step) tunes about log2(T) times, not T times.
"""
import collections
import concurrent.futures
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
from kernels.backend import tl, triton  # noqa: E402
from triton_launches import DTYPES, model_launches, recorded_launches  # noqa: E402

flash = importlib.import_module("kernels.flash_attention")    # the module (kernels.flash_attention is the function)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = (80, 90)
MAX_GRID = (2 ** 31 - 1, 65535, 65535)       # CUDA's grid limits per axis (x, y, z)
MAX_THREADS = 1024                            # threads per program (block)


def unique(launches):
    """One launch per distinct (kernel, arguments, options): the compiles that differ."""
    seen = {}
    for launch in launches:
        seen.setdefault(json.dumps([launch.kernel, launch.args, launch.options], sort_keys=True), launch)
    return list(seen.values())


def compile_for_gpus(launches):
    """tests/triton_aot.py's report for each (launch, target), compiled by two processes side by side (a compile
    is single-threaded) without the interpreter. Each kernel's launches are dealt to the two in turn: a kernel's
    compiles cost alike, and flash attention's cost more than all the others together (dealt in the recorded order,
    they fell mostly to one process, which took 85 s where the other took 27)."""
    ordered = sorted(launches, key=lambda launch: launch.kernel)     # stable: a kernel's launches stay in order
    chunks = [ordered[i::2] for i in range(min(2, len(ordered)))]
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        return [report for reports in pool.map(compile_chunk, chunks) for report in reports]


def compile_chunk(launches):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    request = dict(targets=list(TARGETS), launches=[dataclasses.asdict(launch) for launch in launches])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "triton_aot.py")], cwd=ROOT, env=env,
                          input=json.dumps(request), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines()]
    for report in reports:
        report["launch"] = launches[report["launch"]]
    return reports


@pytest.fixture(scope="module")
def launches_by_dtype():
    return {dtype: model_launches(dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def compiled(launches_by_dtype):
    """{(dtype, target): [report, ...]} for every distinct launch of every dtype."""
    tagged = {}
    for dtype, launches in launches_by_dtype.items():
        for launch in unique(launches):
            tagged.setdefault(json.dumps([launch.kernel, launch.args, launch.options], sort_keys=True),
                              (launch, set()))[1].add(dtype)
    reports = compile_for_gpus([launch for launch, _ in tagged.values()])
    by_dtype = collections.defaultdict(list)
    for report in reports:
        key = json.dumps([report["launch"].kernel, report["launch"].args, report["launch"].options], sort_keys=True)
        for dtype in tagged[key][1]:
            by_dtype[dtype, report["target"]].append(report)
    return by_dtype


def test_every_kernel_is_launched_in_every_dtype(launches_by_dtype):
    """The recording reaches every Triton kernel in kernels/ in every dtype (so the compile checks below cover
    them all); a kernel no script launches would be dead code."""
    import kernels  # noqa: F401  (imports every kernel module)
    from triton_launches import all_kernels
    for dtype, launches in launches_by_dtype.items():
        missing = set(all_kernels()) - {launch.kernel for launch in launches}
        assert not missing, f"--dtype {dtype}: never launched: {sorted(missing)}"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm_{t}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_compile_for_the_gpu(compiled, dtype, target):
    """Each kernel compiles for the GPU in this dtype (or refuses the dtype before any launch), and a tile
    config fits its shared memory."""
    reports = compiled[dtype, target]
    assert reports, f"no launches recorded for {dtype}"
    failures = [f"{r['launch'].kernel} ({describe_args(r['launch'])}): {r['error']}" for r in reports if not r["ok"]]
    assert not failures, f"{len(failures)} of {len(reports)} kernels fail on sm_{target} in {dtype}:\n\n" + \
        "\n\n".join(failures)


def describe_args(launch):
    return ", ".join(f"{k}={v['tensor'] if isinstance(v, dict) and 'tensor' in v else v}"
                     for k, v in launch.args.items() if isinstance(v, dict))


def test_float64_kernels_never_round_to_fp32(compiled):
    """A float64 launch computes in float64: its TTIR has no float64 -> fp32 conversion (arith.truncf), which
    would make --dtype float64 --kernels triton only fp32-accurate without a word."""
    truncation = re.compile(r"arith\.truncf .* : (?:tensor<[^>]*xf64>|f64) to (?:tensor<[^>]*xf32>|f32)")
    # FP8 quantization (kernels/fp8_cast.py) rounds to 8 bits by definition, through fp32 as torch's casts do
    rounded = sorted({r["launch"].kernel for r in compiled["float64", 90] if truncation.search(r.get("ttir") or "")
                      and not r["launch"].kernel.startswith("kernels.fp8_cast:")})
    assert not rounded, f"float64 kernels that round to fp32: {rounded}"


def test_flash_attention_addresses_tiles_with_64_bit_offsets(compiled):
    """A [rows, D] tile's address is row * stride + column; in the model's [B, T, H, D] layout the row stride is
    H*D, so rows * stride passes 2^31 at T*H*D > 2^31 (T = 1M tokens, H*D = 2048) though the head is far
    smaller: no 2-D tile of the flash kernels may be addressed by int32 offsets (TTIR `tt.addptr`)."""
    addptr_2d = re.compile(r"tt\.addptr .* : tensor<\d+x\d+x!tt\.ptr<\w+>>, tensor<\d+x\d+x(i\d+)>")
    checked = 0
    for report in compiled["float32", 90]:
        if "flash_attention" not in report["launch"].kernel or not report.get("ttir"):
            continue
        offsets = addptr_2d.findall(report["ttir"])
        assert offsets and set(offsets) == {"i64"}, \
            f"{report['launch'].kernel}: 2-D tile addresses from {collections.Counter(offsets)} offsets"
        checked += 1
    assert checked == 3, checked


def test_launch_grids_fit_cuda_limits(launches_by_dtype):
    """Every launch's grid and program size within CUDA's limits, at batch * heads = 70000 (past the 65535 of grid
    axes 1 and 2) for attention, and for the model's launches."""
    from kernels import flash_attention
    B, H, T, D = 35000, 2, 3, 16
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    with recorded_launches() as launches:
        o, _ = flash_attention(q, k, v, causal=True, backend="triton")
        o.backward(torch.ones_like(o))
    assert len(launches) == 3
    for launch in launches + [x for xs in launches_by_dtype.values() for x in xs]:
        for grid in launch.grids:
            assert all(0 < n <= limit for n, limit in zip(grid, MAX_GRID)), f"{launch.kernel}: grid {grid}"
        assert launch.options.get("num_warps", 4) * 32 <= MAX_THREADS, launch.kernel


def test_flash_attention_autotunes_per_length_bucket():
    """Sampling re-runs the model on a sequence one token longer each step (model.generate, no KV cache): the
    autotuner must see a power-of-two bucket of the length, not the length, or it tunes at every new token."""
    from kernels import flash_attention
    with recorded_launches() as launches:
        for T in range(1, 101):
            q = torch.randn(1, 2, T, 16)
            flash_attention(q, q, q, causal=True, backend="triton")
    keys = {launch.autotune_key for launch in launches}
    assert len(launches) == 100 and len(keys) <= 8, f"{len(keys)} autotuner keys for 100 sequence lengths"


@triton.jit
def _store_tile_offsets(Out, row0, stride, BLOCK: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK)
    tl.store(Out + tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :],
             flash._offsets(rows, tl.arange(0, BLOCK), stride))


def test_tile_offsets_past_2_31_do_not_wrap():
    """The tile offsets themselves, at the rows and row stride of a 1M-token sequence with H*D = 2048."""
    row0, stride, BLOCK = 2 ** 20 - 8, 2048, 16         # rows 2^20 - 8 .. 2^20 + 7: the product crosses 2^31
    out = torch.zeros(BLOCK, BLOCK, dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
    _store_tile_offsets[(1,)](out, row0, stride, BLOCK=BLOCK)
    expected = [[(row0 + i) * stride + j for j in range(BLOCK)] for i in range(BLOCK)]
    assert out.tolist() == expected and expected[-1][-1] > 2 ** 31
