"""
bench/timeline.py: one picture of a profiled run: ranks as rows, time as x, what each rank's training thread
was doing, coloured like the playbook's pipeline figures (compute, backward, optimizer, communication, waits
for data, idle).

    torchrun --nproc_per_node=2 train_pp.py --pp 2 --max_steps 6 --profile 2 --out_dir out/pp
    python bench/timeline.py out/pp                   # -> out/pp/timeline.png (from out/pp/trace_rank*.json)

Input: the Chrome traces that --profile writes (profiling.py), one per rank. Only the thread that ran the
recorded steps (the one holding the "ProfilerStep#N" ranges) is drawn; its outermost operators inside a step
become intervals of a kind:
    communication  every "comm:..." range (comm.py names each collective so), at any depth: a collective launched
                   from a backward hook still shows as communication; a blocking collective includes the time
                   it waits for the slowest rank
    wait           "comm:wait ..." ranges: the wait() for an async collective or p2p batch, where a pipeline
                   stage waits for its input (the bubble) and a ring attention step for the next K/V
    backward       autograd's "autograd::engine::evaluate_function: ..." nodes
    optimizer      "Optimizer.step#..." and "Optimizer.zero_grad#..."
    compute        every other operator (forward, loss, clipping, ...)
and the gaps between them are idle (Python, data loading, or waiting outside comm.py). Ranks share one clock:
each trace's times are offsets from its baseTimeNanoseconds, so the ranks of one machine line up
(across machines, as well as their clocks agree).
"""
import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.comm import PROFILE_PREFIX  # noqa: E402

COLOURS = {"compute": "#4C72B0", "backward": "#55A868", "optimizer": "#8172B2", "communication": "#DD8452",
           "wait": "#C44E52"}
TRACE_NAME = re.compile(r"trace_rank(\d+)\.json$")


def trace_paths(out_dir):
    """{rank: path} of OUT_DIR/trace_rank{r}.json."""
    paths = {}
    for path in glob.glob(os.path.join(out_dir, "trace_rank*.json")):
        m = TRACE_NAME.search(path)
        if m:
            paths[int(m.group(1))] = path
    if not paths:
        raise FileNotFoundError(f"no trace_rank*.json in {out_dir} (run a train script with --profile N first)")
    return dict(sorted(paths.items()))


# comm.label's ranges (pipeline actions, ring steps) name a phase, not a kind of work: what runs inside
# them (compute, backward, communication) is drawn instead
PHASES = ("pp:", "cp:")


def kind_of(name):
    if name.startswith(PROFILE_PREFIX + "wait "):
        return "wait"
    if name.startswith(PROFILE_PREFIX):
        return "communication"
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    return "compute"


