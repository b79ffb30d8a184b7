"""
compose/kept_units.py: ZeRO-3 units kept gathered from a zero-bubble pipeline's B until the W that reads their
weights, for compose/zero_pipeline.py's ZeroUnits.

Under zb1, zbv and dualpipev, B needs a unit's weights for the input gradient only, and W's dW = gy^T x needs none,
so ZeRO-3 frees every unit of a chunk as its B ends (train_zero.install_zero3_hooks with grads=None frees the
blocks on the way down, ZeroUnits the rest). One W does read a weight: the fused LM head's
(kernels/linear_cross_entropy.py) computes the logits h W^T again, from the tied embedding in the chunk's root
unit. The store says which parameters each W reads (pipeline/weight_grads.WeightGradStore.reads_of), and a unit
holding one stays gathered, a hold per W still to come:

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
