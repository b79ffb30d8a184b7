"""
bench/gpu_check.py: the one-command GPU check, run as `bash bench/gpu_check.sh` (which skips, exit 0, with one
line, only on a machine without a GPU, and fails with an error line when a GPU exists but python, a CUDA build of
torch, a C compiler or Python.h is missing). Rows run in order of value, each timed; with --budget_s S a row whose
estimate does not fit what is left is listed as "not run (budget)", never started and cut off halfway.

On 1 GPU (every row a line of the table: ok, loss vs reference or error vs bound, speed, MFU, peak memory):
  1. the GPU's own bf16 matmul rate (8192^3): the measured ceiling every MFU is also shown against;
  2. train_single in bf16 at GPT-2-small's shape (12 x 768, 12 heads, T 1024, vocab 50257 padded to 50304; the
     default corpus's tokens), eager and --compile: tokens/s, MFU of the datasheet peak / of row 1;
  3. --kernels triton and --kernels compile against --kernels torch, and each Triton kernel forward+backward
     against its torch peer on GPU tensors at those shapes (error, and time against the peer's);
  4. each FP8 recipe through the real torch._scaled_mm, at a GEMM-bound shape (n_embd 4096) and at GPT-2-small,
     against bf16: loss within FP8_RTOL, tokens/s against bf16's;
  5. CP's block attention (aten's flash kernel returning the log-sum-exp) at T = 8192: ring, zigzag and allgather
     at 2 and 4 ranks emulated in one process, against whole-sequence attention;
  6. host syncs in a train_single step, dense and MoE, as torch.cuda.set_sync_debug_mode reports them (0 outside
     the logged scalars dense; one read of the rows per expert per MoE block and forward);
  7. peak memory of train_single at three shapes (rows 2 and 4's runs and one with --recompute full) against
     plan.py's prediction for the same run;
  8. tests/test_kernels.py and tests/test_fp8.py with their tensors on the GPU.
On N > 1 GPUs the multi-rank rows follow (every train script under torchrun with NCCL at P = the largest power of
two <= min(N, 8) against train_single, CP at T = 8192, the fused kernels and FP8 inside TP; a rank stopped inside a
save past --dist_timeout, which must leave `latest` complete, and train_5d's start-up time: bench/gpu_multi_rows.py),
within the budget.

    bash bench/gpu_check.sh --budget_s 480 --out /tmp/gpu_check    # the check a lent GPU machine runs
    python3 bench/gpu_check.py --dry --budget_s 300                 # anywhere: the rows the budget admits
    bash bench/gpu_check.sh --plan_sweep                            # instead: bench/plan_sweep.py on N GPUs

--out gets table.md, gpu_check.log (the progress lines), and per row its log and run directory (metrics.jsonl).
Tolerances: bf16 keeps 8 significant bits, so two runs that round and reduce in different orders drift apart by
~1e-3 of the loss over a few steps; a lost micro-batch or a wrong gradient scale moves it by far more than
BF16_RTOL. FP8 GEMMs add quantization noise on top (FP8_RTOL). A NaN or inf loss fails its row.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

from common.metrics import read_metrics  # noqa: E402
from gpu_check_args import TIMED_FROM, only_problem, parse_args  # noqa: E402
from gpu_check_rows import GPT2_VOCAB, multi_gpu_rows, one_gpu_rows, predicted_single_gpu_peak  # noqa: E402

BF16_RTOL = 2e-2     # max over steps of |loss - reference| / reference, bf16 runs
FP8_RTOL = 5e-2      # the same for FP8 runs against bf16
GIB = 2 ** 30


class Clock:
    """Seconds spent and left of the budget; dry, it advances by each row's estimate instead of running."""

    def __init__(self, budget_s, dry):
        self.budget_s, self.dry, self.start, self.spent_dry = budget_s, dry, time.time(), 0.0
        self.est_done = self.actual_done = 0.0

    def elapsed(self):
        return self.spent_dry if self.dry else time.time() - self.start

    def left(self):
        return self.budget_s - self.elapsed()

    def estimate(self, row):
        """The row's estimate scaled by how the rows so far compared with theirs (this GPU's speed, a cold disk)."""
        scale = self.actual_done / self.est_done if self.est_done > 0 else 1.0
        return row.est_s * min(max(scale, 0.5), 3.0)

    def done(self, row, seconds):
        self.est_done += row.est_s
        self.actual_done += seconds
        if self.dry:
            self.spent_dry += seconds


