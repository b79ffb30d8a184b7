"""
The GPU check's timing probes (bench/kernel_timings.py) without a GPU: their cases run on CPU tensors (Triton in its
interpreter, tiny shapes) with the CUDA-graph timer and torch.compile replaced, so each case's error check and row
are built as on the GPU; and the prepared run (--only timings,attention,fp8linear,perf) admits its rows, baselines
first, within 8 minutes of GPU time by their estimates.
"""
import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("triton")


@pytest.fixture
def timings_on_cpu(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import gpu_rows
    import kernel_timings
    monkeypatch.setattr(gpu_rows, "DEVICE", "cpu")
    monkeypatch.setattr(kernel_timings, "DEVICE", "cpu")
    monkeypatch.setattr(kernel_timings, "GPT2_SMALL", dict(B=1, T=16, C=32, H=2, V=96))
    monkeypatch.setattr(kernel_timings, "WIDTHS", (32, 64))
    monkeypatch.setattr(kernel_timings, "graph_timed", lambda step, reps=1: (step(), (1.0, "graph"))[1])
    monkeypatch.setattr(kernel_timings, "peak_mib", lambda step: (step(), 1.0)[1])
    monkeypatch.setattr(torch, "compile", lambda fn: fn)
    return kernel_timings


def test_kernel_timing_rows_check_every_kernel_against_its_peers(timings_on_cpu):
    rows = timings_on_cpu.timings()["rows"]
    assert [r["name"].split(",")[0] for r in rows] == ["layer_norm", "bias_gelu", "bias_dropout_add p 0.1"] * 2 + \
        ["linear_cross_entropy"]
    for row in rows:
        assert row["ok"], row
        assert set(row["ms"]) == {"ours", "eager", "compile"} and "ours 1.00x" in row["speed"], row


def test_prepared_run_fits_eight_minutes(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--dry", "--only", "timings,attention,fp8linear,perf", "--budget_s", "480", "--out",
                           str(tmp_path)]) == 0
    admitted = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "would run" in line]
    assert admitted[:3] == ["timings", "attention", "fp8linear"]
    assert {"perf-eager", "perf-triton", "perf-compile", "perf-gemm8-bf16", "perf-gemm8-fp8-tensorwise",
            "perf-gemm8-fp8-rowwise"} <= set(admitted)
    rows = {r.name: r for r in gpu_check.one_gpu_rows(str(tmp_path), 6, (9, 0), 2e-2, 5e-2)}
    assert sum(rows[name].est_s for name in admitted) <= 480
    assert sys.executable in rows["timings"].command and "timings" in rows["timings"].command
