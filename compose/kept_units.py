"""
compose/kept_units.py: ZeRO-3 units kept gathered from a zero-bubble pipeline's B until the W that reads their
weights, for compose/zero_pipeline.py's ZeroUnits.

Under zb1, zbv and dualpipev, B needs a unit's weights for the input gradient only, and W's dW = gy^T x needs none,
so ZeRO-3 frees every unit of a chunk as its B ends (FreedOnTheWayDown the blocks' units on the way down,
free_after_w the rest). One W does read a weight: the fused LM head's (kernels/linear_cross_entropy.py) computes
the logits h W^T again, from the tied embedding in the chunk's root unit. The store says which parameters each W
reads (pipeline/weight_grads.WeightGradStore.reads_of), and a unit holding one stays gathered, a hold per W still
to come:

    B (mb, chunk) ends   free_after_w: the chunk's units freed, but a unit holding what W (mb, chunk) reads held
    in between           the other actions gather and free it as usual: the next micro-batches' F and B (in a V
                         also the other chunk's, whose root unit it is): a gather finds it whole (no all-gather),
                         a free leaves it whole (it is only marked out of backward)
    W (mb, chunk) ends   its gradients handed to ZeRO's reduce-scatter first (the store's after_compute), then the
                         hold released: the last one frees the unit

So the head's weight stays in memory from a B that defers its dW to the last W still to come (on zb1's last
stage, from the first B to the cool-down's W); all-gathers of that unit are fewer than when B frees it, never
more. After a step no unit is held: every W of a step runs inside it.
"""
import functools

import torch
from torch.utils._pytree import tree_leaves


class KeptUnit:
    """A unit's holds; its free() becomes one that leaves the unit whole while a hold is on."""

    def __init__(self, unit):
        self.unit, self.free_now, self.holds = unit, unit.free, 0
        unit.free, unit.kept = self.free, self

    def free(self):
        if self.holds:
            self.unit.in_backward = False        # this backward's use is over; a W still reads the weights
        else:
            self.free_now()

    def release(self):
        self.holds -= 1
        self.free()


def free_after_w(store, key, units):
    """At the end of B(key): free `units` (ZeRO-3 Shards, with .params and .free()), except those holding a
    parameter W(key) reads, which are freed once that W's gradients are handed on (or later, if held again)."""
    reads = {id(p) for p in store.reads_of(key)}
    for unit in units:
        if any(id(p) in reads for p in unit.params):
            kept = getattr(unit, "kept", None) or KeptUnit(unit)
            kept.holds += 1
            store.when_computed(key, functools.partial(KeptUnit.release, kept))
        unit.free()


class FreedOnTheWayDown:
    """ZeRO-3's reduction stand-in under a split backward, for train_zero.install_zero3_hooks(..., grads=this):
    the gradients are reduced after W (ZeroUnits), so a unit's backward prepares no buffer, and a block's unit is
    freed once the gradient reaches the block below (B's dW is deferred to W, which needs no weights); the lowest
    block's unit and the roots are freed by free_after_w. Built before install_zero3_hooks, so that its hook on a
    block's output gradient runs before the one gathering that block's unit: the unit above is freed first."""

    def __init__(self, blocks, shards):
        self.units = list(reversed(shards[:len(blocks)]))      # blocks' units in forward order, as the hooks'
        for i, block in enumerate(blocks):
            block.register_forward_hook(self.post_forward(i))

    def prepare(self, unit):
        """Nothing to prepare: the gradients are the pipeline's to reduce, after W."""

    def post_forward(self, i):
        def hook(module, args, out):
            if self.units[i].in_backward or i + 1 == len(self.units):   # a recompute; the top block: none above
                return
            first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(self.free_above(i))
        return hook

    def free_above(self, i):
        def hook(grad):
            if not self.units[i].in_backward:   # as the hook gathering unit i: not once its backward has begun
                self.units[i + 1].free()        # its backward is over: dW = gy^T x needs no weights
        return hook
