"""
bench/bubble_chart.py: the pipeline bubble by schedule: the textbook formula, the simulator, and real CPU runs.

    python bench/bubble_chart.py          # -> bench/results/bubble.md and bubble.png (./bench.sh bubble runs it)

For afab, 1f1b, interleaved (v = 2), zb1, zbv and dualpipev at each (p, m) of CONFIGS, the idle share of a step:
    formula        pipeline/schedules.theory_idle_fraction: (p-1)/(m+p-1) afab and 1f1b, (p-1)/(v*m+p-1)
                   interleaved, (p-1)/(3m+p-1) zb1, (p-1)/(6m+p-1) zbv and dualpipev (chunk units)
    simulated      pipeline/schedules.simulate with F = B = W, idle / makespan averaged over the ranks
    run's costs    the simulator again with the median F, B, W durations of the measured run (messages still free)
    measured       train_pp.py on CPU with --profile (p = 2 only: 2 ranks on this machine's 2 cores): each rank's
                   idle share of each recorded step, from the runner's action ranges in the traces
                   (bench/timeline.py's pipeline_actions; the step from the first action to the last, over all
                   ranks); and train_pp's own figure (runner: 1 - busy/elapsed per rank, median over steps)
The gap between "run's costs" and "measured" is what the simulator leaves out: message latency and the Python
between actions. Timings, unlike counted bytes, move with the machine's load: the table names the machine.
bubble_slots compares where the idle falls (which rank waits before which action) with the simulator's;
posted_with_a_send says where the plan lets it fall one action earlier.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from pipeline.schedules import (Action, Exchange, comm_plan, placement_of, recvs_of, simulate,  # noqa: E402
                                stage_of, theory_idle_fraction)
from train_pp import make_schedule                                                 # noqa: E402

SCHEDULES = ("afab", "1f1b", "interleaved", "zb1", "zbv", "dualpipev")
CONFIGS = ((2, 4), (2, 8), (4, 8), (4, 16))        # (p, m)
CORES = os.cpu_count() or 1
MODEL = dict(n_layer=4, n_head=4, n_embd=256, block_size=128, micro_batch_size=2)
RUN = dict(max_steps=5, profile=2, warmup_steps=1, eval_interval=0, sample_tokens=0, log_interval=100,
           device="cpu", dtype="float32")            # steps 2 and 3 recorded (profiling.py's schedule)


def chunks_of(name):
    """Model chunks per rank: 2 for interleaved (v = 2 here) and the V-shaped schedules."""
    return 2 if name in ("interleaved", "zbv", "dualpipev") else 1


def train_argv(name, p, m, out_dir, model=MODEL):
    args = {**model, **RUN, "pp": p, "pp_schedule": name, "pp_virtual": chunks_of(name),
            "global_batch_size": m * model["micro_batch_size"], "out_dir": out_dir}
    return [f"--{k}={v}" for k, v in args.items()]


# ----------------------------------------------------------------------------------------------------------
# idle from a timeline: the simulator's, or a measured step's

def idle_share(timeline):
    """Mean over ranks of idle / step, timeline = {rank: [(start, end, ...)]} of one step."""
    start = min(t[0][0] for t in timeline.values())
    span = max(t[-1][1] for t in timeline.values()) - start
    return statistics.mean(1 - sum(e - s for s, e, *_ in t) / span for t in timeline.values())


def simulated(name, p, m, f=1.0, b=1.0, w=1.0):
    """(idle share, {rank: [(start, end, Action)]}) of the simulator with costs F, B, W."""
    sim = simulate(make_schedule(name, p, m, chunks_of(name)), p, chunks_of(name), f, b, w)
    return idle_share(dict(enumerate(sim["timeline"]))), dict(enumerate(sim["timeline"]))


def action_costs(steps):
    """Median seconds of F, B and W actions over a measured run's ranks and steps (W 0 when none)."""
    durations = {k: [e - s for tl in steps for acts in tl.values() for s, e, kind, *_ in acts if kind == k]
                 for k in "FBW"}
    return {k: statistics.median(v) if v else 0.0 for k, v in durations.items()}


def measured_steps(out_dir):
    """[{rank: [(start, end, kind, mb, chunk)]} per recorded step] from a run's traces."""
    from timeline import pipeline_actions
    actions = pipeline_actions(out_dir)
    return [{r: actions[r][i] for r in actions} for i in range(min(len(s) for s in actions.values()))]


