"""
bench/plan_sweep.py: plan.py's predicted peak memory against torch.cuda.max_memory_allocated and
torch.cuda.max_memory_reserved for a sweep of train_5d.py layouts, and whether plan.py calls OOM right. One command on
a machine with GPUs:

    bash bench/gpu_check.sh --plan_sweep                          # runs each layout a few steps, writes the table
    python bench/gpu_check.py --plan_sweep --dry                  # anywhere, CPU too: the sweep's layouts and
                                                                  # predictions, nothing run

The sweep: the layouts of sweep_model(P) that train_5d.py's validate accepts on the P GPUs gpu_check uses, as plan.py
ranks them (train_5d --layout auto's job: bf16 autocast over fp32 states), RUNS of them spread evenly by predicted memory from
the smallest reserved memory to 1.5x the GPU's memory, so that some are predicted to fit and some not. Each runs
STEPS steps under torchrun; every rank writes its torch.cuda.max_memory_allocated and max_memory_reserved (this file's
--worker mode), and a run that dies of CUDA OOM counts as OOM. Compared: plan.py's allocated ("total": the tensors
and cuBLAS's workspaces) against the largest rank's max_memory_allocated, its reserved against the largest
max_memory_reserved (neither holds the CUDA context or NCCL's buffers), and plan.py's OOM verdict (reserved above
planner/memory.usable_bytes of the GPU's total_memory) against the run's. Goals: OOM right for >= 95% of the layouts,
the reserved ratio's median within 0.9-1.1.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner.inputs import GIB  # noqa: E402
from planner.device_memory import CLOSE_CALL, communicators, usable_bytes  # noqa: E402
from planner.device_memory import verdict as device_verdict  # noqa: E402

RUNS, STEPS = 12, 3
KEYS = ("dp", "tp", "cp", "pp", "ep", "sp", "zero_stage", "schedule", "v", "micro_batch_size", "recompute")


def sweep_model(world):
    """A GPT whose layouts on `world` GPUs span both sides of an 80 GB GPU: 0.8B parameters on 1 GPU (16 blocks of
    2048), 1.6B on 2, 3.2B on 4 (16 of 4096), 6.4B on 8; 32 sequences of 2048 tokens a step."""
    wide = world >= 4
    return dict(n_layer=16 * world // (4 if wide else 1), n_head=16 if not wide else 32, n_embd=4096 if wide else 2048,
                block_size=2048, global_batch_size=32)


def sweep_layouts(world, gpu, memory_bytes, vocab_size, runs=RUNS):
    """The sweep's plan.py rows: distinct train_5d-runnable layouts of sweep_model(world) on `world` GPUs of one
    node; for each of `runs` memory targets evenly spaced from the smallest prediction to 1.5 x memory_bytes, the
    layout predicted nearest to it (each at most once), in order of predicted memory."""
    import train_5d
    from common.config import Config
    from plan import accepted_by, plan_job
    from plan import rank_layouts
    cfg = Config(**sweep_model(world), dtype="bfloat16")
    cfg.layout, cfg.plan_gpu = "", ""
    before = dict(os.environ)
    os.environ["WORLD_SIZE"] = str(world)          # train_5d's validate reads the world size from the environment
    try:
        accepts = accepted_by(train_5d.validate, cfg)
        rows = [r for r in rank_layouts(plan_job(cfg, vocab_size, world, world, gpu, "amp")) if accepts(r)]
    finally:
        os.environ.clear()
        os.environ.update(before)
    left = list({tuple(r[k] for k in KEYS): r for r in rows}.values())
    low = min(r["mem_bytes"]["reserved"] for r in left)
    chosen = []
    for i in range(min(runs, len(left))):
        target = low + i * (1.5 * memory_bytes - low) / max(1, runs - 1)
        chosen.append(min(left, key=lambda r: abs(r["mem_bytes"]["reserved"] - target)))
        left.remove(chosen[-1])
    return sorted(chosen, key=lambda r: r["mem_bytes"]["reserved"])


def train_argv(row, world, steps, out_dir):
    """train_5d.py's flags for a plan.py row (as plan.set_layout sets them)."""
    flags = dict(sweep_model(world), dp=row["dp"], tp=row["tp"], cp=row["cp"], pp=row["pp"], ep=row["ep"],
                 zero_stage=row["zero_stage"], pp_schedule=row["schedule"], pp_virtual=row["v"],
                 micro_batch_size=row["micro_batch_size"], recompute=row["recompute"], max_steps=steps,
                 warmup_steps=1, dtype="bfloat16", eval_interval=0, sample_tokens=0, log_interval=1, out_dir=out_dir)
    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    return argv + (["--sp"] if row["sp"] else [])


