"""
compose/ep_grid.py: train_ep's experts on train_5d.py's grid, where expert parallelism meets the other axes: the
router's statistics and the checkpoint's writers. train_ep alone shares experts over the whole world, one rank per
token slice; on the grid the ranks routing the other tokens are the dp x cp group (tp too under SP, where each TP
rank routes its own sequence chunk), the MoE blocks sit in several pipeline stages, and an expert is held by the
tp x edp ranks of its stage, a dense tensor by the stage's whole dp x cp x tp slab. Neither rung knows the grid.

    moe_metrics(chunks, grid, cfg)   the step's router metrics, summed over the ranks that routed the global batch,
                                     every stage's blocks met on rank 0
    checkpoint_holder(name, grid)    which of the ranks holding a whole tensor writes it (checkpoint.save)
"""
import torch
import torch.distributed as dist

from common import comm
from common.routing import end_moe_step, router_metrics
from train_ep import is_expert_param


def moe_metrics(chunks, grid, cfg):
    """The step's router metrics: each MoE block's statistics summed over the ranks that routed the other tokens
    of the global batch (dp x cp; tp too under SP, where each TP rank routes its sequence chunk), which also
    sets every block's load for the next step (routing.end_moe_step); every stage's blocks then meet on rank 0."""
    def reduce(stats):
        comm.all_reduce(stats, group=grid.groups.dp_cp)
        if cfg.sp:
            comm.all_reduce(stats, group=grid.groups.tp)

    stats = end_moe_step(chunks, reduce)
    if grid.sizes["pp"] > 1:
        stages = [None] * grid.sizes["pp"]
        dist.all_gather_object(stages, stats.cpu(), group=grid.groups.pp)
        stats = torch.cat([s for s in stages if s.numel()])
    return router_metrics(stats, cfg.top_k)



# checkpoints: common/checkpoint's one format, so any layout (or train_single) resumes any other. Each whole tensor
# is written by one of the ranks holding it: a dense one by the ranks of its stage's dp x cp x tp slab once
# gathered, an expert by the tp x edp ranks holding it.

def checkpoint_holder(name, grid):
    """(key, holders, my index) of a whole tensor of my stages, for checkpoint.save."""
    data_index, tp, tp_index = dist.get_rank(grid.groups.dp_cp), grid.sizes["tp"], grid.coords["tp"]
    slab = grid.sizes["dp"] * grid.sizes["cp"]
    if is_expert_param(name):
        return "experts", slab // grid.ep * tp, data_index // grid.ep * tp + tp_index
    return "dense", slab * tp, data_index * tp + tp_index