def bubble_slots(timeline, threshold):
    """{(rank, slot): gap} of gaps longer than threshold: slot i = before the rank's i-th action of the step,
    len(actions) = after its last one (until the step's last action anywhere ends)."""
    start = min(t[0][0] for t in timeline.values())
    end = max(t[-1][1] for t in timeline.values())
    out = {}
    for r, acts in timeline.items():
        ends = [start] + [a[1] for a in acts]
        starts = [a[0] for a in acts] + [end]
        out.update({(r, i): s - e for i, (s, e) in enumerate(zip(starts, ends)) if s - e > threshold})
    return out


def early_starts(timeline, name, p, tolerance):
    """[(rank, action, seconds early)] of a measured step's actions that start before the action whose output they
    receive from another rank has ended: none, when the traces share a clock and the runner keeps the schedule's
    messages."""
    v, place = chunks_of(name), placement_of(name)
    ends = {(kind, mb, stage_of(r, chunk, p, place)): end
            for r, acts in timeline.items() for _, end, kind, mb, chunk in acts}
    out = []
    for r, acts in timeline.items():
        for start, _, kind, mb, chunk in acts:
            for src, (what, _, stage) in recvs_of(Action(kind, mb, chunk), r, p, v, place):
                producer = ("F", mb, stage - 1) if what == "act" else ("B", mb, stage + 1)
                if src != r and start < ends[producer] - tolerance:
                    out.append((r, Action(kind, mb, chunk), ends[producer] - start))
    return out


def posted_with_a_send(name, p, m):
    """{(rank, i)}: the rank's i-th action receives a message whose receive the NCCL-safe plan (comm_plan) launches
    in one batch with a send, so only once the action producing that send has ended. Both messages end in the same
    simulated round; where two ranks send each other one, one of them must post its receive after its send, or
    NCCL's in-order groups would deadlock. gloo moves a message only once its receive is posted: the rank may wait
    for the transfer before that action, the idle the simulator puts after it."""
    v, place = chunks_of(name), placement_of(name)
    out = set()
    for r, plan in enumerate(comm_plan(make_schedule(name, p, m, v), p, v)):
        with_send = {msg for x in plan if isinstance(x, Exchange) and any(k == "send" for k, _, _ in x.ops)
                     for k, _, msg in x.ops if k == "recv"}
        actions = [a for a in plan if not isinstance(a, Exchange)]
        out |= {(r, i) for i, a in enumerate(actions)
                if any(msg in with_send for _, msg in recvs_of(a, r, p, v, place))}
    return out


# ----------------------------------------------------------------------------------------------------------
# the runs (one torchrun launch, every rank running every schedule in turn), the table and the chart

def measure(configs, out_root, data_dir):
    """On a rank of the launch: train_pp for each (schedule, p, m); rank 0 returns the runner's idle per rank."""
    import train_pp
    rows = []
    for name, p, m in configs:
        result = train_pp.main(train_argv(name, p, m, os.path.join(out_root, f"{name}_p{p}_m{m}")) +
                               [f"--data_dir={data_dir}"])
        rows.append(dict(name=name, p=p, m=m, runner_idle=result["idle"]))
    return rows


def launch(configs, p, out_root, data_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p}", __file__,
           "--measure", out_root, "--data_dir", data_dir,
           "--runs", ",".join(f"{name}:{m}" for name, _, m in configs)]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(out_root, "runner_idle.json")) as f:
        return json.load(f)


def row_for(name, p, m, out_dir=None, runner_idle=None):
    """The four idle shares (None where not measured) of one schedule at (p, m)."""
    row = dict(name=name, p=p, m=m, formula=theory_idle_fraction(name, p, m, chunks_of(name)),
               simulated=simulated(name, p, m)[0], run_costs=None, measured=None, runner=None, costs=None)
    if out_dir is not None:
        steps = measured_steps(out_dir)
        costs = action_costs(steps)
        w = costs["W"] if name in ("zb1", "zbv", "dualpipev") else 0.0
        row.update(costs=costs, run_costs=simulated(name, p, m, costs["F"], costs["B"], w)[0],
                   measured=statistics.mean(idle_share(tl) for tl in steps),
                   runner=statistics.mean(runner_idle) if runner_idle else None)
    return row


def cell(x):
    return "n/a" if x is None else f"{x:.3f}"


