"""
peaks.py: the peak FLOP/s that MFU divides by. A GPU's is its dense bf16 datasheet figure, looked up by the device's
name (an unknown GPU gets a warning and None: MFU is then reported as null rather than a guess). A CPU has no
datasheet figure that a run can reach, so its peak is measured: the best of a few large fp32 matmuls on the threads
torch uses, once per machine and thread count, kept in ~/.cache/nanoscale/cpu_peak_flops.json (keyed by host name,
CPU model and threads), so that every run on a machine divides by the same peak and MFU and tokens/s rank runs
alike. A figure measured while other jobs shared the cores is too low: a run that achieves more measures again
(raise_cpu_peak) and the file keeps the larger figure, so no run reports an MFU above 100%. Delete the file to
measure again (after a hardware change).
"""
import json
import os
import platform
import sys
import time

import torch

# Dense bf16 tensor-core TFLOP/s (no 2:4 sparsity) per (chip, board), from the vendor's datasheets, which print
# the sparse figure: dense = sparse / 2. A device name is split into words and matched exactly: the chip is the
# first word after "NVIDIA" (so "L40" is never "L4"), the board is "PCIe" or "NVL" when such a word is present,
# else "" (the default board: SXM for A100/H100/H200/H800, e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB").
A100_SHEET = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312 | 624 sparse"
H100_SHEET = "NVIDIA H100 datasheet (resources.nvidia.com, nvidia-tensor-core-gpu-datasheet): BF16 sparse"
GPU_PEAK_TFLOPS = {
    # (chip, board): (dense bf16 TFLOP/s, source)
    ("A100", ""): (312.0, A100_SHEET + " (SXM4 40/80GB)"),
    ("A100", "PCIe"): (312.0, A100_SHEET + " (PCIe 40/80GB)"),
    ("A800", ""): (312.0, "NVIDIA A800 datasheet: BF16 312 | 624 sparse (A100 compute, export-limited NVLink)"),
    ("A800", "PCIe"): (312.0, "NVIDIA A800 PCIe datasheet: BF16 312 | 624 sparse"),
    ("H100", ""): (989.5, H100_SHEET + " 1,979 (H100 SXM)"),
    ("H100", "PCIe"): (756.5, H100_SHEET + " 1,513 (H100 PCIe)"),
    ("H100", "NVL"): (835.5, H100_SHEET + " 1,671 (H100 NVL, per GPU)"),
    ("H800", ""): (989.5, "NVIDIA H800 datasheet: BF16 1,979 sparse (H800 SXM; H100 compute, export-limited NVLink)"),
    ("H800", "PCIe"): (756.5, "NVIDIA H800 PCIe datasheet: BF16 1,513 sparse"),
    ("H200", ""): (989.5, "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 1,979 sparse (H200 SXM)"),
    ("H200", "NVL"): (835.5, "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 1,671 sparse (H200 NVL)"),
    ("B200", ""): (2250.0, "NVIDIA HGX B200 specifications: FP16/BF16 4.5 PFLOPS per GPU, sparse"),
    ("L4", ""): (121.0, "NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): BF16 242 sparse"),
    ("L40", ""): (181.05, "NVIDIA L40 datasheet: BF16 181.05 | 362.1 sparse"),
    ("L40S", ""): (362.05, "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): BF16 362.05 | 733 sparse"),
    ("A10", ""): (125.0, "NVIDIA A10 datasheet (nvidia.com/en-us/data-center/products/a10-gpu): BF16 125 | 250 sparse"),
}


