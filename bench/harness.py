"""
bench/harness.py: run competing commands side by side and write a markdown results table.

    python bench/harness.py --name single --repeats 3 --warmup 3 \
        --run "ours=python train_single.py --max_steps 20 --out_dir {out}" \
        --run "nanoGPT=python bench/peer_nanogpt.py --max_steps 20 --out_dir {out}"

Each --run is LABEL=COMMAND; `{out}` becomes a fresh output directory. Every command must write
{out}/metrics.jsonl in the nanoscale format (docs/observability.md): peers are wrapped to do so. The runs are
executed alternately (A B A B ...) so slow drifts of a shared machine hit all of them alike; a run's
throughput is the median tokens_per_s over its steps after --warmup, and the table reports the median over
repeats and the ratio to the first run (the baseline) in two ways: the ratio of the two medians, and the
median (and range) of the per-round ratios, each round's run divided by the baseline run just before it. On a
machine whose speed drifts between rounds the paired ratio is the steadier of the two. The table goes to
bench/results/NAME.md, and the ratios as a bar chart to bench/results/NAME.png (bench/charts.py; skipped with a note
when matplotlib is missing: bench.sh installs it).

Several comparisons can share one table (bench/sweeps/5d.sh): each --baseline LABEL starts a group, and the runs
after it, up to the next baseline, are compared with it instead of with the first run; --target LABEL=R adds a
column saying whether that run's median paired ratio reaches R.
"""
import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from common.metrics import read_metrics  # noqa: E402  (the repo root is not on the path when run as a script)


def machine_description():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = f"{names[0]} ({len(names)} logical cores)"
    except OSError:
        pass
    try:
        import torch
        if torch.cuda.is_available():
            cpu = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}; host {cpu}"
        version = torch.__version__
    except ImportError:
        version = "?"
    return f"{cpu}; torch {version}; python {platform.python_version()}"


def run_once(label, command, out_dir, warmup, timeout):
    shutil.rmtree(out_dir, ignore_errors=True)      # the bench's own scratch: an earlier sweep's run would be refused
    os.makedirs(out_dir, exist_ok=True)
    cmd = command.replace("{out}", out_dir)
    t0 = time.time()
    proc = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"bench: {label} failed (exit {proc.returncode}):\n$ {cmd}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    rows = read_metrics(out_dir)[warmup:]
    if not rows:
        sys.exit(f"bench: {label} wrote no steps after the {warmup} warm-up steps ({out_dir})")
    med = lambda key: statistics.median(r[key] for r in rows) if all(r.get(key) is not None for r in rows) else None
    return dict(tokens_per_s=med("tokens_per_s"), mfu=med("mfu"), peak_mem_bytes=max(r["peak_mem_bytes"] for r in rows),
                comm_bytes=med("comm_bytes"), wall_s=time.time() - t0)


def fmt(value, kind):
    if value is None:
        return "n/a"
    if kind == "mfu":
        return f"{100 * value:.1f}%"
    if kind == "bytes":
        return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 2**10:.1f} KiB" if value else "0"
    return f"{value:,.0f}"


def group_baselines(labels, baselines):
    """{label: the label it is compared with}: the nearest --baseline at or before it, else the first run."""
    unknown = set(baselines) - set(labels)
    if unknown:
        sys.exit(f"bench: --baseline names no run: {', '.join(sorted(unknown))}")
    out, current = {}, labels[0]
    for label in labels:
        current = label if label in baselines else current
        out[label] = current
    return out


def target_verdict(ratio, target):
    if target is None:
        return ""
    return f">= {target:.2f}: met" if ratio >= target else f">= {target:.2f}: **below** ({ratio:.2f})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="results go to bench/results/NAME.md")
    p.add_argument("--title", default=None, help="heading of the table")
    p.add_argument("--run", action="append", required=True, help="LABEL=COMMAND, {out} = output dir")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians over them")
    p.add_argument("--warmup", type=int, default=3, help="steps ignored at the start of every run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--note", default="", help="a line printed under the table")
    p.add_argument("--baseline", action="append", default=[], help="LABEL: compare the runs after it with it")
    p.add_argument("--target", action="append", default=[], help="LABEL=R: the paired ratio LABEL should reach")
    a = p.parse_args(argv)
    runs = [r.split("=", 1) for r in a.run]
    baseline_of = group_baselines([label for label, _ in runs], a.baseline)
    targets = {label: float(r) for label, r in (t.rsplit("=", 1) for t in a.target)}
    results = {label: [] for label, _ in runs}
    for rep in range(a.repeats):
        for label, command in runs:
            out = os.path.join(ROOT, "bench", "runs", a.name, f"{label.replace(' ', '_')}_{rep}")
            res = run_once(label, command, out, a.warmup, a.timeout)
            results[label].append(res)
            print(f"bench {a.name}: round {rep + 1}/{a.repeats} {label}: {res['tokens_per_s']:,.0f} tok/s", flush=True)

    header = ["run", "tokens/s", "ratio vs baseline" if a.baseline else "ratio vs first", "paired ratio (range)"]
    header += ["target"] if targets else []
    header += ["MFU", "peak memory", "comm bytes/step", "command"]
    chart = []                                         # (label, baseline, median, lo, hi) of the paired ratios
    lines = [f"### {a.title or a.name}", "",
             f"Machine: {machine_description()}. {a.repeats} alternating rounds, median of steps after "
             f"{a.warmup} warm-up steps, then median over rounds.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, command in runs:
        rs = results[label]
        base_rounds = [r["tokens_per_s"] for r in results[baseline_of[label]]]
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        mfus = [r["mfu"] for r in rs if r["mfu"] is not None]
        mfu = statistics.median(mfus) if mfus else None
        paired = [r["tokens_per_s"] / b for r, b in zip(rs, base_rounds)]
        chart.append((label, baseline_of[label], statistics.median(paired), min(paired), max(paired)))
        cells = [label, fmt(tps, 'n'), f"{tps / statistics.median(base_rounds):.2f}",
                 f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})"]
        if targets:
            cells.append(target_verdict(statistics.median(paired), targets.get(label)))
        cells += [fmt(mfu, 'mfu'), fmt(max(r['peak_mem_bytes'] for r in rs), 'bytes'),
                  fmt(statistics.median(r['comm_bytes'] for r in rs), 'bytes'), f"`{command.replace('{out}', 'OUT')}`"]
        lines.append("| " + " | ".join(cells) + " |")
    if a.note:
        lines += ["", a.note]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"{a.name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"bench: wrote {os.path.relpath(path, ROOT)}")
    write_chart(chart, os.path.join(HERE, "results", f"{a.name}.png"), a.title or a.name)


def write_chart(entries, path, title):
    """The table's ratios as bench/results/NAME.png, if matplotlib is there (not a training dependency)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench: matplotlib is not installed, no chart (pip install matplotlib)")
        return None
    from charts import ratio_chart
    ratio_chart(entries, path, title)
    print(f"bench: wrote {os.path.relpath(path, ROOT)}")
    return path


if __name__ == "__main__":
    main()
