"""
zero_checkpoint.py: the sharded layouts' checkpoints, always consolidated to train_single.py's layout (the whole
model's weights and a single-device AdamW's state, in one file of a step directory, checkpoint.save_step), so
any layout or world size, train_single or train_5d can resume any other. For train_zero.py (and train_5d.py's
ZeRO-1), and for train_tp, train_pp and train_ep (save_whole / load_whole: each rank's parameters by their GPT
names, TP slices gathered whole, stages and experts merged on rank 0; at load every rank keeps its part).

A shard (train_zero.Shard) is one bucket or unit of parameters as a flat buffer, zero-padded to a multiple of
the group size; rank r holds elements [lo, hi). Saving all-gathers every flat buffer (master weights, Adam
moments) and cuts it back into named tensors; loading lays the named tensors out flat again (`flatten`) and
keeps [lo, hi).
"""
import torch

import torch.distributed as dist

from checkpoint import load_latest, own_rng_state, rng_state, rng_states_by_rank, save_step, set_rng_state
from comm import all_gather
from config import config_dict
from model import GPT
from optim import configure_optimizer
from tp_shards import full_shape, tp_gather, tp_slice
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
    """The checkpoint exactly as train_single writes it, from whole tensors by GPT parameter name: `model` (a GPT,
    meta is enough) gives the state_dict keys (the tied lm_head.weight too) and the AdamW state order.
    rng_by_rank: every rank's RNG state (checkpoint.rng_states_by_rank), for ranks with their own dropout streams."""
    order, param_groups = optimizer_layout(model, cfg)
    names = {p: n for n, p in model.named_parameters()}
    # one step tensor per parameter, as torch saves them: a shared one would be stepped once per parameter
    state = {i: dict(step=adam_step.clone(), exp_avg=exp_avg[n], exp_avg_sq=exp_avg_sq[n]) for i, n in enumerate(order)}
    # parameters by name (the tied lm_head.weight is wte's); buffers (an MoE block's load) by their own key
    model_state = {k: weights[names.get(p, k)] for k, p in model.state_dict(keep_vars=True).items()}
    extra = {} if rng_by_rank is None else dict(rng_by_rank=rng_by_rank)
    save_step(cfg, dict(model=model_state, optimizer=dict(state=state, param_groups=param_groups), step=next_step,
                        rng=rng_state(), config=config_dict(cfg), **extra), next_step)


def save_consolidated(cfg, model, shards, optimizer, next_step, rank):
    weights, m, v = (full_values(shards, a) for a in ("master", "exp_avg", "exp_avg_sq"))   # every rank
    rngs = rng_states_by_rank()                      # each rank's dropout stream (seed + rank)
    if rank == 0:
        write_single_device_checkpoint(cfg, model, weights, m, v, torch.tensor(float(optimizer.steps)), next_step,
                                       rngs)
    else:
        save_step(cfg, None, next_step)              # the barrier before rank 0 publishes the step


def flatten(s, values):
    """Full tensors (by parameter name) laid out as shard `s`'s zero-padded flat buffer, in the master's dtype."""
    full = torch.zeros(s.padded, dtype=s.master_dtype)
    for name, off in zip(s.names, s.offsets):
        value = values[name].reshape(-1)
        full[off: off + value.numel()] = value
    return full


def read_consolidated(out_dir, named):
    """(checkpoint, None), or (None, why this rank cannot use it: missing on its node, unreadable, or another
    model's). named: (GPT name, full shape) of the parameters this rank will take its part of."""
    try:
        state, path = load_latest(out_dir)
    except (FileNotFoundError, ValueError) as e:
        return None, str(e)
    for name, shape in named:
        value = state["model"].get(name)
        if value is None or tuple(value.shape) != shape:
            return None, (f"checkpoint {path} does not match this model: {name} "
                          f"{None if value is None else tuple(value.shape)} vs {shape}")
    return state, None


@torch.no_grad()
def load_consolidated(cfg, model, shards, optimizer, env):
    """Every rank reads the consolidated checkpoint and keeps its shard; returns the step to continue from."""
    state, error = read_consolidated(cfg.out_dir, [(n, tuple(p.shape)) for n, p in model.named_parameters()])
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


