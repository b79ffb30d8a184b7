"""
bench/plan_nanotron.py: plan.py's predicted MFU against every cell of nanotron's benchmark summary (the Ultra-Scale
Playbook's H100 sweep); writes bench/results/plan_nanotron.md.

    python bench/plan_nanotron.py            # prints the table, writes bench/results/plan_nanotron.md (seconds)
    python bench/plan_nanotron.py --out -    # print only

The subset rule: every cell of huggingface/nanotron docs/benchmark_summary.svg (commit c252843, 2025-03-10, shown in
its README under "Benchmarks"), which gives for each model size (1.34B, 3.57B, 8.86B, 80B) and node count (1-64
nodes of 8 H100) the best configuration of the sweep behind the Ultra-Scale Playbook, its MFU and its memory: 26
cells (80B has none on 1 and 2 nodes). The sweep's full table (thousands of runs, the dataset
nanotron/ultrascale-playbook-data) is not readable here; these are the cells the figure states, not hand-picked.
Each cell is the best of the configurations tried for its size and node count, so its MFU is a maximum over runs:
a planner right on a typical run would read these too low, a bias the report states beside the count. Nothing in
plan.py was fitted to them; they were added as held-out runs, whatever the errors came out to be.
"""
import argparse
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from planner.inputs import GIB, Layout  # noqa: E402
from plan_tables import Setup, describe, write_report  # noqa: E402
from plan_validation import counts, median, predict  # noqa: E402

SOURCE = "huggingface/nanotron docs/benchmark_summary.svg (c252843)"

# The sweep's shapes, scripts/scaling_benchmarks.py (e24d248, "used in" the playbook): (layers, hidden, heads,
# intermediate) of its 1B / 3B / 8B / 70B, vocabulary 131,072, key/value heads = heads (NUM_KEY_VALUE_HEADS None),
# embeddings tied where the intermediate size is under 10,000, SwiGLU (the Llama config's silu MLP), RMSNorm and no
# biases (nanotron's Llama: arch llama). Their parameter
# counts by the script's estimate_num_params are the figure's 1.34 / 3.57 / 8.86 / 80.0B, which identifies them.
SHAPES = {"1.34B": (16, 2048, 32, 8192), "3.57B": (28, 3072, 32, 8192), "8.86B": (32, 4096, 32, 14336),
          "80B": (80, 8192, 64, 28672)}

# (model, nodes, dp, tp, pp, gradient accumulation, micro-batch, ZeRO stage, MFU %, memory GB), as the figure's two
# panels state them (cell text read from the SVG's annotations, placed by their coordinates on its axes)
CELLS = [
    ("1.34B", 64, 128, 2, 2, 1, 2, 1, 5.25, 8.40), ("3.57B", 64, 128, 4, 1, 1, 2, 1, 10.49, 16.42),
    ("8.86B", 64, 128, 4, 1, 1, 2, 0, 18.69, 57.76), ("80B", 64, 32, 16, 1, 4, 2, 1, 17.79, 53.46),
    ("1.34B", 32, 64, 4, 1, 1, 4, 0, 23.20, 19.57), ("3.57B", 32, 64, 4, 1, 1, 4, 0, 26.77, 38.98),
    ("8.86B", 32, 32, 8, 1, 1, 8, 0, 32.71, 63.39), ("80B", 32, 4, 4, 16, 64, 1, 1, 30.75, 64.21),
    ("1.34B", 16, 64, 2, 1, 1, 4, 0, 29.46, 38.84), ("3.57B", 16, 32, 4, 1, 1, 8, 0, 34.59, 66.20),
    ("8.86B", 16, 16, 8, 1, 2, 8, 0, 36.33, 66.88), ("80B", 16, 1, 4, 32, 256, 1, 0, 34.29, 61.18),
    ("1.34B", 8, 32, 1, 2, 8, 1, 1, 32.47, 16.27), ("3.57B", 8, 32, 1, 2, 8, 1, 1, 35.53, 36.73),
    ("8.86B", 8, 32, 1, 2, 8, 1, 1, 39.50, 59.09), ("80B", 8, 1, 4, 16, 256, 1, 0, 30.65, 63.07),
    ("1.34B", 4, 16, 1, 2, 16, 1, 1, 38.38, 16.39), ("3.57B", 4, 16, 1, 2, 8, 2, 1, 40.39, 53.33),
    ("8.86B", 4, 16, 1, 2, 16, 1, 1, 43.31, 61.10), ("80B", 4, 1, 8, 4, 256, 1, 0, 14.76, 65.97),
    ("1.34B", 2, 8, 1, 2, 32, 1, 1, 41.59, 19.45), ("3.57B", 2, 8, 1, 2, 16, 2, 1, 43.77, 54.31),
    ("8.86B", 2, 4, 4, 1, 16, 4, 1, 43.94, 58.34),
    ("1.34B", 1, 4, 1, 2, 16, 4, 1, 44.32, 41.76), ("3.57B", 1, 4, 1, 2, 32, 2, 1, 46.68, 56.87),
    ("8.86B", 1, 2, 1, 4, 128, 1, 1, 45.22, 63.07),
]

