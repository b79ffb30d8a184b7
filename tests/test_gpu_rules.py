"""
GPU rules for the Triton kernels, checked on a CPU (DESIGN.md, "Tests"): the interpreter that runs the kernel
tests here skips what a GPU enforces, so these tests take the launches the kernels make as on a GPU
(tests/triton_launches.py) and check them the GPU's way:

  - every kernel compiles ahead of time for sm_80 (A100) and sm_90 (H100) in every dtype a script can send it
    (--dtype float32 / bfloat16 / float16 / float64 with --kernels triton), down to the cubin, and one of its
    tile configs fits the GPU's shared memory (tests/triton_aot.py); a float64 kernel never rounds to fp32.
"""
import collections
import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
from triton_launches import DTYPES, model_launches  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = (80, 90)


def unique(launches):
    """One launch per distinct (kernel, arguments, options): the compiles that differ."""
    seen = {}
    for launch in launches:
        seen.setdefault(json.dumps([launch.kernel, launch.args, launch.options], sort_keys=True), launch)
    return list(seen.values())


def compile_for_gpus(launches):
    """tests/triton_aot.py's report for each (launch, target), compiled in up to two processes without the
    interpreter (a compile is single-threaded)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    chunks = [launches[i::2] for i in range(min(2, len(launches)))]
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "triton_aot.py")], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in chunks]
    reports = []
    for proc, chunk in zip(procs, chunks):
        request = dict(targets=list(TARGETS), launches=[dataclasses.asdict(launch) for launch in chunk])
        out, err = proc.communicate(json.dumps(request), timeout=1200)
        assert proc.returncode == 0, err[-3000:]
        for line in out.splitlines():
            report = json.loads(line)
            report["launch"] = chunk[report["launch"]]
            reports.append(report)
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
    import re
    truncation = re.compile(r"arith\.truncf .* : (?:tensor<[^>]*xf64>|f64) to (?:tensor<[^>]*xf32>|f32)")
    rounded = sorted({r["launch"].kernel for r in compiled["float64", 90] if truncation.search(r.get("ttir") or "")})
    assert not rounded, f"float64 kernels that round to fp32: {rounded}"
