"""
metrics.py: MFU, peak memory and the metrics.jsonl / progress-line logger every script uses.

MFU = achieved model FLOP/s / peak FLOP/s of the devices used, with model FLOPs from
`model.flops_per_token` (6N + 12*L*h*T). Peaks:
- GPU: a per-device table of dense bf16 tensor-core peaks (vendor datasheets); an unknown GPU gets a warning
  and MFU reported as null rather than a guess;
- CPU: the best of a few large fp32 matmuls on the threads torch uses, measured once per machine and thread
  count and kept in ~/.cache/nanoscale/cpu_peak_flops.json (keyed by host name, CPU model and threads), so that
  every run on a machine divides by the same peak: MFU and tokens/s then rank runs alike. Delete the file to
  measure again (after a hardware change).
SavedActivationBytes counts the activation bytes autograd keeps for backward (train_cp, train_tp);
LiveSavedActivationBytes their peak over a pipeline step (bench/memory_chart.py); ActionTimer a pipeline rank's
idle share (train_pp).
Peak memory, per step (the peak is reset after each logged step): torch.cuda.max_memory_allocated on GPU; on CPU
there is no allocator counter, so what is reported is the process's peak resident set size (Linux's VmHWM, reset
through /proc/self/clear_refs): model, optimizer, activations *and* the Python/torch runtime. Where the peak cannot
be reset (not Linux) it is the lifetime peak (ru_maxrss).
"""
import contextlib
import json
import math
import os
import platform
import resource
import sys
import time

import torch

from common.profiling import make_profiler

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
_cpu_peak_cache = {}


