"""
planner/comm.py: the bytes and seconds of plan.py's communication, per axis of a layout: the link each axis crosses,
the bytes each rank sends per step (comm.py's ring convention, exact against the rungs' counters) and NCCL's
latency per collective (timing.latency). plan.py's step_time subtracts what overlaps.

Rank order as train_5d.py builds its groups: tp innermost, then cp, dp, pp outermost; an axis whose group spans
<= gpus_per_node consecutive ranks runs on NVLink, else on the network.
"""
from planner import shape as plan_shape
from planner import timing as time_model
from pipeline.schedules import placement_of
from planner.inputs import LINK_EFF, PRECISION, model_state_bytes_per_param
from planner.memory import layers_per_rank, moe_blocks


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


def sp_collectives(job, recompute):
    """(collectives, of them in the open under torch's async TP) per block and micro-batch with sequence parallelism,
    each an all-gather or reduce-scatter of one micro-batch's [s, h] activations. The forward gathers the input of
    the attention's and the MLP's column-parallel matmuls and reduce-scatters the output of their row-parallel ones
    (2 + 2); the backward gathers the gradients arriving at the row-parallel outputs and reduce-scatters the input
    gradients (2 + 2), and gathers each column-parallel input again for the weight gradient unless autograd kept the
    gathered copy (job.tp_saves_gathered: torch DTensor keeps it, Megatron-LM, nanotron and train_tp keep the shard;
    under op recompute the gather is not kept and runs again either way). Full recompute runs the forward's four
    again. Megatron's count: 10, 14 with full recompute (megatron/core/tensor_parallel/layers.py,
    LinearWithGradAccumulationAndAsyncCommunication: the backward all-gathers the saved shard); DTensor's: 8, 12.
    In the open under job.tp_overlap_style "torch" (torch/_inductor/fx_passes/micro_pipeline_tp.py, which fuses an
    all-gather with the matmuls it feeds as their left operand and a reduce-scatter with the one matmul that produces
    its input): the backward's reduce-scatters, whose input is the sum of a group's matmuls (Llama's separate wq, wk,
    wv and w1, w3), and the gathers again, whose tensor a weight gradient reads as its right operand."""
    again = not job.tp_saves_gathered or recompute == "op"
    return 8 + 2 * again + 4 * (recompute == "full"), 2 + 2 * again


