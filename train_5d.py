"""
train_5d.py: the rungs composed. Data, tensor, context, pipeline and expert parallelism on one grid of ranks,
each axis the building block of its own rung (imported, not rewritten), checked to train exactly like
train_single.

    torchrun --nproc_per_node=8 train_5d.py                                   # default grid: dp 2 x tp 2 x pp 2
    torchrun --nproc_per_node=8 train_5d.py --tp 2 --sp --cp 2 --pp 2         # tp, cp, pp (dp = 8 / 8 = 1)
    torchrun --nproc_per_node=8 train_5d.py --dp 4 --tp 2 --zero_stage 2      # ZeRO-2 over dp x cp
    torchrun --nproc_per_node=8 train_5d.py --dp 2 --tp 2 --sp --pp 2 --zero_stage 3   # ZeRO-3 (FSDP) in the grid
    torchrun --nproc_per_node=8 train_5d.py --dp 2 --pp 4 --pp_schedule interleaved --pp_virtual 2 --n_layer 8
    torchrun --nproc_per_node=8 train_5d.py --dp 4 --tp 2 --sp --ep 4 --n_experts 8   # MoE, experts over 4 ranks
    torchrun --nproc_per_node=8 train_5d.py --layout auto     # plan.py's best layout for this model and GPU
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 train_5d.py \\
        --tp 8 --pp 2                                     # two nodes: tp inside a node, pp across the two

The grid (grid.py; Megatron's rank order: tp innermost so a TP group shares a node's NVLink, then cp, dp, pp):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i          e.g. dp 2 x tp 2 x pp 2 on 8 ranks:
                                                                     stage 0: [0 1] [2 3]   stage 1: [4 5] [6 7]
                                                                               dp0   dp1             dp0   dp1
What each axis does in one optimizer step (each from its rung):
    tp  train_tp: heads / MLP columns / vocabulary rows split; 2 all-reduces per block forward and backward
        (--sp: reduce-scatter + all-gather, activations sequence-split outside the TP regions; without SP,
        --partition_activations: train_tp's ZeRO-R Pa, each recomputed block's input kept as 1/tp and gathered back)
    cp  train_cp: the sequence cut into cp chunks (zigzag by default); attention's K/V travel around a ring
    pp  train_pp: blocks cut into pp*pp_virtual stages; micro-batches flow through a schedule (afab, 1f1b,
        interleaved, zb1, and zbv / dualpipev with their stages in a V), activations and their gradients sent
        point to point
    dp  train_ddp: each (dp, cp) pair of coordinates holds its slice of the batch / sequence; gradients are
        averaged over the dp x cp group in flat buckets, each launched once the schedule's last backward writing
        it ends (compose/grad_ready.py), or train_zero's ZeRO-1/2 shards over it, or ZeRO-3's units: each
        chunk's blocks gathered block by block in every F and B action, reduce-scattered as each block's
        backward ends (experts, with ep > 1, sharded over their edp group instead; ZeRO-3: a unit per MoE block)
    ep  train_ep: with --n_experts, each MoE block's experts are shared out over ep consecutive ranks of the
        dp x cp group (ep | dp*cp); tokens go to their experts' ranks and back by all_to_all. Expert gradients
        are averaged over the ranks holding the same experts (edp), dense ones over dp x cp. Under --sp each TP
        rank routes its own sequence chunk, so no expert work repeats across tp; MoE blocks sit in stages like
        dense ones. Load balancing is global-batch (routing.py): the same objective in every layout.
A stage's blocks are tensor-parallel and their attention context-parallel (on the heads this TP rank holds).
Loss: each rank's last stage gives the mean over its tokens; the global-batch mean is the average over dp x cp
and micro-batches, exactly train_single's. Global grad norm: every shard counted once (TP replicas by TP rank 0,
the tied weight by the first stage), reduced over tp x pp (the dp x cp replicas agree after averaging).

Bytes per step (metrics.jsonl `comm_bytes_by_axis`, this rank, comm.py's ring convention) are each rung's own
formula with the sizes of the composed step: tp its block all-reduces on [b, T/cp, h], cp its ring on this TP
rank's heads, pp its p2p of [b, T/cp (/tp under SP), h], dp the all-reduce (ZeRO: reduce-scatters, one per
micro-batch for ZeRO-2, + all-gather) of this rank's gradients, ep train_ep's all_to_all rows that leave this
rank (and the all_gather of the row counts); ZeRO-3's dp is (gathers + m) (N-1)/N of each unit's padded bytes
(N: dp x cp, or edp for an experts unit; gathers: 2m when resharding after forward, none for a W action).
Checkpoints are one file in train_single's layout: any layout, or train_single, resumes any other. --kernels and
--fp8 apply inside the stages as in train_single, inside the parallel layers with tp > 1 (FP8 adds tp's amax
all-reduces: compose/fp8_tp.py), gathered by ZeRO-3 in fp32 or with --fp8_all_gather in FP8 (fp8_gather.py);
zb1, zbv and dualpipev defer the dW of nn.Linear, FP8, train_tp's layers and the fused LM head (docs/pipelines.md).
"""
import argparse
import functools
import time

