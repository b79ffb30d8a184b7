"""
compose/zero_pipeline.py: ZeRO inside a pipeline (train_5d.py's --zero_stage 1, 2, 3 beside pp, tp, cp and ep):
train_zero's shards and units meet train_pp's stages, schedules and tied embedding. Neither rung can hold it:
train_zero shards one whole model, reduced once per step, while here each rank holds only its stages' chunks, the
tied weight has a copy on another stage whose shards must line up, ZeRO-2/3 reduce after each backward of a chunk
(after W under zb1, zbv and dualpipev), and ZeRO-3 gathers each chunk's units block by block in every F and B action:

    ZeRO-1   one set of buckets over all chunks, reduce-scattered once, where the schedule is done with them
             (compose/grad_ready.py); the tied bucket after the two copies are summed
    ZeRO-2   each chunk's buckets reduce-scattered after each backward of that chunk (after each W when split)
    ZeRO-3   each chunk's blocks one unit each, its other parameters a root unit (the tied weight alone), an MoE
             block's experts a unit of their own over edp; gathered and freed by hooks, reduced per block

Both classes are compose/dp_axis.py's DataParallelAxis, so the step has no branch on the mode. The tied copies'
sum and SP's partial norms are taken on the shards (every TP rank's buckets have the same layout).
"""
import torch
import torch.distributed as dist

from common import comm
from common.checkpoint import ShardState
from common.tp_grads import sum_in_place
from converters.apply import gather_fp8_units
from compose.dp_axis import DataParallelAxis
from compose.grad_ready import reduce_held
from compose.kept_units import FreedOnTheWayDown, free_after_w
from pipeline.schedules import SPLIT_BACKWARD
from pipeline.tied import tied_grads_sync, tied_weight
from train_ddp import assign_buckets
from train_ep import is_expert_param
from train_zero import ShardedAdamW, ShardedGrads, install_zero3_hooks, shard_model


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
            reduce_held(grads)

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
                reduce_held(grads)                   # a V's tied weight: B of the other chunk may come last
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
                # reduced after W: B frees the units above on the way down (hooked first: freed before a gather)
                reduction = FreedOnTheWayDown(modules, units) if self.after_w else grads
                install_zero3_hooks(chunk, modules, units, reduction, reshard_after_forward=cfg.reshard_after_forward)
                self.units_of[-1] += units
        gather_fp8_units(chunks, self.shards, cfg)   # FP8 GEMMs' weights: in fp32, or FP8 (converters/fp8_gather.py)

    def after_backward(self, action):
        super().after_backward(action)
        if self.after_w:           # the lowest block's unit and the roots (the hooks freed the others), or after W
            free_after_w(self.store, (action.mb, action.chunk), self.units_of[action.chunk])

