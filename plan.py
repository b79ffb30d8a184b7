"""
plan.py: predicted memory and step time of any dp x tp x cp x pp (x ep) layout of model.py's GPT, and the layouts
ranked for a cluster. Formulas only, nothing runs; each part is a function below with its formula in the docstring.

    python plan.py --model llama3-8b --gpus 64 --gpus_per_node 8 --gpu h100 --seq 8192 --global_batch_tokens 4M
    python plan.py --model gpt2-xl --gpus 8 --gpu a100 --seq 1024 --global_batch_tokens 512K \\
                   --layout tp=2,zero_stage=1,micro_batch_size=4,recompute=selective     # one layout in detail
    python plan.py ... --json      # one JSON object per layout considered, OOM ones included
    python plan.py --n_layer 24 --n_embd 2048 --n_head 16 --vocab 50257 ...     # any shape instead of --model

Rank order as train_5d.py builds its groups: tp innermost, then cp, dp, pp outermost; an axis whose group spans
<= gpus_per_node consecutive ranks runs on NVLink, else on the network. Gradients are reduced, and ZeRO shards,
over dp x cp; ep groups are carved out of dp.
    memory per GPU = params + grads + optimizer  (model_state_bytes_per_param; ZeRO padding as train_zero.py's)
                   + activations (Korthikanti et al. 2022 with TP/SP at s/cp tokens, x the schedule's in-flight
                                  micro-batches) + other (logits, buffers, 1 GiB CUDA context); OOM above 95%
    step time      = compute / (peak * eff) + bubble + exposed comm of each axis + optimizer step
"""
import argparse
import json
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from itertools import product

import torch

from config import ConfigError, check, fail
from metrics import GPU_PEAK_TFLOPS
from model import GPTConfig, flops_per_token, model_state_bytes_per_param, num_params
from pipeline_schedules import afab, interleaved, one_f_one_b, peak_in_flight, theory_idle_fraction, zb_h1
from train_ddp import assign_buckets
from train_tp import tp_activation_bytes_per_layer

GIB = 2 ** 30
# Per GPU. peak: metrics.GPU_PEAK_TFLOPS (dense bf16). mem, hbm (bytes/s), nvlink (per direction), net (per GPU, per
# direction): NVIDIA datasheets (A100 80GB SXM: NVLink3 600 GB/s, DGX A100 8x HDR 200 Gb/s; H100 SXM: NVLink4
# 900 GB/s, DGX H100 8x NDR 400 Gb/s; H200 141 GB; HGX B200 180 GB, NVLink5 1.8 TB/s).
# eff: fraction of peak the model FLOPs reach with communication hidden, measured by MosaicML llm-foundry
# (scripts/train/benchmarking/README.md: 7B, seq 2048, 8 GPUs, no activation checkpointing: A100-80GB 64.23%,
# H100-80GB 46.44% MFU = HFU). H200 and B200 have no such row: they take H100's (an assumption).
HARDWARE = {
    "a100": dict(peak="A100", mem=80 * GIB, hbm=2.039e12, nvlink=300e9, net=25e9, eff=0.6423),
    "h100": dict(peak="H100", mem=80 * GIB, hbm=3.35e12, nvlink=450e9, net=50e9, eff=0.4644),
    "h200": dict(peak="H200", mem=141e9, hbm=4.8e12, nvlink=450e9, net=50e9, eff=0.4644),
    "b200": dict(peak="B200", mem=180e9, hbm=8.0e12, nvlink=900e9, net=50e9, eff=0.4644),
}
LINK_EFF = 0.8          # NCCL bus bandwidth / link rate (nccl-tests all_reduce on DGX A100/H100: about 75-85%)
USABLE = 0.95           # allocator fragmentation margin
FRAMEWORK_BYTES = GIB   # CUDA context, cuBLAS workspace, NCCL buffers
# model.py's GPT at these shapes (GeLU MLP of 4h, tied embeddings, full multi-head attention): the llama3-* presets
# have Llama 3's depth, width, heads and vocabulary, not its SwiGLU / GQA (6.97B parameters for llama3-8b, not 8.03B)
MODELS = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab=50257),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25, vocab=50257),
    "llama3-8b": dict(n_layer=32, n_embd=4096, n_head=32, vocab=128256),
    "llama3-70b": dict(n_layer=80, n_embd=8192, n_head=64, vocab=128256),
    "llama3-405b": dict(n_layer=126, n_embd=16384, n_head=128, vocab=128256),
    "gpt3-175b": dict(n_layer=96, n_embd=12288, n_head=96, vocab=51200),
}
PRECISION = {   # model-state recipe of model.model_state_bytes_per_param, bytes per activation value
    "bf16": ("bf16", 2),   # bf16 params/grads + fp32 master and AdamW (train_zero.py --dtype bfloat16)
    "amp": ("fp32", 2),    # fp32 params/grads/AdamW, bf16 autocast (train_single.py on GPU)
    "fp32": ("fp32", 4),
}
RECOMPUTE = ("none", "selective", "full")
MEM_PARTS = ("params", "grads", "optimizer", "activations", "other", "total")


