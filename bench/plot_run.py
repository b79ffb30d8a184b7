"""
bench/plot_run.py: the curves of one or more runs from their metrics.jsonl, overlaid: training loss, val loss,
tokens/s and MFU against the step. The parity picture: a layout's curve on top of train_single's.

    python train_single.py --max_steps 200 --out_dir out/single
    torchrun --nproc_per_node=4 train_5d.py --tp 2 --pp 2 --max_steps 200 --out_dir out/5d
    python bench/plot_run.py out/single out/5d                # -> out/single/curves.png (or --out PNG)

Rows are read as metrics.read_metrics does (a step logged twice, around a resume, counts once: the later row);
val loss comes from the rows log_eval writes ({"step", "val_loss"}). A quantity a run did not record (MFU of a peer
without a known peak: null) is left out of that panel. --smooth N draws the running mean over N steps of the
noisy panels (loss, tokens/s, MFU); the val loss is drawn as measured.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common.metrics import read_metrics  # noqa: E402

PANELS = (("loss", "training loss"), ("val_loss", "val loss"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU (%)"))


def val_losses(out_dir):
    """[(step, val loss)] from metrics.jsonl's evaluation rows, the later row winning for a repeated step."""
    vals = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "val_loss" in row and row["val_loss"] is not None:
                vals[row["step"]] = row["val_loss"]
    return sorted(vals.items())


def run_curves(out_dir):
    """{panel key: ([steps], [values])} of one run: what plot_run draws for it."""
    rows = read_metrics(out_dir)
    curves = {}
    for key in ("loss", "tokens_per_s", "mfu"):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        scale = 100.0 if key == "mfu" else 1.0
        curves[key] = ([s for s, _ in points], [v * scale for _, v in points])
    vals = val_losses(out_dir)
    curves["val_loss"] = ([s for s, _ in vals], [v for _, v in vals])
    return curves


def running_mean(values, n):
    """Mean of the last n values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def plot(runs, path, smooth=1):
    """runs: {label: run_curves(...)}; one 2x2 figure, every run in its colour in every panel."""
    from charts import pyplot, save_figure
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for label, curves in runs.items():
            steps, values = curves[key]
            if not steps:
                continue
            if key != "val_loss" and smooth > 1:
                values = running_mean(values, smooth)
            style = dict(marker="o", markersize=3) if key == "val_loss" else dict(linewidth=1)
            ax.plot(steps, values, label=label, **style)
        ax.set_title(title + (f" (running mean of {smooth})" if smooth > 1 and key != "val_loss" else ""))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    return save_figure(fig, path)


def labels_for(out_dirs):
    """Each run's name: its directory's last component, or more of its path where those collide."""
    names = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    if len(set(names)) == len(names):
        return names
    return [os.path.normpath(d) for d in out_dirs]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dirs", nargs="+", help="run directories, each holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG to write (default: FIRST_OUT_DIR/curves.png)")
    p.add_argument("--labels", nargs="+", default=None, help="a legend name per run (default: directory names)")
    p.add_argument("--smooth", type=int, default=1, help="running mean over N steps for loss, tokens/s, MFU")
    a = p.parse_args(argv)
    labels = a.labels or labels_for(a.out_dirs)
    if len(labels) != len(a.out_dirs):
        p.error(f"--labels names {len(labels)} runs, {len(a.out_dirs)} were given")
    if a.smooth < 1:
        p.error("--smooth must be >= 1")
    for d in a.out_dirs:
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            p.error(f"{d} holds no metrics.jsonl")
    runs = {label: run_curves(d) for label, d in zip(labels, a.out_dirs)}
    out = plot(runs, a.out or os.path.join(a.out_dirs[0], "curves.png"), a.smooth)
    for label, curves in runs.items():
        steps, vals = curves["val_loss"]
        last = f", last val loss {vals[-1]:.4f} at step {steps[-1]}" if vals else ""
        print(f"{label}: {len(curves['loss'][0])} steps{last}")
    print(f"plot_run: wrote {out}")
    return out


if __name__ == "__main__":
    main()
