"""
converters/tp_gemms.py: train_tp's tensor-parallel layers with their GEMMs open to two later techniques, each
through a slot the layer's matmul reads:

    gemm                which GEMMs run: None (torch's) or FP8's (converters/fp8_tp.py's Float8ParallelGemms, set by
                        convert_parallel_to_float8)
    weight_grad_store   when dW runs: None (in backward) or in a zero-bubble pipeline's W action (pipeline/
                        weight_grads.py's WeightGradStore, handed over by defer_weight_grads)

    from converters.tp_gemms import with_gemm_slots
    with_gemm_slots(model)       # train_tp's layers in `model` get the slots (the same objects, parameters, names)

convert_parallel_to_float8 calls it before it fills `gemm`; train_5d.py calls it before defer_weight_grads, which
hands the store to every module with a `weight_grad_store` attribute. Each layer's class becomes itself with a
small class in front (ColumnGemmSlots, RowGemmSlots, LMHeadGemmSlots) that overrides only its `matmul` (a row
layer's `partial`, the term g sums). Imports no rung, whose scripts reach this module through their --fp8.

A column layer's backward then does what train_tp's ColumnLinearFn does (dx with its all-reduce, or SP's
reduce-scatter, overlapped or not) and, with a store, stashes (W, b, x, dy) for W instead of computing dW and db:
B keeps the layer's communication, W runs the same dW GEMM (FP8: on the operands F and B quantized, bit for bit
the unsplit backward's). A row layer's dx needs no communication, so its product is the store's or the FP8 GEMMs'
own linear, summed by train_tp's g as before. docs/pipelines.md ("The W step") says what each layer defers.
"""
import functools

import torch
import torch.nn.functional as F

from common.comm import all_reduce, gather_seq, in_compute_dtype, reduce_scatter_seq


class ColumnLinearGemmsFn(torch.autograd.Function):
    """train_tp's ColumnLinearFn (SP, overlap) with a `store` (the zero-bubble split: backward returns dx with its
    communication and stashes (W, b, x, dy) for W) and a `gemm` (forward / grad_input / grad_weight replace
    torch's three matmuls)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sp, overlap, store=None, gemm=None):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sp, ctx.overlap, ctx.has_bias, ctx.gemm = group, sp, overlap, bias is not None, gemm
        ctx.store, ctx.params = store, (weight, bias)          # the Parameters themselves, for W
        full = gather_seq(x, group)[0] if sp else x
        if gemm is None:
            return F.linear(full, weight, bias)
        y = gemm.forward(ctx, full, weight)
        return y if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        x = gather_seq(x, ctx.group)[0] if ctx.sp else x      # SP: the full sequence again
        if ctx.gemm is None:
            grad_in = grad_out @ weight.to(grad_out.dtype)      # my columns' share of dL/dx
        else:
            grad_in = ctx.gemm.grad_input(ctx, grad_out, weight)
        if ctx.sp:
            grad_in, work = reduce_scatter_seq(grad_in, ctx.group, async_op=ctx.overlap)
        else:
            work = all_reduce(grad_in, group=ctx.group, async_op=ctx.overlap)
        if ctx.store is not None:                                # dW and db wait for the W action (FP8: its GEMM)
            ctx.store.stash(*ctx.params, x, grad_out, None if ctx.gemm is None else ctx.gemm.weight_grad(ctx, weight))
            if work is not None:
                work.wait()
            return grad_in, None, None, None, None, None, None, None
        g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])   # (overlap: runs while
        if ctx.gemm is None:                                                            # the sum travels)
            grad_w = (g2.t() @ x2.to(g2.dtype)).to(weight.dtype)
        else:
            grad_w = ctx.gemm.grad_weight(ctx, g2, x2, weight)
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return grad_in, grad_w, grad_b, None, None, None, None, None


def column_parallel_gemms(x, weight, bias, group, sp, overlap, store, gemm):
    return ColumnLinearGemmsFn.apply(in_compute_dtype(x), weight, bias, group, sp, overlap, store, gemm)


@functools.cache
def eager_gemms():
    """column_parallel_gemms run eagerly under --compile (its collectives, as train_tp's column_parallel), made when
    a layer first gets the slots (with_slots), not by a decorator at import: torch.compiler.disable imports
    torch._dynamo, 2.5 s, which every script importing converters/ (train_single too) would pay."""
    return torch.compiler.disable(column_parallel_gemms)


class ColumnGemmSlots:
    """On train_tp's ColumnParallelLinear: its matmul runs `gemm`'s GEMMs and leaves dW to `weight_grad_store`."""
    weight_grad_store = None
    gemm = None

    def matmul(self, x, bias=None):
        if self.gathered or (self.weight_grad_store is None and self.gemm is None):
            return super().matmul(x, bias)       # (inside an sp_gather module: a local matmul, as train_tp's)
        return self.gemms(x, self.weight, bias, self.group, self.sp, self.overlap, self.weight_grad_store, self.gemm)


class RowGemmSlots:
    """On train_tp's RowParallelLinear: its partial product (before g sums it) is `gemm`'s and / or leaves dW to
    `weight_grad_store` (dx needs no communication here, so the FP8 GEMMs' or the store's own linear is the whole
    change)."""
    weight_grad_store = None
    gemm = None

    def partial(self, x):
        if self.gemm is not None:
            return self.gemm.linear(x, self.weight, self.weight_grad_store)
        if self.weight_grad_store is not None:
            return self.weight_grad_store.linear(x, self.weight)
        return super().partial(x)


class LMHeadGemmSlots:
    """On train_tp's VocabParallelLMHead: its logits leave dW to `weight_grad_store` (its GEMMs stay torch's)."""
    weight_grad_store = None

    def matmul(self, x):
        if self.weight_grad_store is None:
            return super().matmul(x)
        return self.gemms(x, self.weight, None, self.group, self.sp, self.overlap, self.weight_grad_store, None)


# by class name: run as a script, train_tp's classes are __main__'s, a copy of the importable module's
SLOTS = {"ColumnParallelLinear": ColumnGemmSlots, "RowParallelLinear": RowGemmSlots,
         "VocabParallelLMHead": LMHeadGemmSlots}


@functools.cache
def with_slots(cls, slots):
    """cls with the slots' matmul in front of its own: isinstance(layer, cls) stays true."""
    return type(f"{cls.__name__}WithGemmSlots", (slots, cls), {"gemms": staticmethod(eager_gemms())})


def with_gemm_slots(model):
    """Give train_tp's layers inside `model` the slots, in place: each one's class becomes itself with the slots
    mixed in (the same object, so its parameters, their names and tags, and whatever holds the layer are
    unchanged; both slots start empty, so it computes as before). Returns `model`."""
    for m in model.modules():
        slots = SLOTS.get(type(m).__name__)
        if slots is not None:
            m.__class__ = with_slots(type(m), slots)
    return model