import torch
import torch.distributed as dist

from common import comm
from common import checkpoint
from common.checkpoint import ModuleState, ShardState, named_parameters
from common.comm import COMM
from common.distributed import destroy, init_distributed, world_size_from_env
from common.config import ConfigError, check, fail, parse_config
from common.grid import build_grid, bytes_by_axis, print_grid
from plan import apply_auto_layout
from planner.inputs import HARDWARE
from common.metrics import MetricsLogger
from model import GPT, flops_per_token, num_params
from compose.partition_activations import add_partition_args, apply_partition_flags, check_partition_args
from common.optim import NonFiniteGuard, clip_grad_norm, configure_optimizer, lr_at, set_lr
from pipeline.schedules import SPLIT_BACKWARD, V_SHAPED, make_schedule, placement_of, simulate
from train_cp import (ContextParallelAttentionCore, block_attention_kernel, check_cp, local_positions,
                      swap_attention_cores)
from train_ddp import DataParallelGrads, assign_buckets
from train_pp import PipelineRunner, check_pp, stage_views
from compose.grad_ready import GradsReadyBySchedule
from pipeline.tied import tied_copy, tied_grads_sync, tied_weight
from compose.kept_units import free_after_w
from compose.tp_gemms import with_gemm_slots
from pipeline.weight_grads import WeightGradStore, defer_weight_grads
from common.routing import end_moe_step, router_metrics, start_moe_training
from train_ep import ExpertDataParallelGrads, is_expert_param, swap_in_expert_parallel
from common.training import (MOE_FLAGS, apply_kernels_and_fp8, autocast_context, check_fp8_all_gather, check_moe,
                             compiled, enable_tf32, evaluate, fits_on_device, gather_fp8_units, gpt_config,
                             materialize, param_dtype, prepare_data, print_sample, resolve_dtype, should_save)
from common.tp_grads import sum_in_place
from common.tp_shards import init_tp_weights
from common.tp_setup import check_tp
from train_tp import apply_tp, tp_counts
from train_zero import ShardedAdamW, ShardedGrads, install_zero3_hooks, shard_model

# ----------------------------------------------------------------------------------------------------------
# the model: model.py's GPT on the meta device, TP layers swapped in, CP attention, cut into this rank's
# stages; only then does anything get memory, and each parameter is filled from model.init_parameter

