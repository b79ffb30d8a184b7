"""
module_io.py: what a technique needs to know of a model it did not write, found without a model's attribute paths:
which parameters several modules share (a tied embedding and LM head), how a module takes its main input (by
position or by keyword, as Hugging Face's layers are called: `self_attn(hidden_states=h, ...)`) and where its main
output is (a tensor, or the first item of a tuple: `(attn_output, attn_weights)`); and, on such hooks, where
sequence parallelism starts and ends around a module that tensor parallelism leaves replicated. Torch, the stdlib
and comm.py only: train_tp.py, which swaps and hooks a foreign model's modules by name, takes it along when copied
out (docs/copy_out.md).

    shared_parameters(model)              {parameter: [(module name, key), ...]} for those held twice or more
    swap_keeping_ties(model, new)         swap modules by name; tied weights stay one Parameter, or a ValueError
    on_first_input(module, fn)            a pre-hook: the module's first input x becomes fn(x), however passed
    on_first_output(module, fn)           a hook: its first output y becomes fn(y), a tuple keeping the rest
    sequence_parallel_edge(module, style, group)   SP: cut its output to my sequence chunk, or gather its input whole
    check_tp_plan(model, plan, n)         refuse a plan that tensor parallelism over n ranks would apply wrong
    fused_blocks(t, dim, parts)           the fused projections (q|k|v, gate|up) a "column" plan's parts name
    tp_slice(p, full, group)              a tensor-parallel parameter's slice of its whole value (unshard: back)
"""
import inspect

import torch
import torch.distributed as dist

from common.comm import gather_seq, reduce_scatter_seq


def shared_parameters(model):
    """Parameters that two or more module attributes of `model` hold (tied weights), by identity: {parameter:
    [(module name, attribute), ...]} in module order. Names are what named_modules() says."""
    holders = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for key, p in module._parameters.items():
            if p is not None:
                holders.setdefault(p, []).append((name, key))
    return {p: where for p, where in holders.items() if len(where) > 1}


def swap_keeping_ties(model, new):
    """Replace each module `model.get_submodule(name)` by new[name], in place. A parameter that several modules
    held before (a tied embedding / head) is one Parameter after: the first swapped holder's, given to the others
    (same key, same shape). A tie the swap would cut, where some holders are swapped and others are not, or whose
    new parameters differ in shape or split, is a ValueError naming the tied parameters, raised before any swap."""
    ties = []
    for p, where in shared_parameters(model).items():
        swapped = [(name, key) for name, key in where if name in new]
        if not swapped:
            continue
        names = [f"{name}.{key}" if name else key for name, key in where]
        kept = [n for (name, _), n in zip(where, names) if name not in new]
        first = getattr(new[swapped[0][0]], swapped[0][1], None)
        others = [getattr(new[name], key, None) for name, key in swapped[1:]]
        if kept or first is None or any(not same_layout(first, q) for q in others):
            why = f"not swapped: {', '.join(kept)}" if kept else "their new layers split them differently"
            raise ValueError(f"{' and '.join(names)} are one tied parameter, but the swap would untie them ({why}): "
                             f"swap every holder alike, or untie them on purpose first")
        ties.append((first, swapped[1:]))
    for name, module in new.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
    for first, rest in ties:
        for name, key in rest:
            setattr(new[name], key, first)
    return model


def same_layout(a, b):
    """Whether two new parameters can be one: the same shape and the same split tags (tensor-parallel)."""
    tags = ("tp_split", "tp_pad")
    return (b is not None and a.shape == b.shape and a.dtype == b.dtype
            and all(getattr(a, t, None) == getattr(b, t, None) for t in tags))


def first_input_name(module):
    """The name of the first parameter of module.forward (hidden_states for a Hugging Face layer)."""
    return next(iter(inspect.signature(module.forward).parameters))


def on_first_input(module, fn):
    """Register a forward pre-hook that replaces the module's first input x by fn(x), whether x comes by
    position (`module(x)`) or by keyword (`module(hidden_states=x)`); other inputs pass unchanged."""
    name = first_input_name(module)

    def hook(mod, args, kwargs):
        if args:
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        return args, {**kwargs, name: fn(kwargs[name])}
    return module.register_forward_pre_hook(hook, with_kwargs=True)


def first_output(out, fn=None):
    """The main output of a module call: `out` itself if a tensor, else its first item (a tuple's or a list's).
    With fn: the same output with that tensor replaced by fn(tensor), the rest of a tuple kept."""
    if isinstance(out, torch.Tensor):
        return out if fn is None else fn(out)
    if fn is None:
        return out[0]
    return type(out)([fn(out[0]), *out[1:]])


def on_first_output(module, fn):
    """Register a forward hook that replaces the module's main output y (first_output) by fn(y)."""
    return module.register_forward_hook(lambda mod, args, out: first_output(out, fn))


# ----------------------------------------------------------------------------------------------------------
# the edges of sequence parallelism on a module TP leaves replicated (train_tp's tensor_parallel plans)

