"""
profiling.py: `--profile N` for every train script, driven by metrics.MetricsLogger (no script's loop knows it).

    python train_single.py --profile 5 --out_dir out        # or any torchrun ... train_X.py --profile 5
    python bench/timeline.py out                            # -> out/timeline.png

MetricsLogger starts a StepProfiler when it is built and steps it in every log_step, which each script calls once
per optimizer step on every rank. The schedule (torch.profiler.schedule):

    step  0        1                 2 ... N+1                  N+2 ...
          skip     profiler warm-up  recorded (N steps)         off again
          (first step: lazy init, allocator growth, compile: not what a step costs)

Each rank then writes OUT_DIR/trace_rank{r}.json (Chrome trace format: open it in https://ui.perfetto.dev or
chrome://tracing) and rank 0 prints the operators that took the most time. A step's boundary is log_step, so an
evaluation that follows a step is traced inside the next one. Labels in the trace: every collective of comm.py
("comm:all_reduce [0, 1]", the group named by its global ranks) and the wait() of an async one ("comm:wait ..."),
so a ring attention step or a pipeline send shows as its p2p launch, then compute, then the wait; the pipeline
runner's actions ("pp:F mb3 chunk0", "pp:B ...", "pp:W ...") and train_cp's ring steps ("cp:ring step 1",
"cp:ring step 1 backward") through comm.label; autograd's backward nodes; the optimizer step. Off (N = 0) nothing
is built, and comm.py adds no range.
"""
import os

from torch.profiler import ProfilerActivity, profile, schedule

TOP_OPERATORS = 20


class StepProfiler:
    """torch.profiler over `steps` optimizer steps after two warm-up steps; one trace file per rank."""

    def __init__(self, steps, out_dir, rank, device):
        self.out_dir, self.rank, self.written = out_dir, rank, False
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                            on_trace_ready=self.write, record_shapes=False)
        self.prof.start()

    def path(self):
        return os.path.join(self.out_dir, f"trace_rank{self.rank}.json")

    def write(self, prof):
        """Called by torch.profiler when the recorded steps end (or the run stops inside them)."""
        os.makedirs(self.out_dir, exist_ok=True)
        prof.export_chrome_trace(self.path())
        self.written = True
        if self.rank == 0:
            sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort_by, row_limit=TOP_OPERATORS), flush=True)
            print(f"profile: traces written to {os.path.join(self.out_dir, 'trace_rank*.json')} "
                  f"(view: https://ui.perfetto.dev, or python bench/timeline.py {self.out_dir})", flush=True)

    def step(self):
        self.prof.step()

    def close(self):
        """Stop the profiler; a run shorter than the schedule writes what it recorded (or says it had none)."""
        self.prof.stop()
        if not self.written and self.rank == 0:
            print("profile: the run ended before a step was recorded (the first two steps are warm-up); "
                  "no trace written", flush=True)


def make_profiler(cfg, rank, device):
    """A StepProfiler when --profile N > 0, else None (and MetricsLogger.log_step does nothing more)."""
    if cfg.profile == 0:
        return None
    return StepProfiler(cfg.profile, cfg.out_dir, rank, device)
