"""
zero_checkpoint.py: the sharded layouts' checkpoints, always in train_single.py's layout (the whole model's weights
and a single-device AdamW's state, checkpoint.py), so any layout or world size, train_single or train_5d can
resume any other. For train_zero.py, train_tp.py, train_pp.py, train_ep.py and train_5d.py.

Saving never gathers the model on one rank. Each parameter is made whole (ZeRO slices all-gathered over their
group, one bucket at a time; TP slices over tp) on the ranks that hold it, and exactly one of those ranks keeps
it, the least loaded so far (by bytes), so every rank writes about 1/n of its copies' bytes, at once:

    holders of a tensor          tp2: ranks {0,1}     pp2: its stage's rank     ep2 expert 3: rank 1 (+ replicas)
    written by                   the least loaded holder; the others drop their gathered copy straight away

Loading (load_whole, load_consolidated) reads the merged checkpoint (its parts memory-mapped) and keeps this
rank's part: its TP slice, its ZeRO range of the flat buffer (`flatten`), its stages and experts.

A shard (train_zero.Shard) is one bucket or unit of parameters as a flat buffer, zero-padded to a multiple of
the group size; rank r holds elements [lo, hi).
"""
import itertools

import torch
import torch.distributed as dist

from common.checkpoint import load_latest, own_rng_state, rng_state, rng_states_by_rank, save_step, set_rng_state
from common.comm import all_gather
from common.config import config_dict
from model import GPT
from common.optim import configure_optimizer
from common.tp_shards import full_shape, tp_gather, tp_slice
from common.training import fail_together


@torch.no_grad()
def gathered_values(shards, tp_group=None):
    """(parameter name, [weight, exp_avg, exp_avg_sq]) of every parameter of the shards as whole tensors: each
    bucket's flat buffers all-gathered over its group in turn, TP slices then gathered over tp_group. Collectives
    every rank of those groups runs; only one bucket is whole at a time."""
    for s in shards:
        flats = []
        for local in (s.master, s.exp_avg, s.exp_avg_sq):
            full = local
            if s.stage > 0:
                full = torch.empty(s.padded, dtype=local.dtype, device=local.device)
                all_gather(full, local, group=s.group)
            flats.append(full)
        for name, p, off in zip(s.names, s.params, s.offsets):
            values = [f[off: off + p.numel()].view(p.shape) for f in flats]
            if tp_group is not None:
                values = [tp_gather(p, v, tp_group) for v in values]
            yield name, values


def full_values(shards, attr):
    """{parameter name: whole CPU tensor} of the master weights or an AdamW moment (for tests and samples)."""
    index = ("master", "exp_avg", "exp_avg_sq").index(attr)
    return {name: values[index].cpu().clone() for name, values in gathered_values(shards)}


def optimizer_layout(model, cfg):
    """Parameter names in the order of a single-device AdamW's state_dict, and its param_groups."""
    names = {p: n for n, p in model.named_parameters()}
    reference = configure_optimizer(model.named_parameters(), cfg)       # holds no state: layout only
    order = [names[p] for g in reference.param_groups for p in g["params"]]
    return order, reference.state_dict()["param_groups"]


class Writers:
    """Picks the rank that writes each whole tensor: of the `holders` ranks that hold it (the same `key` on each),
    the one with the fewest bytes so far. Holders of a key see its tensors in the same order, so they all pick
    alike without a message."""

    def __init__(self):
        self.loads = {}

    def mine(self, tensor, key, holders, me):
        loads = self.loads.setdefault(key, [0] * holders)
        writer = loads.index(min(loads))
        loads[writer] += tensor.numel() * tensor.element_size()
        return writer == me


