"""
plan.py: predicted memory and step time of any dp x tp x cp x pp (x ep) layout of model.py's GPT, and the layouts
ranked for a cluster. Formulas only, nothing runs; each part is a function below with its formula in the docstring.

    python plan.py --model llama3-8b --gpus 64 --gpus_per_node 8 --gpu h100 --seq 8192 --global_batch_tokens 4M
    python plan.py --model gpt2-xl --gpus 8 --gpu a100 --seq 1024 --global_batch_tokens 512K \\
                   --layout pp=2,zero_stage=1,micro_batch_size=4,recompute=selective     # one layout in detail
    python plan.py ... --json      # one JSON object per layout considered, OOM ones included
    python plan.py --n_layer 24 --n_embd 2048 --n_head 16 --vocab 50257 ...     # any shape instead of --model

Rank order as train_5d.py builds its groups: tp innermost, then cp, dp, pp outermost; an axis whose group spans
<= gpus_per_node consecutive ranks runs on NVLink, else on the network (a ring collective through the NICs of all
its members on a node: link_bandwidth). Gradients are reduced, and ZeRO shards, over dp x cp; ep groups are ep
consecutive ranks of a dp x cp group (grid.expert_partition).
    memory per GPU = params + grads + optimizer  (model_state_bytes_per_param; ZeRO padding as train_zero.py's)
                   + activations (Korthikanti et al. 2022 with TP/SP at s/cp tokens, x the schedule's in-flight
                                  micro-batches) + other (logits, buffers, 1 GiB CUDA context); OOM above 95%
    step time      = compute / (peak * eff) + eager attention's score tensors through HBM (0 with flash attention)
                   + bubble + exposed comm of each axis + optimizer step
What is planned (the GPU table with published efficiencies, model presets, Job, Layout, their checks and the
command-line flags that build them) is plan_inputs.py; the memory formulas are plan_memory.py; this file is the
time formulas, the search and the printed table.
"""
import copy
import json
import os
from dataclasses import asdict
from itertools import product

import torch

from common.config import ConfigError, check, fail
from common.metrics import gpu_chip_and_board
from model import GPTConfig
from common.pipeline_schedules import placement_of, theory_idle_fraction
from common.plan_inputs import (GIB, HARDWARE, LINK_EFF, PRECISION, RECOMPUTE, USABLE, Job, Layout, build_job,
                                model_state_bytes_per_param,
                         parse_args, parse_layout, validate)
from common import plan_shape
from common import plan_time as time_model
from common.plan_memory import MEM_PARTS, layers_per_rank, memory, stage_blocks


# ----------------------------------------------------------------------------------------------------------
# time

