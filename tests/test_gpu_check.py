"""
GPU readiness that a CPU can check: the MFU peak table's name matching (real torch.cuda.get_device_name strings)
and bench/gpu_check.sh skipping cleanly where no GPU is visible.
"""
import importlib.util
import os
import subprocess

import pytest
import torch

from common.metrics import GPU_PEAK_TFLOPS, gpu_chip_and_board, gpu_peak_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A800-SXM4-80GB", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100", 989.5), ("NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.5), ("NVIDIA H200 NVL", 835.5),
    ("NVIDIA H800", 989.5), ("NVIDIA H800 80GB HBM3", 989.5), ("NVIDIA H800 PCIe", 756.5),
    ("NVIDIA L4", 121.0), ("NVIDIA L40", 181.05), ("NVIDIA L40S", 362.05), ("NVIDIA B200", 2250.0),
])
def test_peak_by_exact_chip_and_board(name, tflops):
    assert gpu_peak_flops(name) == tflops * 1e12


def test_lookalike_names_are_not_confused():
    # the substring lookup this replaces gave the L4 peak to an L40 and the SXM peak to an H100 NVL
    assert gpu_chip_and_board("NVIDIA L40") == ("L40", "")
    assert gpu_peak_flops("NVIDIA L40") != gpu_peak_flops("NVIDIA L4")
    assert gpu_peak_flops("NVIDIA H100 NVL") < gpu_peak_flops("NVIDIA H100 80GB HBM3")
    assert gpu_chip_and_board("NVIDIA GH200 480GB") == ("GH200", "")


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "NVIDIA GH200 480GB",
                                  "NVIDIA H20", "AMD Instinct MI300X", ""])
def test_unknown_gpu_warns_and_gives_none(name, capsys):
    assert gpu_peak_flops(name) is None
    assert "MFU will be reported as null" in capsys.readouterr().err


def test_every_row_has_a_source():
    for key, (tflops, source) in GPU_PEAK_TFLOPS.items():
        assert tflops > 0 and ("datasheet" in source or "specifications" in source), key


def test_gpu_check_skips_cleanly_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")          # no GPU visible, on any machine
    r = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert (r.stdout + r.stderr).splitlines() == ["gpu_check: skipped (no CUDA GPU visible)"]


def test_gpu_check_runs_every_train_script_after_its_reference(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))
    rows = gpu_check.runs(8, 3, "out")
    train_scripts = {f for f in os.listdir(ROOT) if f.startswith("train_") and f.endswith(".py")}
    assert {gpu_check.script_of(command) for _, _, command, _, _ in rows} == train_scripts
    seen = set()
    for name, _, _, reference, _ in rows:
        assert reference is None or reference in seen, name
        seen.add(name)
    assert gpu_check.grid_5d(8) == dict(tp=2, pp=2, dp=2, cp=1)
