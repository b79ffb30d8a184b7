"""
metrics.py: MFU, peak memory and the metrics.jsonl / progress-line logger every script uses.

MFU = achieved model FLOP/s / peak FLOP/s of the devices used, with model FLOPs from
`model.flops_per_token` (6N + 12*L*h*T); the peaks (a GPU's datasheet, a CPU's measured matmul) are
common/peaks.py's. A CPU's is an estimate, which the progress line says; a step that achieves more than it has it
measured again (peaks.raise_cpu_peak), so MFU never reads above 100%.
SavedActivationBytes counts the activation bytes autograd keeps for backward (train_cp, train_tp);
LiveSavedActivationBytes their peak over a pipeline step (bench/memory_chart.py); ActionTimer a pipeline rank's
idle share (train_pp).
Peak memory, per step (the peak is reset after each logged step): torch.cuda.max_memory_allocated on GPU; on CPU
there is no allocator counter, so what is reported is the process's peak resident set size (Linux's VmHWM, reset
through /proc/self/clear_refs): model, optimizer, activations *and* the Python/torch runtime. Where the peak cannot
be reset (not Linux) it is the lifetime peak (ru_maxrss).
"""
import contextlib
import errno
import json
import math
import os
import resource
import time

import torch

from common.checkpoint.files import kept_checkpoint
from common.errors import fail
from common.peaks import device_peak_flops, raise_cpu_peak
from common.profiling import make_profiler

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