def run_layout(row, world, steps, out_dir, timeout_s):
    """Run one layout under torchrun: (the largest of its ranks' dict(allocated=max_memory_allocated,
    reserved=max_memory_reserved), or None; 'fits' | 'OOM' (died of CUDA OOM) | 'failed (exit code)')."""
    os.makedirs(out_dir, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.abspath(__file__), "--worker", out_dir, "--"] + train_argv(row, world, steps, out_dir)
    with open(os.path.join(out_dir, "run.log"), "w") as log:
        try:
            rc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    with open(os.path.join(out_dir, "run.log")) as log:
        oom = any(m in log.read() for m in ("CUDA out of memory", "OutOfMemoryError"))
    peaks = [json.load(open(os.path.join(out_dir, f))) for f in os.listdir(out_dir) if f.startswith("peak_rank")]
    if rc == 0 and peaks:
        return {k: max(p[k] for p in peaks) for k in ("allocated", "reserved")}, "fits"
    return None, "OOM" if oom else f"failed (exit {rc})"


def verdict(row, memory_bytes):
    """plan.py's verdict for a row on a GPU of memory_bytes (torch's total_memory): OOM when its reserved memory is
    above what the allocator can have (planner/device_memory.usable_bytes), 'close' when its allocated memory is
    within device_memory.CLOSE_CALL of that (counted apart)."""
    n = communicators(row["dp"], row["tp"], row["cp"], row["pp"], row["ep"])
    usable = usable_bytes(memory_bytes, n)
    said = device_verdict(row["mem_bytes"]["total"], usable)
    return said if said == "close" else "OOM" if row["mem_bytes"]["reserved"] > usable else "fits"


def ratio(predicted, measured):
    """'predicted / measured' as text, '-' without a measurement."""
    return "-" if not measured else f"{predicted / measured:.2f}"


def summary(results, memory_bytes):
    """Markdown lines: one per layout (predicted and measured allocated and reserved, their ratios, the verdicts) and
    the goal figures, over the runs that fit or died of OOM. results: [(row, dict(allocated=, reserved=) or None,
    'fits' | 'OOM' | other)]."""
    lines = ["| layout | allocated: predicted / measured (GiB) | ratio | reserved: predicted / measured (GiB) | ratio "
             "| predicted | measured |", "|---|---|---|---|---|---|---|"]
    right = judged = close = 0
    ratios = {"allocated": [], "reserved": []}
    for row, peak, outcome in results:
        mem, said = row["mem_bytes"], verdict(row, memory_bytes)
        if outcome in ("fits", "OOM") and said == "close":
            close += 1
        elif outcome in ("fits", "OOM"):
            judged += 1
            right += said == outcome
        cells = []
        for key in ("allocated", "reserved"):
            predicted = mem["total" if key == "allocated" else key]
            measured = peak[key] if peak else None
            if measured:
                ratios[key].append(predicted / measured)
            cells.append(f"{predicted / GIB:.2f} / {'-' if not measured else f'{measured / GIB:.2f}'} | "
                         f"{ratio(predicted, measured)}")
        layout = " ".join(f"{k}={row[k]}" for k in KEYS)
        lines.append(f"| {layout} | {cells[0]} | {cells[1]} | {said} | {outcome} |")
    lines.append(f"\nOOM predicted right: {right} of {judged} runs that fit or died of OOM (goal >= 95%), {close} close "
                 f"calls apart (within {100 * CLOSE_CALL:.0f}% of the usable memory); predicted / "
                 f"measured over {len(ratios['reserved'])} runs that finished, median: allocated "
                 f"{median(ratios['allocated'])}, reserved {median(ratios['reserved'])} (goal 0.9-1.1).")
    return lines


def median(values):
    """The median of a list as text ('-' when empty)."""
    values = sorted(values)
    if not values:
        return "-"
    mid = len(values) // 2
    return f"{(values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2):.2f}"


def plan_sweep(world, gpu, memory_bytes, vocab_size, out, dry, steps=STEPS, timeout_s=900):
    """The whole sweep (dry: predictions only); writes out/plan_sweep.md; returns its lines."""
    rows = sweep_layouts(world, gpu, memory_bytes, vocab_size)
    results = []
    for i, row in enumerate(rows):
        if dry:
            results.append((row, None, "not run"))
            continue
        peak, outcome = run_layout(row, world, steps, os.path.join(out, f"plan_sweep_{i}"), timeout_s)
        print(f"  plan sweep {i + 1}/{len(rows)}: {outcome}, peak {peak}", flush=True)
        results.append((row, peak, outcome))
    head = (f"plan.py vs torch.cuda.max_memory_allocated / max_memory_reserved: {len(rows)} train_5d.py layouts of "
            f"{sweep_model(world)} on "
            f"{world} x {gpu} ({memory_bytes / GIB:.1f} GiB), {steps} steps each" + (" (dry: nothing run)" if dry else ""))
    lines = [head, ""] + summary(results, memory_bytes)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def worker(out_dir, argv):
    """Under torchrun: train_5d.main(argv), then this rank's torch.cuda.max_memory_allocated and max_memory_reserved
    to out_dir."""
    import torch
    import train_5d
    train_5d.main(argv)
    rank, device = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    with open(os.path.join(out_dir, f"peak_rank{rank}.json"), "w") as f:
        json.dump(dict(allocated=torch.cuda.max_memory_allocated(device) if cuda else 0,
                       reserved=torch.cuda.max_memory_reserved(device) if cuda else 0), f)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2], sys.argv[4:])