def comm_bytes(job, lay, padded):
    """Bytes this rank sends per step on each axis (comm.py's ring convention, part = (n-1)/n), m micro-batches,
    S = b*s*h*bpv of one micro-batch's activations (s = seq/cp), L_r blocks on the busiest pipeline rank:
        tp  m*L_r * part_t * S * (8 TP: 2 all-reduces fwd + 2 bwd, + 4 under full recompute | SP: sp_collectives,
            10 as train_tp runs it: 2 AG + 2 RS fwd, 4 AG + 2 RS bwd, + 4 under full recompute; test_tp.py counts them)
        cp  m*L_r * ((cp-1)*2 KV + cp * dKV), + (cp-1) KV with full recompute, KV = 2b*s*kv/t*bpv, kv the
            key/value width (h without GQA); train_cp's ring sends dK/dV in K/V's dtype (bf16 under autocast), so
            dKV = KV
        dp  over n = dp*cp, P' padded rank params, p/g bytes: stage 0 all-reduce 2 part P g; 1: RS part P' g + AG
            part P' p; 2: RS per micro-batch m part P' g + AG part P' p; 3: 2m part P' bpv (AG fwd+bwd) + m part P' g:
            ZeRO-3 gathers in the compute dtype (train_zero's all_gather_as under bf16 autocast, FSDP's param_dtype),
            ZeRO-1/2 gather the updated parameters in their own dtype (4 bytes under amp)
        pp  2*m*v*S/(t if SP) (activations forward, gradients back); with job.pp_scatter_gather (Megatron) S/t
            each, and tp all-gathers every arriving message: + 2*m*v*part_t*S on tp
        ep  per MoE block and micro-batch 4 * part_ep * top_k * b*s*h*bpv (dispatch + combine, fwd + bwd)"""
    cfg, (recipe, bpv) = job.cfg, PRECISION[job.precision]
    s, b, h, m, t = cfg.block_size // lay.cp, lay.micro_batch_size, cfg.n_embd, lay.grad_acc(job), lay.tp
    S, blocks = b * s * h * bpv, max(layers_per_rank(job, lay))
    full = lay.recompute == "full"
    out = dict(tp=0.0, cp=0.0, dp=0.0, dp_reduce=0.0, pp=0.0, ep=0.0)
    if t > 1:
        out["tp"] = m * blocks * (t - 1) / t * S * (sp_collectives(job, lay.recompute)[0] if lay.sp else 8 + 4 * full)
    if lay.cp > 1:
        kv = 2 * b * s * plan_shape.kv_dim(job) / t * bpv
        out["cp"] = m * blocks * ((lay.cp - 1) * kv * (2 + full) + lay.cp * kv)
    n = lay.dp * lay.cp
    if n > 1:
        part = (n - 1) / n * padded
        sizes = model_state_bytes_per_param(recipe, job.moments, job.grad_dtype)
        reduced = min(sizes["grads"], 4)         # grad_dtype both: the fp32 buffer is what is reduced
        reduce = {0: 2, 1: 1, 2: m, 3: m}[lay.zero_stage] * part * reduced
        wire = bpv if lay.zero_stage == 3 else sizes["params"]
        gather = {0: 0, 1: 1, 2: 1, 3: 2 * m}[lay.zero_stage] * part * wire
        out["dp"] = reduce + gather
        out["dp_reduce"] = reduce
    if lay.pp > 1:
        split = lay.sp or job.pp_scatter_gather
        out["pp"] = 2 * m * lay.v * S / (t if split else 1)
        out["tp"] += 2 * m * lay.v * (t - 1) / t * S if job.pp_scatter_gather and not lay.sp else 0
    if lay.ep > 1:
        moe = moe_blocks(job, lay.pp, lay.v, 0, placement_of(lay.schedule))
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
    """Seconds of NCCL latency (timing.latency) per step on each axis: the number of collectives each runs
    times the fixed cost of one. Per block and micro-batch: tp 4 all-reduces (TP; 6 with full recompute) or
    sp_collectives' all-gathers and reduce-scatters (SP), as comm_bytes counts them, + the all-gather of
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
            sp_count = sp_collectives(job, lay.recompute)[0]
            per = sp_count * lat["all_gather"] if lay.sp else (4 + 2 * full) * lat["all_reduce"]
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
            moe = moe_blocks(job, lay.pp, lay.v, 0, placement_of(lay.schedule))
            out[axis] = 4 * m * moe * lat["all_to_all"]
    return out


def dp_seconds(job, lay, nbytes, alpha, groups):
    """(reduce, gather) seconds of the data-parallel collectives before any overlap: their bytes over the dp link
    plus their share of `alpha`, NCCL's latency (comm_latency); ZeRO-0's all-reduce instead bucket by bucket (`groups`
    of them) as NCCL's model times one (timing.all_reduce_seconds: across nodes, the ring's latency for large
    messages and the tree's lower bandwidth)."""
    bw = link_bandwidth(job, lay, "dp")
    n, nodes, _ = axis_group(job, lay, "dp")
    if lay.zero_stage == 0 and n > 1:
        message = nbytes["dp_reduce"] * n / (2 * (n - 1)) / groups
        return groups * time_model.all_reduce_seconds(message, n, nodes, bw), 0.0
    share = nbytes["dp_reduce"] / max(nbytes["dp"], 1)
    reduce = nbytes["dp_reduce"] / bw + alpha * share
    return reduce, (nbytes["dp"] - nbytes["dp_reduce"]) / bw + alpha * (1 - share)


def tied_sync_time(job, lay):
    """Seconds of the tied embedding's gradient all-reduce between the first and the last pipeline stage, each rank's
    vocab-parallel shard (V/t x h elements, in the dtype the data-parallel reduction uses), a 2-rank all-reduce over
    pp's link (timing.all_reduce_seconds): it runs after the backward and before the optimizer step, with nothing
    left to hide it. So train_5d.py (pipeline_tied.tied_grads_sync at its gradients' finish), nanotron (trainer.py
    sync_tied_weights_gradients after the data-parallel wait, "TODO ... Put this in hooks so we can overlap
    communication with gradient computation") and Megatron-Core (distributed/finalize_model_grads.py
    _allreduce_word_embedding_grads, after finish_grad_sync). 0 untied, without pp, or where one rank holds both
    ends (the V-shaped schedules)."""
    if not job.tied or lay.pp == 1 or placement_of(lay.schedule) == "v":
        return 0.0
    recipe = PRECISION[job.precision][0]
    grad = min(model_state_bytes_per_param(recipe, job.moments, job.grad_dtype)["grads"], 4)
    message = job.cfg.padded_vocab_size * job.cfg.n_embd / lay.tp * grad
    nodes = 1 if axis_group(job, lay, "pp")[2] == "nvlink" else 2
    return time_model.all_reduce_seconds(message, 2, nodes, link_bandwidth(job, lay, "pp"))


