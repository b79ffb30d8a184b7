"""
plan.py: predicted memory and step time of any dp x tp x cp x pp (x ep) layout of model.py's GPT, and the layouts
ranked for a cluster. Formulas only, nothing runs; each part is a function below with its formula in the docstring.

    python plan.py --model llama3-8b --gpus 64 --gpus_per_node 8 --gpu h100 --seq 8192 --global_batch_tokens 4M
    python plan.py --model gpt2-xl --gpus 8 --gpu a100 --seq 1024 --global_batch_tokens 512K \\
                   --layout pp=2,zero_stage=1,micro_batch_size=4,recompute=selective     # one layout in detail
    python plan.py ... --layout tp=8,pp=16 --software megatron-core    # keys left out searched, a stack's defaults
    python plan.py ... --json      # one JSON object per layout considered, OOM ones included
    python plan.py --n_layer 24 --n_embd 2048 --n_head 16 --vocab 50257 ...     # any shape instead of --model

Rank order as train_5d.py builds its groups: tp innermost, then cp, dp, pp outermost; an axis whose group spans
<= gpus_per_node consecutive ranks runs on NVLink, else on the network (a ring collective through the NICs of all
its members on a node: link_bandwidth). Gradients are reduced, and ZeRO shards, over dp x cp; ep groups are ep
consecutive ranks of a dp x cp group (grid.expert_partition).
    memory per GPU = params + grads + optimizer  (model_state_bytes_per_param; ZeRO padding as train_zero.py's)
                   + activations (Korthikanti et al. 2022 with TP/SP at s/cp tokens, x the schedule's in-flight
                                  micro-batches) + other (logits, buffers, cuBLAS workspaces)   = allocated
                   reserved: + the caching allocator's reserve; OOM where it exceeds the usable memory (the GPU's
                   capacity less the CUDA context and NCCL's buffers; planner/memory.py)
    step time      = compute / (peak * eff) + eager attention's score tensors through HBM (0 with flash attention)
                   + bubble + exposed comm of each axis + optimizer step
What is planned (the GPU table, model presets, Job, Layout and their checks) is planner/inputs.py, the command-line
flags that build them planner/cli.py; the memory formulas are planner/memory.py; compute time and the published
measurements under it planner/timing.py; each axis's bytes, link, latency and overlap planner/comm.py; model shapes
planner/shape.py. This file adds up the step time, searches the layouts and prints the table.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import copy
import json
import math
import os
from dataclasses import fields, replace
from itertools import product

import torch

from common.config import ConfigError, check, fail
from common.model_setup import gpt_config
from common.peaks import gpu_chip_and_board
from pipeline.schedules import theory_idle_fraction
from planner.cli import build_job, parse_args, parse_layout
from planner.inputs import GIB, HARDWARE, RECOMPUTE, Job, Layout, as_run, validate
from planner import elementwise as plan_elementwise
from planner import shape as plan_shape
from planner import timing as time_model
from planner.comm import (axis_group, comm_bytes, comm_latency, dp_seconds, exposed_dp_time,  # noqa: F401
                              exposed_tp_time, link_bandwidth, tied_sync_time)
from planner.device_memory import verdict
from planner.report import HEADER, format_row, launch_command, print_table  # noqa: F401 (plan.launch_command)
from planner.memory import DEVICE_SHARE, MEM_PARTS, communicators, layers_per_rank, memory, usable_bytes
from planner.timing import eager_attention_time, hardware_flops_per_token  # noqa: F401


# ----------------------------------------------------------------------------------------------------------
# time

def step_time(job, lay, mem):
    """Seconds per optimizer step by part:
        compute    tokens / world x timing.compute_time(hardware_flops_per_token): matmuls at the GPU's measured
                   GEMM ceiling, slower for GEMMs of few rows (timing.gemm_rows_factor, rows = b x s / cp: fitted to
                   matmul measurements), the
                   attention scores at the flash kernel's (half of them causal), both x the software share, and the
                   element-wise kernels' bytes at HBM bandwidth (plan_elementwise); x the busiest pipeline rank's
                   share of the blocks (uneven stages)
        attn_hbm   eager_attention_time (0 with flash attention)
        bubble     (compute + attn_hbm) * f/(1-f), f = pipeline_schedules.theory_idle_fraction ((p-1)/(m+p-1), /v interleaved,
                   zb1 (p-1)/(3m+p-1), zbv and dualpipev (p-1)/(6m+p-1) in chunk units, zbv with m < 2p-1
                   2(2p-1-m)/(6m+2(2p-1-m)); equal to pipeline_schedules.simulate's idle share, F = B = W)
        each axis  comm bytes / link bandwidth + comm_latency (NCCL's alpha per collective), then what overlaps:
        tp         comm.exposed_tp_time: all of it, or with job.tp_overlap what the GEMMs beside it cannot hide
        pp         exposed; with job.pp_overlap only the 2(p-1) transfers of the fill and drain stay on the path
        cp         exposed beyond the attention compute it overlaps (ring hops run under the block attention)
        dp         comm.dp_seconds (ZeRO-0's all-reduce as NCCL's model times it), then comm.exposed_dp_time,
                   as the stack overlaps it (job.dp_overlap, job.dp_overlap_style)
        tied       comm.tied_sync_time: the tied embedding's gradient summed over the first and last stage,
                   after the backward (exposed)
        optimizer  read + write of the rank's model states at HBM bandwidth"""
    cfg, hw = job.cfg, job.hw
    m = lay.grad_acc(job)
    rows = lay.micro_batch_size * cfg.block_size // lay.cp
    f_hw, f_attn = time_model.hardware_flops_per_token(job, lay.recompute)
    imbalance = max(layers_per_rank(job, lay)) * lay.pp / cfg.n_layer
    tokens = imbalance * job.global_seqs * cfg.block_size / job.gpus
    compute = tokens * time_model.compute_time(f_hw, f_attn, job, time_model.gemm_rows_factor(job, lay.tp, rows),
                                               plan_elementwise.bytes_per_token(job, lay))
    idle = theory_idle_fraction(lay.schedule, lay.pp, m, lay.v) if lay.pp > 1 else 0.0
    attn_hbm = time_model.eager_attention_time(job, lay)
    bubble = (compute + attn_hbm) * idle / (1 - idle)
    nbytes = comm_bytes(job, lay, mem["padded_params"])
    alpha = comm_latency(job, lay, mem["groups"])
    t = {axis: nbytes[axis] / link_bandwidth(job, lay, axis) + alpha[axis] for axis in ("tp", "cp", "pp", "ep")}
    block_flops = 6 * cfg.n_layer * sum(n_in * n_out for n_in, n_out in plan_shape.block_linears(job, 1))
    gemms = block_flops / f_hw * compute                            # the rank's block GEMMs, forward + backward
    t["tp"] = exposed_tp_time(job, lay, t["tp"], gemms, rows)
    if job.pp_overlap and lay.pp > 1:
        t["pp"] = t["pp"] * 2 * (lay.pp - 1) / (2 * m * lay.v)
    t["cp"] = max(0.0, t["cp"] - f_attn / f_hw * compute)
    reduce, gather = dp_seconds(job, lay, nbytes, alpha["dp"], mem["groups"])
    t["dp"] = exposed_dp_time(job, lay, reduce, gather, mem["groups"], compute, bubble)
    parts = dict(compute=compute, attn_hbm=attn_hbm, bubble=bubble, **t, tied=tied_sync_time(job, lay),
                 optimizer=2 * (mem["params"] + mem["grads"] + mem["optimizer"]) / hw["hbm"])
    parts["total"] = sum(parts.values())
    return parts


def evaluate(job, lay):
    """The full prediction for one layout, as --json prints it: the layout as it runs (as_run: 1f1b with fewer
    micro-batches than stages is afab), memory by part (allocated "total", "reserved", "device" as nvidia-smi shows
    it, "usable" for the allocator), the pipeline rank holding the peak, time by part, tokens/s, MFU, OOM (reserved
    above usable) and the verdict (fits, close within device_memory.CLOSE_CALL, OOM), and which rates priced it."""
    validate(job, lay)
    lay = as_run(job, lay)
    mem = memory(job, lay)
    time = step_time(job, lay, mem)
    tokens = job.global_seqs * job.cfg.block_size
    tps = tokens / time["total"]
    layout = {f.name: getattr(lay, f.name) for f in fields(lay)}       # (dataclasses.asdict deep-copies: slower)
    return dict(layout, mem_bytes={k: mem[k] for k in MEM_PARTS + ("device", "usable")}, time_s=time,
                step_time_s=time["total"], tokens_per_s=tps,
                mfu=tps * plan_shape.flops_per_token(job) / (job.gpus * job.peak),
                oom=mem["reserved"] > mem["usable"], verdict=verdict(mem["total"], mem["usable"]),
                peak_rank=mem["peak_rank"], priced_by=time_model.priced_by(job))


# ----------------------------------------------------------------------------------------------------------
# search

def divisors(n):
    """n's divisors, ascending (pairs d, n/d up to sqrt(n): a million GPUs is a thousand steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidate_layouts(job):
    """The search space: tp within a node, cp <= 16 and micro-batch sizes <= 64 powers of two, every schedule (v = 2
    or 4 interleaved, 2 in a V for zbv and dualpipev) when pp > 1, ZeRO 0-3, ep dividing dp*cp and
    the experts, the three recompute modes, SP on and off."""
    world, node = job.gpus, job.gpus_per_node
    grid = [(tp, cp, pp) for tp in divisors(world) if tp <= node for cp in divisors(world // tp) if cp & (cp - 1) == 0
            and cp <= 16 for pp in divisors(world // (tp * cp))]
    for tp, cp, pp in grid:
        dp = world // (tp * cp * pp)
        scheds = [("1f1b", 1)] if pp == 1 else [("afab", 1), ("1f1b", 1), ("zb1", 1), ("interleaved", 2),
                                                ("interleaved", 4), ("zbv", 2), ("dualpipev", 2)]
        eps = [e for e in divisors(dp * cp) if job.cfg.n_experts % e == 0] if job.cfg.n_experts else [1]
        mbss = [2 ** i for i in range(7) if 2 ** i <= job.global_seqs // dp]
        for ep, (schedule, v), zero, rc, sp, mbs in product(eps, scheds, range(4), RECOMPUTE,
                                                            (False, True) if tp > 1 else (False,), mbss):
            yield Layout(dp, tp, cp, pp, ep, sp, zero, schedule, v, mbs, rc)


def ranking_key(row):
    """Layouts that fit first, fastest first (ties: less memory); then OOM ones, smallest first."""
    speed = 0 if row["oom"] else -row["tokens_per_s"]
    return row["oom"], speed, row["mem_bytes"]["reserved"]


def rank_layouts(job):
    """Every valid layout evaluated, best first (ranking_key)."""
    rows = []
    for lay in candidate_layouts(job):
        if as_run(job, lay) != lay:          # 1f1b with m < p is afab, which the search has already
            continue
        try:
            rows.append(evaluate(job, lay))
        except ConfigError:
            continue
    return sorted(rows, key=ranking_key)


def layout_keys(text):
    """The Layout fields a --layout text gives (parse_layout has checked it)."""
    return {item.strip().partition("=")[0] for item in text.split(",")}


def consistent_layouts(job, fixed):
    """The search space (candidate_layouts) with the keys of `fixed` set as given: dp follows tp*cp*pp unless
    given; without a pipeline the schedule is 1f1b; where pp or the schedule is given, an interleaved schedule whose v
    is not takes every v from 2 to (layers + 2) / pp (deep interleaving, one layer per chunk, as Llama 3 runs it).
    Each candidate counts once by the keys it does not fix (many differ only in those), so the v sweep costs one
    evaluation per v and distinct layout, not per candidate."""
    free = [k for k in Layout.__dataclass_fields__ if k not in fixed]
    seen, projected = set(), set()
    for lay in candidate_layouts(job):
        key = tuple(getattr(lay, k) for k in free)
        if key in projected:
            continue
        projected.add(key)
        values = {**{k: getattr(lay, k) for k in free}, **fixed}
        rest = values["tp"] * values["cp"] * values["pp"]
        values["dp"] = fixed.get("dp", job.gpus // rest)
        if values["pp"] == 1 and "schedule" not in fixed:
            values.update(schedule="1f1b", v=1)
        vs = [values["v"]]
        if values["schedule"] == "interleaved" and "v" not in fixed and {"pp", "schedule"} & set(fixed):
            vs = range(2, (job.cfg.n_layer + 2) // values["pp"] + 1)
        for v in vs:
            layout = Layout(**{**values, "v": v})
            if layout not in seen:
                seen.add(layout)
                yield layout


def complete_layout(job, text):
    """--layout's row: the layout as given when it names every key; else the best (ranking_key) of the layouts
    consistent with the keys it gives, the others searched (the first ConfigError of the defaults' layout when none
    is valid). Returns (row, the keys searched)."""
    given = layout_keys(text)
    default = parse_layout(text, job)
    derived = {"dp"} if {"tp", "cp", "pp"} <= given else set()      # dp = gpus / (tp*cp*pp): not searched
    searched = [k for k in Layout.__dataclass_fields__ if k not in given | derived]
    try:
        rows, error = [evaluate(job, default)], None
    except ConfigError as e:
        rows, error = [], e
    if not searched:
        if error:
            raise error
        return rows[0], []
    for lay in consistent_layouts(job, {k: getattr(default, k) for k in given}):
        try:
            rows.append(evaluate(job, lay))
        except ConfigError:
            continue
    if not rows:
        raise error
    return min(rows, key=ranking_key), searched


# ----------------------------------------------------------------------------------------------------------
# --layout auto: train_5d.py asks for the layout this file ranks best for its run
#
#     torchrun --nproc_per_node=8 train_5d.py --layout auto --n_layer 24 --n_embd 2048 --n_head 16
#     python -m torch.distributed.run --nproc_per_node 4 train_5d.py --layout auto --plan_gpu h100   # CPU: plan as if
#
# The job is the run's own: its model (train_5d's flags, the dataset's vocabulary), world size, GPUs per node
# (torchrun's LOCAL_WORLD_SIZE) and the GPU found (its memory too), with the flags' global batch and precision.
# Every layout is ranked by predicted tokens/s among those that fit; the first that train_5d.py's own validate
# accepts and that fits the memory found is taken. Its degrees, schedule, micro-batch size, ZeRO stage and
# recompute replace the flags'; rank 0 prints why.

def gpu_kind(device_name):
    """inputs.HARDWARE's key for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100'), or None."""
    chip = gpu_chip_and_board(device_name)[0].lower()
    return chip if chip in HARDWARE else None


def set_layout(cfg, row):
    """cfg with the layout of a plan.py row (degrees, schedule, micro-batch size, ZeRO stage, recompute)."""
    for key in ("dp", "tp", "cp", "pp", "ep", "sp", "zero_stage", "micro_batch_size", "recompute"):
        setattr(cfg, key, row[key])
    cfg.pp_schedule, cfg.pp_virtual, cfg.layout = row["schedule"], row["v"], ""
    return cfg


def accepted_by(validate, cfg):
    """row -> whether `validate` (train_5d's own, raising ConfigError) accepts cfg with the row's layout."""
    def accepts(row):
        try:
            validate(set_layout(copy.copy(cfg), row))
        except ConfigError:
            return False
        return True
    return accepts


def plan_job(cfg, vocab_size, world, gpus_per_node, gpu, precision):
    """plan.py's Job for this run: the model the run builds (model_setup.gpt_config: its family's norm, MLP, biases,
    key/value heads and tied head), its loss the project's own (model.LMHead, train_tp's vocab-parallel one under
    TP), its SwiGLU fused where --kernels triton / compile or --compile runs it so (model.py's eager one otherwise)."""
    model = gpt_config(cfg, vocab_size)
    gpt = replace(model, mlp="gelu", n_kv_head=0, ffn_hidden=0)     # the Job's own fields hold these (family_config)
    fused = cfg.compile or cfg.kernels in ("triton", "compile")
    return Job(gpt, world, gpus_per_node, gpu, cfg.global_batch_size, precision, "flash", cfg.bucket_mb,
               loss="nanoscale", n_kv_head=model.n_kv_head, ffn_hidden=model.ffn_hidden, gated=model.mlp == "swiglu",
               tied=model.tied, fused_swiglu=fused)


def fits_in(row, capacity):
    """Whether a row's reserved memory fits a GPU of `capacity` bytes (torch's total_memory) less the CUDA context and
    NCCL's buffers (memory.usable_bytes)."""
    n = communicators(row["dp"], row["tp"], row["cp"], row["pp"], row["ep"])
    return row["mem_bytes"]["reserved"] <= usable_bytes(capacity, n)


def choose_layout(job, memory_bytes, accepts):
    """(best row that `accepts` takes and that fits memory_bytes (torch's total capacity), the ranked rows it was
    chosen from)."""
    rows = [r for r in rank_layouts(job) if accepts(r)]
    fits = [r for r in rows if not r["oom"] and fits_in(r, memory_bytes)]
    check(fits, f"--layout auto: no layout train_5d.py runs fits {memory_bytes / GIB:.1f} GiB per GPU for this "
                f"model and batch (plan.py ranks {len(rows)}); try a smaller --micro_batch_size or model")
    return fits[0], fits


def apply_auto_layout(cfg, vocab_size, device, world, is_main, validate):
    """Replace cfg's layout flags by plan.py's choice for this run among those `validate` (train_5d's) accepts."""
    name = cfg.plan_gpu or (torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    gpu = name if name in HARDWARE else gpu_kind(name)
    check(gpu is not None, f"--layout auto plans for a GPU plan.py knows ({', '.join(HARDWARE)}), found "
                           f"{name or device.type!r}: give the degrees (--dp --tp --cp --pp --ep), or --plan_gpu")
    memory = HARDWARE[gpu]["mem"] * DEVICE_SHARE
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    precision = "fp32" if cfg.dtype in ("float32", "float64") or device.type == "cpu" else "amp"
    job = plan_job(cfg, vocab_size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), gpu, precision)
    best, fits = choose_layout(job, memory, accepted_by(validate, cfg))
    set_layout(cfg, best)
    if is_main:
        print(f"--layout auto: plan.py for {world} x {gpu} ({memory / GIB:.0f} GiB, {job.gpus_per_node} per node), "
              f"{precision}; {len(fits)} layouts train_5d runs fit, ranked by predicted tokens/s; the first is "
              f"taken:\n{HEADER}\n" + "\n".join(format_row(i + 1, r) for i, r in enumerate(fits[:3])), flush=True)
    return best


def main(argv=None):
    """Rank every layout (or evaluate --layout) and print the table, or one JSON object per row with --json."""
    a = parse_args(argv, description=__doc__.split("\n\n")[0])
    try:
        job = build_job(a)
        searched = []
        if a.layout:
            row, searched = complete_layout(job, a.layout)
            rows = [dict(row, searched=searched)]
        else:
            rows = rank_layouts(job)
    except ConfigError as e:
        fail(str(e))
    if not rows:
        fail(f"no layout divides this model, batch and cluster: {job.gpus} GPUs as dp x tp x cp x pp, with dp "
             f"dividing the {job.global_seqs} sequences of a step, tp the {job.cfg.n_head} heads, pp the "
             f"{job.cfg.n_layer} layers (a larger --global_batch_tokens, or fewer --gpus)")
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        if searched:
            print(f"--layout {a.layout}: the keys it leaves out searched (the fastest layout that fits, else the "
                  "smallest): " + ", ".join(f"{k}={rows[0][k]}" for k in searched))
        print_table(job, rows, a.top)
    best = rows[0]
    if best["oom"]:
        fail(f"no layout fits: the smallest needs {best['mem_bytes']['reserved'] / GIB:.1f} GiB of the "
             f"{best['mem_bytes']['usable'] / GIB:.1f} GiB usable per {job.gpu} (more GPUs, a smaller model, "
             "micro-batch or sequence, ZeRO-3, recompute)")
    return rows


if __name__ == "__main__":
    main()
