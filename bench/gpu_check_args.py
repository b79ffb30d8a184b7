"""
bench/gpu_check_args.py: the GPU check's command line, read with the standard library alone, so that
bench/gpu_check.sh can ask it first, on any machine: --help, and a flag it does not know or a value out of range
(a NaN budget, an --only that selects no row, an --out that is a file, a plan sweep over 0 GPUs) as an error line
with exit code 2, before it looks for a GPU. bench/gpu_check.py parses its arguments here too (one parser for both).

    python3 bench/gpu_check_args.py --budget_s 480 --out DIR     # exit 0: bench/gpu_check.py takes these
"""
import argparse
import math
import os
import sys

from gpu_check_rows import ROOT, multi_gpu_rows, one_gpu_rows

TIMED_FROM = 3       # steps before this one build caches and compile: not timed
PLAN_GPUS = (1, 2, 4, 8)  # a plan sweep on a GPU machine runs on the largest of these its GPUs allow


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench/gpu_check.sh", allow_abbrev=False,
                                description="The one-command GPU check (bench/gpu_check.py says what it runs and how "
                                            "it judges). Without a GPU it skips in one line (exit 0); --dry works "
                                            "anywhere.")
    p.add_argument("--budget_s", type=float, default=480.0, help="seconds for all rows; rows that would not fit "
                   "are listed as 'not run (budget)' (default 480: a 15-minute GPU lease with start-up and rerun)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per training run")
    p.add_argument("--out", default=os.path.join("out", "gpu_check"), help="table.md, gpu_check.log, each row's "
                   "log and run directory")
    p.add_argument("--timeout", type=int, default=900, help="seconds before one row counts as hung")
    p.add_argument("--only", default="", help="comma-separated row-name prefixes to run (their references too)")
    p.add_argument("--dry", action="store_true", help="run nothing: list the rows and which the budget admits, "
                   "each at its estimate (works without a GPU)")
    p.add_argument("--plan_sweep", action="store_true", help="instead of the checks: plan.py's predicted peak "
                   "memory and OOM vs torch.cuda.max_memory_allocated and max_memory_reserved over train_5d layouts "
                   "(bench/plan_sweep.py)")
    p.add_argument("--plan_gpus", type=int, default=8, help="with --plan_sweep --dry and no GPU: GPUs to plan for")
    p.add_argument("--plan_gpu", default="h100", help="with --plan_sweep --dry and no GPU: inputs.HARDWARE's GPU")
    args = p.parse_args(argv)
    if not (math.isfinite(args.budget_s) and args.budget_s > 0) or args.steps <= TIMED_FROM or args.timeout <= 0:
        p.error(f"--budget_s and --timeout must be positive (and finite) and --steps > {TIMED_FROM} (the untimed "
                f"steps), got {args.budget_s:g}, {args.timeout}, {args.steps}")
    if args.plan_gpus not in PLAN_GPUS:
        p.error(f"--plan_gpus must be one of {', '.join(map(str, PLAN_GPUS))} (the sweep's world on a GPU machine), "
                f"got {args.plan_gpus}")
    problem = out_problem(args.out) or only_problem(args.only, every_row_name(), "on any machine")
    if problem:
        p.error(problem)
    return args


def out_problem(out):
    """Why --out (relative to the repository root, as gpu_check.py reads it) cannot be the check's directory, or
    None: found now, not when the first row writes its log."""
    path = os.path.join(ROOT, out)
    existing = path                     # the deepest part of the path that exists already
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    what = f"--out {out}" if existing == path else f"--out {out} cannot be created: {existing}"
    if not os.path.isdir(existing):
        return f"{what} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{what} is not writable"
    return None


def every_row_name():
    """The names of the rows a machine of any size (1 to 8 GPUs, FP8 capable) has."""
    rows = one_gpu_rows("out", TIMED_FROM + 1, (9, 0), 0.0, 0.0)
    for n in PLAN_GPUS[1:]:
        rows += multi_gpu_rows(n, "out", TIMED_FROM + 1, (9, 0), 0.0, 0.0)
    return {r.name for r in rows}


def only_problem(only, names, where):
    """Why --only selects nothing: a prefix that starts no row's name among `names` (`where`: which machine's), or
    a value of commas alone; None when every prefix selects a row (an empty --only selects them all)."""
    prefixes = only.split(",")
    if only and not any(prefixes):
        return f"--only {only!r} names no row (comma-separated row-name prefixes)"
    for prefix in prefixes:
        if prefix and not any(name.startswith(prefix) for name in names):
            return (f"--only {prefix!r} selects no row {where} (rows: "
                    f"{', '.join(sorted(names))})")
    return None


if __name__ == "__main__":
    parse_args(sys.argv[1:])
