"""
GPU readiness that a CPU can check: the MFU peak table's name matching (real torch.cuda.get_device_name strings),
and bench/gpu_check.sh skipping cleanly only where no GPU exists, failing with one error line where a GPU exists
but the check could not run (a fake nvidia-smi and fake interpreters stand in for the GPU machine).
"""
import importlib.util
import json
import os
import re
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


def run_gpu_check(tmp_path, nvidia_smi=None, python="python", args=()):
    """bash bench/gpu_check.sh ARGS with PATH = one fresh directory holding at most a fake nvidia-smi (a shell
    script: `nvidia_smi` is its body), and PYTHON = `python`; returns (exit code, output lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        executable(bin_dir / "nvidia-smi", "#!/bin/sh\n" + nvidia_smi + "\n")
    env = dict(os.environ, PATH=str(bin_dir), PYTHON=python)
    r = subprocess.run([shutil.which("bash"), "bench/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
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


def test_gpu_check_reads_its_command_line_first_without_a_gpu(tmp_path):
    """No GPU here, yet --help prints the usage (exit 0), a flag it does not know is an error (exit 2, not
    "skipped"), and --dry lists the rows it would run (it runs nothing)."""
    code, lines = run_gpu_check(tmp_path, python=sys.executable, args=["--help"])
    assert code == 0 and lines[0].startswith("usage: bench/gpu_check.sh") and "--budget_s" in "\n".join(lines), lines
    code, lines = run_gpu_check(tmp_path, python=sys.executable, args=["--budget", "480"])
    assert code == 2 and lines[-1] == "bench/gpu_check.sh: error: unrecognized arguments: --budget 480", lines
    code, lines = run_gpu_check(tmp_path, python=sys.executable, args=["--dry", "--out", str(tmp_path / "out")])
    assert code == 0 and "(dry: nothing runs)" in lines[0] and not any("skipped" in x for x in lines), lines


@pytest.mark.parametrize("args, message", [
    (["--budget_s", "nan"], "--budget_s and --timeout must be positive (and finite)"),
    (["--budget_s", "inf"], "got inf, 900, 6"),
    (["--only", "zzz"], "--only 'zzz' selects no row on any machine (rows: 5d-2, 5d-4, 5d-8, attention,"),
    (["--only", "cp, syncs"], "--only ' syncs' selects no row"),
    (["--only", ",,"], "--only ',,' names no row"),
    (["--out", "README.md"], "--out README.md is a file, not a directory"),
    (["--out", "README.md/run"], "--out README.md/run cannot be created: "),
    (["--plan_sweep", "--dry", "--plan_gpus", "0"], "--plan_gpus must be one of 1, 2, 4, 8"),
    (["--plan_sweep", "--dry", "--plan_gpus", "1024"], "got 1024"),
])
def test_gpu_check_refuses_values_out_of_range_before_looking_for_a_gpu(tmp_path, args, message):
    """Before, a NaN budget admitted every row, an --only that matched nothing passed with an empty table, an --out
    that is a file failed at the first log, and a sweep over 0 GPUs (or 1024, minutes of planning) ran."""
    code, lines = run_gpu_check(tmp_path, python=sys.executable, args=args)
    assert code == 2 and lines[-1].startswith("bench/gpu_check.sh: error: ") and message in lines[-1], lines


def test_gpu_check_refuses_what_only_the_machine_can_tell(tmp_path, capsys):
    """A row name of another machine (ddp-2 on one GPU) and a plan sweep for a GPU plan.py does not know: one line,
    exit 2, nothing run."""
    gpu_check = load_gpu_check()
    assert gpu_check.main(["--dry", "--only", "ddp-2", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out.startswith("gpu_check: error: --only 'ddp-2' selects no row in a --dry run")
    assert gpu_check.main(["--plan_sweep", "--dry", "--plan_gpu", "v100", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out == ("gpu_check: error: --plan_sweep: plan.py knows no GPU --plan_gpu 'v100' (it "
                                       "knows a100, a100-40gb, h100, h100-hbm2e, h200, b200)\n")
    assert os.listdir(tmp_path) == []


def test_gpu_check_names_a_python_that_is_not_one_and_a_wedged_nvidia_smi(tmp_path):
    code, lines = run_gpu_check(tmp_path, python="/bin/echo")   # echo would "pass" every step, the rows included
    assert code == 2 and lines == ["gpu_check: error: PYTHON=/bin/echo is not a Python 3 interpreter (asked for its "
                                   "version, it answered: -c import sys; print(\"python\", sys.version_info[0]))"]
    bin_dir = tmp_path / "bin"
    executable(bin_dir / "nvidia-smi", f'#!/bin/sh\necho "{GPU_LISTING}"\nexec /bin/sleep 30\n')
    env = dict(os.environ, PATH=str(bin_dir), PYTHON=sys.executable, NVIDIA_SMI_TIMEOUT="1")
    r = subprocess.run([shutil.which("bash"), "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=20)      # before: waited as long as nvidia-smi did
    assert r.returncode == 1 and r.stdout == ("gpu_check: error: nvidia-smi -L gave no answer within 1 s "
                                              "(NVIDIA_SMI_TIMEOUT): a wedged driver? (nvidia-smi -L alone shows it)\n")


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


FAKE_CUDA = """import importlib.machinery
import sys
import types


