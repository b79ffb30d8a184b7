"""
zero_checkpoint.py: ZeRO's checkpoints, always consolidated to train_single.py's layout (the whole model's
weights and a single-device AdamW's state, in one file), so any stage or world size, train_single or
train_5d can resume any other. For train_zero.py (and train_5d.py's ZeRO-1).

A shard (train_zero.Shard) is one bucket or unit of parameters as a flat buffer, zero-padded to a multiple of
the group size; rank r holds elements [lo, hi). Saving all-gathers every flat buffer (master weights, Adam
moments) and cuts it back into named tensors; loading lays the named tensors out flat again (`flatten`) and
keeps [lo, hi).
"""
import torch

from checkpoint import (checkpoint_path, load_checkpoint, own_rng_state, rng_state, rng_states_by_rank, save_checkpoint,
                        set_rng_state)
from comm import all_gather
from config import config_dict, fail
from optim import configure_optimizer
from train_single import fail_together


@torch.no_grad()
def full_values(shards, attr):
    """{parameter name: full fp32 (or float64) tensor} of the master weights or an AdamW moment, gathered
    from the shards."""
    out = {}
    for s in shards:
        local = getattr(s, attr)
        full = local
        if s.stage > 0:
            full = torch.empty(s.padded, dtype=local.dtype, device=local.device)
            all_gather(full, local, group=s.group)
        for name, p, off in zip(s.names, s.params, s.offsets):
            out[name] = full[off: off + p.numel()].view(p.shape).cpu().clone()
    return out


def optimizer_layout(model, cfg):
    """Parameter names in the order of a single-device AdamW's state_dict, and its param_groups."""
    names = {p: n for n, p in model.named_parameters()}
    reference = configure_optimizer(model.named_parameters(), cfg)       # holds no state: layout only
    order = [names[p] for g in reference.param_groups for p in g["params"]]
    return order, reference.state_dict()["param_groups"]


def write_single_device_checkpoint(cfg, model, weights, exp_avg, exp_avg_sq, adam_step, next_step, rng_by_rank=None):
    """ckpt.pt exactly as train_single writes it, from whole tensors by GPT parameter name: `model` (a GPT,
    meta is enough) gives the state_dict keys (the tied lm_head.weight too) and the AdamW state order.
    rng_by_rank: every rank's RNG state (checkpoint.rng_states_by_rank), for ranks with their own dropout streams."""
    order, param_groups = optimizer_layout(model, cfg)
    names = {p: n for n, p in model.named_parameters()}
    # one step tensor per parameter, as torch saves them: a shared one would be stepped once per parameter
    state = {i: dict(step=adam_step.clone(), exp_avg=exp_avg[n], exp_avg_sq=exp_avg_sq[n]) for i, n in enumerate(order)}
    # parameters by name (the tied lm_head.weight is wte's); buffers (an MoE block's load) by their own key
    model_state = {k: weights[names.get(p, k)] for k, p in model.state_dict(keep_vars=True).items()}
    extra = {} if rng_by_rank is None else dict(rng_by_rank=rng_by_rank)
    try:
        save_checkpoint(checkpoint_path(cfg.out_dir), dict(
            model=model_state, optimizer=dict(state=state, param_groups=param_groups), step=next_step,
            rng=rng_state(), config=config_dict(cfg), **extra))
    except ValueError as e:                          # non-finite weights: keep the checkpoint that is there
        fail(str(e), rank_local=True)


def save_consolidated(cfg, model, shards, optimizer, next_step, rank):
    weights, m, v = (full_values(shards, a) for a in ("master", "exp_avg", "exp_avg_sq"))   # every rank
    rngs = rng_states_by_rank()                      # each rank's dropout stream (seed + rank)
    if rank == 0:
        write_single_device_checkpoint(cfg, model, weights, m, v, torch.tensor(float(optimizer.steps)), next_step,
                                       rngs)


def flatten(s, values):
    """Full tensors (by parameter name) laid out as shard `s`'s zero-padded flat buffer, in the master's dtype."""
    full = torch.zeros(s.padded, dtype=s.master_dtype)
    for name, off in zip(s.names, s.offsets):
        value = values[name].reshape(-1)
        full[off: off + value.numel()] = value
    return full


def read_consolidated(path, model):
    """(checkpoint, None), or (None, why this rank cannot use it: missing on its node, or another model's)."""
    try:
        state = load_checkpoint(path)
    except FileNotFoundError as e:
        return None, str(e)
    for name, p in model.named_parameters():
        value = state["model"].get(name)
        if value is None or value.shape != p.shape:
            return None, (f"checkpoint {path} does not match this model: parameter {name} "
                          f"{None if value is None else tuple(value.shape)} vs {tuple(p.shape)}")
    return state, None


@torch.no_grad()
def load_consolidated(cfg, model, shards, optimizer, env):
    """Every rank reads the consolidated checkpoint and keeps its shard; returns the step to continue from."""
    path = checkpoint_path(cfg.out_dir)
    state, error = read_consolidated(path, model)
    fail_together(error, env)
    order, _ = optimizer_layout(model, cfg)
    opt = state["optimizer"]["state"]
    m, v = ({n: opt[i][key] for i, n in enumerate(order)} for key in ("exp_avg", "exp_avg_sq"))
    for s in shards:
        weights = flatten(s, state["model"])
        if s.stage < 3:
            s.full.copy_(weights)
        for t, full in ((s.master, weights), (s.exp_avg, flatten(s, m)), (s.exp_avg_sq, flatten(s, v))):
            t.copy_(full[s.lo: s.hi])
    optimizer.steps = int(opt[0]["step"])
    set_rng_state(own_rng_state(state))
    return state["step"]