# ----------------------------------------------------------------------------------------------------------
# train_tp, train_pp, train_ep: `modules` are this rank's GPT-named modules (the model, or its pipeline chunks);
# tp_group: the group a TP parameter's slices are spread over (None: every parameter is whole on its rank)

def named_parameters(modules):
    """(GPT name, parameter) of every distinct parameter of `modules` (a tied weight once)."""
    seen, out = set(), []
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def whole_parts(modules, optimizer, tp_group, keep):
    """({name: [weight, exp_avg, exp_avg_sq, step]}, {buffer name: tensor}) as whole CPU tensors, for the parameters
    `keep(name)` selects (TP slices are gathered over tp_group, a collective: every TP rank takes part). AdamW
    state a skipped first step never created is zeros at step 0, as AdamW would create it."""
    params = {}
    for name, p in named_parameters(modules):
        st = optimizer.state[p]
        values = [p, st.get("exp_avg", torch.zeros_like(p)), st.get("exp_avg_sq", torch.zeros_like(p))]
        if tp_group is not None:                     # every TP rank takes part, whether it keeps the value or not
            values = [tp_gather(p, t, tp_group) for t in values]
        if keep(name):
            params[name] = [t.detach().cpu() for t in values] + [st.get("step", torch.tensor(0.0)).cpu()]
    buffers = {name: b.cpu() for module in modules for name, b in module.named_buffers() if keep(name)}
    return params, buffers


def save_whole(cfg, gcfg, modules, optimizer, next_step, tp_group=None, keep=lambda name: True):
    """One checkpoint in train_single's layout from every rank's parts: the parts `keep` selects go to rank 0
    (the first rank to send a name wins: replicas and the tied embedding's copy are equal), which writes it."""
    rngs = rng_states_by_rank()                      # every rank's own dropout stream
    parts = whole_parts(modules, optimizer, tp_group, keep)
    gathered = [parts]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(parts, gathered, dst=0)
    if gathered is None:
        save_step(cfg, None, next_step)              # the barrier before rank 0 publishes the step
        return
    params, buffers = {}, {}
    for part_params, part_buffers in gathered:
        params = {**part_params, **params}
        buffers = {**part_buffers, **buffers}
    with torch.device("meta"):
        gpt = GPT(gcfg)
    weights, exp_avg, exp_avg_sq = ({n: value[i] for n, value in params.items()} for i in range(3))
    write_single_device_checkpoint(cfg, gpt, {**weights, **buffers}, exp_avg, exp_avg_sq,
                                   next(iter(params.values()))[3], next_step, rngs)


def local_part(p, full, tp_group):
    """This rank's part of a whole value of parameter p (its TP slice, or all of it), in p's dtype and device."""
    return tp_slice(p, full.to(p), tp_group) if tp_group is not None else full.to(p)


@torch.no_grad()
def load_whole(cfg, gcfg, modules, optimizer, env, tp_group=None):
    """Every rank reads the one checkpoint and keeps its part of each weight and AdamW moment (its TP slice of
    its own parameters), and its buffers; returns the step to continue from."""
    named = named_parameters(modules)
    shapes = [(n, full_shape(p, tp_group) if tp_group is not None else tuple(p.shape)) for n, p in named]
    shapes += [(n, tuple(b.shape)) for module in modules for n, b in module.named_buffers()]
    state, error = read_consolidated(cfg.out_dir, shapes)
    fail_together(error, env)
    with torch.device("meta"):
        gpt = GPT(gcfg)
    order, _ = optimizer_layout(gpt, cfg)
    saved = {name: state["optimizer"]["state"].get(i) for i, name in enumerate(order)}
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    local = {}                                       # this optimizer's state_dict, in its own order
    for name, p in named:
        p.copy_(local_part(p, state["model"][name], tp_group))
        if saved[name] is not None:
            moments = {key: local_part(p, saved[name][key], tp_group) for key in ("exp_avg", "exp_avg_sq")}
            local[index[id(p)]] = dict(step=saved[name]["step"], **moments)
    optimizer.load_state_dict(dict(state=local, param_groups=optimizer.state_dict()["param_groups"]))
    for module in modules:
        for name, b in module.named_buffers():       # an MoE block's load: the previous step's expert shares
            b.copy_(state["model"][name])
    set_rng_state(own_rng_state(state))
    return state["step"]
