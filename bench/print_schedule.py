"""
bench/print_schedule.py: print a pipeline schedule as an ASCII timeline (simulated, F = B = W = 1), with its
idle share next to the textbook formula and the peak in-flight micro-batch-chunks per rank.

    python bench/print_schedule.py --pp 4 --n_microbatches 8 --schedule zb1
    python bench/print_schedule.py --pp 2 --n_microbatches 4 --schedule interleaved --pp_virtual 2
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.schedules import SCHEDULES, V_SHAPED, render, simulate, theory_idle_fraction   # noqa: E402
from train_pp import make_schedule                                                          # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description="Print a pipeline schedule and its simulated bubble.")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--n_microbatches", type=int, default=8)
    ap.add_argument("--pp_virtual", type=int, default=2)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    a = ap.parse_args(argv)
    v = a.pp_virtual if a.schedule == "interleaved" else 2 if a.schedule in V_SHAPED else 1
    sim = simulate(make_schedule(a.schedule, a.pp, a.n_microbatches, v), a.pp, v)
    print(render(sim, v))
    print(f"idle fraction {sim['idle'][0] / sim['makespan']:.3f} (theory "
          f"{theory_idle_fraction(a.schedule, a.pp, a.n_microbatches, v):.3f}), "
          f"peak in flight per rank {sim['peak_in_flight']}")


if __name__ == "__main__":
    main()
