"""
planner/memory.py: plan.py's memory per GPU of a layout, by part. Formulas only; each part is a function with its
formula in the docstring, and the tests hold each against what the rungs count (tests/test_plan.py).

    memory per GPU = params + grads + optimizer   zero_state_bytes over train_zero's flat groups (padding included)
                   + activations                  in_flight micro-batch-chunks x blocks per chunk x
                                                  layer_activation_bytes (Korthikanti et al. 2022 with TP/SP at
                                                  s/cp tokens) + head_activation_bytes on the last stage
                   + other                        the loss's working set, ZeRO buffers, p2p and CP buffers, cuBLAS
                                                  workspaces, pipeline outputs kept (planner/runtime_memory.py)
                   = allocated (torch.cuda.max_memory_allocated)
    reserved       = allocated + ALLOCATOR_RESERVE x (activations + other), at most usable_bytes where the allocated fit
                                                 (torch.cuda.max_memory_reserved: the caching allocator's blocks; states
                                                  are allocated once, the rest churns; under pressure the allocator
                                                  frees its cache and retries instead of failing)
    on the device  = reserved + CUDA_CONTEXT + NCCL_COMM_BYTES per communicator   (what nvidia-smi shows)
    OOM            reserved > usable_bytes = the GPU's total capacity - CUDA_CONTEXT - NCCL_COMM_BYTES per communicator
                   (with the cap: the live tensors alone do not fit)
    of the fullest pipeline rank (peak_rank says which; stages.peak_candidates). Those constants, their sources and
    the verdict (fits, close, OOM): planner/device_memory.py.

Stages are placed as pipeline_schedules.stage_of places them: round-robin (stage c*p + rank is chunk c of rank),
or in a V for zbv and dualpipev (rank r holds stages r and 2p-1-r, so rank 0 holds both ends and the tied
embedding once); stage k holds shape.stage_layer_counts' k-th share of the layers (L/(p*v) unless the ends are
cut or p*v does not divide L): planner/stages.py. The model's shape (GQA, MLP width, gated, untied) comes from
plan_shape.
"""
import math
from dataclasses import replace
from functools import lru_cache

from model import activation_bytes_per_layer
from pipeline.schedules import placement_of, rank_of
from planner.device_memory import (ALLOCATOR_RESERVE, CUDA_CONTEXT, DEVICE_SHARE, NCCL_COMM_BYTES,  # noqa: F401
                                    capacity_of, communicators, usable_bytes)
from planner.inputs import PRECISION, model_state_bytes_per_param
from planner.head import loss_of, loss_saved_bytes, loss_transient_bytes
from planner.runtime_memory import pipeline_buffers_bytes, pipeline_outputs_bytes
from planner.stages import (block_sizes, end_ranks, layers_per_rank, moe_blocks, peak_candidates,  # noqa: F401
                             stage_blocks)          # where the stages are (planner/stages.py); plan.py's callers
                                                    # and the tests reach them here too
from planner.shape import (activation_delta_values, block_numels, embedding_numels, expert_start, held_layers,
                           job_of_shape, kv_dim, mlp_saved_values, norm_numels, norm_saved_bytes,
                           op_recompute_values)

MEM_PARTS = ("params", "grads", "optimizer", "activations", "other", "total", "reserved")

# CUBLAS_WORKSPACE: torch's cuBLAS and cuBLASLt workspaces, through the caching allocator (counted as allocated): 32
# MiB each on Hopper (torch's default CUBLAS_WORKSPACE_CONFIG ":4096:8", 8 x 4 MiB). What a GPU's memory holds
# besides the tensors, and the verdict: planner/device_memory.py.
CUBLAS_WORKSPACE = 2 * 32 * 2 ** 20


# ----------------------------------------------------------------------------------------------------------
# model states