def write_table(rows, path, machine, load=""):
    lines = ["### Pipeline bubble by schedule: formula, simulator and measured (train_pp on CPU)", "",
             f"Idle share of a step, mean over ranks. Measured at p = 2 only ({CORES} cores here): {machine}{load}. "
             f"Model L{MODEL['n_layer']} H{MODEL['n_head']} h{MODEL['n_embd']} T{MODEL['block_size']}, micro-batch "
             f"{MODEL['micro_batch_size']}, fp32, 2 profiled steps. Command: `python bench/bubble_chart.py`. "
             "formula = simulated F=B=W: the simulator reproduces the textbook; simulated with the run's median "
             "F/B/W: what the cost ratios change; measured above that: message latency, the Python between actions "
             "and other processes on the cores, which the simulator leaves out.", "",
             "| schedule | p | m | formula | simulated F=B=W | simulated, run's F/B/W | measured (traces) | "
             "measured (runner) | run's F / B / W ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        costs = "n/a" if r["costs"] is None else " / ".join(f"{1e3 * r['costs'][k]:.1f}" for k in "FBW")
        lines.append(f"| {r['name']} | {r['p']} | {r['m']} | {cell(r['formula'])} | {cell(r['simulated'])} | "
                     f"{cell(r['run_costs'])} | {cell(r['measured'])} | {cell(r['runner'])} | {costs} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def write_chart(rows, path):
    """bubble.png: a panel per (p, m), per schedule a bar for each estimate of the idle share."""
    from charts import pyplot, save_figure
    plt = pyplot()
    configs = list(dict.fromkeys((r["p"], r["m"]) for r in rows))
    kinds = (("formula", "formula", "#4C72B0"), ("simulated", "simulated F=B=W", "#8172B2"),
             ("run_costs", "simulated, run's costs", "#55A868"), ("measured", "measured (traces)", "#C44E52"))
    fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 4), sharey=True, squeeze=False)
    for ax, (p, m) in zip(axes[0], configs):
        mine = [r for r in rows if (r["p"], r["m"]) == (p, m)]
        for k, (key, label, colour) in enumerate(kinds):
            xs = [i + (k - 1.5) * 0.2 for i, r in enumerate(mine) if r[key] is not None]
            ax.bar(xs, [r[key] for r in mine if r[key] is not None], 0.2, label=label, color=colour)
        ax.set_xticks(range(len(mine)), [r["name"] for r in mine], rotation=40, ha="right", fontsize=8)
        ax.set_title(f"p = {p}, m = {m}" + ("" if p <= CORES else f" (not run: {p} ranks > {CORES} cores)"),
                     fontsize=9)
    axes[0][0].set_ylabel("idle share of a step")
    axes[0][0].legend(fontsize=7)                 # the first panel has every kind of bar
    return save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data_dir", default=None, help="a prepared dataset (default: the default corpus)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for bubble.md and bubble.png")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)     # a rank of the launch: runs' folder
    ap.add_argument("--runs", default="", help=argparse.SUPPRESS)          # its schedule:m list
    a = ap.parse_args(argv)
    if a.measure:
        p = int(os.environ["WORLD_SIZE"])
        rows = measure([(run.split(":")[0], p, int(run.split(":")[1])) for run in a.runs.split(",")],
                       a.measure, a.data_dir)
        if os.environ["RANK"] == "0":
            with open(os.path.join(a.measure, "runner_idle.json"), "w") as f:
                json.dump(rows, f)
        from common.distributed import destroy
        destroy()
        return rows
    from harness import machine_description
    from memory_chart import default_corpus
    out_root = os.path.join(ROOT, "bench", "runs", "bubble")
    todo = [(name, p, m) for p, m in CONFIGS if p <= CORES for name in SCHEDULES]
    load = os.getloadavg()[0]
    runs = {}
    for p in sorted({p for _, p, _ in todo}):
        for r in launch([c for c in todo if c[1] == p], p, out_root, a.data_dir or default_corpus()):
            runs[r["name"], r["p"], r["m"]] = r["runner_idle"]
    rows = []
    for p, m in CONFIGS:
        for name in SCHEDULES:
            ran = (name, p, m) in runs
            rows.append(row_for(name, p, m, os.path.join(out_root, f"{name}_p{p}_m{m}") if ran else None,
                                runs.get((name, p, m))))
    os.makedirs(a.out, exist_ok=True)
    load = f"; load average {load:.1f} before the runs, {os.getloadavg()[0]:.1f} after"
    print(open(write_table(rows, os.path.join(a.out, "bubble.md"), machine_description(), load)).read())
    print(f"bubble_chart: wrote {write_chart(rows, os.path.join(a.out, 'bubble.png'))}")
    return rows


if __name__ == "__main__":
    main()
