"""
converters/fp8_tp.py: the FP8 GEMMs of kernels/fp8.py inside tensor-parallel layers, each operand quantized as
one device holding the whole layer would quantize it, while the layer keeps its own TP / SP communication.

    from converters.fp8_tp import convert_parallel_to_float8
    convert_parallel_to_float8(model, "tensorwise")   # every column / row-parallel layer (train_tp) runs FP8 GEMMs

train_tp's layers get a `gemm` slot from converters/tp_gemms.py (None: torch's): a column layer's backward calls its
forward / grad_input / grad_weight around the collectives, a row layer's partial product is its linear. A TP layer
holds a slice of W, and each of its three GEMMs contracts over one dimension, whole on every rank or split over tp:

                    contracts over    column-parallel (W's rows split)      row-parallel (W's columns split)
    y  = x W^T      K (in features)   whole                                 split: partial sums, then g sums
    dx = dy W       N (out features)  split: partial sums, then f sums      whole
    dW = dy^T x     M (tokens)        whole (under SP, x gathered again)    whole

What a scale spans, hence what must be reduced (all_reduce MAX over tp, counted like every collective):
    tensorwise, delayed  one scale per tensor: a split tensor's amax (column: W, dy; row: x, W) is maxed over tp,
        one value per tensor per micro-batch (x of a column layer and dy of a row layer are whole on every rank).
        delayed pushes that whole-tensor amax, so every rank's history is one device's.
    rowwise  one scale per row along the contraction dim: where the contraction is whole each rank holds whole
        rows, no reduction; where it is split (row's y, column's dx) each rank holds a piece of every row, so the
        row amaxes of both operands (M + N or M + K values) are maxed over tp.
    blockwise  1x128 tiles along K, 128x128 weight blocks: when every shard edge is a multiple of 128
        (n_embd / tp, each q|k|v part and the MLP width / tp, each gate|up part: common/tp_setup.check_tp requires it)
        each tile and block lies inside one rank and one part, so no reduction at all. A tile cut by a shard edge would need a scale shared
        by two ranks' GEMMs, which one _scaled_mm per rank cannot take: refused.
With these, every element is quantized to the same FP8 value on every layout. What differs from one device is
the order of the sums where the contraction is split: tp partial products, each rounded to the GEMM's output
dtype (fp32; bf16 for row- and block-scaled GEMMs on a GPU), then summed in the parameter dtype, where one device
rounds once. A later quantization can round such a value the other way: docs/kernels.md has the measured bound.
"""
import functools

import torch
import torch.distributed as dist

import kernels.fp8 as fp8
from common.comm import all_reduce
from converters.tp_gemms import with_gemm_slots
from kernels.fp8 import BLOCK, E4M3, E5M2, RECIPES, check_fp8_support, delayed_amax, fp8_matmul
from kernels.fp8_cast import fp8_amax


def max_over(group, *amaxes):
    """The amaxes, each maxed elementwise over the ranks of `group` (one all-reduce for all of them)."""
    flat = torch.cat([a.reshape(-1) for a in amaxes])
    all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return [v.view_as(a) for a, v in zip(amaxes, flat.split([a.numel() for a in amaxes]))]


