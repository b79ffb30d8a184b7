"""
bench/gpu_check_args.py: the GPU check's command line, read with the standard library alone, so that
bench/gpu_check.sh can ask it first, on any machine: --help, and a flag it does not know as an error line with exit
code 2, before it looks for a GPU. bench/gpu_check.py parses its arguments here too (one parser for both).

    python3 bench/gpu_check_args.py --budget_s 480 --out DIR     # exit 0: bench/gpu_check.py takes these
"""
import argparse
import os
import sys

TIMED_FROM = 3       # steps before this one build caches and compile: not timed


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
    if args.budget_s <= 0 or args.steps <= TIMED_FROM or args.timeout <= 0:
        p.error(f"--budget_s and --timeout must be positive and --steps > {TIMED_FROM} (the untimed steps)")
    return args


if __name__ == "__main__":
    parse_args(sys.argv[1:])
