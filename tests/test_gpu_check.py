"""
GPU readiness that a CPU can check: the MFU peak table's name matching (real torch.cuda.get_device_name strings),
and bench/gpu_check.sh skipping cleanly only where no GPU exists, failing with one error line where a GPU exists
but the check could not run (a fake nvidia-smi and fake interpreters stand in for the GPU machine).
"""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

from common.peaks import GPU_PEAK_TFLOPS, gpu_chip_and_board, gpu_peak_flops

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


GPU_LISTING = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-2c4a9f6e-0000-0000-0000-000000000000)"


def executable(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def run_gpu_check(tmp_path, nvidia_smi=None, python="python"):
    """bash bench/gpu_check.sh with PATH = one fresh directory holding at most a fake nvidia-smi (a shell
    script: `nvidia_smi` is its body), and PYTHON = `python`; returns (exit code, output lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        executable(bin_dir / "nvidia-smi", "#!/bin/sh\n" + nvidia_smi + "\n")
    env = dict(os.environ, PATH=str(bin_dir), PYTHON=python)
    r = subprocess.run([shutil.which("bash"), "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    return r.returncode, (r.stdout + r.stderr).splitlines()


def fake_python(tmp_path, torch_source=None):
    """An interpreter without the installed packages (python -S), importing `torch_source` as torch if given."""
    site = tmp_path / "site"
    if torch_source is not None:
        (site / "torch").mkdir(parents=True)
        (site / "torch" / "__init__.py").write_text(torch_source)
    return executable(tmp_path / "python", f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')


CPU_ONLY_TORCH = 'import types\n__version__ = "2.13.0+cpu"\nversion = types.SimpleNamespace(cuda=None)\n'
TORCH_WITHOUT_DRIVER = (  # a CUDA build whose CUDA is newer than the driver: is_available() warns and says False
    'import types, warnings\n__version__ = "2.11.0+cu130"\nversion = types.SimpleNamespace(cuda="13.0")\n'
    'def is_available():\n'
    '    warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 12020)")\n'
    '    return False\n'
    'cuda = types.SimpleNamespace(is_available=is_available, device_count=lambda: 0)\n')


def test_gpu_check_skips_cleanly_without_a_gpu(tmp_path):
    code, lines = run_gpu_check(tmp_path, nvidia_smi=None, python="/nonexistent/python")
    assert code == 0
    assert lines == ["gpu_check: skipped (no NVIDIA GPU here: nvidia-smi not found)"]


def test_gpu_check_skips_where_nvidia_smi_lists_no_gpu(tmp_path):
    code, lines = run_gpu_check(tmp_path, nvidia_smi='echo "No devices were found"; exit 6')
    assert code == 0 and lines == ["gpu_check: skipped (nvidia-smi lists no GPU)"]


@pytest.mark.parametrize("case, expected", [
    ("no python", "no python at PYTHON=/nonexistent/python"),
    ("no torch", "no torch in"),
    ("CPU-only torch", "is a CPU-only build"),
    ("driver too old", "cannot use the GPU"),
    ("nvidia-smi fails", "nvidia-smi failed (exit 9)"),
])
def test_gpu_check_fails_where_a_gpu_exists_but_the_check_cannot_run(tmp_path, case, expected):
    """With a GPU listed, no probe failure may pass as "no GPU": one error line naming it, exit 1."""
    listing, python = f'echo "{GPU_LISTING}"', sys.executable
    if case == "no python":
        python = "/nonexistent/python"
    elif case == "no torch":
        python = fake_python(tmp_path)
    elif case == "CPU-only torch":
        python = fake_python(tmp_path, CPU_ONLY_TORCH)
    elif case == "driver too old":
        python = fake_python(tmp_path, TORCH_WITHOUT_DRIVER)
    else:
        listing = "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9"
    code, lines = run_gpu_check(tmp_path, nvidia_smi=listing, python=python)
    assert code == 1, lines
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: ") and expected in lines[0], lines
    if case == "driver too old":
        assert "driver on your system is too old" in lines[0]


def test_gpu_check_never_installs_torch_or_triton():
    """Installing requirements.txt's torch on a GPU machine could replace its CUDA build (and its matching triton)
    with another build. The script installs every other pin."""
    script = open(os.path.join(ROOT, "bench", "gpu_check.sh")).read()
    assert '"" | "#"* | torch* | triton*) ;;' in script and "pip install" in script
    assert "-r requirements" not in script


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_check_py_run_directly_without_a_gpu_fails(monkeypatch, capsys):
    """python bench/gpu_check.py (not through the .sh) where torch sees no GPU: an error and exit 1, not a pass."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 1
    assert "gpu_check: error:" in capsys.readouterr().out


def test_gpu_check_runs_every_train_script_after_its_reference(monkeypatch):
    gpu_check = load_gpu_check()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))
    rows = gpu_check.runs(8, 3, "out")
    train_scripts = {f for f in os.listdir(ROOT) if f.startswith("train_") and f.endswith(".py")}
    assert {gpu_check.script_of(command) for _, _, command, _, _ in rows} == train_scripts
    seen = set()
    for name, _, _, reference, _ in rows:
        assert reference is None or reference in seen, name
        seen.add(name)
    assert gpu_check.grid_5d(8) == dict(tp=2, pp=2, dp=2, cp=1)


def test_gpu_syncs_skips_in_one_line_without_a_gpu():
    """bench/gpu_syncs.py (CUDA's own count of a micro-batch's syncs) on a machine without a GPU: one line, exit 0."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run bench/gpu_syncs.py itself")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_syncs.py")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("gpu_syncs: skipped:") and not run.stderr, run
