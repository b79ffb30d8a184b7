"""
bench/mixture_share.py: the share of each source in a --data_mix run's global batches, step by step, against its
weight (common/data_mix.py).

    python bench/mixture_share.py                                    # GPT-3's five weights, 32 sequences a step
    python bench/mixture_share.py --weights 0.6,0.3,0.1 --global_batch_size 8 --steps 500
    python bench/mixture_share.py --metrics out --weights 0.6,0.3,0.1 --block_size 256    # a run's own counts

Without --metrics the draws are the loader's own (data_mix.draw_sources on each step's generator: a function of
(seed, step) alone, so no corpus is read). A step's share scatters around the weight with standard error
sqrt(w (1 - w) / global_batch_size); the running share over all steps so far closes in on it. The chart
(bench/results/mixture_share.png) draws both with the weight; the table (mixture_share.md) the final running share
with its 3-standard-error band.
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from common.data_mix import cumulative_weights, draw_sources, mixture_rng  # noqa: E402

GPT3 = dict(common_crawl=0.60, webtext2=0.22, books1=0.08, books2=0.08, wikipedia=0.03)   # Brown et al. table 2.2


def drawn_counts(weights, seed, global_batch_size, steps):
    """[steps, sources] sequences per source in each step's global batch, as MixtureLoader draws them."""
    cum = cumulative_weights(weights)
    return np.stack([np.bincount(draw_sources(mixture_rng(seed, s, "train"), cum, global_batch_size),
                                 minlength=len(weights)) for s in range(steps)])


def run_counts(out_dir, block_size):
    """(names, [steps, sources] sequences per source per step) from a run's metrics.jsonl (cumulative tokens there,
    block_size per sequence)."""
    rows = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "tokens_by_source" in row:
                rows[row["step"]] = row["tokens_by_source"]
    if not rows:
        sys.exit(f"error: {out_dir}/metrics.jsonl has no tokens_by_source (not a --data_mix run)")
    names = list(rows[min(rows)])
    total = np.array([[rows[s][n] for n in names] for s in sorted(rows)], dtype=np.float64)
    return names, np.diff(np.vstack([np.zeros(len(names)), total]), axis=0) / block_size


def write_outputs(names, weights, counts, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    per_step = counts / counts.sum(axis=1, keepdims=True)
    running = counts.cumsum(axis=0) / counts.sum(axis=1).cumsum()[:, None]
    weights = np.asarray(weights) / sum(weights)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = np.arange(len(counts))
    for k, name in enumerate(names):
        color = f"C{k}"
        ax.plot(steps, per_step[:, k], color=color, alpha=0.25, lw=0.8)
        ax.plot(steps, running[:, k], color=color, lw=2, label=f"{name} (weight {weights[k]:.2f})")
        ax.axhline(weights[k], color=color, ls="--", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("share of the global batch's sequences")
    ax.set_title(title + ": per step (faint), running (bold), weight (dashed)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    fig.savefig(os.path.join(out, "mixture_share.png"), dpi=90)
    n = counts.sum()
    lines = [f"# Sampled share vs weight ({title})", "", f"{int(n):,} sequences over {len(counts)} steps.", "",
             "| source | weight | sampled share | 3 standard errors | within |", "|---|---|---|---|---|"]
    for k, name in enumerate(names):
        band = 3 * (weights[k] * (1 - weights[k]) / n) ** 0.5
        share = running[-1, k]
        lines.append(f"| {name} | {weights[k]:.4f} | {share:.4f} | {band:.4f} | "
                     f"{'yes' if abs(share - weights[k]) <= band else 'no'} |")
    with open(os.path.join(out, "mixture_share.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default=",".join(str(w) for w in GPT3.values()),
                   help="comma-separated weights (default: GPT-3's mixture)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--global_batch_size", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--metrics", default=None, help="a --data_mix run's out_dir: its counts instead of fresh draws "
                                                   "(give its weights in --data_mix's order)")
    p.add_argument("--block_size", type=int, default=256, help="with --metrics: the run's --block_size")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    weights = [float(w) for w in a.weights.split(",")]
    if a.metrics:
        names, counts = run_counts(a.metrics, a.block_size)
        if len(names) != len(weights):
            sys.exit(f"error: {len(names)} sources in the run, {len(weights)} weights given")
        title = f"run {a.metrics}"
    else:
        names = list(GPT3) if len(weights) == len(GPT3) else [f"source {k}" for k in range(len(weights))]
        counts = drawn_counts(weights, a.seed, a.global_batch_size, a.steps)
        title = f"seed {a.seed}, {a.global_batch_size} sequences a step"
    write_outputs(names, weights, counts, a.out, title)


if __name__ == "__main__":
    main()
