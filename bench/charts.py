"""
bench/charts.py: the PNG charts written beside bench's markdown tables (bench/harness.py). matplotlib is not a
training dependency: it is imported here, lazily, with the Agg backend (no display), and bench.sh installs it.
"""


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, works without a display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ratio_chart(entries, path, title):
    """A horizontal bar per run: its median paired tokens/s ratio vs its baseline, the bar's whisker the range
    over rounds, a line at 1.0 (= the baseline's speed). entries: [(label, baseline label, median, lo, hi)] in
    table order; each baseline group gets its own colour."""
    plt = pyplot()
    baselines = list(dict.fromkeys(base for _, base, _, _, _ in entries))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(entries)))
    for y, (label, base, median, lo, hi) in enumerate(entries):
        colour = colours[baselines.index(base) % len(colours)]
        ax.barh(y, median, color=colour, alpha=0.45 if label == base else 0.9)
        ax.errorbar(median, y, xerr=[[median - lo], [hi - median]], fmt="none", ecolor="black", capsize=3)
        ax.text(hi, y, f"  {median:.2f}", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(entries)), [f"{label}  (vs {base})" if label != base else f"{label}  (baseline)"
                                        for label, base, _, _, _ in entries], fontsize=8)
    ax.invert_yaxis()                                  # table order, top to bottom
    ax.set_xlabel("tokens/s ratio vs baseline (median of paired rounds, whisker: range)")
    ax.set_xlim(0, max(hi for *_, hi in entries) * 1.15)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