# nanotron as the sweep ran it (examples/config_tiny_llama_bench.yaml at 67c5ebb, the base config the script edits,
# and the script's own settings): its sharded cross-entropy in fp32 (planner/head.py's nanotron loss), flash attention
# (nanotron's Llama), torch DDP with 25 MB buckets
# (ddp_bucket_cap_mb: 25, plan.py's default bucket) reducing under the last micro-batch's backward (plan.py's "ddp"
# rule), gradients accumulated and reduced in fp32 (accumulate_grad_in_fp32: true), pp_engine 1f1b with plain
# point-to-point sends, tp_mode REDUCE_SCATTER (sequence parallel) with tp_linear_async_communication (the input's
# all-gather beside the local shard's part of the GEMM, not a chunked pipeline: plan.py's tp_overlap 0, so what
# it hides is not counted), no activation recompute (the base config sets none), bf16. Assumed where the figure is
# silent: seq 4,096 (the script's SEQUENCE_LENGTHS and its "~1M" batch: every cell's dp x accumulation x
# micro-batch is 256 sequences, 2^20 tokens at 4,096), H100 SXM with plan.py's h100 network row (400 Gb/s per GPU),
# and MFU over 989.5 TFLOP/s with nanotron's model FLOPs (models/llama.py get_flops: 6 x every matmul weight, the
# LM head once, + 12 L h s for the scores: plan.py's count).
JOB = dict(attn="flash", dp_overlap=True, pp_scatter_gather=False, tp_overlap=0.0, pp_overlap=False,
           grad_dtype="fp32", loss="nanotron")
# the all-reduce across nodes as NCCL's tuning model times it (timing.all_reduce_seconds: the tree, the ring's plateau)
# was written while looking at these cells' errors (its one-micro-batch cells 2 -> 4 of 8): every cell is marked
ALL_REDUCE = "timing.all_reduce_seconds: NCCL's tree and ring plateau"


def setup(model, nodes, dp, tp, pp, accumulation, mbs, zero, mfu, gib):
    """The cell as a validation Setup."""
    L, h, a, ffn = SHAPES[model]
    shape = dict(arch="llama", n_layer=L, n_embd=h, n_head=a, vocab=131072, ffn_hidden=ffn, gated=True,
                 tied=ffn < 10_000)
    lay = Layout(dp=dp, tp=tp, pp=pp, sp=tp > 1, zero_stage=zero, micro_batch_size=mbs, schedule="1f1b")
    return Setup(model, SOURCE, shape, 8 * nodes, "h100", 4096, dp * accumulation * mbs, lay, mfu / 100,
                 f"{mfu}% MFU, {gib} GB", "nanotron", dict(JOB), seen=(ALL_REDUCE,))


