"""
tp_shards.py: how a tensor-parallel parameter of train_tp.py relates to the full tensor train_single.py holds.

A sharded parameter carries `tp_split = (dim, parts)`: the full tensor is blocks along `dim` (3 equal ones for
c_attn's q|k|v, 1 elsewhere, or of widths in proportion `parts`: (q_per_kv, 1, 1) for grouped-query attention's)
and rank r of n keeps the r-th 1/n of each block; `tp_pad` zero rows are appended first where the vocabulary does
not divide by n. A parameter without `tp_split` is replicated whole. That slicing rule (tp_slice and its inverse
unshard) lives in module_io.py, as train_tp's layers load with it and a copied rung takes it along.

    c_attn.weight [3h, h], parts 3, n 2:   full  [ q0 q1 | k0 k1 | v0 v1 ]   rank 0 [ q0 k0 v0 ]  rank 1 [ q1 k1 v1 ]
    GQA, 4 q heads, 2 kv heads, (2, 1, 1): full  [ q0 q1 q2 q3 | k0 k1 | v0 v1 ]     rank 0 [ q0 q1 k0 v0 ] ...

Every layout starts from the same weights because init_tp_weights draws each full parameter from
model.init_parameter and keeps its slice; gather_full_weights and tp_gather go back (checkpoints, parity tests).
"""
import torch
import torch.distributed as dist

from common.comm import all_gather
from common.module_io import tp_slice, unshard
from model import init_parameter


def full_shape(p, group):
    """The shape of the whole tensor whose TP slice is parameter p (padding rows excluded)."""
    if not hasattr(p, "tp_split"):
        return tuple(p.shape)
    n, dim = dist.get_world_size(group), p.tp_split[0]
    return tuple(size * n - p.tp_pad if i == dim else size for i, size in enumerate(p.shape))


@torch.no_grad()
def tp_gather(p, local, group):
    """Inverse of tp_slice: the whole value from every rank's part `local` (shaped like p), padding dropped."""
    if not hasattr(p, "tp_split"):
        return local.detach()
    n = dist.get_world_size(group)
    flat = local.new_empty(n * local.numel())                         # every rank's part, in rank order
    all_gather(flat, local.detach().reshape(-1).contiguous(), group=group)
    whole = unshard(flat.view((n,) + tuple(local.shape)).unbind(0), *p.tp_split)
    return whole[: len(whole) - p.tp_pad]


@torch.no_grad()
def init_tp_weights(model, seed, group):
    """Each parameter's full initial value from model.init_parameter, one at a time; keep this rank's slice."""
    for name, p in model.named_parameters():
        p.copy_(tp_slice(p, init_parameter(name, full_shape(p, group), model.cfg.n_layer, seed), group))


def gather_full_weights(model, group):
    """{name: full tensor}, as train_single.py's model would hold it (for parity checks and exports)."""
    return {name: tp_gather(p, p, group).cpu().clone() for name, p in model.named_parameters()}
