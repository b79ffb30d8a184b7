"""
bench/charts.py: the PNG charts written beside bench's markdown tables (bench/harness.py). matplotlib is not a
training dependency: it is imported here, lazily, with the Agg backend (no display), and bench.sh installs it.

    python bench/charts.py bench/results/tp.md ...     # redraw NAME.png from tables already written (./bench.sh charts)

A table written before charts existed gets its chart this way, from its own numbers: the paired ratio and its range
where the table has them, else its "ratio vs first" column (one median per run, no range).
"""
import os
import re
import sys
import textwrap


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, works without a display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi=110):
    """Lay the figure out, write it as a PNG at `path`, free it; returns path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


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
    ax.set_title(textwrap.fill(title, 110), fontsize=10)
    return save_figure(fig, path)


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def first_table(path):
    """The rows (header first) of the first markdown table in a file: the harness's; notes may add others."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("|"):
                if not line.startswith("|---"):
                    rows.append(cells(line))
            elif rows:
                break
    return rows


def table_entries(path):
    """(label, baseline label, median, lo, hi) per run of a bench/harness.py table. A run whose paired ratio is
    1.00 (1.00-1.00), or the first run, is a baseline; each run is compared with the last baseline above it."""
    rows = first_table(path)
    header, entries, baseline = rows[0], [], None
    if header[0] != "run" or not any(h.startswith("ratio vs") for h in header):
        return []                                     # not a harness table (memory, bubble, scaling draw theirs)
    paired = header.index("paired ratio (range)") if "paired ratio (range)" in header else None
    plain = header.index(next(h for h in header if h.startswith("ratio vs")))
    for row in rows[1:]:
        label = row[0]
        found = re.fullmatch(r"([\d.]+) \(([\d.]+)-([\d.]+)\)", row[paired]) if paired is not None else None
        median, lo, hi = (float(x) for x in found.groups()) if found else (float(row[plain]),) * 3
        if baseline is None or (found and (median, lo, hi) == (1.0, 1.0, 1.0)):
            baseline = label
        entries.append((label, baseline, median, lo, hi))
    return entries


def main(paths):
    for path in paths:
        entries = table_entries(path)
        if not entries:
            continue
        with open(path) as f:
            title = f.readline().lstrip("# ").strip()
        print(f"charts: wrote {ratio_chart(entries, os.path.splitext(path)[0] + '.png', title)}")


if __name__ == "__main__":
    main(sys.argv[1:])
