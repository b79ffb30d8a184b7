"""
compose/dp_axis.py: the data-parallel axis of a pipelined, tensor-parallel step (train_5d.py), one object whatever
its mode, so the step has no branch on it. Here train_ddp's buckets (train_ep's with experts) meet train_pp's
schedule and stages and train_tp's slices; neither rung can hold it: a rung's DP knows no schedule, no tied copy on
another stage and no TP replica, and a pipeline knows no buckets. The ZeRO modes, ZeRO inside a pipeline, subclass
it in compose/zero_pipeline.py.

    follow(runner, ...)   hooked to the pipeline: ZeRO-2/3 reduce after each backward of a chunk; replicas and ZeRO-1
                          each bucket after the schedule's last backward writing it (SP's norms summed over tp first)
    start(), finish()     around it: the mean over dp x cp (ZeRO: into my shard of each bucket) waited for, the tied
                          copies summed (ZeRO-1 before the mean, replicas on the means, ZeRO-2/3 on shards, SP's too)
    clip(max_norm)        the global grad norm, each value counted once over the grid, gradients scaled
    step(lr), zero_grad(), held (what this rank holds, for checkpoint.save / load)

Global grad norm: every shard counted once (TP replicas by TP rank 0, the tied weight by the first stage), reduced
over tp x pp (the dp x cp replicas agree after averaging; with ep > 1 experts differ over ep, so over every rank).
"""
import torch.distributed as dist

from common.checkpoint import ModuleState, named_parameters
from common.optim import clip_grad_norm, configure_optimizer, set_lr
from compose.grad_ready import GradsReadyBySchedule
from pipeline.tied import tied_copy, tied_grads_sync, tied_weight
from train_ddp import DataParallelGrads
from train_ep import ExpertDataParallelGrads, is_expert_param
from common.tp_grads import tp_counts


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
