"""
bench/memory_chart.py: memory per rank by layout, counted on CPU, against plan.py's prediction for the same layout.

    python bench/memory_chart.py             # -> bench/results/memory.md and memory.png (./bench.sh memory runs it)
    python bench/memory_chart.py --layouts "dp2,pp2 1f1b"       # some of LAYOUTS only

Each layout of LAYOUTS runs train_5d.py for 2 steps on a small model (fp32, CPU, gloo), all layouts of one world
size in one torchrun launch. Every rank counts, exactly:
    model states  bytes of its live parameter, gradient and optimizer-state tensors after the run, each storage once:
                  the parameters and their .grad (train_ddp's buckets), AdamW's exp_avg and exp_avg_sq (its
                  one-element step counters are left out, as plan.py leaves them out), or under ZeRO the flat
                  shards as metrics.model_state_bytes counts them
    activations   the peak, over a step, of the bytes autograd holds for backward: metrics.LiveSavedActivationBytes
                  around the pipeline runner's step, so the micro-batches a schedule keeps in flight all count
plan.py predicts the same parts for the same planner/inputs.Layout and pipeline rank: planner/memory.model_state
(states), planner/memory.activation_bytes (activations). Its other parts (logits, p2p buffers, the CUDA
context) have no exact count on CPU and are left out. Counted bytes do not depend on the machine's load.
Split-backward schedules (zb1, zbv, dualpipev) are not among the layouts: their W passes keep inputs outside
autograd, which the counter cannot see.
"""
import argparse
import json
import os
import subprocess
import sys
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PARTS = ("params", "grads", "optimizer", "activations")
MODEL = dict(n_layer=4, n_head=4, n_embd=64, block_size=64, global_batch_size=8, micro_batch_size=2,
             bucket_mb=0.05)                      # small buckets: several per rank, so ZeRO pads each
RUN = dict(max_steps=2, warmup_steps=1, eval_interval=0, sample_tokens=0, log_interval=100, device="cpu",
           dtype="float32")
# label -> train_5d flags; the world size is dp*tp*cp*pp
LAYOUTS = {
    "dp2": dict(dp=2),
    "dp2 zero1": dict(dp=2, zero_stage=1),
    "dp2 zero2": dict(dp=2, zero_stage=2),
    "dp2 full recompute": dict(dp=2, recompute="full"),
    "tp2": dict(tp=2),
    "tp2 sp": dict(tp=2, sp=True),
    "cp2": dict(cp=2),
    "pp2 afab": dict(pp=2, pp_schedule="afab"),
    "pp2 1f1b": dict(pp=2, pp_schedule="1f1b"),
    "pp2 interleaved": dict(pp=2, pp_schedule="interleaved", pp_virtual=2),
    "pp4 1f1b": dict(pp=4, pp_schedule="1f1b"),
    "dp2 ep2 moe": dict(dp=2, ep=2, n_experts=4, top_k=2),
    "dp2 ep2 moe cf1": dict(dp=2, ep=2, n_experts=4, top_k=2, capacity_factor=1.0),
    "dp4 zero2": dict(dp=4, zero_stage=2),
    "dp2 tp2 zero1": dict(dp=2, tp=2, zero_stage=1),
    "dp2 pp2 zero1": dict(dp=2, pp=2, zero_stage=1),
    "tp2 pp2 sp": dict(tp=2, pp=2, sp=True),
}

NOTE = ("Model states are plan.py's formulas exactly where the ratio reads '='. Activations: an expert rank holds "
        "what the router sent it. Dropless, plan.py assumes an even share (planner/memory.moe_routed_rows), so the "
        "busier rank reads above 1 by the routing imbalance, which plan.py does not model; with a capacity factor it "
        "counts the capacity, an upper bound (ratio <= 1). The split-backward schedules' deferred inputs are left "
        "out (not measured here).")


def world_of(flags):
    return flags.get("dp", 1) * flags.get("tp", 1) * flags.get("cp", 1) * flags.get("pp", 1)


def train_argv(flags, data_dir, out_dir):
    """train_5d's command line for one layout (every degree given, so none is chosen for us)."""
    args = {**MODEL, **RUN, "dp": 1, "tp": 1, "cp": 1, "pp": 1, **flags, "data_dir": data_dir, "out_dir": out_dir}
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items()]


# ----------------------------------------------------------------------------------------------------------
# measuring, on every rank

