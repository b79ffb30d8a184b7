"""
bench/print_schedule.py: print a pipeline schedule as an ASCII timeline (simulated, F = B = W = 1 unless --costs
says otherwise), with its idle share next to the textbook formula and the peak in-flight micro-batch-chunks per
rank.

    python bench/print_schedule.py --pp 4 --n_microbatches 8 --schedule zb1
    python bench/print_schedule.py --pp 2 --n_microbatches 4 --schedule interleaved --pp_virtual 2
    python bench/print_schedule.py --pp 2 --n_microbatches 8 --schedule interleaved --costs 7.1:13.4:0 --latency 1

--costs F:B:W simulates at a measured ratio (a run's median action durations: bubble_sim_run in train_pp's
metrics.jsonl is the same simulation); a schedule without W actions runs its whole backward in B, costing B + W.
--latency L (same unit) delays every message between ranks by L after its producer ends. The timeline is drawn
for whole-number costs and latency only.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.schedules import SCHEDULES, V_SHAPED, render, simulate, theory_idle_fraction   # noqa: E402
from train_pp import make_schedule                                                          # noqa: E402


def costs_arg(text):
    """'F:B:W' -> (f, b, w), each a finite number >= 0, F and B > 0."""
    try:
        f, b, w = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--costs takes F:B:W, three numbers such as 1:2:0; got {text!r}")
    if not all(0 <= x < float("inf") for x in (f, b, w)) or f == 0 or b == 0:
        raise argparse.ArgumentTypeError(f"--costs F:B:W needs finite costs, F and B above 0 and W >= 0; got {text!r}")
    return tuple(int(x) if x.is_integer() else x for x in (f, b, w))     # whole numbers: a timeline is drawn


def latency_arg(text):
    try:
        latency = float(text)
    except ValueError:
        latency = float("nan")
    if not 0 <= latency < float("inf"):
        raise argparse.ArgumentTypeError(f"--latency needs a finite number >= 0; got {text!r}")
    return int(latency) if latency.is_integer() else latency


def main(argv=None):
    ap = argparse.ArgumentParser(description="Print a pipeline schedule and its simulated bubble.")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--n_microbatches", type=int, default=8)
    ap.add_argument("--pp_virtual", type=int, default=2)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--costs", type=costs_arg, default=(1, 1, 1), help="F:B:W per chunk (default 1:1:1)")
    ap.add_argument("--latency", type=latency_arg, default=0, help="delay of each message between ranks (default 0)")
    a = ap.parse_args(argv)
    v = a.pp_virtual if a.schedule == "interleaved" else 2 if a.schedule in V_SHAPED else 1
    sim = simulate(make_schedule(a.schedule, a.pp, a.n_microbatches, v), a.pp, v, *a.costs, latency=a.latency)
    if all(isinstance(c, int) for c in a.costs + (a.latency,)):
        print(render(sim, v))
    print(f"idle fraction {sim['idle_share'][0]:.3f} (theory, F = B = W: "
          f"{theory_idle_fraction(a.schedule, a.pp, a.n_microbatches, v):.3f}), per rank "
          + " ".join(f"{x:.3f}" for x in sim["idle_share"]) + f", peak in flight per rank {sim['peak_in_flight']}")


if __name__ == "__main__":
    main()
