"""
grid.py: train_5d.py's grid of ranks. One rank order (Megatron's: tp innermost so a TP group shares a node's
NVLink, then cp, dp, pp outermost) and every process group derived from it, the expert groups carved out of
dp x cp, the printout, and the step's counted bytes by axis.

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i          e.g. dp 2 x tp 2 x pp 2 on 8 ranks:
                                                                     stage 0: [0 1] [2 3]   stage 1: [4 5] [6 7]
                                                                               dp0   dp1             dp0   dp1
"""
import math
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist

from common.comm import COMM, new_group

AXES = ("tp", "cp", "dp", "pp")          # innermost first
GROUPS = dict(tp=("tp",), cp=("cp",), dp=("dp",), pp=("pp",),
              dp_cp=("dp", "cp"),        # gradient averaging, loss averaging: every copy of the same weights
              mp=("tp", "pp"))           # model parallel: the ranks that together hold one copy (grad norm)
AXIS_OF = dict(tied="pp", dp_cp="dp", edp="dp")  # the axis a group's bytes count under, where not its own name


# ----------------------------------------------------------------------------------------------------------
# the grid: one rank order, every group derived from it

def coords_of(rank, sizes):
    """{axis: index} of a global rank, tp varying fastest."""
    coords = {}
    for axis in AXES:
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return coords


def partition(sizes, varying):
    """Every group of global ranks that differ only along the `varying` axes, each in increasing rank order
    (so a pp group lists stage 0 first)."""
    groups = {}
    for rank in range(math.prod(sizes.values())):
        c = coords_of(rank, sizes)
        groups.setdefault(tuple(c[a] for a in AXES if a not in varying), []).append(rank)
    return list(groups.values())


def tied_pairs(sizes, v_shaped=False):
    """The first and last pipeline stage of each pp group: the two copies of the tied embedding (none when the
    stages are placed in a V: pipeline rank 0 holds both ends, one Parameter)."""
    return [[g[0], g[-1]] for g in partition(sizes, ("pp",))] if sizes["pp"] > 1 and not v_shaped else []


@dataclass
class Grid:
    sizes: dict        # axis -> degree
    coords: dict       # axis -> this rank's index
    groups: SimpleNamespace   # this rank's process group of each name: groups.tp, .cp, .dp, .pp, .dp_cp, .mp,
                              # .tied (first / last stage; else None), .ep and .edp (experts)
    members: dict      # name -> every group's global ranks (for the printout)
    ep: int = 1        # expert-parallel degree: experts sharded over ep ranks of each dp x cp group
    communicators: int = 0   # process groups made: one per distinct (axis, ranks) of size > 1, one per rank of size 1
    creations: int = 0       # calls that made them (make_groups): one per name with new groups, one for all one-rank


def expert_partition(sizes, ep):
    """EP groups: ep consecutive members of each dp x cp group (the ranks holding different slices of the
    batch); EDP groups: the ranks of a dp x cp group holding the same experts (stride ep)."""
    data_groups = partition(sizes, GROUPS["dp_cp"])
    return dict(ep=[g[i:i + ep] for g in data_groups for i in range(0, len(g), ep)],
                edp=[g[j::ep] for g in data_groups for j in range(ep)])


def make_groups(rank_lists, rank, timeout_s):
    """Every group of one name (disjoint lists of global ranks), made by one call on every rank; returns this rank's
    group, or None. With the default group bound to a GPU (NCCL, init_distributed) that is one `dist.split_group`: a
    single ncclCommSplit for the whole list, where `new_group` per group is one split of the whole world each (1,024
    splits for the one-rank groups of 1,024 ranks). Elsewhere (gloo, where a group is a store prefix, not a split
    communicator; the one-process default group) one `new_group` per group."""
    if getattr(dist.group.WORLD, "bound_device_id", None) is not None:
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        return dist.split_group(split_ranks=[list(r) for r in rank_lists], timeout=timeout)
    mine = None
    for ranks in rank_lists:
        group = new_group(list(ranks), timeout_s)
        mine = group if rank in ranks else mine
    return mine


def build_grid(sizes, rank, timeout_s, ep=1, v_shaped=False):
    """Create every group (all ranks create all of them, in the same order) and keep this rank's. Names whose
    groups hold the same ranks and count under the same axis share one process group (dp_cp is dp when cp is 1; the
    tied pair is the pp group when pp is 2), and a rank's size-1 groups are one (a degree of 1 on several axes): under
    NCCL each group made is a communicator. Each name's new groups are made by one call (make_groups: one NCCL split
    per name, not per group), and the one-rank groups of every rank by one more (docs/nccl.md)."""
    members, splits = {}, {}                    # splits: creation call -> the (axis, ranks) keys it makes
    layout = {name: partition(sizes, axes) for name, axes in GROUPS.items()}
    layout["tied"] = tied_pairs(sizes, v_shaped)
    if ep > 1:
        layout.update(expert_partition(sizes, ep))
    seen = set()
    for name, rank_lists in layout.items():
        members[name] = rank_lists
        for ranks in rank_lists:
            key = group_key(name, ranks)
            if key not in seen:
                seen.add(key)
                splits.setdefault(name if len(ranks) > 1 else "one rank", []).append(key)
    made = {}
    for keys in splits.values():                # the same calls, in the same order, on every rank
        mine = make_groups([ranks for _, ranks in keys], rank, timeout_s)
        made.update({key: mine if rank in key[1] else None for key in keys})
    groups = {name: made[group_key(name, r)] for name, lists in layout.items() for r in lists if rank in r}
    groups.setdefault("tied", None)              # middle stages, or pp == 1
    return Grid(sizes, coords_of(rank, sizes), SimpleNamespace(**groups), members, ep, len(made), len(splits))


def group_key(name, ranks):
    """What makes two groups one: the same ranks, counted under the same axis (every one-rank group is this rank's
    one; it sends no bytes)."""
    return (AXIS_OF.get(name, name) if len(ranks) > 1 else "one rank", tuple(ranks))


def print_grid(grid, cfg, act_shape, n_params_local):
    sizes = grid.sizes
    print(f"train_5d: dp {sizes['dp']} x tp {sizes['tp']} x cp {sizes['cp']} x pp {sizes['pp']} = "
          f"{math.prod(sizes.values())} ranks (rank order: tp innermost, then cp, dp, pp)", flush=True)
    for name in ("tp", "cp", "dp", "pp", "dp_cp", "tied", "ep", "edp"):
        if grid.members.get(name):
            rows = " ".join("[" + " ".join(map(str, g)) + "]" for g in grid.members[name])
            print(f"  {name:6s} {rows}", flush=True)
    b, t, h = act_shape
    local_t, local_heads = cfg.block_size // sizes["cp"], cfg.n_head // sizes["tp"]
    print(f"  messages: pp [{b}, {t}, {h}] activations (and their gradients) per micro-batch and stage boundary; "
          f"tp [{b}, {local_t}, {h}] per block, 2 forward + 2 backward; cp K and V of {local_heads} heads x "
          f"{local_t} positions per ring step; dp {n_params_local:,} gradient values per step",
          flush=True)


def bytes_by_axis(grid):
    """This step's counted bytes by grid axis (the tied-weight pair counts as pp, the norm's scalar as mp)."""
    names = {group: AXIS_OF.get(name, name) for name, group in vars(grid.groups).items() if group is not None}
    out = dict(dp=0.0, tp=0.0, cp=0.0, pp=0.0, ep=0.0, mp=0.0)
    for group, nbytes in COMM.by_group.items():
        out[names.get(group, "mp")] += nbytes
    return out