@lru_cache(maxsize=None)
def flat_groups(cfg, tp, ep, pp, v, rank, stage, bucket_mb, placement="loop", experts=None):
    """Numels of train_zero.py's flat groups on this rank: stage 3 one unit per block (backward order) + the roots
    (embedding, final LayerNorm: one unit where one stage holds both; with more stages, as train_5d shards them, the
    embedding alone, so its two copies' shards line up, and ln_f (+ an untied head) another); stages 0-2
    train_ddp.assign_buckets over the parameters in reverse order, sized in fp32 bytes (train_zero builds the model in
    fp32 on the meta device). The vocab-parallel embedding (V/tp rows) is on the rank of the first stage and, tied, on
    the rank of the last (once when one rank holds both, as in a V); ln_f on the last. experts: None, every
    parameter; False, all but the MoE experts; True, the experts alone (train_5d shards them over edp with ep > 1: an
    MoE block's experts one unit at stage 3). cfg: a Job.shape."""
    job = job_of_shape(cfg)
    cfg = job.cfg
    moe = [cfg.is_moe_block(i) for i in stage_blocks(job, pp, v, rank, placement)]
    blocks = [block_numels(job, tp, ep, is_moe) for is_moe in moe]
    if experts is not None:                   # block_numels lists an MoE block's experts after its dense tensors
        k = expert_start(job)
        blocks = [(b[k:] if experts else b[:k]) if is_moe else ([] if experts else b) for b, is_moe in zip(blocks, moe)]
    if experts:
        if stage == 3:
            return tuple(sum(b) for b in reversed(blocks) if b)
        return bucket_numels([n for b in reversed(blocks) for n in reversed(b)], bucket_mb * 2 ** 20 / 4)
    first, last = rank == 0, rank == rank_of(pp * v - 1, pp, placement)
    embed = embedding_numels(job, tp, first, last)
    head = embed[-1:] if last and not job.tied else []          # untied: the LM head, after ln_f in backward
    embed = embed[:len(embed) - len(head)]
    tail = head + (norm_numels(job) if last else [])
    if stage == 3:
        roots = [embed, tail] if pp * v > 1 else [embed + tail]
        return tuple([sum(b) for b in reversed(blocks)] + [sum(r) for r in roots if r])
    ordered = embed + [n for b in blocks for n in b] + (norm_numels(job) if last else []) + head
    return bucket_numels(list(reversed(ordered)), bucket_mb * 2 ** 20 / 4)