def run(command, log_path, timeout_s):
    """Run one command in its own process group (a hung rank is killed with its siblings); exit code or 'timeout'."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def train_result(row, out, results):
    """Cells of a finished train row from its metrics.jsonl: ok, loss vs reference, tokens/s, MFU, peak memory."""
    metrics = read_metrics(os.path.join(out, row.name))
    losses = [m["loss"] for m in metrics]
    timed = metrics[TIMED_FROM:] or metrics
    tok_s, mfu = median(m["tokens_per_s"] for m in timed), median(m["mfu"] for m in timed)
    results[row.name] = dict(losses=losses, tok_s=tok_s, mfu=mfu, peak=max(m["peak_mem_bytes"] for m in metrics),
                             reserved=max(m.get("peak_reserved_bytes") or 0 for m in metrics))
    if not losses or any(v is None or not math.isfinite(v) for v in losses):
        return "FAIL (loss not finite)", "NaN/inf (logged as null)"
    ref = results.get(row.ref, {}).get("losses")
    if row.ref is None:
        return "ok", "reference"
    if ref is None or len(ref) != len(losses) or any(v is None for v in ref):
        return "FAIL (no reference)", f"{row.ref} did not finish"
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    return ("ok" if gap <= row.rtol else "FAIL (loss)"), f"{gap:.1e} vs {row.ref} (<= {row.rtol:g})"


def speed_cells(row, results, ceiling, peak):
    """tokens/s (and its ratio to the row's speed peer), MFU of the datasheet peak / of the measured matmul."""
    r = results.get(row.name)
    if not r or r["tok_s"] is None:
        return "-", "-", "-"
    speed = f"{r['tok_s']:,.0f}"
    peer = results.get(row.speed_peer or "", {}).get("tok_s")
    if peer:
        speed += f" ({r['tok_s'] / peer:.2f}x {row.speed_peer})"
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    if r["mfu"] is not None and ceiling and peak:
        mfu += f" / {100 * r['mfu'] * peak / ceiling:.1f}%"
    return speed, mfu, f"{r['peak'] / GIB:.2f} GiB"


def probe_cells(row, out):
    """Table rows of a probe (bench/gpu_rows.py) from its JSON: [(name, verdict, check, speed)]."""
    try:
        with open(os.path.join(out, f"{row.name}.json")) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        return {}, [(row.what, "FAIL (no result)", f"{type(e).__name__}: {e}", "-")]
    return result, [(r["name"], "ok" if r["ok"] else "FAIL", r["check"], r["speed"]) for r in result["rows"]]


def plan_memory_cells(results, gpu_name):
    """Row 7: plan.py's predicted peaks for each run it was asked about against the run's measured ones."""
    from plan import gpu_kind
    gpu = gpu_kind(gpu_name) or "h100"
    cells = []
    for name, flags in results.get("_plan", []):
        r = results.get(name)
        if not r:
            continue
        try:
            allocated, reserved = predicted_single_gpu_peak(flags, GPT2_VOCAB, gpu)
        except Exception as e:         # plan.py could not answer: its own row fails, the table still comes
            cells.append((f"plan.py peak memory, {name}", "FAIL", f"{type(e).__name__}: {e}", "-"))
            continue
        ratio = allocated / r["peak"]
        cells.append((f"plan.py peak memory, {name}", "ok" if abs(ratio - 1) <= 0.10 else "off (> 10%)",
                      f"allocated {allocated / GIB:.2f} / {r['peak'] / GIB:.2f} GiB = {ratio:.2f}; reserved "
                      f"{reserved / GIB:.2f} / {r['reserved'] / GIB:.2f} GiB = {reserved / max(r['reserved'], 1):.2f}",
                      "-"))
    return cells


def format_table(machine, args, table):
    lines = [f"GPU check on {machine}: budget {args.budget_s:.0f} s; train rows {args.steps} steps in bf16 autocast, "
             f"tokens/s and MFU the medians from step {TIMED_FROM}; MFU of the datasheet peak / of the measured "
             f"bf16 matmul (row 1)", "",
             "| row | what | ok | loss vs reference, or error | speed | MFU | peak memory | time |",
             "|---|---|---|---|---|---|---|---|"]
    return lines + ["| " + " | ".join(str(c) for c in cells) + " |" for cells in table]


def main(argv=None):
    args = parse_args(argv)
    if args.plan_sweep:
        return plan_sweep_main(args)
    if not args.dry and not torch.cuda.is_available():   # run directly where torch sees no GPU: fail, never pass
        print("gpu_check: error: torch.cuda.is_available() is False (bash bench/gpu_check.sh says why)")
        return 1
    n_gpus = torch.cuda.device_count() if not args.dry else 1
    gpu_name = torch.cuda.get_device_name(0) if not args.dry else "(dry run)"
    capability = torch.cuda.get_device_capability(0) if not args.dry else (9, 0)
    out = os.path.join(ROOT, args.out)
    P = 1 << (min(n_gpus, 8).bit_length() - 1)
    rows = one_gpu_rows(out, args.steps, capability, BF16_RTOL, FP8_RTOL)
    if P > 1:
        rows += multi_gpu_rows(P, out, args.steps, capability, BF16_RTOL, FP8_RTOL)
    where = "in a --dry run (one GPU of capability 9.0)" if args.dry else f"on this machine ({n_gpus} x {gpu_name})"
    problem = only_problem(args.only, {r.name for r in rows}, where)
    if problem:                         # (a multi-GPU row's name on one GPU, an FP8 row's below capability 8.9)
        print(f"gpu_check: error: {problem}")
        return 2
    rows = selected(rows, args.only)
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "gpu_check.log"), "a")

    def say(text):
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    clock = Clock(args.budget_s, args.dry)
    machine = f"{n_gpus} x {gpu_name}, torch {torch.__version__}"
    say(f"gpu_check: {machine}; {len(rows)} rows, budget {args.budget_s:.0f} s" + (" (dry: nothing runs)" if args.dry
                                                                                   else ""))
    if not args.dry:
        data = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check_rows.py"), "data", out],
                              cwd=ROOT, capture_output=True, text=True)
        if data.returncode != 0:
            say(f"gpu_check: error: could not prepare the data: {(data.stderr or data.stdout).strip()[-300:]}")
            return 1
    table, results, failed, ceiling = [], {"_plan": []}, False, None
    from common.peaks import gpu_peak_flops
    peak = None if args.dry else gpu_peak_flops(gpu_name)
    not_run = set()
    for row in rows:
        est = clock.estimate(row)
        missing = [dep for dep in (row.ref, row.speed_peer) if dep in not_run]
        if missing:
            not_run.add(row.name)
            table.append([row.name, row.what, "not run (reference)", f"{missing[0]} did not run", "-", "-", "-", "-"])
            say(f"  {row.name:<22} not run ({missing[0]}, its reference, did not run)")
            continue
        if est > clock.left():
            not_run.add(row.name)
            table.append([row.name, row.what, "not run (budget)", f"needs ~{est:.0f} s, {max(0, clock.left()):.0f} "
                          "s left", "-", "-", "-", "-"])
            say(f"  {row.name:<22} not run (budget: ~{est:.0f} s needed, {max(0, clock.left()):.0f} s left)")
            continue
        if args.dry:
            clock.done(row, row.est_s)
            table.append([row.name, row.what, "dry", "-", "-", "-", "-", f"~{row.est_s:.0f} s"])
            say(f"  {row.name:<22} would run (~{row.est_s:.0f} s)")
            continue
        t0 = time.time()
        if row.kind == "train":         # a rerun into the same OUT: this row's last run is not another run's
            shutil.rmtree(os.path.join(out, row.name), ignore_errors=True)
        rc = 0 if row.kind == "plan" else run(row.command, os.path.join(out, f"{row.name}.log"),    # plan: in-process
                                              min(args.timeout, clock.left() + 0.1 * args.budget_s))
        seconds = time.time() - t0
        clock.done(row, seconds)
        timing = f"{seconds:.0f} s"
        if rc != 0:
            table.append([row.name, row.what, f"FAIL (exit {rc})", f"log: {row.name}.log", "-", "-", "-", timing])
        elif row.kind == "train":
            verdict, check = train_result(row, out, results)
            if row.plan_flags is not None:
                results["_plan"].append((row.name, row.plan_flags))
            table.append([row.name, row.what, verdict, check, *speed_cells(row, results, ceiling, peak), timing])
        elif row.kind == "tests":
            table.append([row.name, row.what, "ok", "passed", "-", "-", "-", timing])
        else:
            result, sub = probe_cells(row, out) if row.kind == "probe" else ({}, plan_memory_cells(results, gpu_name))
            if "tflops" in result:
                ceiling = result["tflops"] * 1e12
            table += [[row.name, name, verdict, check, speed, "-", "-", timing] for name, verdict, check, speed in sub]
        verdicts = [cells[2] for cells in table if cells[0] == row.name]
        failed |= any(v != "ok" for v in verdicts) or not verdicts
        say(f"  {row.name:<22} {', '.join(verdicts) or 'FAIL (no result)':<24} {seconds:6.0f} s  (log: "
            f"{os.path.join(args.out, row.name)}.log)")
    lines = format_table(machine, args, table)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    say("\n".join(lines))
    log.close()
    return 1 if failed else 0