def measure_cpu_matmul_flops(n=1024, repeats=5):
    """Best achieved fp32 FLOP/s of an n x n matmul on this process's threads (cached in the process)."""
    key = (n, torch.get_num_threads())
    if key not in _cpu_peak_cache:
        g = torch.Generator().manual_seed(0)            # private: must not disturb the training RNG
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        a @ b                                               # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        _cpu_peak_cache[key] = 2 * n ** 3 / best
    return _cpu_peak_cache[key]


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
    means the next run measures again."""
    path = path or cpu_peak_file()
    key = f"{platform.node()} | {cpu_model()} | {torch.get_num_threads()} threads"
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if not isinstance(known.get(key), (int, float)):
        known[key] = measure_cpu_matmul_flops(repeats=20)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(known, f, indent=1)
            os.replace(tmp, path)                   # atomic: ranks starting together never see half a file
        except OSError:
            pass
    return float(known[key])


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
              f"(add its dense bf16 datasheet figure to metrics.GPU_PEAK_TFLOPS)", file=sys.stderr)
        return None
    return row[0] * 1e12


def device_peak_flops(device):
    """Peak FLOP/s of one device, or None when unknown (then MFU is not reported)."""
    if device.type == "cpu":
        return machine_cpu_peak_flops()
    return gpu_peak_flops(torch.cuda.get_device_name(device))


def peak_memory_bytes(device):
    """The peak since the last reset_peak_memory (the process's start before the first)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB (macOS: bytes)


def reset_peak_memory(device):
    """Start a new peak at the current use: so that each step's row reports that step's peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                            # Linux >= 4.0: peak RSS := current RSS
    except OSError:
        pass


class SavedActivationBytes:
    """Bytes of the tensors autograd keeps for backward during a forward, parameters excluded (each storage
    counted once): the activation memory of one micro-batch, exact on any device."""

    def __init__(self, model):                 # weights are saved by reference too: not activations
        self.skip, self.bytes = {p.untyped_storage().data_ptr() for p in model.parameters()}, 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.seen, self.bytes = set(), 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        return self.hooks.__enter__() or self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class ActionTimer:
    """The share of a pipeline step a rank spends idle (waiting for messages): installed as PipelineRunner's
    action_hook it times each action's compute; idle = 1 - busy / the step's span. On a GPU the times are CUDA
    events on the compute stream, read once the step is over (a host clock would time only the kernel launches);
    on CPU, host clocks."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self):
        self.spans, self.begin = [], self.mark()

    def stop(self):
        self.end = self.mark()

    @contextlib.contextmanager
    def __call__(self, action):
        begin = self.mark()
        yield
        self.spans.append((begin, self.mark()))

    def idle_fraction(self):
        if self.cuda:
            self.end.synchronize()
            busy = sum(a.elapsed_time(b) for a, b in self.spans)
            return 1.0 - busy / self.begin.elapsed_time(self.end)
        return 1.0 - sum(b - a for a, b in self.spans) / (self.end - self.begin)


class _Held:
    """A saved tensor as autograd holds it under LiveSavedActivationBytes: counted until autograd drops it."""

    def __init__(self, tensor, counter, ptr, nbytes):
        self.tensor, self.counter, self.ptr, self.nbytes = tensor, counter, ptr, nbytes
        counter.hold(ptr, nbytes)

    def __del__(self):
        self.counter.release(self.ptr, self.nbytes)


class LiveSavedActivationBytes:
    """The bytes autograd holds for backward *now*, and their peak, across many forwards and backwards (a pipeline
    step, several micro-batches in flight): a saved tensor counts from its forward until autograd frees it after
    its backward, each storage once, parameters excluded. SavedActivationBytes counts one forward; this is the
    activation memory a schedule reaches. Tensors kept outside autograd (a split backward's stash for its W pass,
    pipeline_weight_grads.py) are not seen."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.now = self.peak = 0
        self.holders = {}                         # storage pointer -> saved tensors holding it

    def hold(self, ptr, nbytes):
        if self.holders.get(ptr, 0) == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self.holders[ptr] = self.holders.get(ptr, 0) + 1

    def release(self, ptr, nbytes):
        self.holders[ptr] -= 1
        if self.holders[ptr] == 0:
            del self.holders[ptr]
            self.now -= nbytes

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() in self.skip or storage.nbytes() == 0:
            return t
        return _Held(t, self, storage.data_ptr(), storage.nbytes())   # a live storage's pointer is its own

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def format_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024


def format_duration(seconds):
    seconds = int(max(seconds, 0))
    h, m, s = seconds // 3600, seconds % 3600 // 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Rank 0 appends one JSON row per optimizer step to out_dir/metrics.jsonl and prints a progress line
    every log_interval steps. Throughput and MFU are computed here, from the step time. With --profile N it also
    drives profiling.StepProfiler on every rank (each script calls log_step once per optimizer step on all)."""

    def __init__(self, cfg, env, flops_per_token, n_devices, tokens_per_step, resume=False):
        self.cfg, self.env, self.active = cfg, env, env.rank == 0
        self.flops_per_token, self.tokens_per_step = flops_per_token, tokens_per_step
        peak = device_peak_flops(env.device)
        self.peak_total = None if peak is None else peak * n_devices
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.file = None
        if self.active:
            os.makedirs(cfg.out_dir, exist_ok=True)
            self.file = open(self.path, "a" if resume else "w")
        self.step_times = []
        self.profiler = make_profiler(cfg, env.rank, env.device)
        reset_peak_memory(env.device)                # step 0's peak: from here, not the setup's temporaries

    def log_step(self, step, loss, lr, grad_norm, step_time_s, comm_bytes, **extra):
        if self.profiler is not None:
            self.profiler.step()
        if not self.active:
            return None
        tokens_per_s = self.tokens_per_step / step_time_s
        mfu = None if self.peak_total is None else tokens_per_s * self.flops_per_token / self.peak_total
        row = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=(step + 1) * self.tokens_per_step,
                   step_time_s=step_time_s, tokens_per_s=tokens_per_s, mfu=mfu,
                   peak_mem_bytes=peak_memory_bytes(self.env.device), comm_bytes=comm_bytes, **extra)
        reset_peak_memory(self.env.device)
        self.write(row)
        self.step_times.append(step_time_s)
        last = self.cfg.stop_step or self.cfg.max_steps
        if step % self.cfg.log_interval == 0 or step == last - 1:
            recent = sorted(self.step_times[-self.cfg.log_interval:])
            eta = recent[len(recent) // 2] * (last - step - 1)
            mfu_txt = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
            print(f"step {step:5d}/{self.cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                  f"{tokens_per_s / 1e3:.1f}k tok/s | MFU {mfu_txt} | mem {format_bytes(row['peak_mem_bytes'])} | "
                  f"ETA {format_duration(eta)}", flush=True)
        return row

    def log_eval(self, step, val_loss):
        if self.active:
            print(f"step {step:5d} | val loss {val_loss:.4f}", flush=True)
            self.write(dict(step=step, val_loss=val_loss))

    def write(self, row):
        """One JSON line; inf / NaN (a skipped step's loss, optim.NonFiniteGuard) as null, which JSON has."""
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self):
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None
        if self.file is not None:
            self.file.close()


def read_metrics(out_dir):
    """Training rows of metrics.jsonl, the later row winning when a step appears twice (resume)."""
    rows = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row:
                rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


# ----------------------------------------------------------------------------------------------------------
# ZeRO's model states and gathered units (train_zero.py's shards and buckets, by duck typing: no rung imported)

def model_state_bytes(model, shards, buckets):
    """Bytes of the parameter, gradient and optimizer-state tensors alive on this rank, each storage once.
    shards: train_zero's Shards; buckets: their ShardedGrads' buckets, in the same order."""
    seen, out = set(), dict(params=0, grads=0, optim=0)

    def add(kind, t):
        st = None if t is None else t.untyped_storage()
        if st is not None and st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out[kind] += st.nbytes()
    for p in model.parameters():
        add("params", p)
        add("grads", p.grad)
    for b, s in zip(buckets, shards):                 # the master *is* the parameter shard: counted once
        for kind, t in (("params", s.shard), ("grads", b.buffer), ("grads", s.grad), ("optim", s.master),
                        ("optim", s.exp_avg), ("optim", s.exp_avg_sq)):
            add(kind, t)
    return out


class GatheredBytes:
    """ZeRO-3's gathered parameters: the bytes of whole units alive, at their peak (install_zero3_hooks's
    on_gather; memory only grows at a gather, so sampling there finds the peak)."""

    def __init__(self, shards):
        self.shards, self.peak = shards, 0

    def __call__(self):
        self.peak = max(self.peak, sum(s.full.untyped_storage().nbytes() for s in self.shards))