@contextmanager
def instrumented(train_5d, seen):
    """train_5d with its pipeline runner counting live saved activations into `seen`: measured from outside,
    nothing in train_5d changes."""
    from common.metrics import LiveSavedActivationBytes
    runner_class = train_5d.PipelineRunner

    class CountingRunner(runner_class):
        def step(self, actions, get_batch):
            with LiveSavedActivationBytes(self.chunks.parameters()) as live:
                out = super().step(actions, get_batch)
            seen["activations"] = max(seen.get("activations", 0), live.peak)
            return out

    train_5d.PipelineRunner = CountingRunner
    try:
        yield
    finally:
        train_5d.PipelineRunner = runner_class


def state_bytes(chunks, buckets, optimizer, shards):
    """Live model-state bytes of this rank by part, each storage once (buckets: the ZeRO shards' own)."""
    if shards:
        from common.metrics import model_state_bytes
        out = model_state_bytes(chunks, shards, buckets)
        return dict(params=out["params"], grads=out["grads"], optimizer=out["optim"])
    seen, out = set(), dict(params=0, grads=0, optimizer=0)
    for p in chunks.parameters():
        moments = [optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq") if k in optimizer.state.get(p, {})]
        for part, t in [("params", p), ("grads", p.grad)] + [("optimizer", m) for m in moments]:
            storage = None if t is None else t.untyped_storage()
            if storage is not None and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[part] += storage.nbytes()
    return out


def measure_layouts(labels, data_dir, out_root):
    """On one rank of a launch: run train_5d for each layout and count its parts (a list, one dict per layout)."""
    import train_5d
    rows = []
    for label in labels:
        seen, out_dir = {}, os.path.join(out_root, label.replace(" ", "_"))
        with instrumented(train_5d, seen):
            result = train_5d.main(train_argv(LAYOUTS[label], data_dir, out_dir))
        axis = result["dp_axis"]
        buckets = [b for grads in axis.reductions() for b in getattr(grads, "buckets", [])]
        states = state_bytes(result["chunks"], buckets, axis.optimizer, axis.shards)
        rows.append(dict(layout=label, coords=dict(result["grid"].coords), activations=seen["activations"],
                         vocab_size=result["gcfg"].vocab_size, **states))
    return rows


# ----------------------------------------------------------------------------------------------------------
# predicting, and the table and chart

def plan_layout(flags):
    """planner/inputs.Layout of train_5d's flags (schedule 1f1b without pp, as train_5d's default)."""
    from planner.inputs import Layout
    return Layout(dp=flags.get("dp", 1), tp=flags.get("tp", 1), cp=flags.get("cp", 1), pp=flags.get("pp", 1),
                  ep=flags.get("ep", 1), sp=flags.get("sp", False), zero_stage=flags.get("zero_stage", 0),
                  schedule=flags.get("pp_schedule", "1f1b"), v=flags.get("pp_virtual", 1),
                  micro_batch_size=MODEL["micro_batch_size"], recompute=flags.get("recompute", "none"))


def predicted(label, vocab_size, pp_rank):
    """plan.py's bytes by part for one layout's pipeline rank."""
    import plan
    from planner import memory as plan_memory
    from model import GPTConfig
    from planner.inputs import Job
    flags = LAYOUTS[label]
    cfg = GPTConfig(vocab_size=vocab_size, block_size=MODEL["block_size"], n_layer=MODEL["n_layer"],
                    n_head=MODEL["n_head"], n_embd=MODEL["n_embd"], n_experts=flags.get("n_experts", 0),
                    top_k=flags.get("top_k", 2), capacity_factor=flags.get("capacity_factor", 0.0))
    world = world_of(flags)
    job = Job(cfg, world, world, "h100", MODEL["global_batch_size"], precision="fp32", bucket_mb=MODEL["bucket_mb"],
              loss="nanoscale")
    lay = plan_layout(flags)
    plan.validate(job, lay)
    st = plan_memory.model_state(job, lay, pp_rank)[0]     # fp32 (the Job's precision)
    return dict(params=st["params"], grads=st["grads"], optimizer=st["optimizer"],
                activations=plan_memory.activation_bytes(job, lay, pp_rank))


def compare(measured):
    """One row per (layout, pipeline rank): the largest count of its ranks per part, plan's prediction, and whether
    all its ranks counted alike. measured: every rank's rows of measure_layouts."""
    rows = []
    for label in dict.fromkeys(r["layout"] for r in measured):
        mine = [r for r in measured if r["layout"] == label]
        for pp_rank in sorted({r["coords"]["pp"] for r in mine}):
            stage = [r for r in mine if r["coords"]["pp"] == pp_rank]
            rows.append(dict(layout=label, pp_rank=pp_rank, ranks=len(stage),
                             alike=all(r[k] == stage[0][k] for r in stage for k in PARTS),
                             measured={k: max(r[k] for r in stage) for k in PARTS},
                             predicted=predicted(label, stage[0]["vocab_size"], pp_rank)))
    return rows


def kib(n):
    return f"{n / 1024:,.1f}"


def ratio_text(m, p):
    return "=" if m == p else f"{m / p:.3f}"


def write_table(rows, path, note=""):
    """memory.md: measured and predicted KiB by part, and their ratio (= when equal to the byte)."""
    head = ["layout", "pp rank"] + [f"{k} KiB measured / plan (ratio)" for k in PARTS] + ["ranks alike"]
    lines = ["### Memory per rank by layout: counted on CPU vs plan.py", "",
             f"train_5d.py, L{MODEL['n_layer']} H{MODEL['n_head']} h{MODEL['n_embd']} T{MODEL['block_size']}, "
             f"global batch {MODEL['global_batch_size']} in micro-batches of {MODEL['micro_batch_size']}, fp32, "
             f"bucket {MODEL['bucket_mb']} MiB, 2 steps. Command: `python bench/memory_chart.py`. Model states: live "
             "tensors after the run; activations: peak bytes autograd holds during a step (all micro-batches in "
             "flight). A stage's largest rank is shown; 'ratio' is measured / plan.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["layout"], str(r["pp_rank"])]
        for k in PARTS:
            m, p = r["measured"][k], r["predicted"][k]
            cells.append(f"{kib(m)} / {kib(p)} ({ratio_text(m, p)})")
        lines.append("| " + " | ".join(cells + ["yes" if r["alike"] else "no"]) + " |")
    lines += ["", note] if note else []
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def write_chart(rows, path):
    """memory.png: per layout and pipeline rank, a measured and a predicted bar, each stacked by part."""
    from charts import pyplot, save_figure
    plt = pyplot()
    colours = dict(zip(PARTS, ("#4C72B0", "#55A868", "#8172B2", "#DD8452")))
    fig, ax = plt.subplots(figsize=(min(15, 2 + 0.7 * len(rows)), 5.5))
    for x, r in enumerate(rows):
        for offset, kind, hatch in ((-0.2, "measured", ""), (0.2, "predicted", "//")):
            bottom = 0
            for part in PARTS:
                value = r[kind][part] / 2 ** 20
                ax.bar(x + offset, value, 0.38, bottom=bottom, color=colours[part], hatch=hatch, edgecolor="white",
                       label=part if x == 0 and kind == "measured" else None)
                bottom += value
    names = [r["layout"] + (f"\npp rank {r['pp_rank']}" if LAYOUTS[r["layout"]].get("pp", 1) > 1 else "") for r in rows]
    ax.set_xticks(range(len(rows)), names, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("MiB per rank")
    ax.set_title("Memory per rank by layout: counted on CPU (left bar) vs plan.py (right, hatched); train_5d fp32",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, path)


def launch(world, labels, data_dir, out_root):
    """One torchrun launch of this file in --measure mode; returns every rank's rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
           "--measure", out_root, "--data_dir", data_dir, "--layouts", ",".join(labels)]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = []
    for rank in range(world):
        with open(os.path.join(out_root, f"rank{rank}.json")) as f:
            rows += json.load(f)
    return rows


def default_corpus():
    """The default corpus's folder, prepared on first use (data.ensure_dataset knows it by its relative path)."""
    from common.data import DEFAULT_DATA_DIR, ensure_dataset
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        ensure_dataset(DEFAULT_DATA_DIR)
    finally:
        os.chdir(cwd)
    return os.path.join(ROOT, DEFAULT_DATA_DIR)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated labels of LAYOUTS")
    p.add_argument("--data_dir", default=None, help="a prepared dataset (default: the default corpus)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for memory.md and memory.png")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)    # a rank of a launch: its runs' folder
    a = p.parse_args(argv)
    labels = a.layouts.split(",")
    if a.measure:
        rows = measure_layouts(labels, a.data_dir, a.measure)
        with open(os.path.join(a.measure, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(rows, f)
        from common.distributed import destroy
        destroy()                                # leave the group together
        return rows
    data_dir = a.data_dir or default_corpus()
    measured = []
    for world in sorted({world_of(LAYOUTS[label]) for label in labels}):
        mine = [label for label in labels if world_of(LAYOUTS[label]) == world]
        measured += launch(world, mine, data_dir, os.path.join(ROOT, "bench", "runs", "memory", f"world{world}"))
    rows = compare(measured)
    os.makedirs(a.out, exist_ok=True)
    print(open(write_table(rows, os.path.join(a.out, "memory.md"), NOTE)).read())
    print(f"memory_chart: wrote {write_chart(rows, os.path.join(a.out, 'memory.png'))}")
    return rows


if __name__ == "__main__":
    main()
