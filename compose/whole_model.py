"""
compose/whole_model.py: the whole trained model back on one rank for train_5d.py's end-of-run sample, where the
pipeline's stages meet expert parallelism (and ZeRO's shards, TP's slices): no rung holds more than one of these
cuts, so none can undo all of them. Each rank's held state gives its whole tensors (ZeRO's shards and TP's slices
gathered: checkpoint's ModuleState / ShardState.whole); the experts are then gathered over ep, the stages over pp:

    every rank       {name: whole tensor} of its stages' parameters, its experts only
    ep group         gather_object -> its first rank: every expert of its stages
    pp group         (the tp, cp, dp coordinate 0 ranks only) gather_object -> global rank 0: every stage

Before any gather rank 0 checks that twice the fp32 model's bytes fit its device (training.fits_on_device) and
broadcasts the answer, so every rank skips the sample alike, with one line, where the model would not fit.
"""
import torch
import torch.distributed as dist

from common import comm
from common.evaluation import print_sample
from common.startup import fits_on_device
from model import GPT, num_params


def gather_to_first(obj, group):
    """[obj of every rank of `group`] on the group's first rank, None on the others."""
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def gather_whole(held, grid):
    """{name: whole weight} of the model (buffers too) on global rank 0 (None elsewhere), for the sample:
    experts gathered over ep, the stages' parts over pp."""
    parts = {name: values[0].cpu() for name, values, _ in held.whole(moments=False)}
    if grid.ep > 1:
        gathered = gather_to_first(parts, grid.groups.ep)
        if gathered is None:
            return None
        parts = {k: v for part in gathered for k, v in part.items()}
    if grid.coords["tp"] or grid.coords["cp"] or grid.coords["dp"]:
        return None
    gathered = gather_to_first(parts, grid.groups.pp)
    return None if gathered is None else {k: v for part in gathered for k, v in part.items()}


def sample_on_rank0(cfg, held, grid, gcfg, loader, env):
    """The whole trained model on global rank 0, for the eyeball test that training worked; skipped with one line
    when it would not fit beside what rank 0 holds: twice the fp32 model's bytes, the gathered weights (which NCCL's
    gather_object stages on the device, each stage's padded to the largest's) then the model built from them."""
    need = 2 * num_params(gcfg) * 4
    fits = torch.tensor(float(env.rank != 0 or fits_on_device(need, env.device)), device=env.device)
    comm.broadcast(fits, src=0)                  # rank 0's answer: every rank skips the gather, or none
    if not fits:
        if env.is_main:
            print(f"sample: skipped: the whole model needs {need / 2**30:.1f} GiB free on rank 0's {env.device} "
                  f"(twice its fp32 weights), more than it has", flush=True)
        return
    whole = gather_whole(held, grid)
    if whole is not None:
        model = GPT(gcfg).to(env.device)
        model.load_state_dict({**whole, "lm_head.weight": whole["transformer.wte.weight"]})
        print_sample(model, loader, cfg, env)