# ----------------------------------------------------------------------------------------------------------
# what overlaps, as each stack runs it

def exposed_dp_time(job, lay, reduce, gather, calls, compute, bubble):
    """Seconds of the data-parallel reductions (`reduce`) and parameter gathers (`gather`) left on the step's path
    (`calls`: buckets, or ZeRO-3 units, each one collective per round), by how the stack overlaps them
    (job.dp_overlap, job.dp_overlap_style). A round's last bucket is ready only when the backward that fills it ends,
    so it is exposed whatever overlaps; `one_reduce` and `one_gather` are one bucket's share (its bytes and NCCL
    latency), m micro-batches per step:
        no overlap     reduce + gather
        ZeRO-3         prefetched gathers and reduce-scatters under the compute; each micro-batch's first gather and
                       last reduce-scatter exposed: max(reduce + gather - compute, m (one_gather + one_reduce))
        ddp            torch DDP / FSDP's no_sync, DeepSpeed: the last micro-batch's backward (2/3 compute / m; every
                       backward at ZeRO-2, which reduce-scatters each micro-batch) hides the reductions, less each
                       round's last bucket; ZeRO-1/2's gather after the optimizer step exposed
        mcore          Megatron-Core --overlap-grad-reduce: the last micro-batch's backward and the pipeline drain
                       (half the bubble) hide the reduce-scatters; --overlap-param-gather: the next step's first
                       forward (1/3 compute / m) and the fill (the other half) hide the gathers; one bucket of each
                       exposed"""
    m = lay.grad_acc(job)
    if not job.dp_overlap:
        return reduce + gather
    reduce_rounds = {0: 1, 1: 1, 2: m, 3: m}[lay.zero_stage]
    gather_rounds = {0: 1, 1: 1, 2: 1, 3: 2 * m}[lay.zero_stage]
    one_reduce, one_gather = reduce / (reduce_rounds * calls), gather / (gather_rounds * calls)
    if lay.zero_stage == 3:
        return max(reduce + gather - compute, m * (one_gather + one_reduce))
    backward = 2 / 3 * compute / (1 if lay.zero_stage == 2 else m)
    if job.dp_overlap_style == "mcore":
        hidden_reduce = max(reduce - backward - bubble / 2, one_reduce)
        return hidden_reduce + (max(gather - compute / 3 / m - bubble / 2, one_gather) if gather else 0.0)
    return max(reduce - backward, reduce_rounds * one_reduce) + gather


def exposed_tp_time(job, lay, comm, gemm_time, rows):
    """Seconds of tp communication (`comm`) left exposed when a share job.tp_overlap of it is pipelined with the GEMMs
    beside it (Transformer Engine's userbuffers: each all-gather / reduce-scatter in tp chunks, chunk k's transfer
    under chunk k-1's GEMM). Derived from the times that overlap, not a constant: each of the four GEMM groups of a
    block (shape.block_linears; `gemm_time` the rank's block GEMM seconds, split by their FLOPs) has a quarter
    of the bytes beside it; the first of its tp chunks cannot hide, the rest hide up to the GEMM's time:
        exposed_i = c_i / t + max(0, c_i (t-1)/t - g_i)
    and the GEMMs run as t chunks of rows/t rows each, slower by timing.gemm_rows_factor at rows/t over rows.
    The share not pipelined stays exposed. Under job.tp_overlap_style "torch" only the collectives torch's pass fuses
    are pipelined (sp_collectives: the rest are in the open, and so is all of it without SP), and their GEMMs'
    slowdown is charged in the same share."""
    x, t = job.tp_overlap, lay.tp
    if not x or t == 1 or not comm:
        return comm
    fused = 1.0                                      # the share of the bytes pipelined
    if job.tp_overlap_style == "torch" and not lay.sp:
        fused = 0.0                                  # torch's pass fuses all-gathers and reduce-scatters only
    elif job.tp_overlap_style == "torch":
        total, in_open = sp_collectives(job, lay.recompute)
        fused = 1 - in_open / total
    flops = [n_in * n_out for n_in, n_out in plan_shape.block_linears(job, t)]
    c = comm * fused
    pipelined = sum(c / 4 / t + max(0.0, c / 4 * (t - 1) / t - gemm_time * f / sum(flops)) for f in flops)
    slower = time_model.gemm_rows_factor(job, t, rows / t) / time_model.gemm_rows_factor(job, t, rows) - 1
    return x * (pipelined + comm - c + gemm_time * slower * fused) + (1 - x) * comm