def peak_reserved_bytes(device):
    """What the caching allocator held at its peak since the last reset (torch.cuda.max_memory_reserved: what
    nvidia-smi shows, less the CUDA context); on CPU, with no caching allocator, the same as peak_memory_bytes."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    return peak_memory_bytes(device)


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

    def during(self, counting):
        """This tracker while `counting` (a step's first micro-batch: all are alike), else nothing: its hook runs
        on every tensor autograd saves, a host cost the other micro-batches need not pay."""
        return self if counting else contextlib.nullcontext()


class ActionTimer:
    """The share of a pipeline step a rank spends idle (waiting for messages): installed as PipelineRunner's
    action_hook it times each action's compute; idle = 1 - busy / the step's span. On a GPU the times are CUDA
    events on the compute stream, read once the step is over (a host clock would time only the kernel launches);
    on CPU, host clocks. costs() gives the step's median F, B and W durations: the ratio to simulate the
    schedule at (pipeline.schedules.simulate), so measured idle is compared with the bubble of the same costs."""

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
        self.spans.append((action.kind, begin, self.mark()))

    def elapsed(self, begin, end):
        """Seconds between two marks (of a step that has ended)."""
        return begin.elapsed_time(end) / 1e3 if self.cuda else end - begin

    def idle_fraction(self):
        if self.cuda:
            self.end.synchronize()
        busy = sum(self.elapsed(a, b) for _, a, b in self.spans)
        return 1.0 - busy / self.elapsed(self.begin, self.end)

    def costs(self):
        """{"f", "b", "w"}: median seconds of this step's F, B and W actions (0 for a kind it has none of)."""
        if self.cuda:
            self.end.synchronize()
        out = {}
        for kind in "FBW":
            times = sorted(self.elapsed(a, b) for k, a, b in self.spans if k == kind)
            out[kind.lower()] = times[len(times) // 2] if times else 0.0
        return out


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
    pipeline/weight_grads.py) are not seen."""

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
    drives profiling.StepProfiler on every rank (each script calls log_step once per optimizer step on all).

    A step's loss and grad norm may be passed as device tensors (train_single): reading one stops the host until
    the device has finished, so such rows wait and are read together, in one copy, at the next log step or
    read() (before an evaluation or a checkpoint). `on_read(step, loss, grad_norm)` then sees each one, in step
    order, on every rank (the non-finite guard's count and stop). The waiting rows share their window's time
    evenly: their steps' host times plus the wait for the device, so tokens/s counts only finished work; their
    peak memory is the window's. tokens_per_step: the tokens of an optimizer step (default: the global batch's)."""

    def __init__(self, cfg, env, flops_per_token, n_devices, tokens_per_step=None, resume=False, on_read=None):
        self.cfg, self.env, self.active = cfg, env, env.rank == 0
        self.flops_per_token = flops_per_token
        self.tokens_per_step = cfg.global_batch_size * cfg.block_size if tokens_per_step is None else tokens_per_step
        peak = device_peak_flops(env.device)
        self.peak_total = None if peak is None else peak * n_devices
        self.n_devices = n_devices
        self.cpu_estimate = peak is not None and env.device.type == "cpu"     # a measured matmul, not a datasheet
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.file = None
        if self.active:
            os.makedirs(cfg.out_dir, exist_ok=True)
            self.file = open(self.path, "a" if resume else "w")
        self.step_times = []
        self.waiting, self.on_read = [], on_read     # rows whose loss / grad norm are still on the device
        self.mixture = mixture_counts(cfg) if self.active else None
        self.profiler = make_profiler(cfg, env.rank, env.device)
        reset_peak_memory(env.device)                # step 0's peak: from here, not the setup's temporaries

    def log_step(self, step, loss, lr, grad_norm, step_time_s, comm_bytes, **extra):
        """The step's row, written now (returned, on rank 0) or, holding device values, at the next read."""
        if self.profiler is not None:
            self.profiler.step()
        self.waiting.append((step, loss, lr, grad_norm, step_time_s, comm_bytes, extra))
        last = self.cfg.stop_step or self.cfg.max_steps
        on_device = isinstance(loss, torch.Tensor) or isinstance(grad_norm, torch.Tensor)
        if not on_device or step % self.cfg.log_interval == 0 or step == last - 1:
            return self.read()
        return None

    def read(self):
        """Write the waiting rows, their device values read in one copy; returns the last row (rank 0)."""
        if not self.waiting:
            return None
        waiting, self.waiting = self.waiting, []
        pairs = [(w[1], w[3]) for w in waiting]
        start = time.perf_counter()
        values = read_values(pairs)
        on_device = any(isinstance(v, torch.Tensor) for pair in pairs for v in pair)
        waited = time.perf_counter() - start if on_device else 0.0      # for the device to finish the window
        step_time_s = (sum(w[4] for w in waiting) + waited) / len(waiting)
        peak, reserved = peak_memory_bytes(self.env.device), peak_reserved_bytes(self.env.device)
        row = None
        for (step, _, lr, _, _, comm_bytes, extra), (loss, grad_norm) in zip(waiting, values):
            if self.on_read is not None:
                self.on_read(step, loss, grad_norm)
            if self.active:
                row = self.write_step(step, loss, lr, grad_norm, step_time_s, comm_bytes, peak, reserved, extra)
        reset_peak_memory(self.env.device)
        return row

    def write_step(self, step, loss, lr, grad_norm, step_time_s, comm_bytes, peak, reserved, extra):
        tokens_per_s = self.tokens_per_step / step_time_s
        achieved = tokens_per_s * self.flops_per_token
        if self.cpu_estimate and achieved > self.peak_total:     # the CPU peak was measured under load: again
            self.peak_total = self.n_devices * raise_cpu_peak(achieved / self.n_devices)
        mfu = None if self.peak_total is None else achieved / self.peak_total
        row = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=(step + 1) * self.tokens_per_step,
                   step_time_s=step_time_s, tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_bytes=peak,
                   peak_reserved_bytes=reserved, comm_bytes=comm_bytes, **extra)
        if self.mixture is not None:                 # --data_mix: tokens and epochs per source
            row.update(self.mixture.metrics(step))
        self.write(row)
        self.step_times.append(step_time_s)
        last = self.cfg.stop_step or self.cfg.max_steps
        if step % self.cfg.log_interval == 0 or step == last - 1:
            recent = sorted(self.step_times[-self.cfg.log_interval:])
            eta = recent[len(recent) // 2] * (last - step - 1)
            mfu_txt = "n/a" if mfu is None else f"{100 * mfu:.1f}%" + (" (CPU peak est.)" if self.cpu_estimate else "")
            print(f"step {step:5d}/{self.cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                  f"{tokens_per_s / 1e3:.1f}k tok/s | MFU {mfu_txt} | mem {format_bytes(peak)} | "
                  f"ETA {format_duration(eta)}", flush=True)
        return row

    def log_eval(self, step, val_loss):
        if self.active:
            by_source = getattr(val_loss, "by_source", {})
            parts = ", ".join(f"{os.path.basename(os.path.normpath(n))} {v:.4f}" for n, v in by_source.items())
            print(f"step {step:5d} | val loss {val_loss:.4f}{f' ({parts})' if parts else ''}", flush=True)
            self.write(dict(step=step, val_loss=val_loss, **({"val_loss_by_source": by_source} if by_source else {})))

    def write(self, row):
        """One JSON line; inf / NaN (a skipped step's loss, optim.NonFiniteGuard) as null, which JSON has."""
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as e:                         # a full disk (ENOSPC), a quota: one line, not a traceback
            fail(f"cannot write {self.path} ({errno.errorcode.get(e.errno, 'error')}: {e.strerror or e}); "
                 f"{kept_checkpoint(self.cfg.out_dir)} once there is space", rank_local=True)

    def close(self):
        self.read()
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None
        if self.file is not None:
            self.file.close()


def read_values(pairs):
    """[(loss, grad_norm)] of floats and device tensors -> floats; all the tensors read in one copy."""
    tensors = [v.detach().to(torch.float64) for pair in pairs for v in pair if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return [[next(read) if isinstance(v, torch.Tensor) else float(v) for v in pair] for pair in pairs]


def mixture_counts(cfg):
    """Per-source accounting of a --data_mix run (data_mix.MixtureCounts), None for one corpus."""
    if not getattr(cfg, "data_mix", ""):
        return None
    from common.data_mix import MixtureCounts, parse_data_mix
    return MixtureCounts(parse_data_mix(cfg.data_mix), cfg.seed, cfg.global_batch_size, cfg.block_size)


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
    """ZeRO-3's gathered parameters: the bytes of whole units alive, at their peak. Wraps each shard's all_gather
    (whatever gathers it at construction, an FP8 unit's own too) and wait() to sample right after each: memory only
    grows at a gather (or, for one in 16 bits, at its wait()), so sampling there finds the peak."""

    def __init__(self, shards):
        self.shards, self.peak = shards, 0
        for s in shards:
            s.all_gather = self.sampled(s.all_gather)
            s.wait = self.sampled(s.wait)

    def sampled(self, all_gather):
        def gather(*args, **kwargs):
            handle = all_gather(*args, **kwargs)
            self.peak = max(self.peak, sum(s.full.untyped_storage().nbytes() for s in self.shards))
            return handle
        return gather