def fake_cuda(torch):
    torch.version.cuda = "13.0"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda *device: "NVIDIA H100 80GB HBM3"
    torch.cuda.get_device_capability = lambda *device: (9, 0)
    torch.cuda.get_device_properties = lambda *device: types.SimpleNamespace(total_memory=80 * 2 ** 30)


class AfterTorch:
    \"\"\"Fakes the GPU when torch is imported, not at start-up: the script's many interpreters that never import
    torch (python3 -c 'import numpy', argument checks) start in a fraction of a second.\"\"\"
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (load(module), fake_cuda(module))
        return spec


sys.meta_path.insert(0, AfterTorch())
"""


def fake_gpu_machine(tmp_path, hidden_module=None):
    """The lent GPU machine as far as gpu_check.sh can tell: nvidia-smi lists one H100, `python3` (and no `python`)
    is an interpreter whose torch is a CUDA build that sees it, a C compiler, and a pip that reaches no index.
    hidden_module: a package made unimportable in that interpreter. Returns the environment to run under."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_CUDA)
    if hidden_module:
        (site / f"{hidden_module}.py").write_text(f"raise ImportError('no module named {hidden_module}')\n")
    executable(bin_dir / "nvidia-smi", f'#!/bin/sh\necho "{GPU_LISTING}"\n')
    executable(bin_dir / "python3", f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    os.symlink(shutil.which("cc") or shutil.which("gcc"), bin_dir / "cc")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH", "VIRTUAL_ENV")}
    return dict(env, PATH=str(bin_dir), PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_INDEX_URL="http://127.0.0.1:9/")


def test_gpu_check_reaches_the_rows_offline_and_holds_them_to_the_budget(tmp_path):
    """On a faked GPU machine with no network and only python3, the check installs nothing, raises nothing, and
    lists its rows: those that fit --budget_s (by their estimates) would run, the rest are "not run (budget)"."""
    env = fake_gpu_machine(tmp_path)
    r = subprocess.run([shutil.which("bash"), "bench/gpu_check.sh", "--dry", "--budget_s", "200", "--out",
                        str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = r.stdout + r.stderr
    assert r.returncode == 0, output
    assert "Traceback" not in output and "error:" not in output and "installing" not in output, output
    assert "torch 2." in output and "1 GPU(s)" in output          # the probe saw the (faked) GPU
    run = [float(m) for m in re.findall(r"would run \(~(\d+) s\)", output)]
    assert run and sum(run) <= 200, output
    assert "not run (budget" in output
    assert "| row | what | ok |" in open(tmp_path / "out" / "table.md").read()


def test_gpu_check_without_network_names_a_missing_package_in_one_line(tmp_path):
    env = fake_gpu_machine(tmp_path, hidden_module="pytest")
    r = subprocess.run([shutil.which("bash"), "bench/gpu_check.sh", "--dry"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if "error:" in line]
    assert r.returncode == 1 and len(errors) == 1 and "pytest" in errors[0], r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


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


@pytest.mark.parametrize("budget", [60, 150, 400])
def test_budget_admits_rows_in_order_until_the_next_does_not_fit(tmp_path, budget):
    gpu_check = load_gpu_check()
    assert gpu_check.main(["--dry", "--budget_s", str(budget), "--out", str(tmp_path)]) == 0
    rows = [line.split(" | ") for line in open(tmp_path / "table.md") if line.startswith("| ") and "---" not in line]
    verdicts = [r[2] for r in rows[1:]]
    spent = sum(float(r[7].strip(" |\n~s")) for r in rows[1:] if r[2] == "dry")
    assert spent <= budget and verdicts[0] == "dry" and "not run (budget)" in verdicts


def test_a_non_finite_loss_is_a_failed_row_not_a_crash(tmp_path):
    """A NaN loss is logged as null (JSON has no NaN): the row fails with that reason, the table still comes."""
    gpu_check = load_gpu_check()
    os.makedirs(tmp_path / "fp8")
    with open(tmp_path / "fp8" / "metrics.jsonl", "w") as f:
        for step, loss in enumerate([10.9, None, None, None, None]):
            f.write(json.dumps(dict(step=step, loss=loss, tokens_per_s=1e5, mfu=0.3, peak_mem_bytes=2 ** 30)) + "\n")
    row = gpu_check.one_gpu_rows(str(tmp_path), 5, (9, 0), 2e-2, 5e-2)[-1]
    row.name, row.ref = "fp8", None
    results = {}
    verdict, check = gpu_check.train_result(row, str(tmp_path), results)
    assert verdict == "FAIL (loss not finite)" and "NaN" in check
    assert gpu_check.speed_cells(row, results, None, None)[0] == "100,000"


def test_every_row_comes_after_the_rows_it_is_compared_with():
    gpu_check = load_gpu_check()
    rows = gpu_check.one_gpu_rows("out", 6, (9, 0), 2e-2, 5e-2) + gpu_check.multi_gpu_rows(8, "out", 6, (9, 0), 2e-2,
                                                                                              5e-2)
    seen = set()
    for row in rows:
        assert all(dep is None or dep in seen for dep in (row.ref, row.speed_peer)), row.name
        seen.add(row.name)
    scripts = {part for row in rows for part in row.command if part.endswith(".py") and part.startswith("train_")}
    assert scripts == {f for f in os.listdir(ROOT) if f.startswith("train_") and f.endswith(".py")}
    assert gpu_check.selected(rows, "gemm-fp8-rowwise")[0].name == "gemm-bf16"     # its reference comes along


def test_every_single_gpu_train_row_parses_as_train_single_reads_it(monkeypatch):
    """Each 1-GPU train row's command line (the perf rows' --kernels head and --sdpa cudnn among them) is one that
    train_single's own parser and checks accept, with the row's flags: a typo would cost a GPU run."""
    import train_single
    gpu_check = load_gpu_check()

    class Parsed(Exception):
        pass

    def stop(cfg, **kwargs):
        raise Parsed(cfg)
    monkeypatch.setattr(train_single, "init_distributed", stop)
    rows = [r for r in gpu_check.one_gpu_rows("out", 6, (9, 0), 2e-2, 5e-2) if "train_single.py" in r.command]
    assert {"perf-head", "perf-sdpa-cudnn"} <= {r.name for r in rows}
    for row in rows:
        with pytest.raises(Parsed) as parsed:
            train_single.main(row.command[2:])
        cfg, argv = parsed.value.args[0], row.command[2:]
        flags = {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--") and not b.startswith("--")}
        for flag in ("--kernels", "--sdpa", "--fp8", "--micro_batch_size"):
            assert flag not in flags or str(getattr(cfg, flag[2:])) == flags[flag], (row.name, flag)


def test_emulated_cp_ranks_equal_whole_sequence_attention(monkeypatch):
    """The GPU row 5 runs each CP layout's ranks in turn in one process; in float64 on CPU, with the plain-torch
    block attention, that emulation equals whole-sequence attention (so on the GPU only the kernel is tested)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_rows
    import train_cp
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 48, 8, generator=g, dtype=torch.float64) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(dout)
    want = [out.detach()] + [t.grad for t in leaves]
    for layout in ("ring", "zigzag", "allgather"):
        for n in (2, 3, 4):
            got = gpu_rows.emulated_cp(layout, n, q, k, v, dout, train_cp.PLAIN_TORCH)
            assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-12, (layout, n)
    # the row's time is the slowest rank's, each rank timed alone on inputs copied out beforehand
    timed = []
    monkeypatch.setattr(gpu_rows, "time_ms", lambda fn, reps, warmup: (timed.append(fn()), 10.0 * len(timed))[1])
    assert gpu_rows.slowest_rank_ms("zigzag", 3, q, k, v, dout, train_cp.PLAIN_TORCH) == 30.0 and len(timed) == 3
