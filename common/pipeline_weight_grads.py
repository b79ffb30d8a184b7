"""
pipeline_weight_grads.py: the backward split of the zb1 schedule (pipeline_schedules.py), for train_pp.py.

A Linear layer's backward computes two things: dx = gy W (the input gradient the previous stage is waiting
for) and dW = gy^T x (the weight gradient nothing downstream needs until the optimizer step). zb1's B action
computes only dx and sends it at once; the matching W action computes dW later, in what would be a bubble
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism"). Here the blocks' nn.Linear layers are swapped for
DeferredWeightGradLinear: its backward returns dx and stashes (layer, x, gy) in a WeightGradStore, and
W(micro-batch) turns the stash into gradients. Parameters and their names are unchanged.
"""
import torch
import torch.nn as nn


class WeightGradStore:
    """Linear layers stash (layer, input, output gradient) during B; W(mb) computes their dW = gy^T x."""

    def __init__(self):
        self.pending, self.saved = [], {}

    def close(self, key):
        self.saved[key], self.pending = self.pending, []

    @torch.no_grad()
    def compute(self, key):
        for layer, x, gy in self.saved.pop(key):
            gy2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1]).to(gy.dtype)  # tokens as rows
            grads = [(layer.weight, gy2.t() @ x2)] + ([(layer.bias, gy2.sum(0))] if layer.bias is not None else [])
            for p, g in grads:
                p.grad = g.to(p.dtype) if p.grad is None else p.grad.add_(g.to(p.dtype))


class _LinearInputGradOnly(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dx and leaves dW, db to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, store):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.store = layer, store
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        ctx.store.pending.append((ctx.layer, x, gy))
        return (gy @ weight.to(gy.dtype)).to(x.dtype), None, None, None, None   # dx: the critical path


class DeferredWeightGradLinear(nn.Module):
    """Drop-in for a block's nn.Linear (same parameters, same names) under the zb1 schedule."""

    def __init__(self, linear, store):
        super().__init__()
        self.weight, self.bias, self.store = linear.weight, linear.bias, store

    def forward(self, x):
        return _LinearInputGradOnly.apply(x, self.weight, self.bias, self, self.store)


def defer_weight_grads(module, store):
    """Swap every nn.Linear inside `module` (the blocks' four matmuls) for DeferredWeightGradLinear."""
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                setattr(parent, name, DeferredWeightGradLinear(child, store))
