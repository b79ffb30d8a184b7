"""
pipeline/weight_grads.py: the backward split of the zb1 schedule (pipeline/schedules.py), for train_pp.py.

A Linear layer's backward computes two things: dx = gy W (the input gradient the previous stage is waiting
for) and dW = gy^T x (the weight gradient nothing downstream needs until the optimizer step). zb1's B action
computes only dx and sends it at once; the matching W action computes dW later, in what would be a bubble
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism"). Here the blocks' nn.Linear layers are swapped for
DeferredWeightGradLinear: its backward returns dx and stashes (layer, x, gy) in a WeightGradStore, and
W(micro-batch) turns the stash into gradients. Parameters and their names are unchanged.

Any layer that runs its own GEMMs takes the store itself (a `weight_grad_store` attribute) and stashes what its W
needs: train_tp's tensor-parallel layers, given the attribute by converters/tp_gemms.py (B keeps the input gradient's
all-reduce, or SP's reduce-scatter); kernels/fp8.py's Float8Linear and the FP8 GEMMs inside the tensor-parallel
layers (W runs the FP8 dW GEMM on the dy that B quantized and the x that F quantized: the unsplit backward's
numbers, bit for bit); kernels/apply.py's fused LM head (W recomputes the logits its forward did not keep).
Gradients that are a reduction inside a fused kernel's one pass over dy (the fused LayerNorm's dgamma, dbeta, the
fused bias adds' db) stay in B, as nn.LayerNorm's do. docs/pipelines.md ("The W step") says why for each.

A W that reads a parameter's value (the fused LM head's, for the logits; dW = gy^T x reads none) says so when it is
deferred (`reads`): under ZeRO-3 the unit holding that parameter then stays gathered until the W has run
(compose/kept_units.py), where any other unit is freed as B ends.
"""
import functools

import torch
import torch.nn as nn


class WeightGradStore:
    """Layers stash their weight gradients' work during B; W(mb) does it: dW = gy^T x (and db) for a Linear, or
    whatever function a layer with GEMMs of its own deferred."""

    def __init__(self):
        self.pending, self.saved = [], {}
        self.pending_reads, self.reads = [], {}  # the parameters each W reads the values of
        self.done = {}                           # key -> what to call once its W and after_compute are over
        self.after_compute = None                # called with the key after each W (ZeRO-2: reduce now)

    def stash(self, weight, bias, x, gy, weight_grad=None):
        """From a backward that returned only dx (bias None: its gradient is not this layer's to defer).
        weight_grad(gy2, x2): the layer's own dW GEMM on the 2-D operands (tokens as rows); None: gy2^T x2."""
        self.defer(functools.partial(linear_weight_grads, weight, bias, x, gy, weight_grad))

    def defer(self, grads, reads=()):
        """grads(): [(parameter, its gradient)], called by W of the micro-batch B is running; reads: the parameters
        whose values grads() reads (none for dW = gy^T x)."""
        self.pending.append(grads)
        self.pending_reads += reads

    def linear(self, x, weight, bias=None):
        """y = x W^T + b whose backward returns only dx and stashes the rest here: for layers that own their
        forward (converters/tp_gemms.py's parallel layers read it from their `weight_grad_store`)."""
        return _LinearInputGradOnly.apply(x, weight, bias, self)

    def close(self, key):
        self.saved[key], self.pending = self.pending, []
        self.reads[key], self.pending_reads = self.pending_reads, []

    def reads_of(self, key):
        """The parameters whose values W(key) will read (after B(key) has closed it)."""
        return self.reads[key]

    def when_computed(self, key, fn):
        """Call fn() once W(key) has run and after_compute(key) has taken its gradients."""
        self.done.setdefault(key, []).append(fn)

    @torch.no_grad()
    def compute(self, key):
        for grads in self.saved.pop(key):
            for p, g in grads():
                p.grad = g.to(p.dtype) if p.grad is None else p.grad.add_(g.to(p.dtype))
        del self.reads[key]
        if self.after_compute is not None:
            self.after_compute(key)
        for fn in self.done.pop(key, ()):
            fn()


def linear_weight_grads(weight, bias, x, gy, weight_grad=None):
    """[(weight, dW), (bias, db)] of y = x W^T + b from its input and output gradient: dW = gy^T x by torch's
    GEMM, or by `weight_grad` (an FP8 layer's), db = the sum of gy over tokens."""
    gy2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])      # tokens as rows
    dw = gy2.t() @ x2.to(gy2.dtype) if weight_grad is None else weight_grad(gy2, x2)
    return [(weight, dw)] + ([(bias, gy2.sum(0))] if bias is not None else [])


class _LinearInputGradOnly(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dx and leaves dW, db to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.store = (weight, bias), store          # the Parameters themselves, for W
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        ctx.store.stash(*ctx.params, x, gy)
        return (gy @ weight.to(gy.dtype)).to(x.dtype), None, None, None   # dx: the critical path


class DeferredWeightGradLinear(nn.Module):
    """Drop-in for a block's nn.Linear (same parameters, same names) under the zb1 schedule."""

    def __init__(self, linear, store):
        super().__init__()
        self.weight, self.bias, self.store = linear.weight, linear.bias, store

    def forward(self, x):
        return self.store.linear(x, self.weight, self.bias)

    def matmul(self, x):
        """x W^T without the bias, its dW deferred: for kernels/apply.py's FusedBlock, which adds the bias in its
        fused kernel (whose backward sums db in B)."""
        return self.store.linear(x, self.weight)


def defer_weight_grads(module, store):
    """Swap every nn.Linear inside `module` (the blocks' four matmuls) for DeferredWeightGradLinear; a layer that
    runs its own GEMMs (a `weight_grad_store` attribute: converters/tp_gemms.py's tensor-parallel layers, FP8
    layers, the fused LM head) is handed the store and defers its own dW, keeping its communication in B."""
    for parent in list(module.modules()):
        if hasattr(parent, "weight_grad_store"):
            parent.weight_grad_store = store
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                setattr(parent, name, DeferredWeightGradLinear(child, store))