@dataclass(frozen=True)
class Job:
    """What is trained on what: the model, the cluster and the batch."""
    cfg: GPTConfig
    gpus: int
    gpus_per_node: int
    gpu: str
    global_seqs: int
    precision: str = "bf16"  # a PRECISION key
    attn: str = "flash"       # flash: no s x s scores stored (torch's fused SDPA); eager: Korthikanti's 5as/h term
    bucket_mb: float = 25.0
    eff: float = 0.0          # 0: the GPU's default

    @property
    def shape(self):
        """The model config as a hashable key (for the cached flat_groups)."""
        return tuple((k, getattr(self.cfg, k)) for k in ("vocab_size", "n_layer", "n_embd", "n_experts", "moe_every"))

    @property
    def hw(self):
        return HARDWARE[self.gpu]

    @property
    def peak(self):
        """Dense bf16 FLOP/s of the GPU's SXM board, from metrics.GPU_PEAK_TFLOPS (a datasheet cited per row)."""
        return GPU_PEAK_TFLOPS[(self.hw["peak"], "")][0] * 1e12


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    zero_stage: int = 0
    schedule: str = "1f1b"
    v: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"

    def grad_acc(self, job):
        return job.global_seqs // (self.dp * self.micro_batch_size)


def validate(job, lay):
    """Raise ConfigError unless the layout divides the world, the model, the sequence and the batch."""
    cfg = job.cfg
    check(lay.dp * lay.tp * lay.cp * lay.pp == job.gpus,
          f"dp*tp*cp*pp = {lay.dp}*{lay.tp}*{lay.cp}*{lay.pp} != {job.gpus} GPUs")
    check(cfg.n_head % lay.tp == 0, f"n_head={cfg.n_head} is not divisible by tp={lay.tp}")
    check(cfg.padded_vocab_size % lay.tp == 0, f"padded vocab {cfg.padded_vocab_size} not divisible by tp={lay.tp}")
    check(not lay.sp or lay.tp > 1, "sp needs tp > 1")
    check(lay.cp == 1 or cfg.block_size % (2 * lay.cp) == 0, f"seq={cfg.block_size} not divisible by 2*cp (zigzag)")
    check(lay.cp == 1 or job.attn == "flash", "eager attention is modelled without cp only")
    check(cfg.n_layer % (lay.pp * lay.v) == 0, f"n_layer={cfg.n_layer} not divisible by pp*v={lay.pp * lay.v}")
    check(job.global_seqs % (lay.dp * lay.micro_batch_size) == 0,
          f"global batch of {job.global_seqs} sequences not divisible by dp*micro_batch_size = "
          f"{lay.dp}*{lay.micro_batch_size}")
    check(lay.schedule in ("afab", "1f1b", "interleaved", "zb1"), f"unknown schedule {lay.schedule!r}")
    check((lay.v > 1) == (lay.schedule == "interleaved"), "v > 1 exactly when the schedule is interleaved")
    check(lay.schedule != "interleaved" or lay.grad_acc(job) % lay.pp == 0, "interleaved needs micro-batches % pp == 0")
    check(lay.zero_stage in (0, 1, 2, 3) and (lay.zero_stage < 3 or lay.pp == 1), "zero_stage 3 only with pp=1")
    check(lay.recompute in RECOMPUTE, f"unknown recompute {lay.recompute!r}")
    check(lay.ep == 1 or (cfg.n_experts % lay.ep == 0 and lay.dp % lay.ep == 0),
          f"ep={lay.ep} must divide n_experts={cfg.n_experts} and dp={lay.dp}")


# ----------------------------------------------------------------------------------------------------------
# memory: model states