def build_chunks(cfg, vocab_size, grid, device, dtype):
    gcfg = gpt_config(cfg, vocab_size)
    with torch.device("meta"):
        gpt = GPT(gcfg, seed=cfg.seed)
        if grid.ep > 1:                        # train_ep's MoE: my experts only, tokens exchanged over ep
            swap_in_expert_parallel(gpt, grid.groups.ep)
    if grid.sizes["tp"] > 1:
        apply_tp(gpt, grid.groups.tp, cfg.sp, device="meta")
    if grid.sizes["cp"] > 1:
        # the compute dtype (bf16 under autocast, not the parameters' fp32) decides between the fused kernels
        kernel = block_attention_kernel(cfg.kernels, device, resolve_dtype(cfg, device), cfg.n_embd // cfg.n_head)
        swap_attention_cores(gpt, lambda: ContextParallelAttentionCore(grid.groups.cp, cfg.cp_layout, kernel))
    mine = stage_views(gpt, grid.coords["pp"], grid.sizes["pp"], cfg.pp_virtual, placement_of(cfg.pp_schedule))
    chunks = materialize(mine, device, dtype)
    pos = local_positions(cfg.cp_layout, cfg.block_size, grid.sizes["cp"], grid.coords["cp"], device)
    for chunk in chunks:
        init_tp_weights(chunk, cfg.seed, grid.groups.tp)    # my TP slice of each full initial value
        chunk.pos = pos                                        # RoPE at this CP rank's global positions
    return chunks, gcfg, pos


# ----------------------------------------------------------------------------------------------------------
# the dp x cp axis, one object whatever its mode, so the step below has no branch on it:
#     follow(runner, ...)   hooked to the pipeline: ZeRO-2/3 reduce after each backward of a chunk; replicas and ZeRO-1
#                           each bucket after the schedule's last backward writing it (SP's norms summed over tp first)
#     start(), finish()     around it: the mean over dp x cp (ZeRO: into my shard of each bucket) waited for, the tied
#                           copies summed (ZeRO-1 before the mean, replicas on the means, ZeRO-2/3 on shards, SP's too)
#     clip(max_norm)        the global grad norm, each value counted once over the grid, gradients scaled
#     step(lr), zero_grad(), held (what this rank holds, for checkpoint.save / load)

class DataParallelAxis:
    """What every mode shares: the reductions hooked to the pipeline, and counting each value once in the norm (TP
    replicas by TP rank 0, the tied weight by the first stage)."""
    reduce_per_backward, after_w = False, False
    shards = ()                                      # ZeRO's flat buckets (none when every rank holds all)

    def __init__(self, chunks, grid):
        self.chunks, self.grid = chunks, grid

    def counted(self, p):
        copy = tied_weight(self.chunks) if not any(c.first for c in self.chunks) else None   # the last stage's
        return p is not copy and tp_counts(p, self.grid.groups.tp)

    def reductions(self):
        """Every gradient reduction: `grads_of` lists them per chunk (ZeRO-2/3) or for all chunks at once."""
        return [grads for part in self.grads_of for grads in part]

    def start(self):
        for grads in self.reductions():
            grads.require_sync(self.reduce_per_backward and not self.after_w)

    def follow(self, runner, store, actions):
        """Hook the reductions to the runner (after each B) and the WeightGradStore (W): ZeRO-2/3 reduce per backward;
        replicas and ZeRO-1 launch each bucket after the last action of `actions` (this rank's schedule) writing it,
        SP's norms summed over tp first (compose/grad_ready.py), ZeRO-1's tied bucket at finish, after its sum."""
        hooks = self
        self.store = store                          # ZeRO-3: which units a W reads (compose/kept_units.py)
        if not self.reduce_per_backward:
            copy = tied_copy(self.chunks, self.grid.groups.tied) if self.shards else None     # ZeRO-1's
            hooks = GradsReadyBySchedule(self.chunks, actions, self.reductions(), self.grid.groups.tp, hold=copy)
        runner.after_backward = hooks.after_backward
        if store is not None:
            store.after_compute = hooks.after_weight_grads

    def after_backward(self, action):          # ZeRO-2/3: this chunk's buckets (the other chunk has none now)
        if self.reduce_per_backward and not self.after_w:
            for grads in self.grads_of[action.chunk]:
                grads.finish()

    def finish(self):            # what the schedule left launched, every reduction waited for
        for grads in self.reductions():
            grads.require_sync(True)
            grads.finish()

    def clip(self, max_norm):
        owned, replicas = self.owned_grads()
        any_grad = (owned + replicas)[0]             # (with ep a rank may count none of its own)
        return clip_grad_norm(owned, max_norm, group=self.norm_group, device=any_grad.device,
                              dtype=any_grad.dtype, replicas=replicas)

    def zero_grad(self):
        for grads in self.reductions():
            grads.zero_grad()


class Replicas(DataParallelAxis):
    """train_ddp's buckets (train_ep's with experts: averaged over their replicas only); every rank a full AdamW.
    The dp x cp replicas agree after averaging, so the norm is reduced over tp x pp (all ranks with ep > 1)."""

    def __init__(self, chunks, cfg, grid, device, holder):
        super().__init__(chunks, grid)
        self.optimizer = configure_optimizer(chunks.named_parameters(), cfg, device.type)
        if grid.ep > 1:
            named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
            self.grads = ExpertDataParallelGrads(named, grid.groups.dp_cp, grid.groups.edp, grid.ep,
                                                 cfg.bucket_mb, is_expert_param)
        else:
            self.grads = DataParallelGrads(list(chunks.parameters()), grid.groups.dp_cp, "bucket", cfg.bucket_mb)
        self.grads_of = [[self.grads]]
        self.norm_group = grid.groups.mp if grid.ep == 1 else dist.group.WORLD
        self.held = ModuleState(chunks, self.optimizer, holder, grid.groups.tp)

    def owned_grads(self):
        """(gradients this rank counts in the norm, replicas it only scales); with ep > 1 experts differ over
        ep: the first dp x cp replica of each dense value and the first EDP replica of each expert's."""
        groups = self.grid.groups

        def first(name):
            return self.grid.ep == 1 or dist.get_rank(groups.edp if is_expert_param(name) else groups.dp_cp) == 0
        pieces = [(p.grad, self.counted(p) and first(n)) for n, p in named_parameters(self.chunks)]   # tied: once
        return [g for g, mine in pieces if mine], [g for g, mine in pieces if not mine]

    def finish(self):            # sum and mean are linear: the tied copies' sum taken on their means is alike
        super().finish()
        tied_grads_sync(self.chunks, self.grid.groups.tied)

    def step(self, lr):
        set_lr(self.optimizer, lr)
        self.optimizer.step()


class ZeroShards(DataParallelAxis):
    """train_zero's ZeRO-1/2 shards over dp x cp (with ep > 1 each expert's over its edp group, divided by ep as
    train_ep's ExpertDataParallelGrads does). The tied weight gets a bucket of its own, laid out alike on the first
    and last stage, so their shards can be summed. ZeRO-1 reduces once, after the pipeline. ZeRO-2 keeps no full
    gradients: each chunk's buckets are reduce-scattered after each backward of that chunk (interleaved chunks
    apart), and the two sums are taken on the shards (every TP rank's buckets have the same layout)."""

    def __init__(self, chunks, cfg, grid, dtype, device, holder):
        super().__init__(chunks, grid)
        names = {p: n for chunk in chunks for n, p in chunk.named_parameters()}     # the GPT's names
        self.shards, self.grads_of, self.expert_shards = [], [], []
        self.after_w = cfg.pp_schedule in SPLIT_BACKWARD     # ZeRO-2/3: reduce after W, when dW has come
        grad_stage = min(cfg.zero_stage, 2) if self.after_w else cfg.zero_stage    # ZeRO-3 under W: ZeRO-2's grads
        for part in ([chunks] if cfg.zero_stage == 1 else chunks):   # ZeRO-1: one set over all chunks
            self.grads_of.append([])
            for group, shards in self.shard(part, cfg, grid, dtype, device, names):
                self.grads_of[-1].append(ShardedGrads(shards, group, grad_stage))
                self.shards += shards
                self.expert_shards += shards if group is not grid.groups.dp_cp else []
        self.optimizer = ShardedAdamW(self.shards, cfg.weight_decay)
        self.reduce_per_backward, self.norm_group = cfg.zero_stage >= 2, dist.group.WORLD
        self.held = ShardState(self.shards, self.optimizer, chunks, holder, grid.groups.tp)

    def shard(self, part, cfg, grid, dtype, device, names):
        """[(group, its shards)] of `part`: dense buckets over dp x cp, with ep > 1 the experts' over edp. In a V
        the tied weight is one Parameter in both chunks: the first chunk's buckets hold it."""
        tied = tied_weight(part if isinstance(part, torch.nn.ModuleList) else [part])
        params = [p for p in reversed(list(part.parameters())) if p is not tied]
        if any(tied is q for s in self.shards for q in s.params):
            tied = None
        experts = [p for p in params if grid.ep > 1 and is_expert_param(names[p])]
        dense = [p for p in params if not (grid.ep > 1 and is_expert_param(names[p]))]
        out = []
        for group, these, extra in ((grid.groups.dp_cp, dense, [[tied]] if tied is not None else []),
                                    (getattr(grid.groups, "edp", None), experts, [])):
            buckets = assign_buckets(these, cfg.bucket_mb * 2 ** 20) + extra
            if buckets:
                out.append((group, shard_model(self.chunks, cfg.zero_stage, group, dtype, device, buckets=buckets,
                                               names=names)))     # (every chunk's modules: a V's LM head too)
        return out

    def after_weight_grads(self, key):
        """ZeRO-2 under zb1, zbv, dualpipev, after W (micro-batch, chunk): reduce-scatter what the chunk holds
        (this W's weight gradients and what B left since; sums, so their order does not matter)."""
        for grads in self.grads_of[key[1]]:
            grads.reduce_held()

    def my_slices(self):
        """(parameter, its part inside this rank's slice [lo, hi) of its bucket's gradient)."""
        out = []
        for s in self.shards:
            for p, off in zip(s.params, s.offsets):
                lo, hi = max(off, s.lo), min(off + p.numel(), s.hi)
                if lo < hi:
                    out.append((p, s.grad[lo - s.lo: hi - s.lo]))
        return out

    def finish(self):
        if not self.reduce_per_backward:             # ZeRO-1: the tied copies summed before their reduce-scatter
            tied_grads_sync(self.chunks, self.grid.groups.tied)
            super().finish()
        else:                                        # ZeRO-2/3: the sums on the shards
            for grads in self.reductions() if self.after_w else ():
                grads.reduce_held()                  # a V's tied weight: B of the other chunk may come last
            tied = tied_weight(self.chunks)
            if tied is not None and self.grid.groups.tied is not None:
                shard = next(s for s in self.shards if s.params[0] is tied)
                comm.all_reduce(shard.grad, group=self.grid.groups.tied)
            partial = [g for p, g in self.my_slices() if getattr(p, "sequence_parallel", False)]
            sum_in_place(partial, self.grid.groups.tp)
        if self.expert_shards:                       # an expert's gradient sums its EP group's tokens already
            torch._foreach_div_([s.grad for s in self.expert_shards], self.grid.ep)

    def owned_grads(self):
        pieces = [(g, self.counted(p)) for p, g in self.my_slices()]
        return [g for g, mine in pieces if mine], [g for g, mine in pieces if not mine]

    def step(self, lr):
        self.optimizer.step(lr, [s.grad for s in self.shards])   # my slice of every bucket
        for s in self.shards:
            s.publish()                                          # all-gather the updated slices (not ZeRO-3)


class ZeroUnits(ZeroShards):
    """train_zero's ZeRO-3 over dp x cp: each chunk's blocks one unit each, its other parameters a root unit (the
    tied weight alone where its copy is on another stage, so the two copies' shards line up; in a V one unit that
    both chunks gather). With ep > 1 each MoE block's experts are a unit of their own over edp, gathered by hooks
    on the experts module. Each chunk has its own hooks and reduction: a micro-batch's F or B action gathers (and
    prefetches) its chunk's units block by block, and reduce-scatters their gradients as each block's backward
    ends. Under zb1, zbv and dualpipev, B gathers a block for its input gradients and frees it when the gradient
    reaches the block below (dW = gy^T x needs no weights; a unit whose weight a W reads, the fused LM head's, is
    kept until that W: compose/kept_units.py); the gradients are ZeRO-2's, reduce-scattered after W. The sums are
    then taken on the shards, as for ZeRO-2."""

    def shard(self, chunk, cfg, grid, dtype, device, names):
        tied = tied_weight([chunk]) if grid.groups.tied is not None else None
        blocks, done = list(chunk.transformer["h"]), {id(q) for s in self.shards for q in s.params}

        def expert(p):
            return grid.ep > 1 and is_expert_param(names[p])
        units = [[p for p in b.parameters() if not expert(p)] for b in reversed(blocks)]
        experts = [u for u in ([p for p in b.parameters() if expert(p)] for b in reversed(blocks)) if u]
        done |= {id(p) for block in blocks for p in block.parameters()}
        rest = [p for p in chunk.parameters() if id(p) not in done]     # (a V's tied weight: in chunk 0's unit)
        roots = [g for g in ([p for p in rest if p is tied], [p for p in rest if p is not tied]) if g]
        out = [(grid.groups.dp_cp, units + roots)] + ([(grid.groups.edp, experts)] if experts else [])
        return [(group, shard_model(self.chunks, 3, group, dtype, device, blocks=[], buckets=groups, names=names))
                for group, groups in out]      # (every chunk's modules: a V's LM head holds the tied weight too)

    def __init__(self, chunks, cfg, grid, dtype, device, holder):
        super().__init__(chunks, cfg, grid, dtype, device, holder)
        tied, self.units_of = tied_weight(chunks), []
        for chunk, reductions in zip(chunks, self.grads_of):   # gather, free and reduce-scatter unit by unit
            blocks = list(chunk.transformer["h"])
            experts = [b.mlp.experts for b in blocks if hasattr(b.mlp, "experts")]
            self.units_of.append([])
            for grads, modules in zip(reductions, (blocks, experts)):
                units = [b.shard for b in grads.buckets]
                if modules is blocks and "wte" in chunk.transformer and all(s.params[0] is not tied for s in units):
                    units.append(next(s for s in self.shards if s.params[0] is tied))   # a V: chunk 0's unit
                install_zero3_hooks(chunk, modules, units, None if self.after_w else grads,
                                    reshard_after_forward=cfg.reshard_after_forward)
                self.units_of[-1] += units
        gather_fp8_units(chunks, self.shards, cfg)   # FP8 GEMMs' weights: in fp32, or FP8 (compose/fp8_gather.py)

    def after_backward(self, action):
        super().after_backward(action)
        if self.after_w:           # the lowest block's unit and the roots (the hooks freed the others), or after W
            free_after_w(self.store, (action.mb, action.chunk), self.units_of[action.chunk])


def moe_metrics(chunks, grid, cfg):
    """The step's router metrics: each MoE block's statistics summed over the ranks that routed the other tokens
    of the global batch (dp x cp; tp too under SP, where each TP rank routes its sequence chunk), which also
    sets every block's load for the next step (routing.end_moe_step); every stage's blocks then meet on rank 0."""
    def reduce(stats):
        comm.all_reduce(stats, group=grid.groups.dp_cp)
        if cfg.sp:
            comm.all_reduce(stats, group=grid.groups.tp)

    stats = end_moe_step(chunks, reduce)
    if grid.sizes["pp"] > 1:
        stages = [None] * grid.sizes["pp"]
        dist.all_gather_object(stages, stats.cpu(), group=grid.groups.pp)
        stats = torch.cat([s for s in stages if s.numel()])
    return router_metrics(stats, cfg.top_k)


# ----------------------------------------------------------------------------------------------------------
# checkpoints: common/checkpoint/__init__.py's one format, so any layout (or train_single) resumes any other. Each whole
# tensor is written by one of the ranks holding it: a dense one by the ranks of its stage's dp x cp x tp slab
# once gathered, an expert by the tp x edp ranks holding it.

def checkpoint_holder(name, grid):
    """(key, holders, my index) of a whole tensor of my stages, for checkpoint.save."""
    data_index, tp, tp_index = dist.get_rank(grid.groups.dp_cp), grid.sizes["tp"], grid.coords["tp"]
    slab = grid.sizes["dp"] * grid.sizes["cp"]
    if is_expert_param(name):
        return "experts", slab // grid.ep * tp, data_index // grid.ep * tp + tp_index
    return "dense", slab * tp, data_index * tp + tp_index


def gather_to_first(obj, group):
    """[obj of every rank of `group`] on the group's first rank, None on the others."""
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def gather_whole(held, grid):
    """{name: whole weight} of the model (buffers too) on global rank 0 (None elsewhere), for the sample:
    experts gathered over ep, the stages' parts over pp."""
    parts = {name: values[0].cpu() for name, values, _ in held.whole(moments=False)}
    if grid.ep > 1:
        gathered = gather_to_first(parts, grid.groups.ep)
        if gathered is None:
            return None
        parts = {k: v for part in gathered for k, v in part.items()}
    if grid.coords["tp"] or grid.coords["cp"] or grid.coords["dp"]:
        return None
    gathered = gather_to_first(parts, grid.groups.pp)
    return None if gathered is None else {k: v for part in gathered for k, v in part.items()}


def sample_on_rank0(cfg, held, grid, gcfg, loader, env):
    """The whole trained model on global rank 0, for the eyeball test that training worked; skipped with one line
    when it would not fit beside what rank 0 holds: twice the fp32 model's bytes, the gathered weights (which NCCL's
    gather_object stages on the device, each stage's padded to the largest's) then the model built from them."""
    need = 2 * num_params(gcfg) * 4
    fits = torch.tensor(float(env.rank != 0 or fits_on_device(need, env.device)), device=env.device)
    comm.broadcast(fits, src=0)                  # rank 0's answer: every rank skips the gather, or none
    if not fits:
        if env.is_main:
            print(f"sample: skipped: the whole model needs {need / 2**30:.1f} GiB free on rank 0's {env.device} "
                  f"(twice its fp32 weights), more than it has", flush=True)
        return
    whole = gather_whole(held, grid)
    if whole is not None:
        model = GPT(gcfg).to(env.device)
        model.load_state_dict({**whole, "lm_head.weight": whole["transformer.wte.weight"]})
        print_sample(model, loader, cfg, env)


# ----------------------------------------------------------------------------------------------------------
# the command line

def extra_args(parser):
    parser.set_defaults(tp=0, cp=0, pp=0)      # 0: chosen by default_layout when no degree is given
    add_partition_args(parser)                 # ZeRO-R's Pa on the tp axis (compose/partition_activations.py)
    parser.add_argument("--layout", default="", choices=["", "auto"],
                        help="auto: the layout plan.py ranks best for this model, world and GPU (plan.py); "
                             "it replaces the degree, schedule, micro-batch, ZeRO and recompute flags")
    parser.add_argument("--plan_gpu", default="", help="with --layout auto: plan as if on this GPU (a100, h100, "
                                                       "h200, b200; default: the GPU found)")
    parser.add_argument("--pp_uneven", action="store_true",
                        help="allow n_layer not divisible by pp*pp_virtual: the first n_layer %% (pp*pp_virtual) "
                             "stages take one block more (train_pp's split, plan.py's default)")
    parser.add_argument("--reshard_after_forward", action=argparse.BooleanOptionalAction, default=True,
                        help="ZeRO-3: free each block's gathered weights after its forward and gather them again for "
                             "its backward (--no-reshard_after_forward: keep them until its backward is over)")


def default_layout(cfg, world):
    """With no degree flag: tp 2 and pp 2 where they divide (the world, the heads, the layers), dp the rest."""
    if cfg.tp or cfg.cp or cfg.pp or cfg.dp:
        cfg.tp, cfg.cp, cfg.pp = cfg.tp or 1, cfg.cp or 1, cfg.pp or 1
        return
    cfg.tp = 2 if world % 2 == 0 and cfg.n_head % 2 == 0 else 1
    cfg.pp = 2 if world % (2 * cfg.tp) == 0 and cfg.n_layer % 2 == 0 else 1
    cfg.cp = 1


def validate(cfg):
    world = world_size_from_env()
    if cfg.layout == "auto":                   # chosen once the vocabulary is known (main), then validated
        check(not (cfg.tp or cfg.cp or cfg.pp or cfg.dp or cfg.ep > 1), "--layout auto chooses the degrees: "
              "leave out --dp --tp --cp --pp --ep")
        check(cfg.plan_gpu in ("",) + tuple(HARDWARE),
              f"--plan_gpu {cfg.plan_gpu}: plan.py knows {', '.join(HARDWARE)}")
        check(cfg.plan_gpu or (cfg.device != "cpu" and torch.cuda.is_available()), "--layout auto plans for a GPU: "
              "none here; give the degrees (--dp --tp --cp --pp --ep), or --plan_gpu h100 to plan as if on one")
        return
    default_layout(cfg, world)
    tp, cp, pp = cfg.tp, cfg.cp, cfg.pp
    for name in ("tp", "cp", "pp", "pp_virtual"):
        check(getattr(cfg, name) >= 1, f"--{name} must be >= 1, got {getattr(cfg, name)}")
    check(world % (tp * cp * pp) == 0, f"tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp} does not divide the world "
                                       f"size {world}")
    cfg.dp = cfg.dp or world // (tp * cp * pp)
    check(cfg.dp * tp * cp * pp == world, f"dp*tp*cp*pp = {cfg.dp}*{tp}*{cp}*{pp} = {cfg.dp * tp * cp * pp} "
                                          f"!= world size {world}")
    check_cp(cfg, cp)
    check(not cfg.sp or tp > 1, "--sp needs --tp > 1")
    check_tp(cfg, tp, cfg.block_size // cp, what="block_size/cp")
    check_partition_args(cfg, tp)
    check(cfg.global_batch_size % (cfg.micro_batch_size * cfg.dp) == 0,
          f"global_batch_size={cfg.global_batch_size} is not divisible by micro_batch_size * dp = "
          f"{cfg.micro_batch_size} * {cfg.dp}")
    m = cfg.global_batch_size // (cfg.micro_batch_size * cfg.dp)
    check_pp(cfg, pp, m)
    check(cfg.dtype != "float16", "train_5d supports float32, bfloat16 and float64 (no fp16 loss scaling)")
    check(cfg.zero_stage in (0, 1, 2, 3), f"--zero_stage {cfg.zero_stage}: 0 (replicas), 1, 2 or 3")
    check_fp8_all_gather(cfg)
    check(cfg.zero_stage < 3 or cfg.dp * cp > 1, "--zero_stage 3 shards over dp x cp: with dp*cp = 1 there is "
                                                 "nothing to shard")
    check(cfg.zero_stage < 3 or cfg.pp_schedule != "interleaved" or pp > 1, "--zero_stage 3 with interleaved "
          "needs --pp > 1 (with pp 1 two chunks of one rank would both write the tied weight's gradient unit)")
    check_moe(cfg)
    check(cfg.ep >= 1 and (cfg.dp * cp) % cfg.ep == 0, f"--ep {cfg.ep} must divide dp*cp = {cfg.dp * cp} (experts "
                                                        f"are shared out over ranks holding different tokens)")
    check(cfg.ep == 1 or (cfg.n_experts > 0 and cfg.n_experts % cfg.ep == 0),
          f"--ep {cfg.ep} needs --n_experts > 0 and divisible by it, got {cfg.n_experts}")
    check(cfg.n_experts == 0 or cfg.moe_every <= cfg.n_layer, f"--moe_every {cfg.moe_every} > --n_layer: no MoE block")


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_config(argv, techniques=("dp", "tp", "sp", "cp", "cp_layout", "pp", "pp_schedule", "pp_virtual",
                                         "zero_stage", "bucket_mb", "fp8", "fp8_all_gather", "ep") + MOE_FLAGS,
                       description=__doc__.split("\n\n")[0], extra_args=extra_args, validate=validate)
    env = init_distributed(cfg)
    loader = prepare_data(cfg, env)
    if cfg.layout == "auto":                   # once the vocabulary is known; a refusal is still one line
        try:
            apply_auto_layout(cfg, loader.vocab_size, env.device, env.world_size, env.is_main, validate)
        except ConfigError as e:
            fail(str(e))
    sizes = dict(tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, pp=cfg.pp)
    grid = build_grid(sizes, env.rank, cfg.dist_timeout, cfg.ep, v_shaped=cfg.pp_schedule in V_SHAPED)
    dp_rank, dp = grid.coords["dp"], cfg.dp
    micro = cfg.micro_batch_size
    m = cfg.global_batch_size // (micro * dp)                  # micro-batches per step on each dp rank
    dtype = resolve_dtype(cfg, env.device)
    enable_tf32(env.device)

    chunks, gcfg, pos = build_chunks(cfg, loader.vocab_size, grid, env.device, param_dtype(dtype))
    apply_partition_flags(cfg, gcfg, [b for c in chunks for b in c.transformer["h"]], grid.groups.tp)   # ZeRO-R's Pa
    start_moe_training(chunks, cfg.global_batch_size * cfg.block_size // (dp * cfg.cp))   # my step's tokens
    for chunk in chunks:              # fused modules, FP8 GEMMs; under TP inside the parallel layers (kernels/apply.py)
        apply_kernels_and_fp8(chunk, cfg, env.device)
    store = WeightGradStore() if cfg.pp_schedule in SPLIT_BACKWARD else None
    if store is not None:
        with_gemm_slots(chunks)       # train_tp's layers take the store too (compose/tp_gemms.py)
        defer_weight_grads(chunks, store)
    compiled(chunks, cfg, [b for chunk in chunks for b in chunk.transformer["h"]])   # by block, in ZeRO-3's hooks
    act_shape = (micro, len(pos) // (cfg.tp if cfg.sp else 1), cfg.n_embd)
    schedules = make_schedule(cfg.pp_schedule, cfg.pp, m, cfg.pp_virtual)
    sim = simulate(schedules, cfg.pp, cfg.pp_virtual)
    runner = PipelineRunner(chunks, grid.groups.pp, schedules, m, act_shape, env.device, store,
                            autocast_context(dtype, env.device), param_dtype(dtype))
    holder = functools.partial(checkpoint_holder, grid=grid)
    if cfg.zero_stage:
        dp_axis = (ZeroUnits if cfg.zero_stage == 3 else ZeroShards)(chunks, cfg, grid, param_dtype(dtype),
                                                                     env.device, holder)
    else:
        dp_axis = Replicas(chunks, cfg, grid, env.device, holder)
    dp_axis.follow(runner, store, schedules[grid.coords["pp"]])
    guard = NonFiniteGuard(cfg, env.is_main)
    torch.manual_seed(cfg.seed + grid.coords["pp"] * dp + dp_rank)   # dropout: own stream per stage and batch slice
    start = checkpoint.start_from(cfg, env, gcfg, dp_axis.held)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(gcfg), n_devices=env.world_size,
                           tokens_per_step=cfg.global_batch_size * cfg.block_size, resume=cfg.resume)
    if env.is_main:
        print_grid(grid, cfg, act_shape, sum(p.numel() for p in chunks.parameters()))
        print(f"  schedule {cfg.pp_schedule}, {m} micro-batches of {micro} per dp rank, simulated bubble "
              f"{sim['idle'][0] / sim['makespan']:.3f}, {dtype}, {env.device}, steps {start}..{last_step - 1}",
              flush=True)

    for group in (grid.groups.pp, grid.groups.cp):   # a collective before the first send/recv of a group (NCCL
        dist.barrier(group=group)              # connects a pair at its first p2p; torch wants the group up first)

    def batch(step, mb, split="train"):
        """This rank's micro-batch: its dp slice of the global batch, its cp positions of every sequence."""
        x, y = loader.micro_batch(step, mb, micro, dp_rank, dp, split)
        return x[:, pos], y[:, pos]

    def eval_loss(x, y):                       # every rank: the full loss of one validation micro-batch
        loss = runner.forward_only_loss(x[:, pos], y[:, pos])
        comm.all_reduce(loss, group=grid.groups.cp)
        return loss / cfg.cp

    for step in range(start, last_step):
        t0 = time.perf_counter()
        COMM.reset()
        lr = lr_at(step, cfg)
        dp_axis.start()
        loss_sum = runner.step(schedules[grid.coords["pp"]], lambda mb: batch(step, mb))
        dp_axis.finish()
        grad_norm = dp_axis.clip(cfg.grad_clip)
        with COMM.uncounted():                   # the logged loss, on every rank for the guard: not step traffic
            comm.all_reduce(loss_sum, group=grid.groups.dp_cp)      # the last stage's mean over dp x cp
            last = dist.get_global_rank(grid.groups.pp, runner.last_stage_rank)   # rank 0 in a V
            comm.broadcast(loss_sum, last, group=grid.groups.pp)
        loss_value = float(loss_sum) / (m * dp * cfg.cp)
        if guard.step_ok(step, loss_value, grad_norm):   # global loss and norm: every rank decides alike
            dp_axis.step(lr)
        dp_axis.zero_grad()
        comm_bytes, by_axis = COMM.bytes_sent, bytes_by_axis(grid)     # this step's traffic, before logging
        router = moe_metrics(chunks, grid, cfg) if cfg.n_experts else {}
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, comm_bytes,
                        comm_bytes_by_axis=by_axis, bubble_sim=sim["idle"][grid.coords["pp"]] / sim["makespan"],
                        **router)

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            chunks.eval()
            val = evaluate(eval_loss, loader, cfg)
            chunks.train()
            logger.log_eval(step, val)
        if should_save(cfg, step, last_step):
            checkpoint.save(cfg, gcfg, step + 1, dp_axis.held)
    logger.close()
    if cfg.sample_tokens > 0 and last_step > start:     # (AdamW's state exists once a step has run)
        sample_on_rank0(cfg, dp_axis.held, grid, gcfg, loader, env)
    return dict(chunks=chunks, cfg=cfg, gcfg=gcfg, grid=grid, dp_axis=dp_axis)


if __name__ == "__main__":
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
