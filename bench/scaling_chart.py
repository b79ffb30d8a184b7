"""
bench/scaling_chart.py: tokens/s against the number of ranks, read from bench's own result tables.

    python bench/scaling_chart.py                           # from bench/results/ddp_scaling.md (./bench.sh ddp)
    python bench/scaling_chart.py bench/results/ddp_scaling.md "bench/results/5d.md:5d all 1,5d dp2"
                                                            # both tables (./bench.sh scaling)

Each argument is a table bench/harness.py wrote, optionally with the runs to take from it (default: all of them);
a run's rank count is its command's --nproc_per_node (1 without torchrun). Writes bench/results/scaling.md (the
points, speed-up over the table's 1-rank run and efficiency = speed-up / ranks) and scaling.png (measured lines
against ideal linear scaling). No number is made here: every point is a median from the table named beside it.
On a 2-core machine (bench/results name theirs) a run can have at most 2 ranks of 1 thread each: more would share
cores, so scaling beyond the machine's cores is not measured, and the chart says so.
"""
import argparse
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def read_table(path, wanted=None):
    """(title, cores of the machine it names, [(label, ranks, tokens/s)]) of a harness table, in table order;
    wanted: the labels to keep."""
    title, cores, points = os.path.basename(path), None, []
    with open(path) as f:
        for line in f:
            if line.startswith("### "):
                title = line[4:].strip()
            machine = re.search(r"^Machine: .*\((\d+) logical cores\)", line)
            cores = int(machine.group(1)) if machine else cores
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("| ") or len(cells) < 3 or not cells[1].replace(",", "").isdigit():
                continue                          # the header, the separator and the idle tables below some
            nproc = re.search(r"--nproc_per_node[ =](\d+)", cells[-1])
            if wanted is None or cells[0] in wanted:
                points.append((cells[0], int(nproc.group(1)) if nproc else 1, float(cells[1].replace(",", ""))))
    if not points or min(r for _, r, _ in points) != 1:
        raise SystemExit(f"scaling_chart: {path} has no 1-rank run among {wanted or 'its runs'}")
    return title, cores or os.cpu_count(), points


def series(spec):
    """'PATH' or 'PATH:label,label' -> (source, title, cores, points)."""
    path, _, labels = spec.partition(":")
    return (os.path.basename(path), *read_table(path, labels.split(",") if labels else None))


def fewest_cores(all_series):
    return min(cores for _, _, cores, _ in all_series)


def write_table(all_series, path, command):
    cores = fewest_cores(all_series)
    lines = ["### Scaling: tokens/s by number of ranks", "",
             f"Read from the tables named (their machine, rounds and commands, and whether the per-rank or the global "
             f"batch is held fixed, are there) by `{command}`. Their machine has {cores} cores: runs beyond {cores} "
             "ranks of 1 thread would share cores, so scaling past them is not measured.", "",
             "| table | run | ranks | tokens/s | speed-up vs 1 rank | efficiency |", "|---|---|---|---|---|---|"]
    for source, _, _, points in all_series:
        one = next(t for _, r, t in points if r == 1)
        for label, ranks, tps in points:
            lines.append(f"| {source} | {label} | {ranks} | {tps:,.0f} | {tps / one:.2f} | {tps / one / ranks:.0%} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def write_chart(all_series, path):
    from charts import pyplot, save_figure
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    most = max(r for *_, points in all_series for _, r, _ in points)
    cores = fewest_cores(all_series)
    for source, title, _, points in all_series:
        one = next(t for _, r, t in points if r == 1)
        line, = ax.plot([r for _, r, _ in points], [t for _, _, t in points], marker="o", label=f"{source}: {title}")
        ax.plot([1, most], [one, one * most], linestyle="--", color=line.get_color(), alpha=0.5)
        for label, ranks, tps in points:
            ax.annotate(f"{label}: {tps / one / ranks:.0%}", (ranks, tps), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
    ax.set_xticks(range(1, most + 1))
    ax.set_xlabel(f"ranks (1 thread each; the machine has {cores} cores: beyond {cores} not measurable)")
    ax.set_ylabel("tokens/s (median over rounds)")
    ax.set_title("Scaling: measured (solid) vs ideal linear (dashed); labels: efficiency", fontsize=9)
    ax.legend(fontsize=6, loc="upper left")
    return save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="*", default=[os.path.join(HERE, "results", "ddp_scaling.md")],
                    help="harness tables, each PATH or PATH:run,run")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for scaling.md and scaling.png")
    a = ap.parse_args(argv)
    all_series = [series(spec) for spec in a.tables]
    os.makedirs(a.out, exist_ok=True)
    command = "python bench/scaling_chart.py " + " ".join(f'"{os.path.relpath(t, ROOT)}"' for t in a.tables)
    print(open(write_table(all_series, os.path.join(a.out, "scaling.md"), command)).read())
    print(f"scaling_chart: wrote {write_chart(all_series, os.path.join(a.out, 'scaling.png'))}")
    return all_series


if __name__ == "__main__":
    main()