def accumulation(s):
    """Micro-batches per step and data-parallel replica."""
    return s.global_seqs // (s.layout.dp * s.layout.micro_batch_size)


def layout_class(lay):
    """The error's class by parallelism: tp only, pp only or both (no cell is dp only)."""
    return {(True, False): "tp only", (False, True): "pp only", (True, True): "tp and pp"}[(lay.tp > 1, lay.pp > 1)]


def summary(rows, key, label):
    """Within 15%, median error and the error's sign for each value of key(row)."""
    lines = [f"| {label} | runs | within 15% | median error | over / under |", "|---|---|---|---|---|"]
    for value in sorted({key(r) for r in rows}, key=str):
        errors = [r["error"] for r in rows if key(r) == value]
        lines.append(f"| {value} | {len(errors)} | {sum(abs(e) <= 0.15 for e in errors)} | "
                     f"{100 * median(errors):+.1f}% | {sum(e > 0 for e in errors)} / {sum(e < 0 for e in errors)} |")
    return lines


def report(rows):
    within = counts([abs(r["error"]) <= 0.15 for r in rows], [r["setup"] for r in rows])
    lines = [f"**Predicted MFU within 15% of the published: {within}; median error "
             f"{100 * median([r['error'] for r in rows]):+.1f}%.** Rules written while looking at these cells: "
             + "; ".join(sorted({rule for r in rows for rule in r["setup"].seen})) + " (every cell).", "",
             "| model | nodes | layout | accumulation | published | plan.py MFU (error) | "
             "predicted memory (allocated / reserved) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        s, row = r["setup"], r["row"]
        lines.append(f"| {s.name} | {s.gpus // 8} | {describe(row)} | {accumulation(s)} | "
                     f"{s.published_text} | {100 * r['mfu']:.1f}% ({100 * r['error']:+.1f}%) | "
                     f"{row['mem_bytes']['total'] / GIB:.1f} / {row['mem_bytes']['reserved'] / GIB:.1f} GiB |")
    lines += ["", "By parallelism:", ""] + summary(rows, lambda r: layout_class(r["setup"].layout), "class")
    lines += ["", "By micro-batch:", ""] + summary(rows, lambda r: f"mbs {r['setup'].layout.micro_batch_size}",
                                                   "micro-batch")
    lines += ["", "By micro-batches per step (gradient accumulation):", ""] + summary(
        rows, lambda r: "one" if accumulation(r["setup"]) == 1 else "2 or more", "micro-batches per step")
    lines += ["", "By model:", ""] + summary(rows, lambda r: r["setup"].name, "model")
    ratios = {kind: median([r["row"]["mem_bytes"][kind] / GIB / cell[-1] for cell, r in zip(CELLS, rows)])
              for kind in ("total", "reserved")}       # nanotron logs memory / 1024**3 (helpers.py): GiB
    lines += ["", "The one-micro-batch cells' predicted step by part (ms; dp and tp as exposed), beside the step the "
              "published MFU implies (the predicted step x predicted / published MFU) and the data-parallel time if "
              "nothing hid it (`dp_overlap` off):", "",
              "| model | nodes | compute | bubble | tp | dp | pp | tied | optimizer | predicted step | implied step | "
              "missing | dp, none hidden |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if accumulation(r["setup"]) == 1:
            t = r["row"]["time_s"]
            implied = t["total"] * r["mfu"] / r["setup"].published_mfu
            exposed = predict(replace(r["setup"], job=dict(r["setup"].job, dp_overlap=False)))["row"]["time_s"]["dp"]
            lines.append(f"| {r['setup'].name} | {r['setup'].gpus // 8} | " + " | ".join(
                f"{1e3 * t[k]:.1f}" for k in ("compute", "bubble", "tp", "dp", "pp", "tied", "optimizer"))
                + f" | {1e3 * t['total']:.0f} | {1e3 * implied:.0f} | {1e3 * (implied - t['total']):.0f} | "
                f"{1e3 * exposed:.1f} |")
    lines += ["", f"Memory, not scored: plan.py's reserved memory / the figure's GB, median {ratios['reserved']:.2f} "
              f"(its allocated / the figure's GB: {ratios['total']:.2f}) over the {len(rows)} cells."]
    return lines


HEAD = """# plan.py against nanotron's benchmark summary

Produced by `python bench/plan_nanotron.py` (plan.py's defaults; nothing fitted to these runs). The runs: every cell
of nanotron's benchmark summary figure (huggingface/nanotron docs/benchmark_summary.svg), the best configuration of
the Ultra-Scale Playbook's H100 sweep for each model size and node count, with its MFU; the script's docstrings say
where each input comes from and what was assumed (sequence length 4,096 among them). Each cell is the best of its
sweep's runs: its MFU is a maximum, so errors here lean negative for a planner right on a typical run. The figure's
memory ("GB") is shown, not scored: it does not say whether it is allocated or reserved memory.
"""

NOTES = """
## What the errors show

- **Closer where a step has one micro-batch per replica, not there yet.** The 8 cells without gradient
  accumulation (dp 32-128 with TP, 16-64 nodes) are predicted +10% at the median, 4 of 8 within 15%, worst where the
  tokens per GPU are fewest: the 1.34B and the 3.57B on 64 nodes (2,048 and 4,096 tokens per GPU and step, both
  ZeRO-1) +171% and +52% (the 1.34B +153% before these cells were built as Llama, without biases: its buckets, and
  so the last one the backward leaves exposed, changed). They were +29% and 2 of 8 before ZeRO-0's all-reduce was
  timed as NCCL's tuning model times it (planner/timing.all_reduce_seconds: across nodes the ring's latency x 1.9
  for large messages, and the tree's bandwidth, half of 0.9 x the bus x a correction for medium sizes): at dp 64-128 one 50 MB bucket takes about 1.4x
  what latency + bytes / ring bandwidth said, so the reduction no longer fits under the last backward (the 8.86B on
  64 nodes +24% -> -2%, the 3.57B on 32 +29% -> +4%, the 1.34B on 32 +39% -> +15%). That rule was added with these
  errors in view; its constants are NCCL's own (tuning.cc, the file whose latencies plan_time already used), none
  fitted. The two ZeRO-1 cells: nanotron reduce-scatters each bucket through its reduce_scatter_coalesced, which
  flattens the bucket into dp per-rank buffers (128 copies per bucket at dp 128, and torch flattens the list again
  for NCCL); that cost is launches, not bytes, and no per-launch figure was found to price it. nanotron's DDP does
  overlap the reduction with the last backward (its fp32 accumulation hook launches each bucket's collective
  asynchronously; the trainer waits after the backward). Held out from the table and every constant, not unseen.
- **Pipeline-only layouts are near** (the 11 cells with tp 1: 11 within 15%, -1% at the median, 5 of 11 over; 10 within,
  +5% and 10 over before the element-wise kernels were priced by their bytes, planner/elementwise.py): no class of
  error. The 1.34B's and 3.57B's tied embedding has its gradient summed
  over the two stages after the backward (planner/comm.tied_sync_time), on the step's path.
- **Too fast even against a best-of-sweep figure.** A maximum over runs would read plan.py's errors negative; the
  median is positive, so plan.py is too fast on this stack's typical run by more than the median says.
- **One cell looks like an outlier of the sweep itself:** the 80B on 4 nodes (tp 8 x pp 4, 256 micro-batches)
  reached 14.8% where the same model reached 30.7% and 34.3% on 8 and 16 nodes; its 66 GB of 80 is the fullest of
  the 80B cells. plan.py predicts 37.8% (+156%); nothing in the figure says what held it back.
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_nanotron.md"), help="file, or -")
    args = p.parse_args(argv)
    rows = [predict(setup(*cell)) for cell in CELLS]
    return write_report(HEAD + "\n" + "\n".join(report(rows)) + "\n" + NOTES, args.out)


if __name__ == "__main__":
    main()