def checkpoint_part(cfg, gpt, mine):
    """This rank's part of the checkpoint in train_single's layout: the state_dict entries (the tied lm_head.weight
    with wte) and the AdamW states (by a single-device optimizer's index) of `mine`: {parameter name: [weight,
    exp_avg, exp_avg_sq, step]}, {buffer name: [tensor]}. `gpt`: a GPT of the model's shape (meta is enough)."""
    order, _ = optimizer_layout(gpt, cfg)
    names = {p: n for n, p in gpt.named_parameters()}
    model = {}
    for key, p in gpt.state_dict(keep_vars=True).items():
        name = names.get(p, key)
        if name in mine:
            model[key] = mine[name][0]
    # one step tensor per parameter, as torch saves them: a shared one would be stepped once per parameter
    state = {i: dict(step=mine[n][3].clone(), exp_avg=mine[n][1], exp_avg_sq=mine[n][2])
             for i, n in enumerate(order) if n in mine}
    return dict(model=model, optimizer=dict(state=state))


def save_parts(cfg, gcfg, entries, next_step):
    """Every rank calls this. entries: (name, [weight, exp_avg, exp_avg_sq, step] or [buffer], (key, holders, me))
    of every whole tensor this rank holds (a generator: it may run the gathers); the ones this rank is picked for
    are kept and written as its part, in parallel with the other ranks (checkpoint.save_step)."""
    rngs = rng_states_by_rank()                      # each rank's own dropout stream
    writers, mine = Writers(), {}
    for name, values, (key, holders, me) in entries:
        if writers.mine(values[0], key, holders, me):
            mine[name] = [v.detach().cpu().clone() for v in values]
    with torch.device("meta"):
        gpt = GPT(gcfg)
    meta = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        _, param_groups = optimizer_layout(gpt, cfg)
        meta = dict(model={}, optimizer=dict(state={}, param_groups=param_groups), step=next_step, rng=rng_state(),
                    rng_by_rank=rngs, config=config_dict(cfg))
    save_step(cfg, meta, next_step, checkpoint_part(cfg, gpt, mine))


def save_consolidated(cfg, model, shards, optimizer, next_step, rank):
    """train_zero: every rank of the data-parallel group holds each bucket whole once it is gathered."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    step = torch.tensor(float(optimizer.steps))
    entries = ((name, values + [step], ("params", world, rank)) for name, values in gathered_values(shards))
    save_parts(cfg, model.cfg, entries, next_step)


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


def tied_copies(modules):
    """The last pipeline stage's copy of the tied embedding where the first stage is on another rank (not
    written: the first stage's equal weight is)."""
    first = any(getattr(m, "first", True) for m in modules)
    return set() if first else {"transformer.wte.weight"}


def whole_values(modules, optimizer, tp_group):
    """(name, [weight, exp_avg, exp_avg_sq, step]) of each parameter of `modules` (the tied copy excepted) as
    whole tensors: TP slices gathered over tp_group, a collective every TP rank runs. AdamW state a skipped first
    step never created is zeros at step 0, as AdamW would create it."""
    skip = tied_copies(modules)
    for name, p in named_parameters(modules):
        if name in skip:
            continue
        st = optimizer.state[p]
        values = [p, st.get("exp_avg", torch.zeros_like(p)), st.get("exp_avg_sq", torch.zeros_like(p))]
        if tp_group is not None:
            values = [tp_gather(p, t, tp_group) for t in values]
        yield name, [t.detach() for t in values] + [st.get("step", torch.tensor(0.0))]


def save_modules(cfg, gcfg, modules, values, holder, next_step):
    """`values`: (name, [weight, exp_avg, exp_avg_sq, step]) of the parameters of `modules` as whole tensors; they
    and the modules' buffers are written in parts. holder(name): (key, how many ranks hold that tensor whole, this
    rank's index among them)."""
    entries = ((name, whole, holder(name)) for name, whole in values)
    buffers = ((name, [b], holder(name)) for module in modules for name, b in module.named_buffers())
    save_parts(cfg, gcfg, itertools.chain(entries, buffers), next_step)


def save_whole(cfg, gcfg, modules, optimizer, next_step, tp_group=None, holder=lambda name: ("all", 1, 0)):
    """train_tp, train_pp, train_ep: each rank's parameters (TP slices gathered) and buffers, written in parts."""
    save_modules(cfg, gcfg, modules, whole_values(modules, optimizer, tp_group), holder, next_step)


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