def stage_blocks(cfg, pp, v, rank):
    """Global block indices on pipeline rank `rank`: stages rank, rank+p, ... of L/(p*v) blocks each."""
    per = cfg.n_layer // (pp * v)
    return [i for c in range(v) for i in range((c * pp + rank) * per, (c * pp + rank + 1) * per)]


def block_numels(cfg, tp, ep, moe):
    """One block's parameters on a tp rank, in model.parameters() order. Column-parallel c_attn / c_fc (weights and
    biases / tp), row-parallel projections (weights / tp, biases whole), LayerNorms whole; an MoE block has a whole
    router (E*h) and E/ep whole experts (8h^2 + 5h each) instead of the MLP."""
    h = cfg.n_embd
    attn = [h, h, 3 * h * h // tp, 3 * h // tp, h * h // tp, h, h, h]
    if moe:
        return attn + [cfg.n_experts * h] + [4 * h * h, 4 * h, 4 * h * h, h] * (cfg.n_experts // ep)
    return attn + [4 * h * h // tp, 4 * h // tp, 4 * h * h // tp, h]


@lru_cache(maxsize=None)
def flat_groups(cfg, tp, ep, pp, v, rank, stage, bucket_mb):
    """Numels of train_zero.py's flat groups on this rank: stage 3 one unit per block (backward order) + the root
    (embedding, final LayerNorm); stages 0-2 train_ddp.assign_buckets over the parameters in reverse order, sized in
    fp32 bytes (train_zero builds the model in fp32 on the meta device). The vocab-parallel embedding (V/tp rows) is
    on the first stage and, tied, on the last; ln_f on the last. cfg: a Job.shape."""
    cfg = GPTConfig(**dict(cfg))
    blocks = [block_numels(cfg, tp, ep, cfg.is_moe_block(i)) for i in stage_blocks(cfg, pp, v, rank)]
    first, last = rank == 0, rank == pp - 1
    embed = [cfg.padded_vocab_size * cfg.n_embd // tp] if first or last else []
    root = embed + ([cfg.n_embd, cfg.n_embd] if last else [])
    if stage == 3:
        return tuple([sum(b) for b in reversed(blocks)] + ([sum(root)] if root else []))
    ordered = embed + [n for b in blocks for n in b] + ([cfg.n_embd, cfg.n_embd] if last else [])
    metas = [torch.empty(n, device="meta") for n in reversed(ordered)]
    return tuple(sum(p.numel() for p in bucket) for bucket in assign_buckets(metas, bucket_mb * 2 ** 20))


def zero_state_bytes(groups, n, stage, recipe):
    """Model-state bytes per rank, groups padded to a multiple of n ranks (P' = sum ceil(g/n)*n; P' = P at stage 0),
    bytes per parameter (p, g, o) from model.model_state_bytes_per_param (bf16: 2, 2, 12; fp32: 4, 4, 8):
        stage 0: (p + g + o) P      stage 1: (p + g) P' + o P'/n      stage 2: p P' + (g + o) P'/n
        stage 3: (p + g + o) P'/n   (ZeRO paper, 7.5B on 64 GPUs, bf16: 120 / 31.4 / 16.6 / 1.9 GB)"""
    padded = sum(groups) if stage == 0 else sum(-(-g // n) * n for g in groups)
    b = model_state_bytes_per_param(recipe)
    return dict(params=b["params"] * padded / (n if stage >= 3 else 1),
                grads=b["grads"] * padded / (n if stage >= 2 else 1),
                optimizer=b["optim"] * padded / (n if stage >= 1 else 1), padded=padded)


# ----------------------------------------------------------------------------------------------------------
# memory: activations

def layer_activation_bytes(job, lay, moe=False, extras=True):
    """Bytes one block keeps for backward for one micro-batch of b sequences of s = seq/cp tokens:
    train_tp.tp_activation_bytes_per_layer (Korthikanti eq. 2 with TP: sbh(10 + 24/t + 5as/(ht)), TP+SP: /t; with
    flash attention the 5as/h scores term is not stored, as with selective recompute), plus what this model keeps
    beyond the paper's count: q and k before and after RoPE (+2sbh/t values), the fp32 log-sum-exp of the fused
    attention (a*s*b*4/t bytes, gone with selective recompute) and two LayerNorms' mean and rstd (16sb bytes, /t
    under SP; extras=False: the paper's count alone). An MoE block stores its MLP part (h + 8h/t values per token)
    once per routed expert (x top_k)."""
    cfg, bpv, t = job.cfg, PRECISION[job.precision][1], lay.tp
    s, b, h = job.cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd
    rc = "selective" if (job.attn == "flash" and lay.recompute == "none") else lay.recompute
    base = tp_activation_bytes_per_layer(s, b, cfg, t, sp=lay.sp, bytes_per_value=bpv, recompute=rc,
                                         dropout=cfg.dropout > 0)
    if lay.recompute == "full" or not extras:
        return base
    lse = cfg.n_head * s * b * 4 / t if (lay.recompute == "none" and job.attn == "flash") else 0
    extra = 2 * s * b * h * bpv / t + lse + 16 * s * b / (t if lay.sp else 1)
    if moe:
        extra += (cfg.top_k - 1) * s * b * h * bpv * (1 + 8 / t)
    return base + extra


def head_activation_bytes(job, lay):
    """Last stage, per micro-batch: ln_f input and LM-head input (2sbh values, /t under SP), their stats and the
    targets (16sb bytes), the fp32 softmax of the (vocab-parallel) cross-entropy (4*s*b*V/t) and the RoPE table."""
    cfg, bpv = job.cfg, PRECISION[job.precision][1]
    s, b, h = cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd
    return (2 * s * b * h * bpv / (lay.tp if lay.sp else 1) + 16 * s * b + 4 * s * b * cfg.padded_vocab_size / lay.tp
            + s * (h // cfg.n_head) * 4)


@lru_cache(maxsize=None)
def in_flight(schedule, p, m, v, rank):
    """Micro-batch-chunks whose activations pipeline rank `rank` holds at its peak, replayed from
    pipeline_schedules.py's action lists: afab m, 1f1b and zb1 p - rank, interleaved more. 1 without pp."""
    if p == 1:
        return 1
    if schedule == "interleaved":
        return peak_in_flight(interleaved(p, m, rank, v))
    return peak_in_flight({"afab": afab, "1f1b": one_f_one_b, "zb1": zb_h1}[schedule](p, m, rank))


def activation_bytes(job, lay, rank):
    """in_flight(rank) x (L/(p*v) blocks of layer_activation_bytes) + head_activation_bytes on the last stage
    (x m for afab, else 1: the last stage runs each micro-batch's backward right after its forward)."""
    blocks = stage_blocks(job.cfg, lay.pp, lay.v, rank)
    per_chunk = len(blocks) // lay.v
    moe_share = sum(job.cfg.is_moe_block(i) for i in blocks) / len(blocks)
    layer = (1 - moe_share) * layer_activation_bytes(job, lay) + moe_share * layer_activation_bytes(job, lay, True)
    total = in_flight(lay.schedule, lay.pp, lay.grad_acc(job), lay.v, rank) * per_chunk * layer
    if rank == lay.pp - 1:
        total += head_activation_bytes(job, lay) * (lay.grad_acc(job) if lay.schedule == "afab" and lay.pp > 1 else 1)
    return total


def other_bytes(job, lay, rank, groups):
    """Working sets beside states and activations: the logits of one micro-batch in compute dtype plus their fp32
    copy (s*b*V/t*(bpv + 4), last stage); ZeRO-2's two gradient buffers in flight (2 * largest bucket * g);
    ZeRO-3's gathered current + prefetched unit and the unit's full gradient ((2p + g) * largest unit); amp's bf16
    copies of the weights (2 bytes per rank parameter); p2p buffers (2 b*s*h values, /t under SP); CP's K/V in flight
    (2 * 2b*s*h/t values); FRAMEWORK_BYTES."""
    cfg, (recipe, bpv) = job.cfg, PRECISION[job.precision]
    s, b, h = cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd
    sizes = model_state_bytes_per_param(recipe)
    out = FRAMEWORK_BYTES
    if rank == lay.pp - 1:
        out += s * b * cfg.padded_vocab_size / lay.tp * (bpv + (4 if bpv < 4 else 0))
    if lay.zero_stage == 2:
        out += 2 * max(groups) * sizes["grads"]
    if lay.zero_stage == 3:
        out += max(groups) * (2 * sizes["params"] + sizes["grads"])
    if job.precision == "amp":
        out += 2 * sum(groups)
    if lay.pp > 1:
        out += 2 * s * b * h * bpv / (lay.tp if lay.sp else 1)
    if lay.cp > 1:
        out += 4 * s * b * h / lay.tp * bpv
    return out


def memory(job, lay):
    """Memory parts of the fuller of the first and the last pipeline rank (bytes)."""
    best = None
    for rank in sorted({0, lay.pp - 1}):
        groups = flat_groups(job.shape, lay.tp, lay.ep, lay.pp, lay.v, rank, lay.zero_stage, job.bucket_mb)
        st = zero_state_bytes(groups, lay.dp * lay.cp, lay.zero_stage, PRECISION[job.precision][0])
        parts = dict(params=st["params"], grads=st["grads"], optimizer=st["optimizer"],
                     activations=activation_bytes(job, lay, rank), other=other_bytes(job, lay, rank, groups))
        parts["total"] = sum(parts.values())
        parts["padded_params"] = st["padded"]
        if best is None or parts["total"] > best["total"]:
            best = parts
    return best


# ----------------------------------------------------------------------------------------------------------
# time

def link_bandwidth(job, lay, axis):
    """Bytes/s of the link an axis crosses: its group spans tp (tp), tp*cp (cp), tp*cp*ep (ep), tp*cp*dp (dp) or all
    (pp) consecutive ranks; within a node NVLink, else the GPU's network share; times LINK_EFF."""
    span = dict(tp=lay.tp, cp=lay.tp * lay.cp, ep=lay.tp * lay.cp * lay.ep, dp=lay.tp * lay.cp * lay.dp,
                pp=job.gpus)[axis]
    return (job.hw["nvlink"] if span <= job.gpus_per_node else job.hw["net"]) * LINK_EFF


def hardware_flops_per_token(cfg, recompute):
    """model.flops_per_token (6N + 12*L*h*T) plus what recompute adds: full a second forward of every block
    (2 N_blocks + 4*L*h*T), selective the attention scores' forward (4*L*h*T)."""
    L, h, T = cfg.n_layer, cfg.n_embd, cfg.block_size
    blocks = num_params(cfg, cfg.top_k if cfg.n_experts else None) - h * cfg.padded_vocab_size - 2 * h
    extra = dict(none=0, selective=4 * L * h * T, full=2 * blocks + 4 * L * h * T)[recompute]
    return flops_per_token(cfg) + extra


def comm_bytes(job, lay, padded):
    """Bytes this rank sends per step on each axis (comm.py's ring convention, part = (n-1)/n), m micro-batches,
    S = b*s*h*bpv of one micro-batch's activations (s = seq/cp), L/pp blocks on the rank:
        tp  m*L/pp * part_t * S * (8 TP: 2 all-reduces fwd + 2 bwd | 10 SP: 2 AG + 2 RS fwd, 4 AG + 2 RS bwd) + 4 more
            per block under full recompute (test_tp.py counts these)
        cp  m*L/pp * ((cp-1)*2 KV + cp * dKV (fp32)), + (cp-1) KV with full recompute, KV = 2b*s*h/t*bpv (train_cp)
        dp  over n = dp*cp, P' padded rank params, p/g bytes: stage 0 all-reduce 2 part P g; 1: RS part P' g + AG
            part P' p; 2: RS per micro-batch m part P' g + AG part P' p; 3: 2m part P' p (AG fwd+bwd) + m part P' g
        pp  2*m*v*S/(t if SP) (activations forward, gradients back)
        ep  per MoE block and micro-batch 4 * part_ep * top_k * b*s*h*bpv (dispatch + combine, fwd + bwd)"""
    cfg, (recipe, bpv) = job.cfg, PRECISION[job.precision]
    s, b, h, m, t = cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd, lay.grad_acc(job), lay.tp
    S, blocks = b * s * h * bpv, cfg.n_layer // lay.pp
    full = lay.recompute == "full"
    out = dict(tp=0.0, cp=0.0, dp=0.0, dp_reduce=0.0, pp=0.0, ep=0.0)
    if t > 1:
        out["tp"] = m * blocks * (t - 1) / t * S * ((10 if lay.sp else 8) + 4 * full)
    if lay.cp > 1:
        kv = 2 * b * s * h / t * bpv
        out["cp"] = m * blocks * ((lay.cp - 1) * kv * (2 + full) + lay.cp * kv * 4 / bpv)
    n = lay.dp * lay.cp
    if n > 1:
        part, sz = (n - 1) / n * padded, model_state_bytes_per_param(recipe)
        reduce = dict(zip((0, 1, 2, 3), (2 * part * sz["grads"], part * sz["grads"], m * part * sz["grads"],
                                         m * part * sz["grads"])))[lay.zero_stage]
        gather = dict(zip((0, 1, 2, 3), (0, part * sz["params"], part * sz["params"],
                                         2 * m * part * sz["params"])))[lay.zero_stage]
        out["dp"], out["dp_reduce"] = reduce + gather, reduce
    if lay.pp > 1:
        out["pp"] = 2 * m * lay.v * S / (t if lay.sp else 1)
    if lay.ep > 1:
        moe = sum(cfg.is_moe_block(i) for i in stage_blocks(cfg, lay.pp, lay.v, 0))
        out["ep"] = m * moe * 4 * (lay.ep - 1) / lay.ep * cfg.top_k * b * s * h * bpv
    return out


def step_time(job, lay, mem):
    """Seconds per optimizer step by part:
        compute    tokens * hardware_flops_per_token / world / (peak * eff)
        bubble     compute * f/(1-f), f = pipeline_schedules.theory_idle_fraction ((p-1)/(m+p-1), /v interleaved,
                   zb1 (p-1)/(3m+p-1))
        tp, pp, ep comm bytes / link bandwidth, exposed whole
        cp         exposed beyond the attention compute it overlaps (ring hops run under the block attention)
        dp         reductions exposed beyond the backward they overlap (stage 0-1: the last micro-batch's, 2/3 of
                   compute/m; stage 2: every backward, 2/3 of compute; stage 3 also the gathers, all compute);
                   stage 1-2's all-gather after the step is exposed
        optimizer  read + write of the rank's model states at HBM bandwidth"""
    cfg, hw = job.cfg, job.hw
    peak, eff, m = job.peak, job.eff or hw["eff"], lay.grad_acc(job)
    f_hw = hardware_flops_per_token(cfg, lay.recompute)
    compute = job.global_seqs * cfg.block_size * f_hw / job.gpus / (peak * eff)
    idle = theory_idle_fraction(lay.schedule, lay.pp, m, lay.v) if lay.pp > 1 else 0.0
    attn_share = 12 * cfg.n_layer * cfg.n_embd * cfg.block_size * (1 + (lay.recompute != "none") / 3) / f_hw
    nbytes = comm_bytes(job, lay, mem["padded_params"])
    t = {axis: nbytes[axis] / link_bandwidth(job, lay, axis) for axis in ("tp", "cp", "pp", "ep")}
    t["cp"] = max(0.0, t["cp"] - attn_share * compute)
    bw = link_bandwidth(job, lay, "dp")
    reduce, gather = nbytes["dp_reduce"] / bw, (nbytes["dp"] - nbytes["dp_reduce"]) / bw
    if lay.zero_stage == 3:
        t["dp"] = max(0.0, reduce + gather - compute)
    else:
        window = 2 / 3 * compute / (1 if lay.zero_stage == 2 else m)
        t["dp"] = max(0.0, reduce - window) + gather
    parts = dict(compute=compute, bubble=compute * idle / (1 - idle), **t,
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
                mfu=tps * flops_per_token(job.cfg) / (job.gpus * job.peak),
                oom=mem["total"] > USABLE * job.hw["mem"])


# ----------------------------------------------------------------------------------------------------------
# search

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(job):
    """The search space: tp within a node, cp <= 16 and micro-batch sizes <= 64 powers of two, every schedule (v = 2
    or 4 interleaved) when pp > 1, ZeRO 0-3 (0-1 with pp), the three recompute modes, SP on and off."""
    world, node = job.gpus, job.gpus_per_node
    grid = [(tp, cp, pp) for tp in divisors(world) if tp <= node for cp in divisors(world // tp) if cp & (cp - 1) == 0
            and cp <= 16 for pp in divisors(world // (tp * cp))]
    for tp, cp, pp in grid:
        dp = world // (tp * cp * pp)
        scheds = [("1f1b", 1)] if pp == 1 else [("afab", 1), ("1f1b", 1), ("zb1", 1), ("interleaved", 2),
                                                ("interleaved", 4)]
        eps = [e for e in divisors(dp) if job.cfg.n_experts % e == 0] if job.cfg.n_experts else [1]
        mbss = [2 ** i for i in range(7) if 2 ** i <= job.global_seqs // dp]
        for ep, (schedule, v), zero, rc, sp, mbs in product(eps, scheds, range(4 if pp == 1 else 2), RECOMPUTE,
                                                            (False, True) if tp > 1 else (False,), mbss):
            yield Layout(dp, tp, cp, pp, ep, sp, zero, schedule, v, mbs, rc)


def rank_layouts(job):
    """Every valid layout evaluated, best first: those that fit by tokens/s (ties: less memory), then OOM by memory."""
    rows = []
    for lay in candidate_layouts(job):
        try:
            rows.append(evaluate(job, lay))
        except ConfigError:
            continue
    return sorted(rows, key=lambda r: (r["oom"], 0 if r["oom"] else -r["tokens_per_s"], r["mem_bytes"]["total"]))


def launch_command(job, row):
    """The train_5d.py command line of a layout (flag names as in config.py)."""
    cfg = job.cfg
    flags = {k: row[k] for k in ("dp", "tp", "cp", "pp", "ep", "zero_stage", "micro_batch_size", "recompute")}
    flags.update(pp_schedule=row["schedule"], pp_virtual=row["v"], n_layer=cfg.n_layer, n_head=cfg.n_head,
                 n_embd=cfg.n_embd, block_size=cfg.block_size, global_batch_size=job.global_seqs,
                 dtype="float32" if job.precision == "fp32" else "bfloat16")
    if cfg.n_experts:
        flags.update(n_experts=cfg.n_experts, top_k=cfg.top_k)
    args = " ".join(f"--{k} {v}" for k, v in flags.items()) + (" --sp" if row["sp"] else "")
    return (f"torchrun --nnodes {max(1, job.gpus // job.gpus_per_node)} --nproc_per_node "
            f"{min(job.gpus, job.gpus_per_node)} train_5d.py {args}")


# ----------------------------------------------------------------------------------------------------------
# command line

def parse_tokens(text):
    """'4M' -> 4 * 2^20 tokens (K, M, G binary, as global batches are usually powers of two)."""
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    check(number.replace(".", "", 1).isdigit(), f"--global_batch_tokens: cannot read {text!r} (e.g. 4M, 524288)")
    return int(float(number) * scale)


def parse_layout(text, job):
    """'tp=4,zero_stage=1,schedule=interleaved,...' (Layout's fields; dp defaults to gpus / (tp*cp*pp))."""
    kinds, values = {f.name: f.type for f in fields(Layout)}, {}
    for key, _, value in (item.partition("=") for item in text.split(",") if item):
        check(key in kinds, f"--layout: unknown key {key!r}; known: {', '.join(kinds)}")
        check(kinds[key] is not int or value.isdigit(), f"--layout: {key}={value!r} is not a positive integer")
        values[key] = value in ("1", "true") if kinds[key] is bool else kinds[key](value)
    rest = values.get("tp", 1) * values.get("cp", 1) * values.get("pp", 1)
    check(rest > 0 and job.gpus % rest == 0, f"tp*cp*pp = {rest} does not divide {job.gpus} GPUs")
    values.setdefault("dp", job.gpus // rest)
    values.setdefault("v", 2 if values.get("schedule") == "interleaved" else 1)
    return Layout(**values)


def build_job(a):
    check(a.gpu in HARDWARE, f"unknown GPU {a.gpu!r}; known: {', '.join(HARDWARE)}")
    check(a.model is None or a.model in MODELS, f"unknown model {a.model!r}; known: {', '.join(MODELS)}")
    shape = {**MODELS.get(a.model, {}), **{k: getattr(a, k) for k in SHAPE if getattr(a, k)}}
    check(len(shape) == 4, "give --model or all of --n_layer --n_embd --n_head --vocab")
    check(shape["n_embd"] % shape["n_head"] == 0, "n_embd must be divisible by n_head")
    check(min(a.gpus, a.gpus_per_node, a.seq) > 0, "--gpus, --gpus_per_node and --seq must be positive")
    tokens = parse_tokens(a.global_batch_tokens)
    check(tokens % a.seq == 0 and tokens >= a.seq, f"global batch of {tokens} tokens is not a multiple of seq={a.seq}")
    cfg = GPTConfig(vocab_size=shape["vocab"], block_size=a.seq, n_layer=shape["n_layer"], n_head=shape["n_head"],
                    n_embd=shape["n_embd"], n_experts=a.n_experts, top_k=a.top_k)
    return Job(cfg, a.gpus, a.gpus_per_node, a.gpu, tokens // a.seq, a.precision, a.attn, a.bucket_mb, a.eff)


HEADER = ("  #   dp tp cp  pp ep sp zero    schedule v mbs recompute | params  grads  optim   acts other  total GiB | "
          "compute  bubble      tp      cp      dp      pp      ep (ms) |   tokens/s   MFU")


def format_row(i, r):
    mem, t = r["mem_bytes"], r["time_s"]
    return (f"{i:3d} {r['dp']:4d} {r['tp']:2d} {r['cp']:2d} {r['pp']:3d} {r['ep']:2d} {'y' if r['sp'] else '-':>2s} "
            f"{r['zero_stage']:4d} {r['schedule'] if r['pp'] > 1 else '-':>11s} {r['v']} {r['micro_batch_size']:3d} "
            f"{r['recompute']:>9s} | " + " ".join(f"{mem[k] / GIB:6.1f}" for k in MEM_PARTS) + " | "
            + " ".join(f"{1e3 * t[k]:7.1f}" for k in ("compute", "bubble", "tp", "cp", "dp", "pp", "ep"))
            + f" | {r['tokens_per_s']:10.0f} {100 * r['mfu']:5.1f}% {'OOM' if r['oom'] else 'fits'}")


SHAPE = ("n_layer", "n_embd", "n_head", "vocab")
FLAGS = [("n_experts", int, 0, "experts per MoE block (0: dense)"), ("top_k", int, 2, "experts per token"),
         ("gpus", int, 8, "GPUs in all"), ("gpus_per_node", int, 8, "GPUs sharing NVLink"),
         ("gpu", str, "h100", f"one of {', '.join(HARDWARE)}"), ("seq", int, 4096, "sequence length"),
         ("global_batch_tokens", str, "4M", "tokens per optimizer step (K/M/G binary)"),
         ("precision", str, "bf16", "bf16 (train_zero) | amp (fp32 states, bf16 autocast) | fp32"),
         ("attn", str, "flash", "flash (no s x s scores kept) | eager (Korthikanti's 5as/h term)"),
         ("bucket_mb", float, 25.0, "gradient bucket MiB (ZeRO padding)"),
         ("eff", float, 0.0, "compute efficiency (0: the GPU's default, see HARDWARE)"),
         ("layout", str, None, "evaluate one layout, e.g. tp=8,zero_stage=1,micro_batch_size=2"),
         ("top", int, 10, "rows printed")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=f"preset: {', '.join(MODELS)}")
    for k in SHAPE:
        ap.add_argument(f"--{k}", type=int, default=0, help="model shape (overrides the preset)")
    for name, kind, default, text in FLAGS:
        ap.add_argument(f"--{name}", type=kind, default=default, help=text,
                        choices=dict(precision=list(PRECISION), attn=["flash", "eager"]).get(name))
    ap.add_argument("--json", action="store_true", help="one JSON object per layout (OOM ones included)")
    a = ap.parse_args(argv)
    try:
        job = build_job(a)
        rows = [evaluate(job, parse_layout(a.layout, job))] if a.layout else rank_layouts(job)
    except ConfigError as e:
        fail(str(e))
    if not rows:
        fail("no layout divides this model, batch and cluster")
    for r in rows if a.json else []:
        print(json.dumps(r))
    if not a.json:
        cfg = job.cfg
        print(f"{num_params(cfg) / 1e9:.2f}B params (L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}, V="
              f"{cfg.padded_vocab_size}), {flops_per_token(cfg) / 1e9:.1f} GFLOP/token; {job.gpus} x {job.gpu}, "
              f"{job.gpus_per_node}/node; seq {cfg.block_size}, {job.global_seqs} sequences/step, {job.precision}")
        print(HEADER)
        print("\n".join(format_row(i + 1, r) for i, r in enumerate(rows[:a.top])))
        print(("OOM: no layout fits (the smallest is first). " if rows[0]["oom"] else "")
              + f"{sum(not r['oom'] for r in rows)} of {len(rows)} layouts fit. Launch:\n{launch_command(job, rows[0])}")
    return rows


if __name__ == "__main__":
    main()