def link_bandwidth(job, lay, axis):
    """Bytes/s of the link an axis crosses, times LINK_EFF: its group spans tp (tp), tp*cp (cp), tp*ep (ep: ep
    consecutive members of a dp x cp group, tp apart), tp*cp*dp (dp) or all (pp) consecutive ranks; within a node
    NVLink. Across nodes, point-to-point traffic (cp's ring hops, pp, ep's all-to-all) leaves through each GPU's own
    NIC: the GPU's network share. A ring collective (tp's and dp's all-reduce, reduce-scatter, all-gather) enters and
    exits each node once per NCCL channel, and NCCL runs a channel per NIC, so a group with g members on a node
    (tp: all of the node's; dp x cp: one per tp group) moves its bytes through g NICs: min(NVLink, g * net). NCCL's
    maintainer: "Ring Allreduce requires data to go through each GPU and enter/exit the node once" (NVIDIA/nccl
    #687), "~12 GB/s with each NIC, then ~24 when using 2 NICs, etc" (#307); measured, 1/2/4 GPUs of a node in the
    ring: 363/173/132 ms (#569), 4 vs 8: 45 vs 90 GB/s (#1168)."""
    node = job.gpus_per_node
    span = dict(tp=lay.tp, cp=lay.tp * lay.cp, ep=lay.tp * lay.ep, dp=lay.tp * lay.cp * lay.dp, pp=job.gpus)[axis]
    if span <= node:
        return job.hw["nvlink"] * LINK_EFF
    nics = dict(tp=node, dp=max(1, node // lay.tp)).get(axis, 1)
    return min(job.hw["nvlink"], nics * job.hw["net"]) * LINK_EFF


def hardware_flops_per_token(job, recompute):
    """plan_shape.flops_per_token (6N + 12*L*h*T) plus what recompute adds: full a second forward of every block
    (2 N_blocks + 4*L*h*T), selective the attention scores' forward (4*L*h*T), op (torchtitan's policy) the
    forward of the matmuls it does not keep (plan_shape.op_recompute_values). Returns (all, attention's part)."""
    cfg = job.cfg
    attn = plan_shape.attention_flops_per_token(job) * (1 + (recompute in ("selective", "full")) / 3)
    extra = 2 * plan_shape.block_params(job) if recompute == "full" else 0
    extra += cfg.n_layer * plan_shape.op_recompute_values(job)[2] if recompute == "op" else 0
    return plan_shape.flops_per_token(job) + extra + attn - plan_shape.attention_flops_per_token(job), attn


def comm_bytes(job, lay, padded):
    """Bytes this rank sends per step on each axis (comm.py's ring convention, part = (n-1)/n), m micro-batches,
    S = b*s*h*bpv of one micro-batch's activations (s = seq/cp), L_r blocks on the busiest pipeline rank:
        tp  m*L_r * part_t * S * (8 TP: 2 all-reduces fwd + 2 bwd | 10 SP: 2 AG + 2 RS fwd, 4 AG + 2 RS bwd) + 4 more
            per block under full recompute (test_tp.py counts these)
        cp  m*L_r * ((cp-1)*2 KV + cp * dKV (fp32)), + (cp-1) KV with full recompute, KV = 2b*s*kv/t*bpv, kv the
            key/value width (h without GQA; train_cp)
        dp  over n = dp*cp, P' padded rank params, p/g bytes: stage 0 all-reduce 2 part P g; 1: RS part P' g + AG
            part P' p; 2: RS per micro-batch m part P' g + AG part P' p; 3: 2m part P' p (AG fwd+bwd) + m part P' g
        pp  2*m*v*S/(t if SP) (activations forward, gradients back); with job.pp_scatter_gather (Megatron) S/t
            each, and tp all-gathers every arriving message: + 2*m*v*part_t*S on tp
        ep  per MoE block and micro-batch 4 * part_ep * top_k * b*s*h*bpv (dispatch + combine, fwd + bwd)"""
    cfg, (recipe, bpv) = job.cfg, PRECISION[job.precision]
    s, b, h, m, t = cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd, lay.grad_acc(job), lay.tp
    S, blocks = b * s * h * bpv, max(layers_per_rank(job, lay))
    full = lay.recompute == "full"
    out = dict(tp=0.0, cp=0.0, dp=0.0, dp_reduce=0.0, pp=0.0, ep=0.0)
    if t > 1:
        out["tp"] = m * blocks * (t - 1) / t * S * ((10 if lay.sp else 8) + 4 * full)
    if lay.cp > 1:
        kv = 2 * b * s * plan_shape.kv_dim(job) / t * bpv
        out["cp"] = m * blocks * ((lay.cp - 1) * kv * (2 + full) + lay.cp * kv * 4 / bpv)
    n = lay.dp * lay.cp
    if n > 1:
        part = (n - 1) / n * padded
        sizes = model_state_bytes_per_param(recipe, job.moments)
        reduce = {0: 2, 1: 1, 2: m, 3: m}[lay.zero_stage] * part * sizes["grads"]
        gather = {0: 0, 1: 1, 2: 1, 3: 2 * m}[lay.zero_stage] * part * sizes["params"]
        out["dp"] = reduce + gather
        out["dp_reduce"] = reduce
    if lay.pp > 1:
        split = lay.sp or job.pp_scatter_gather
        out["pp"] = 2 * m * lay.v * S / (t if split else 1)
        out["tp"] += 2 * m * lay.v * (t - 1) / t * S if job.pp_scatter_gather and not lay.sp else 0
    if lay.ep > 1:
        moe = sum(cfg.is_moe_block(i) for i in stage_blocks(job, lay.pp, lay.v, 0, placement_of(lay.schedule)))
        out["ep"] = m * moe * 4 * (lay.ep - 1) / lay.ep * cfg.top_k * b * s * h * bpv
    return out


def axis_group(job, lay, axis):
    """(members, nodes they span, hop: 'nvlink' or 'net') of one group of `axis` (rank order tp, cp, dp, pp)."""
    node = job.gpus_per_node
    n = dict(tp=lay.tp, cp=lay.cp, dp=lay.dp * lay.cp, ep=lay.ep, pp=lay.pp)[axis]
    span = dict(tp=lay.tp, cp=lay.tp * lay.cp, ep=lay.tp * lay.ep, dp=lay.tp * lay.cp * lay.dp, pp=job.gpus)[axis]
    if span <= node:
        return n, 1, "nvlink"
    stride = dict(tp=1, pp=job.gpus // lay.pp).get(axis, lay.tp)     # ranks between two members of a group
    per_node = max(1, node // stride)
    return n, max(1, n // per_node), "net"


def comm_latency(job, lay, groups):
    """Seconds of NCCL latency (plan_time.latency) per step on each axis: the number of collectives each runs
    times the fixed cost of one. Per block and micro-batch: tp 4 all-reduces (TP; 6 with full recompute) or 6
    all-gathers + 4 reduce-scatters (SP; 14 with full recompute), as comm_bytes counts them, + the all-gather of
    every pipeline message Megatron's scatter/gather splits; cp one send per KV hop
    (2(cp-1) + cp, + cp-1 with full recompute); ep 4 all-to-alls per MoE block. dp: one collective per bucket
    (ZeRO 0-2: all-reduce, or reduce-scatter + all-gather, stage 2's reduce-scatter every micro-batch) or per unit
    (ZeRO-3: 2 all-gathers + 1 reduce-scatter per micro-batch). pp: 2 sends per micro-batch and chunk."""
    m, blocks, full = lay.grad_acc(job), max(layers_per_rank(job, lay)), lay.recompute == "full"
    out = {}
    for axis in ("tp", "cp", "dp", "pp", "ep"):
        n, nodes, _ = axis_group(job, lay, axis)
        lat = {kind: time_model.latency(kind, n, nodes) for kind in time_model.COLLECTIVES}
        if axis == "tp":
            per = (10 + 4 * full) * lat["all_gather"] if lay.sp else (4 + 2 * full) * lat["all_reduce"]
            gathers = 2 * m * lay.v if lay.pp > 1 and job.pp_scatter_gather and not lay.sp else 0
            out[axis] = m * blocks * per + gathers * lat["all_gather"]
        elif axis == "cp":
            out[axis] = m * blocks * (3 * n - 2 + (n - 1) * full) * lat["send"]
        elif axis == "dp":
            per_step = {0: lat["all_reduce"], 1: lat["reduce_scatter"] + lat["all_gather"],
                        2: m * lat["reduce_scatter"] + lat["all_gather"],
                        3: m * (2 * lat["all_gather"] + lat["reduce_scatter"])}[lay.zero_stage]
            out[axis] = groups * per_step
        elif axis == "pp":
            out[axis] = 2 * m * lay.v * lat["send"]
        else:
            moe = sum(job.cfg.is_moe_block(i) for i in stage_blocks(job, lay.pp, lay.v, 0, placement_of(lay.schedule)))
            out[axis] = 4 * m * moe * lat["all_to_all"]
    return out


def eager_attention_time(job, lay):
    """Seconds per step a rank's eager (unfused) attention spends streaming its a/t x s x s score tensors (b per
    micro-batch, m micro-batches, L/pp blocks) through HBM in its non-matmul kernels; 0 with flash attention, which
    never writes them (Dao et al. 2022, FlashAttention, Sec. 2-3: standard attention is bound by these accesses) and
    which the measurement behind eff used. Bytes per score element, 16-bit values and 1-byte dropout masks, as
    Megatron-LM's fused scale-mask-softmax and torch's dropout move them:
        softmax 2 + 2 forward, 2 + 2 + 2 backward;  dropout (p > 0) 2 + 1 + 2 forward, 2 + 1 + 2 backward;
        the forward ones again under selective or full recompute;  time = bytes / datasheet HBM bandwidth"""
    if job.attn == "flash":
        return 0.0
    cfg, drop = job.cfg, job.cfg.dropout > 0
    forward = (4 + 5 * drop) * (1 + (lay.recompute in ("selective", "full")))
    elements = cfg.n_head // lay.tp * cfg.block_size ** 2 * job.global_seqs // lay.dp * cfg.n_layer // lay.pp
    return elements * (forward + 6 + 5 * drop) / job.hw["hbm"]


def step_time(job, lay, mem):
    """Seconds per optimizer step by part:
        compute    tokens / world x plan_time.compute_time(hardware_flops_per_token): matmuls at the GPU's measured
                   GEMM ceiling, the attention scores at the flash kernel's (half of them causal), both x the software
                   share; x the busiest pipeline rank's share of the blocks (uneven stages)
        attn_hbm   eager_attention_time (0 with flash attention)
        bubble     (compute + attn_hbm) * f/(1-f), f = pipeline_schedules.theory_idle_fraction ((p-1)/(m+p-1), /v interleaved,
                   zb1 (p-1)/(3m+p-1), zbv and dualpipev (p-1)/(6m+p-1) in chunk units, zbv with m < 2p-1
                   2(2p-1-m)/(6m+2(2p-1-m)); equal to pipeline_schedules.simulate's idle share, F = B = W)
        each axis  comm bytes / link bandwidth + comm_latency (NCCL's alpha per collective), then what overlaps:
        tp         exposed, less job.tp_overlap x the compute it runs beside (plan_time.TP_OVERLAP)
        pp         exposed; with job.pp_overlap only the 2(p-1) transfers of the fill and drain stay on the path
        cp         exposed beyond the attention compute it overlaps (ring hops run under the block attention)
        dp         reductions exposed beyond the backward they overlap (stage 0-1: the last micro-batch's, 2/3 of
                   compute/m; stage 2: every backward, 2/3 of compute; stage 3 also the gathers, all compute);
                   stage 1-2's all-gather after the step is exposed; all exposed without job.dp_overlap
        optimizer  read + write of the rank's model states at HBM bandwidth"""
    cfg, hw = job.cfg, job.hw
    m = lay.grad_acc(job)
    f_hw, f_attn = hardware_flops_per_token(job, lay.recompute)
    imbalance = max(layers_per_rank(job, lay)) * lay.pp / cfg.n_layer
    compute = imbalance * job.global_seqs * cfg.block_size / job.gpus * time_model.compute_time(f_hw, f_attn, job)
    idle = theory_idle_fraction(lay.schedule, lay.pp, m, lay.v) if lay.pp > 1 else 0.0
    attn_share = f_attn / f_hw
    nbytes = comm_bytes(job, lay, mem["padded_params"])
    alpha = comm_latency(job, lay, mem["groups"])
    t = {axis: nbytes[axis] / link_bandwidth(job, lay, axis) + alpha[axis] for axis in ("tp", "cp", "pp", "ep")}
    t["tp"] = max(0.0, t["tp"] - job.tp_overlap * compute)
    if job.pp_overlap and lay.pp > 1:
        t["pp"] = t["pp"] * 2 * (lay.pp - 1) / (2 * m * lay.v)
    t["cp"] = max(0.0, t["cp"] - attn_share * compute)
    bw = link_bandwidth(job, lay, "dp")
    reduce, gather = nbytes["dp_reduce"] / bw, (nbytes["dp"] - nbytes["dp_reduce"]) / bw
    reduce += alpha["dp"] * nbytes["dp_reduce"] / max(nbytes["dp"], 1)
    gather += alpha["dp"] * (1 - nbytes["dp_reduce"] / max(nbytes["dp"], 1))
    if lay.zero_stage == 3:
        t["dp"] = max(0.0, reduce + gather - compute * job.dp_overlap)
    else:
        window = 2 / 3 * compute / (1 if lay.zero_stage == 2 else m) * job.dp_overlap
        t["dp"] = max(0.0, reduce - window) + gather
    attn_hbm = eager_attention_time(job, lay)
    parts = dict(compute=compute, attn_hbm=attn_hbm, bubble=(compute + attn_hbm) * idle / (1 - idle), **t,
                 optimizer=2 * (mem["params"] + mem["grads"] + mem["optimizer"]) / hw["hbm"])
    parts["total"] = sum(parts.values())
    return parts


def evaluate(job, lay):
    """The full prediction for one layout, as --json prints it."""
    validate(job, lay)
    mem = memory(job, lay)
    time = step_time(job, lay, mem)
    tokens = job.global_seqs * job.cfg.block_size
    tps = tokens / time["total"]
    return dict(asdict(lay), mem_bytes={k: mem[k] for k in MEM_PARTS},
                time_s=time, step_time_s=time["total"], tokens_per_s=tps,
                mfu=tps * plan_shape.flops_per_token(job) / (job.gpus * job.peak),
                oom=mem["total"] > USABLE * job.hw["mem"])


# ----------------------------------------------------------------------------------------------------------
# search

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(job):
    """The search space: tp within a node, cp <= 16 and micro-batch sizes <= 64 powers of two, every schedule (v = 2
    or 4 interleaved, 2 in a V for zbv and dualpipev) when pp > 1, ZeRO 0-3 (0-1 with pp), ep dividing dp*cp and
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
        for ep, (schedule, v), zero, rc, sp, mbs in product(eps, scheds, range(4 if pp == 1 else 2), RECOMPUTE,
                                                            (False, True) if tp > 1 else (False,), mbss):
            yield Layout(dp, tp, cp, pp, ep, sp, zero, schedule, v, mbs, rc)


def ranking_key(row):
    """Layouts that fit first, fastest first (ties: less memory); then OOM ones, smallest first."""
    speed = 0 if row["oom"] else -row["tokens_per_s"]
    return row["oom"], speed, row["mem_bytes"]["total"]


def rank_layouts(job):
    """Every valid layout evaluated, best first (ranking_key)."""
    rows = []
    for lay in candidate_layouts(job):
        try:
            rows.append(evaluate(job, lay))
        except ConfigError:
            continue
    return sorted(rows, key=ranking_key)


def launch_command(job, row):
    """The train_5d.py command line of a layout (flag names as in config.py)."""
    cfg = job.cfg
    flags = {k: row[k] for k in ("dp", "tp", "cp", "pp", "ep", "zero_stage", "micro_batch_size", "recompute")}
    flags.update(pp_schedule=row["schedule"], pp_virtual=row["v"], n_layer=cfg.n_layer, n_head=cfg.n_head,
                 n_embd=cfg.n_embd, block_size=cfg.block_size, global_batch_size=job.global_seqs,
                 dtype="float32" if job.precision == "fp32" else "bfloat16")
    if cfg.n_experts:
        flags.update(n_experts=cfg.n_experts, top_k=cfg.top_k)
    if cfg.capacity_factor:
        flags.update(capacity_factor=cfg.capacity_factor)
    args = " ".join(f"--{k} {v}" for k, v in flags.items()) + (" --sp" if row["sp"] else "")
    return (f"torchrun --nnodes {max(1, job.gpus // job.gpus_per_node)} --nproc_per_node "
            f"{min(job.gpus, job.gpus_per_node)} train_5d.py {args}")


# ----------------------------------------------------------------------------------------------------------
# printed table and main (the flags are plan_inputs.parse_args)

HEADER = ("  #   dp tp cp  pp ep sp zero    schedule v mbs recompute | params  grads  optim   acts other  total GiB | "
          "compute attnHBM  bubble      tp      cp      dp      pp      ep (ms) |   tokens/s   MFU")


def format_row(i, r):
    """Row i of the table: the layout, memory parts in GiB, time parts in ms, tokens/s, MFU, fits or OOM."""
    mem, t = r["mem_bytes"], r["time_s"]
    return (f"{i:3d} {r['dp']:4d} {r['tp']:2d} {r['cp']:2d} {r['pp']:3d} {r['ep']:2d} {'y' if r['sp'] else '-':>2s} "
            f"{r['zero_stage']:4d} {r['schedule'] if r['pp'] > 1 else '-':>11s} {r['v']} {r['micro_batch_size']:3d} "
            f"{r['recompute']:>9s} | " + " ".join(f"{mem[k] / GIB:6.1f}" for k in MEM_PARTS) + " | "
            + " ".join(f"{1e3 * t[k]:7.1f}" for k in ("compute", "attn_hbm", "bubble", "tp", "cp", "dp", "pp", "ep"))
            + f" | {r['tokens_per_s']:10.0f} {100 * r['mfu']:5.1f}% {'OOM' if r['oom'] else 'fits'}")


def print_table(job, rows, top):
    """The job in one line, the first `top` rows, how many fit and the launch command of the best."""
    cfg = job.cfg
    print(f"{plan_shape.num_params(job) / 1e9:.2f}B params (L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}, "
          f"kv={job.n_kv_head or cfg.n_head}, f={plan_shape.ffn(job)}{' gated' if job.gated else ''}, V="
          f"{cfg.padded_vocab_size}{'' if job.tied else ' untied'}), {plan_shape.flops_per_token(job) / 1e9:.1f} "
          f"GFLOP/token; {job.gpus} x {job.gpu}, "
          f"{job.gpus_per_node}/node; seq {cfg.block_size}, {job.global_seqs} sequences/step, {job.precision}")
    print(HEADER)
    print("\n".join(format_row(i + 1, r) for i, r in enumerate(rows[:top])))
    gpt = (job.n_kv_head in (0, cfg.n_head) and plan_shape.ffn(job) == 4 * cfg.n_embd and not job.gated and job.tied
           and not (job.first_stage_layers or job.last_stage_layers) and rows[0]["recompute"] != "op")
    print(("OOM: no layout fits (the smallest is first). " if rows[0]["oom"] else "")
          + f"{sum(not r['oom'] for r in rows)} of {len(rows)} layouts fit. Launch"
          + ("" if gpt else " (model.py's GPT of this depth and width: train_5d has no GQA, SwiGLU, untied or uneven "
                            "stages, nor recompute op)") + f":\n{launch_command(job, rows[0])}")


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
    """plan_inputs.HARDWARE's key for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100'), or None."""
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
    """plan.py's Job for this run."""
    model = GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                      n_embd=cfg.n_embd, n_experts=cfg.n_experts, top_k=cfg.top_k, moe_every=cfg.moe_every)
    return Job(model, world, gpus_per_node, gpu, cfg.global_batch_size, precision, "flash", cfg.bucket_mb)


def choose_layout(job, memory_bytes, accepts):
    """(best row that `accepts` takes and that fits memory_bytes, the ranked rows it was chosen from)."""
    rows = [r for r in rank_layouts(job) if accepts(r)]
    fits = [r for r in rows if not r["oom"] and r["mem_bytes"]["total"] <= USABLE * memory_bytes]
    check(fits, f"--layout auto: no layout train_5d.py runs fits {memory_bytes / GIB:.1f} GiB per GPU for this "
                f"model and batch (plan.py ranks {len(rows)}); try a smaller --micro_batch_size or model")
    return fits[0], fits


def apply_auto_layout(cfg, vocab_size, device, world, is_main, validate):
    """Replace cfg's layout flags by plan.py's choice for this run among those `validate` (train_5d's) accepts."""
    name = cfg.plan_gpu or (torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    gpu = name if name in HARDWARE else gpu_kind(name)
    check(gpu is not None, f"--layout auto plans for a GPU plan.py knows ({', '.join(HARDWARE)}), found "
                           f"{name or device.type!r}: give the degrees (--dp --tp --cp --pp --ep), or --plan_gpu")
    memory = HARDWARE[gpu]["mem"]
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
        rows = [evaluate(job, parse_layout(a.layout, job))] if a.layout else rank_layouts(job)
    except ConfigError as e:
        fail(str(e))
    if not rows:
        fail("no layout divides this model, batch and cluster")
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print_table(job, rows, a.top)
    return rows


if __name__ == "__main__":
    main()