class Float8ParallelGemms:
    """The three FP8 GEMMs of one tensor-parallel layer. split: "out" (column-parallel: W's rows, hence y's and
    dy's columns) or "in" (row-parallel: W's columns, hence x's columns). Forward state for backward goes on the
    autograd ctx, so one object serves every micro-batch in flight."""

    def __init__(self, recipe, group, split, history_len=16, device=None):
        if recipe not in RECIPES or split not in ("out", "in"):
            raise ValueError(f"FP8 recipe {recipe!r} / split {split!r}: expected one of {RECIPES} / out, in")
        self.recipe, self.group, self.split = recipe, group, split
        self.amax_history = torch.zeros(3, history_len, device=device)    # x, W, dy (delayed)
        # linear(x, weight, store=None): x W^T with autograd, no communication of its own (a row-parallel layer's
        # partial product); store: a zero-bubble pipeline's WeightGradStore (pipeline/weight_grads.py), which
        # runs the dW GEMM in W. Its collectives (the amax reductions) run eagerly under torch.compile, as train_tp's
        # do. Wrapped here, not by a decorator at import, where torch.compiler.disable would import torch._dynamo
        # (1.3 s) into every script, a refused one too; a partial, not a bound method, so a deepcopy's points at it.
        self.linear = functools.partial(torch.compiler.disable(_parallel_linear), self)

    def whole_amax(self, t, split_here, slot):
        """Tensorwise: the amax of the whole tensor (t's, maxed over tp where t is this rank's slice: split_here).
        Delayed: that amax pushed into the history, and the history's scale source returned. None for rowwise and
        blockwise, whose amaxes fp8_matmul takes per row / tile."""
        if self.recipe not in ("tensorwise", "delayed"):
            return None
        a = fp8_amax(t, (0, 0), fp8.fused_cast(t))         # [1, 1], one fused pass on a GPU
        if split_here:
            a = max_over(self.group, a)[0]
        return delayed_amax(self.amax_history[slot], t, a) if self.recipe == "delayed" else a

    def k_reduce(self, split_k):
        """fp8_matmul's hook for a split contraction (rowwise row amaxes maxed over tp); blockwise checks that its
        tiles do not straddle ranks."""
        if not split_k:
            return None
        return lambda a, b: max_over(self.group, a, b)

    def check_blocks(self, x2, weight):
        if self.recipe == "blockwise" and dist.get_world_size(self.group) > 1:
            local = weight.shape[0] if self.split == "out" else x2.shape[1]
            if local % BLOCK:
                raise ValueError(f"FP8 blockwise under tensor parallelism needs shards that are whole {BLOCK}-blocks; "
                                 f"this layer's shard is {local} wide")

    def forward(self, ctx, x, weight):
        """y = x W^T in FP8 for this rank's slice; stashes the amaxes for backward on ctx."""
        x2 = x.reshape(-1, x.shape[-1])
        self.check_blocks(x2, weight)
        row = self.split == "in"
        x_amax, w_amax = self.whole_amax(x2, row, 0), self.whole_amax(weight, True, 1)
        y = fp8_matmul(x2, weight, E4M3, E4M3, self.recipe, x_amax, w_amax, k_reduce=self.k_reduce(row))
        ctx.fp8_amaxes = (x_amax, w_amax)
        return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    def grad_dtype(self, dy):
        # cuBLASLt's row-scaled FP8 GEMMs take e4m3 operands only (as kernels/fp8.py's Float8Linear)
        return E4M3 if fp8.gemm_kind(dy) != "cpu" and self.recipe in ("rowwise", "blockwise") else E5M2

    def grad_input(self, ctx, dy, weight):
        """dx = dy W (this rank's share: a partial sum for a column layer); stashes dy's amax for grad_weight."""
        dy2 = dy.reshape(-1, dy.shape[-1])
        column = self.split == "out"
        ctx.fp8_dy_amax = self.whole_amax(dy2, column, 2)
        dx = fp8_matmul(dy2, weight.t(), self.grad_dtype(dy), E4M3, self.recipe, ctx.fp8_dy_amax, ctx.fp8_amaxes[1],
                        k_reduce=self.k_reduce(column))
        return dx.to(dy.dtype).view(*dy.shape[:-1], weight.shape[1])

    def grad_weight(self, ctx, dy2, x2, weight):
        """dW of this rank's slice = dy^T x, contracted over the tokens (whole on every rank)."""
        dw = fp8_matmul(dy2.t(), x2.t(), self.grad_dtype(dy2), E4M3, self.recipe, ctx.fp8_dy_amax,
                        ctx.fp8_amaxes[0], b_is_weight=False)
        return dw.to(weight.dtype)

    def weight_grad(self, ctx, weight):
        """grad_weight as a function of (dy2, x2): what a zero-bubble pipeline's W step calls
        (pipeline/weight_grads.WeightGradStore.stash), the same GEMM on the same operands and amaxes."""
        return functools.partial(self.grad_weight, ctx, weight=weight)


def _parallel_linear(gemms, x, weight, store=None):
    """Float8ParallelGemms.linear (its __init__ says what and why)."""
    return _ParallelFloat8Linear.apply(x, weight, gemms, store)


class _ParallelFloat8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gemms, store):
        ctx.save_for_backward(x, weight)
        ctx.gemms, ctx.store, ctx.weight = gemms, store, weight     # the Parameter itself, for W
        return gemms.forward(ctx, x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = ctx.gemms.grad_input(ctx, dy, weight)
        weight_grad = ctx.gemms.weight_grad(ctx, weight)
        if ctx.store is not None:       # dW later, the same GEMM on the same operands and amaxes
            ctx.store.stash(ctx.weight, None, x, dy, weight_grad)
            return dx, None, None, None
        return dx, weight_grad(dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])), None, None


def convert_parallel_to_float8(model, recipe="tensorwise", skip=("lm_head", "wte", "router", "gate")):
    """Give every tensor-parallel linear layer (a module with a `gemm` slot and a weight tagged `tp_split`: train_tp's
    column / row-parallel layers, given the slot here) FP8 GEMMs, in place; returns their names. The split comes
    from the weight's tag: dim 0 (out features) is column-parallel, dim 1 row-parallel."""
    with_gemm_slots(model)
    converted = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "gemm") or not hasattr(weight, "tp_split") or any(s in name for s in skip):
            continue
        check_fp8_support(weight.device)
        split = "out" if weight.tp_split[0] == 0 else "in"
        module.gemm = Float8ParallelGemms(recipe, module.group, split, device=weight.device)
        converted.append(name)
    return converted