def model_state(job, lay, rank):
    """(zero_state_bytes' parts summed, every flat group) on pipeline rank `rank`: the groups sharded over dp x cp,
    and with ep > 1 under ZeRO the experts' over their edp group (dp*cp/ep ranks), as train_5d shards them."""
    n, placement = lay.dp * lay.cp, placement_of(lay.schedule)
    split = lay.ep > 1 and lay.zero_stage > 0
    parts = [(False, n), (True, n // lay.ep)] if split else [(None, n)]
    total, groups = dict(params=0, grads=0, optimizer=0, padded=0), ()
    for experts, ranks in parts:
        these = flat_groups(job.shape, lay.tp, lay.ep, lay.pp, lay.v, rank, lay.zero_stage, bucket_mb(job, n),
                            placement, experts)
        st = cached_state_bytes(these, ranks, lay.zero_stage, PRECISION[job.precision][0], job.moments,
                                job.grad_dtype)
        total = {k: total[k] + st[k] for k in total}
        groups += these
    return total, groups


def bucket_mb(job, group):
    """The gradient bucket (MiB of fp32) over a reduction group of `group` ranks (dp x cp): job.bucket_mb, grown to
    job.bucket_mb_per_dp x group where that is larger (Megatron-Core's rule: timing.MCORE_BUCKET)."""
    return max(job.bucket_mb, job.bucket_mb_per_dp * group)


def bucket_numels(numels, bucket_numel):
    """train_ddp.assign_buckets' rule on parameter sizes (fp32: bucket_numel = bucket bytes / 4): consecutive
    parameters in backward order fill a bucket until the next would overflow it; a larger one is alone."""
    buckets, current = [], 0
    for n in numels:
        if current and current + n > bucket_numel:
            buckets.append(current)
            current = 0
        current += n
    return tuple(buckets + [current] if current else buckets)


def tp_activation_bytes_per_layer(seq_len, batch, cfg, tp, sp=False, **kw):
    """Korthikanti et al.'s activation bytes per layer under TP (+SP), from model.activation_bytes_per_layer (same
    keywords). TP splits all inside the TP regions; the two LayerNorm inputs, the inputs of c_attn and c_fc and the
    two residual dropout masks stay whole. SP splits those along the sequence too: everything is 1/tp."""
    full = activation_bytes_per_layer(seq_len, batch, cfg, **kw)
    if sp:
        return full / tp
    bpv, masks = kw.get("bytes_per_value", 2), 2 if kw.get("dropout", True) else 0
    whole = full if kw.get("recompute") == "full" else seq_len * batch * cfg.n_embd * (4 * bpv + masks)
    return whole + (full - whole) / tp


def zero_state_bytes(groups, n, stage, recipe, moments="fp32", grad_dtype="param"):
    """Model-state bytes per rank, groups padded to a multiple of n ranks (P' = sum ceil(g/n)*n; P' = P at stage 0),
    bytes per parameter (p, g, o) from inputs.model_state_bytes_per_param (bf16: 2, 2, 12; fp32: 4, 4, 8):
        stage 0: (p + g + o) P      stage 1: (p + g) P' + o P'/n      stage 2: p P' + (g + o) P'/n
        stage 3: (p + g + o) P'/n   (ZeRO paper, 7.5B on 64 GPUs, bf16: 120 / 31.4 / 16.6 / 1.9 GB)"""
    padded = sum(groups) if stage == 0 else sum(-(-g // n) * n for g in groups)
    b = model_state_bytes_per_param(recipe, moments, grad_dtype)
    return dict(params=b["params"] * padded / (n if stage >= 3 else 1),
                grads=b["grads"] * padded / (n if stage >= 2 else 1),
                optimizer=b["optim"] * padded / (n if stage >= 1 else 1), padded=padded)


# the search meets the same flat groups (a tuple) for every micro-batch size, recompute mode and schedule
cached_state_bytes = lru_cache(maxsize=None)(zero_state_bytes)


# ----------------------------------------------------------------------------------------------------------
# activations

def moe_routed_rows(job, lay):
    """(N, R, K) of one MoE block on the busiest expert rank: N tokens it routes (b*s, s = seq/cp, /t under SP where
    each tp rank routes its own chunk), R rows its experts compute, K rows it sent out and gets back (E experts,
    k = top_k, cf = capacity_factor):
        dropless (cf = 0)   R = K = N*k: the even share, ASSUMED, not a bound; a rank whose experts the router
                            favours computes more (bench/results/memory.md: the busier of two ranks)
        capacity (cf > 0)   R <= E * ceil(cf*N*k/E), K <= min(N*k, E * ceil(cf*N*k/E)), UPPER BOUNDS: model.route
                            keeps at most ceil(cf*N*k/E) rows per expert from each rank, and a rank's E/ep experts
                            hear from the ep ranks of its group (ep * E/ep * ceil(...))"""
    cfg = job.cfg
    n = lay.micro_batch_size * cfg.block_size // lay.cp // (lay.tp if lay.sp else 1)
    if cfg.capacity_factor <= 0:
        return n, n * cfg.top_k, n * cfg.top_k
    cap = cfg.n_experts * math.ceil(cfg.capacity_factor * n * cfg.top_k / cfg.n_experts)
    return n, cap, min(n * cfg.top_k, cap)


def moe_extra_bytes(job, lay):
    """Bytes an MoE block keeps beyond the dense block's count (whose MLP input, the router's input here, stays),
    as model.MoE with train_ep.ExpertParallelExperts saves them, (N, R, K) = moe_routed_rows, experts whole (not
    split over tp):
        router   N*E fp32 probabilities + N*k int64 top-k (+ N*k bool kept flags with a capacity; + N*k fp32
                 gates and their N sums where they are renormalized, Mixtral's router_renorm)
        experts  R * (h + m values: the gathered input rows and an expert MLP's shape.mlp_saved_values m, 8h for
                 4h GeLU experts, 4f for eager SwiGLU ones of width f; + h mask bytes with dropout + 2 int64
                 indices: the regrouping permutation and its inverse)
        combine  K * (2h values: the returned rows, kept by the gate multiply, and their product, which
                 index_add_ keeps though its backward needs only the shape; + 3 int64 indices + 1 fp32 gate)
        less the dense MLP's m values (b*s*m/t) and its dropout mask (b*s*h bytes, /t under SP), which the dense
        count holds (Korthikanti's 8h with activation_delta_values' m - 8h)"""
    cfg, bpv, t = job.cfg, PRECISION[job.precision][1], lay.tp
    h, mask = cfg.n_embd, cfg.dropout > 0
    tokens = lay.micro_batch_size * cfg.block_size // lay.cp
    n, rows, back = moe_routed_rows(job, lay)
    router = n * (4 * cfg.n_experts + 8 * cfg.top_k + cfg.top_k * (cfg.capacity_factor > 0)
                  + (4 * cfg.top_k + 4) * cfg.router_renorm)
    m = mlp_saved_values(job)
    experts = rows * ((h + m) * bpv + h * mask + 16)
    combine = back * (2 * h * bpv + 28)
    dense = tokens * m * bpv / t + tokens * h * mask / (t if lay.sp else 1)
    return router + experts + combine - dense


@lru_cache(maxsize=4096)     # asked for several times per layout (each pipeline rank, dense and MoE blocks)
def layer_activation_bytes(job, lay, moe=False, extras=True):
    """Bytes one block keeps for backward for one micro-batch of b sequences of s = seq/cp tokens:
    tp_activation_bytes_per_layer (Korthikanti eq. 2 with TP: sbh(10 + 24/t + 5as/(ht)), TP+SP: /t; with flash
    attention the 5as/h scores term is not stored, as with selective recompute), plus what this model keeps beyond
    the paper's count: q and k before and after RoPE (+2sbh/t values; none without RoPE, job.rope False: learned or
    ALiBi positions), the fp32 log-sum-exp of the fused attention (a*s*b*4/t bytes, gone with selective recompute),
    the two norms' fp32 statistics (shape.norm_saved_bytes: LayerNorm's mean and rstd, 16sb bytes; RMSNorm's rstd
    alone, 8sb; /t under SP), c_attn's and c_fc's inputs whole where autograd keeps them gathered under SP
    (job.tp_saves_gathered: +2sbh(1 - 1/t) values), an MoE block's moe_extra_bytes (extras=False: the paper's count
    alone), and residual_extra_bytes (the fp32 residual stream under amp).
    train_cp's attention output is laid out as SDPA's, so c_proj's input is a view of the one saved copy under cp."""
    cfg, bpv, t = job.cfg, PRECISION[job.precision][1], lay.tp
    s, b, h = job.cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd
    if lay.recompute == "op":
        block_input, kept, _ = op_recompute_values(job)
        lse = cfg.n_head * s * b * 4 / t
        return s * b * bpv * (block_input / (t if lay.sp else 1) + kept / t) + lse + residual_extra_bytes(job, lay, 1)
    rc = "selective" if (job.attn == "flash" and lay.recompute == "none") else lay.recompute
    base = tp_activation_bytes_per_layer(s, b, cfg, t, sp=lay.sp, bytes_per_value=bpv, recompute=rc,
                                         dropout=cfg.dropout > 0)
    if not extras:
        return base
    if lay.recompute == "full":
        return base + residual_extra_bytes(job, lay, 1)
    lse = cfg.n_head * s * b * 4 / t if (lay.recompute == "none" and job.attn == "flash") else 0
    rotated = 2 * h if job.rope else h - kv_dim(job)        # without RoPE no rotated q (h) and k (kv) copies
    stats = 2 * norm_saved_bytes(job) * s * b / (t if lay.sp else 1)
    extra = s * b * bpv * (rotated + activation_delta_values(job)) / t + lse + stats
    extra += 2 * s * b * h * bpv * (1 - 1 / t) if lay.sp and job.tp_saves_gathered else 0
    if moe:
        extra += moe_extra_bytes(job, lay)
    return base + extra + residual_extra_bytes(job, lay, 2)


def residual_extra_bytes(job, lay, copies):
    """Bytes beyond the 16-bit count for `copies` saved tensors of the residual stream (the block input under full or
    op recompute: 1; the two LayerNorm inputs otherwise: 2; ln_f's: 1), b*s*h values, /t under SP: under amp
    (job.fp32_residual) the stream is fp32. Autocast runs matmuls in bf16 but the embedding's output (an fp32 weight's
    rows) and each residual add (fp32 + bf16 promotes) stay fp32, and layer_norm is on autocast's fp32 list (torch's
    "Automatic Mixed Precision" docs, "CUDA Ops that can autocast to float32"), so each LayerNorm saves a 4-byte
    input where Korthikanti et al. count 2 (measured: torch's MemTracker on model.py under CPU autocast)."""
    cfg, bpv = job.cfg, PRECISION[job.precision][1]
    if not (job.fp32_residual and job.precision == "amp"):
        return 0
    tokens = lay.micro_batch_size * cfg.block_size // lay.cp
    return copies * tokens * cfg.n_embd * (4 - bpv) / (lay.tp if lay.sp else 1)


def head_activation_bytes(job, lay):
    """Last stage, per micro-batch: ln_f's input and the LM head's input (2sbh values, /t under SP; the fused head,
    which saves dh instead, the first alone), ln_f's statistics (shape.norm_saved_bytes) and the int64 targets (8sb
    bytes), what the loss saves (planner/head.loss_saved_bytes, each stack's own: the fp32 softmax of most, the
    16-bit logits and their log-sum-exp of a fused loss, dh and dW of the fused head) and the RoPE table."""
    cfg, bpv = job.cfg, PRECISION[job.precision][1]
    s, b, h = cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd
    inputs = 1 if loss_of(job, lay) == "linear_ce" else 2
    return (inputs * s * b * h * bpv / (lay.tp if lay.sp else 1) + (norm_saved_bytes(job) + 8) * s * b
            + loss_saved_bytes(job, lay) + s * (h // cfg.n_head) * 4 + residual_extra_bytes(job, lay, 1))


def in_flight(schedule, p, m, v, rank):
    """Micro-batch-chunks whose activations pipeline rank `rank` holds at its peak (forward done, backward, or the
    weight-gradient W of a split schedule, not yet), as pipeline_schedules.simulate counts them (tested equal):
        afab m    1f1b p - rank    zb1 p (W runs rank micro-batches late)    1 without pp
        interleaved min(2(p-rank-1) + (v-1)p + 1, v*m): its warm-up forwards + 1
        zbv min(2p, m + 1 + rank, 2m) (ZB-V: 1F1B's p micro-batches = 2p chunks once m >= 2p-1)
        dualpipev 2p + 1 (DeepSeek-V3 Table 2: PP+1 chunks with PP = 2p stages; m >= 2p)"""
    if p == 1:
        return 1
    return dict(afab=m, zb1=p, dualpipev=2 * p + 1, zbv=min(2 * p, m + 1 + rank, 2 * m),
                interleaved=min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)).get(schedule, p - rank)


def activation_bytes(job, lay, rank):
    """shape.held_layers (in_flight(rank) x L/(p*v) blocks when the chunks are even) x layer_activation_bytes
    + head_activation_bytes on the last stage's rank (x m for afab, else 1: every other schedule runs a
    micro-batch's last-stage backward right after its forward)."""
    placement = placement_of(lay.schedule)
    blocks = stage_blocks(job, lay.pp, lay.v, rank, placement)
    moe_share = moe_blocks(job, lay.pp, lay.v, rank, placement) / max(1, len(blocks))
    layer = (1 - moe_share) * layer_activation_bytes(job, lay) + moe_share * layer_activation_bytes(job, lay, True)
    total = held_layers(job, lay, rank, lay.grad_acc(job)) * layer
    if rank == end_ranks(lay)[1]:
        total += head_activation_bytes(job, lay) * (lay.grad_acc(job) if lay.schedule == "afab" and lay.pp > 1 else 1)
    return total


def other_bytes(job, lay, rank, groups):
    """Working sets beside states and activations at the start of the backward: the loss's (head.loss_transient_bytes,
    last stage) and the stage outputs a pipeline runtime keeps (runtime_memory.pipeline_outputs_bytes); ZeRO-2's two
    gradient buffers in flight (2 * largest bucket * g); ZeRO-3's gathered current + prefetched unit and the unit's
    full gradient ((2p + g) * largest unit); amp's bf16 copies of the weights (2 bytes per rank parameter, which the
    matmuls save for their backward; under ZeRO-3 only those of the two gathered units; under full recompute none of
    the blocks', but the one being recomputed); pipeline receive buffers (plan_runtime_memory); CP's K/V in flight
    (2 * 2b*s*h/t values); torch's cuBLAS and cuBLASLt workspaces (CUBLAS_WORKSPACE); under full recompute the
    block being recomputed: what it keeps without recompute, less its stored input, live until its backward ends
    (the last block's recompute starts after the loss's backward: the larger of the two counts)."""
    cfg, (recipe, bpv) = job.cfg, PRECISION[job.precision]
    s, b = cfg.block_size // lay.cp, lay.micro_batch_size
    sizes = model_state_bytes_per_param(recipe, job.moments, job.grad_dtype)
    out = CUBLAS_WORKSPACE
    loss = loss_transient_bytes(job, lay) if rank == end_ranks(lay)[1] else 0
    if lay.zero_stage == 2:
        out += 2 * max(groups) * sizes["grads"]
    if lay.zero_stage == 3:
        out += max(groups) * (2 * sizes["params"] + sizes["grads"])
    recomputed = 0      # full recompute: the blocks' casts are not saved (each is made again in its recompute)
    if lay.recompute == "full" and lay.zero_stage < 3:
        recomputed = list(block_sizes(job.shape, lay.tp, lay.ep, lay.pp, lay.v, rank, placement_of(lay.schedule)))
        recomputed = recomputed or [0]
    if job.precision == "amp":      # ZeRO-3 frees a unit's casts with its gathered weights: current + prefetched
        out += 2 * (2 * max(groups) if lay.zero_stage == 3 else sum(groups) - sum(recomputed or [0]))
    if lay.pp > 1:
        first, last = rank == 0, rank == end_ranks(lay)[1]
        held = in_flight(lay.schedule, lay.pp, lay.grad_acc(job), lay.v, rank) * (lay.v - first) / lay.v
        out += pipeline_outputs_bytes(job, lay, lay.v, last) + pipeline_buffers_bytes(job, lay, lay.v, first, last, held)
    if lay.cp > 1:
        out += 4 * s * b * kv_dim(job) / lay.tp * bpv
    block = 0       # under full recompute the block being recomputed, after the loss's gradients are freed
    if lay.recompute == "full":
        block = layer_activation_bytes(job, replace(lay, recompute="none")) - layer_activation_bytes(job, lay)
        block += 2 * max(recomputed) if job.precision == "amp" and recomputed else 0
    return out + max(loss, block)


def peak_bytes(job, lay, parts):
    """The tensors' peak (allocated): at the start of the backward, every part; a step of one micro-batch whose
    gradients were set to None after the last step (job.grads_freed) has none yet there (autograd allocates each as
    its backward runs, while the activations it frees are larger), so the peak is the larger of that point without
    them and the optimizer step's states (params + grads + optimizer + cuBLAS's workspaces)."""
    whole = sum(parts.values())
    if not (job.grads_freed and lay.grad_acc(job) == 1):
        return whole
    return max(whole - parts["grads"], parts["params"] + parts["grads"] + parts["optimizer"] + CUBLAS_WORKSPACE)


def rank_memory(job, lay, rank, usable):
    """Memory parts of pipeline rank `rank` (bytes), as memory() describes them, and the flat groups' count."""
    st, groups = model_state(job, lay, rank)
    parts = dict(params=st["params"], grads=st["grads"], optimizer=st["optimizer"],
                 activations=activation_bytes(job, lay, rank), other=other_bytes(job, lay, rank, groups))
    parts["total"] = peak_bytes(job, lay, parts)
    parts["reserved"] = parts["total"] + ALLOCATOR_RESERVE * (parts["activations"] + parts["other"])
    if parts["total"] <= usable:                  # the cache yields to live tensors before a cudaMalloc fails
        parts["reserved"] = min(parts["reserved"], usable)
    parts["padded_params"] = st["padded"]
    parts["groups"] = len(groups)        # buckets (ZeRO 0-2) or units (ZeRO-3): one collective each
    parts["peak_rank"] = rank
    return parts


def memory(job, lay):
    """Memory parts of the fullest pipeline rank (bytes), the max over peak_candidates (every rank, or the ends and
    the turn where no middle rank can hold more); peak_rank: which (the lowest of equals). total: what the tensors
    take at their peak (allocated); reserved: with the caching allocator's blocks beyond them (ALLOCATOR_RESERVE of
    the tensors that come and go); device: reserved + the CUDA context and NCCL's buffers (nvidia-smi's figure)."""
    best = None
    n = communicators(lay.dp, lay.tp, lay.cp, lay.pp, lay.ep)
    usable = usable_bytes(capacity_of(job), n)
    for rank in peak_candidates(job, lay):
        parts = rank_memory(job, lay, rank, usable)
        if best is None or (parts["reserved"], parts["total"]) > (best["reserved"], best["total"]):
            best = parts
    best["device"] = best["reserved"] + CUDA_CONTEXT + NCCL_COMM_BYTES * n
    best["usable"] = usable
    return best