def selected(rows, only):
    """Rows whose names start with one of `only`'s prefixes, and the rows they are compared with (all if empty)."""
    prefixes = [s for s in only.split(",") if s]
    if not prefixes:
        return rows
    wanted = {r.name for r in rows if any(r.name.startswith(s) for s in prefixes)}
    while True:
        needed = {dep for r in rows if r.name in wanted for dep in (r.ref, r.speed_peer) if dep} - wanted
        if not needed:
            return [r for r in rows if r.name in wanted]
        wanted |= needed


def plan_sweep_main(args):
    """--plan_sweep: on min(N, 8) CUDA GPUs (a power of two), or with --dry as if on --plan_gpus x --plan_gpu.
    Writes OUT/plan_sweep.md; the default corpus is byte-level, so the vocabulary is 256 without reading it."""
    from plan import gpu_kind
    from planner.inputs import HARDWARE
    from planner.memory import DEVICE_SHARE
    from plan_sweep import plan_sweep
    N = torch.cuda.device_count()
    if N == 0 and not args.dry:
        print("gpu_check --plan_sweep: no CUDA GPU here (use --dry to see the sweep)")
        return 0
    world = 1 << (min(N, 8).bit_length() - 1) if N else args.plan_gpus
    gpu = gpu_kind(torch.cuda.get_device_name(0)) if N else args.plan_gpu
    if gpu not in HARDWARE:
        name = repr(torch.cuda.get_device_name(0)) if N else f"--plan_gpu {args.plan_gpu!r}"
        print(f"gpu_check: error: --plan_sweep: plan.py knows no GPU {name} (it knows {', '.join(HARDWARE)})")
        return 2
    memory = torch.cuda.get_device_properties(0).total_memory if N else HARDWARE[gpu]["mem"] * DEVICE_SHARE
    lines = plan_sweep(world, gpu, memory, 256, os.path.join(ROOT, args.out), args.dry or not N)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