class ScatterToSP(torch.autograd.Function):
    """Enter SP from a replicated region (a replicated embedding's output): keep my sequence chunk. Backward:
    every rank's chunk gradient, all-gathered, is the gradient of the replicated input on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.dim = group, 0 if x.dim() == 2 else 1     # [B, T, h], or a position table's [T, h]
        return x.chunk(dist.get_world_size(group), dim=ctx.dim)[dist.get_rank(group)]

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group, dim=ctx.dim)[0], None


class GatherFromSP(torch.autograd.Function):
    """Leave SP for the whole sequence: all-gather it. Backward: into a replicated region (a replicated final
    layer or head) every rank computed the same gradient, so my chunk of it is mine (no sum); summed=True, as TP's
    f (sp_gather), each rank's covers only its own columns: the chunks are reduce-scattered."""

    @staticmethod
    def forward(ctx, x, group, summed=False):
        ctx.group, ctx.summed = group, summed
        return gather_seq(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.summed:
            return reduce_scatter_seq(grad, ctx.group)[0], None, None
        return grad.chunk(dist.get_world_size(ctx.group), dim=1)[dist.get_rank(ctx.group)], None, None


EDGES = ("sp_begin", "sp_end", "sp_gather")     # styles that hook a module and swap nothing


def sequence_parallel_edge(module, style, group):
    """Hooks that cut a replicated module's output to my sequence chunk (sp_begin) or gather its input whole
    (sp_end; sp_gather as TP's f, its gradient summed); its parameters and their names stay as they are."""
    if style == "sp_begin":
        on_first_output(module, lambda out: ScatterToSP.apply(out, group))
    else:
        on_first_input(module, lambda x: GatherFromSP.apply(x, group, style == "sp_gather"))


# ----------------------------------------------------------------------------------------------------------
# a plan checked before any swap (train_tp's tensor_parallel): what would otherwise run and train wrong, or fail on
# one rank with a bare shape error while another rank fails elsewhere

STYLES = ("column", "row", "embedding") + EDGES
FUSED = ("c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "in_proj", "gate_up_proj", "w13")   # common names


def check_tp_plan(model, plan, n):
    """Raise ValueError, alike on every rank and before any swap, for a plan entry tensor parallelism over n ranks
    would apply wrong: an unknown style; an nn.Linear planned "column" that looks like fused projections (a known
    fused name, or out_features = 3 in_features: q|k|v), whose rank slices would be all of q and part of k, unless
    its parts are given (("column", 3), or ("column", 1) for one projection); features a split does not divide
    (each fused block's, for parts given as widths: ("column", (q_per_kv, 1, 1)) under grouped-query attention)."""
    for name, style in plan.items():
        kind, parts = style if isinstance(style, tuple) else (style, None)
        if kind not in STYLES:
            raise ValueError(f"{name}: unknown tensor-parallel style {style!r}: column, row, embedding, sp_begin, "
                             f"sp_end or sp_gather")
        module = model.get_submodule(name)
        if kind == "column" and parts is None and (name.rsplit(".", 1)[-1] in FUSED
                                                   or module.out_features == 3 * module.in_features):
            raise ValueError(f"{name}: an nn.Linear {module.in_features} -> {module.out_features} planned \"column\" "
                             f"looks like fused projections (q|k|v): split as one, each rank would get all of q and "
                             f"part of k; plan (\"column\", 3) (its number of fused parts), or (\"column\", 1) if "
                             f"it is one projection")
        if kind == "column" and isinstance(parts, tuple):
            widths = block_widths(module.out_features, parts)
            if sum(widths) != module.out_features or any(w % n for w in widths):
                raise ValueError(f"{name}: its {module.out_features} out_features do not split into blocks in "
                                 f"proportion {parts}, each divisible by tp {n} (grouped-query attention: tp must "
                                 f"divide the number of key/value heads)")
            continue
        split = {"column": ("out_features", n * (parts or 1)), "row": ("in_features", n)}.get(kind)
        if split is not None and getattr(module, split[0]) % split[1]:
            raise ValueError(f"{name}: its {getattr(module, split[0])} {split[0]} do not split into {split[1]} "
                             f"equal parts (tp {n}): pad them to a multiple (a tied head's vocabulary too, as "
                             f"nanoGPT's 50304 for GPT-2's 50257)")


# ----------------------------------------------------------------------------------------------------------
# a tensor-parallel parameter and its whole value (train_tp's layers load theirs; tp_shards.py inits, gathers and
# checkpoints them): it carries `tp_split = (dim, parts)`, its whole value is fused blocks along dim, rank r of n
# keeps the r-th 1/n of each; `tp_pad` zero rows are appended first (a vocabulary tp does not divide)

def fused_blocks(t, dim, parts):
    """The blocks of fused projections in t along dim, each split over the tp ranks on its own: `parts` equal
    blocks (an int: 3 for q|k|v, 2 for gate|up), or blocks as wide as the widths `parts` in proportion (a tuple:
    grouped-query attention's (q_per_kv, 1, 1) for q|k|v). Proportions hold in a rank's slice of t too."""
    return t.split(block_widths(t.shape[dim], parts), dim)


def block_widths(features, parts):
    """The widths of the fused blocks of `features` features (they sum to `features` where the parts fit)."""
    return [features // parts] * parts if isinstance(parts, int) else [features * w // sum(parts) for w in parts]


def shard_of(full, dim, parts, rank, n):
    return torch.cat([block.chunk(n, dim)[rank] for block in fused_blocks(full, dim, parts)], dim)


def unshard(pieces, dim, parts):                                 # inverse of shard_of; pieces[r]: rank r's
    blocks = [fused_blocks(piece, dim, parts) for piece in pieces]
    return torch.cat([torch.cat(block, dim) for block in zip(*blocks)], dim)   # block j: every rank's part of it


def tp_slice(p, full, group):
    """This rank's part of `full` (a whole value of parameter p: its weight, or an optimizer moment)."""
    if not hasattr(p, "tp_split"):                               # replicated: the whole value
        return full
    full = torch.cat([full, full.new_zeros(p.tp_pad, *full.shape[1:])])    # padding rows (dim 0) are zeros
    return shard_of(full, *p.tp_split, dist.get_rank(group), dist.get_world_size(group))