def merge(intervals):
    """Sorted, non-overlapping union of (start, end) pairs."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def subtract(intervals, holes):
    """Parts of the (sorted, disjoint) intervals outside the (sorted, disjoint) holes."""
    out = []
    for start, end in intervals:
        for h_start, h_end in holes:
            if h_end <= start or h_start >= end:
                continue
            if h_start > start:
                out.append((start, h_start))
            start = max(start, h_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def step_events(trace):
    """(the recorded steps' (start, end), the complete events of the thread that ran them), times in us on the
    machine's clock."""
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("the trace holds no ProfilerStep# range (not written by --profile?)")
    tid = steps[0]["tid"]
    thread = [(base + e["ts"], base + e["ts"] + e["dur"], e["name"]) for e in events
              if e["tid"] == tid and e.get("cat") in ("cpu_op", "user_annotation")
              and not e["name"].startswith(("ProfilerStep#",) + PHASES)]
    return [(base + e["ts"], base + e["ts"] + e["dur"]) for e in steps], thread


def rank_intervals(trace):
    """[(start_us, end_us, kind)] of one rank, disjoint and sorted: communication and waits over the rest."""
    steps, events = step_events(trace)
    events.sort(key=lambda e: (e[0], -e[1]))
    outermost, end_of_open = [], float("-inf")
    for start, end, name in events:
        if start >= end_of_open:                 # not inside the previous outermost event
            outermost.append((start, end, name))
            end_of_open = end
    comm = merge((s, e) for s, e, name in events if name.startswith(PROFILE_PREFIX))
    waits = merge((s, e) for s, e, name in events if kind_of(name) == "wait")
    out = [(s, e, "wait") for s, e in waits]
    out += [(s, e, "communication") for s, e in subtract(comm, waits)]
    for kind in ("compute", "backward", "optimizer"):
        mine = merge((s, e) for s, e, name in outermost if kind_of(name) == kind)
        out += [(s, e, kind) for s, e in subtract(mine, comm)]
    return sorted(out), (min(s for s, _ in steps), max(e for _, e in steps))


def timeline(out_dir):
    """{rank: [(start_s, end_s, kind)]} with t = 0 at the earliest recorded step start over all ranks, and the
    recorded window {rank: (start_s, end_s)}: the data bench/timeline.py draws."""
    raw = {}
    for rank, path in trace_paths(out_dir).items():
        with open(path) as f:
            raw[rank] = rank_intervals(json.load(f))
    t0 = min(window[0] for _, window in raw.values())
    rows = {r: [((s - t0) / 1e6, (e - t0) / 1e6, k) for s, e, k in iv] for r, (iv, _) in raw.items()}
    windows = {r: ((w[0] - t0) / 1e6, (w[1] - t0) / 1e6) for r, (_, w) in raw.items()}
    return rows, windows


ACTION_NAME = re.compile(r"^pp:([FBW]) mb(\d+) chunk(\d+)$")


def rank_actions(trace):
    """One rank's pipeline actions per recorded step: [[(start_us, end_us, kind, mb, chunk)]] in time order, on the
    machine's clock."""
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    steps, actions = [], []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start, end = base + e["ts"], base + e["ts"] + e["dur"]
        if e["name"].startswith("ProfilerStep#"):
            steps.append((start, end))
        match = ACTION_NAME.match(e["name"])
        if match:
            kind, mb, chunk = match.groups()
            actions.append((start, end, kind, int(mb), int(chunk)))
    actions.sort()
    return [[a for a in actions if start <= a[0] < end] for start, end in sorted(steps)]


def pipeline_actions(out_dir):
    """{rank: [[(start_s, end_s, kind, mb, chunk), ...] for each recorded step]}: the pipeline runner's actions
    (its "pp:F mb3 chunk0" ranges), on one clock for all ranks (t = 0: the earliest action)."""
    raw = {}
    for rank, path in trace_paths(out_dir).items():
        with open(path) as f:
            raw[rank] = rank_actions(json.load(f))
    t0 = min(step[0][0] for steps in raw.values() for step in steps if step)
    return {r: [[((s - t0) / 1e6, (e - t0) / 1e6, *rest) for s, e, *rest in step] for step in steps]
            for r, steps in raw.items()}


def busy_fractions(rows, windows):
    """{rank: {kind: fraction of the rank's recorded window}} (the rest is idle)."""
    out = {}
    for rank, intervals in rows.items():
        span = windows[rank][1] - windows[rank][0]
        out[rank] = {k: sum(e - s for s, e, kind in intervals if kind == k) / span for k in COLOURS}
    return out


def plot(rows, windows, path, title=""):
    from charts import pyplot, save_figure
    from matplotlib.patches import Patch
    plt = pyplot()

    ranks = sorted(rows)
    fig, ax = plt.subplots(figsize=(14, 1.4 + 0.6 * len(ranks)))
    for y, rank in enumerate(ranks):
        start, end = windows[rank]
        ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), facecolors="#EEEEEE")     # idle background
        for kind, colour in COLOURS.items():
            bars = [(s, e - s) for s, e, k in rows[rank] if k == kind]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colour, linewidth=0)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()                            # rank 0 on top, as in the playbook's figures
    ax.set_xlabel("time (s)")
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()] + [Patch(color="#EEEEEE", label="idle")]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles), frameon=False)
    ax.set_title(title, loc="left")
    save_figure(fig, path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="a run's out_dir holding trace_rank*.json (--profile N)")
    p.add_argument("--out", default=None, help="PNG to write (default OUT_DIR/timeline.png)")
    a = p.parse_args(argv)
    rows, windows = timeline(a.out_dir)
    out = a.out or os.path.join(a.out_dir, "timeline.png")
    plot(rows, windows, out, title=f"{os.path.basename(os.path.normpath(a.out_dir))}: {len(rows)} ranks")
    for rank, fractions in busy_fractions(rows, windows).items():
        idle = 1 - sum(fractions.values())
        print(f"rank {rank}: " + "  ".join(f"{k} {100 * v:.0f}%" for k, v in fractions.items()) +
              f"  idle {100 * idle:.0f}%")
    print(f"timeline: wrote {out}")
    return out


if __name__ == "__main__":
    main()