def measure_cpu_matmul_flops(n=1024, repeats=5):
    """Best achieved fp32 FLOP/s of an n x n matmul on this process's threads."""
    g = torch.Generator().manual_seed(0)            # private: must not disturb the training RNG
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b                                               # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def cpu_model():
    """The CPU's model name (Linux's /proc/cpuinfo), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_file():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nanoscale", "cpu_peak_flops.json")


def machine_cpu_peak_flops(path=None):
    """The CPU peak of this machine at this thread count, measured by the first run that needs it (20 repeats:
    the best of them) and read from cpu_peak_file() by every later one. A file that cannot be written only
    means the next run measures again. The figure of another thread count on this machine bounds it from below,
    as a figure measured while other processes shared the cores is too low: t threads do at least what fewer do,
    and at least t/k of what k > t threads do (four ranks on two cores, each measuring one thread, would record a
    quarter of the truth)."""
    path = path or cpu_peak_file()
    machine, key = cpu_peak_key()
    known = read_cpu_peaks(path)
    if not isinstance(known.get(key), (int, float)):
        known[key] = measure_cpu_matmul_flops(repeats=20)
        write_cpu_peaks(path, known)
    threads = torch.get_num_threads()
    bound = [flops * min(1.0, threads / k) for k, flops in threads_measured(known, machine).items()]
    return float(max([known[key]] + bound))


def raise_cpu_peak(at_least, path=None):
    """The CPU peak after a run achieved `at_least` FLOP/s per device, more than the peak it was dividing by (a
    figure measured under load): measured again now, and never below what the run achieved; the file keeps it,
    so later runs divide by it too. An MFU above 100% is never reported."""
    path = path or cpu_peak_file()
    _, key = cpu_peak_key()
    known = read_cpu_peaks(path)
    known[key] = max(machine_cpu_peak_flops(path), measure_cpu_matmul_flops(repeats=20), at_least)
    write_cpu_peaks(path, known)
    return float(known[key])


def cpu_peak_key():
    """(this machine, its cache key at this thread count): host name and CPU model, then the threads."""
    machine = f"{platform.node()} | {cpu_model()}"
    return machine, f"{machine} | {torch.get_num_threads()} threads"


def read_cpu_peaks(path):
    """{key: FLOP/s} of the cache file; {} where it is missing or unreadable."""
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    return known if isinstance(known, dict) else {}


def write_cpu_peaks(path, known):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, path)                   # atomic: ranks starting together never see half a file
    except OSError:
        pass


def threads_measured(known, machine):
    """{thread count: peak} of the entries of `machine` in the cache file's dict."""
    out = {}
    for key, flops in known.items():
        head, _, tail = key.rpartition(" | ")
        if head == machine and tail.endswith(" threads") and tail[:-8].isdigit() and isinstance(flops, (int, float)):
            out[int(tail[:-8])] = flops
    return out


def gpu_chip_and_board(name):
    """(chip, board) of a CUDA device name: 'NVIDIA H100 NVL' -> ('H100', 'NVL'), 'NVIDIA A100-PCIE-40GB' ->
    ('A100', 'PCIe'), 'NVIDIA L40S' -> ('L40S', ''). Words are split at spaces and hyphens and compared whole."""
    words = name.replace("-", " ").split()
    if words and words[0] in ("NVIDIA", "Tesla"):
        words = words[1:]
    chip = words[0] if words else ""
    board = ""
    for word in words[1:]:
        if word.upper() == "PCIE":
            board = "PCIe"
        elif word.upper() == "NVL":
            board = "NVL"
    return chip, board


def gpu_peak_flops(name):
    """Dense bf16 peak FLOP/s of the GPU named `name` (torch.cuda.get_device_name), or None (with a warning)
    when the table has no row for it: a wrong peak would make every MFU figure wrong, so none is guessed."""
    row = GPU_PEAK_TFLOPS.get(gpu_chip_and_board(name))
    if row is None:
        print(f"warning: no peak FLOP/s known for GPU {name!r}; MFU will be reported as null "
              f"(add its dense bf16 datasheet figure to peaks.GPU_PEAK_TFLOPS)", file=sys.stderr)
        return None
    return row[0] * 1e12


def device_peak_flops(device):
    """Peak FLOP/s of one device, or None when unknown (then MFU is not reported)."""
    if device.type == "cpu":
        return machine_cpu_peak_flops()
    return gpu_peak_flops(torch.cuda.get_device_name(device))
