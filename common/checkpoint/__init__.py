"""
checkpoint.py: the one checkpoint of every script and layout, in train_single.py's form (the model's state_dict by
its single-device names, AdamW's state in a single-device optimizer's order, next step, RNG states, config), so any
layout or world size resumes any other. Two calls, whatever a rank holds (the API is at the bottom):

    checkpoint.save(cfg, model_cfg, next_step, held)             every rank, after a step
    start = checkpoint.start_from(cfg, env, model_cfg, held)     every rank: on --resume, load's step; else 0
                                                                  (with --init_from's weights: hf.py)

A save is a step directory whose completeness is committed last:

    OUT_DIR/ckpt/step_00000010/part_00000.pt ... part_00007.pt   every rank's part, written at once
    ... every rank says its part is on disk (or why not: all stop, the step directory removed) ...
    OUT_DIR/ckpt/step_00000010/ckpt.pt   {step, rng, config, model_config, corpus, fp16's loss scale, AdamW
                                          param_groups and parameter names, parts: [...]}   by rank 0
    OUT_DIR/ckpt/latest                  "step_00000010", published by rank 0 (temporary file + os.replace)

so a crash at any moment leaves `latest` naming a complete checkpoint; resume reads it (or, if it was lost, the
newest complete step directory). A one-process run writes ckpt.pt alone, with everything in it. Reading merges the
parts into the one-file form, memory-mapped, so a rank that keeps a slice of each tensor reads little more than its
slice. After publishing, all but the newest --keep_checkpoints step directories are removed. Files are read with
weights_only=True (no pickled code is executed). Data position needs no state: the batch of step s is a pure
function of (seed, s) (data.py), so the step number *is* the data position.

The files themselves (paths, atomic writes, a full disk, the out_dir lock) are common/checkpoint/files.py's; whether a
checkpoint fits this run (the model-defining fields, the entries, AdamW state by name, inf/NaN) is
common/checkpoint/compat.py's.
"""
import os

import torch
import torch.distributed as dist

from common.checkpoint.files import (CKPT_DIR, FILE, LATEST, PART, SaveError, latest_checkpoint,  # noqa: F401
                                     load_checkpoint, load_latest, publish, remove_stale_temp_files, remove_step_dir,
                                     resolve_resume, step_dir, write_file)
from common.checkpoint.compat import compatibility_problem, model_config, rank_problem
from common.comm import all_gather
from common.distributed import agree, fail_together
from common.errors import fail, fail_after_another_rank
from common.checkpoint import fp8_state
from common.checkpoint.rank_states import by_rank, own_rng_state, rng_state, set_rng_state
from common.optim import configure_optimizer
from common.run_identity import corpus_of
from common.module_io import tp_slice
from common.tp_shards import full_shape, tp_gather
from model import GPT


def non_finite_entries(state):
    """Names of the model entries of a checkpoint (or a part of one) that hold inf or NaN."""
    return [k for k, t in state["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]


def refuse_non_finite(cfg, state, next_step):
    """Stop every rank, keeping the checkpoints on disk, if any rank's part of this save holds inf/NaN: a diverged
    run never replaces a good checkpoint (the NaN guard, optim.NonFiniteGuard, should have stopped it before)."""
    bad = non_finite_entries(state) if state is not None else []
    what = f"the inf/NaN check of the save of step {next_step}"
    if not agree("inf/NaN" if bad else None, cfg.dist_timeout, what):      # every rank decides alike
        where = f"the weights hold inf/NaN ({', '.join(bad[:3])})" if bad else "another rank's weights hold inf/NaN"
        message = f"not saving step {next_step} to {cfg.out_dir}: {where}; the checkpoints on disk are kept"
        if bad:
            fail(message, rank_local=True)
        fail_after_another_rank(message)


def save_step(cfg, state, next_step, part=None):
    """Every rank of the run calls this after step next_step - 1. `state`: the checkpoint (train_single's layout,
    or its metadata when the weights come in parts) on rank 0, None elsewhere. `part`: this rank's part of a
    sharded save (`save`: every rank passes one, maybe empty), else None. Parts are written in parallel, then every
    rank says whether its write worked (also the barrier: every part is on disk), then rank 0 writes ckpt.pt and
    publishes the step as latest, and says so. A crash at any point leaves the previous complete checkpoint as
    latest; a failed write (a full disk) ends every rank with one line, the step directory removed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    refuse_non_finite(cfg, part if part is not None else state, next_step)
    directory = step_dir(cfg.out_dir, next_step)
    what = f"the checkpoint save of step {next_step}"
    error = None
    if part is not None:
        error = write_or_error(write_file, f"{directory}/{PART.format(rank)}", part)
    commit_or_fail(cfg, next_step, error, what)
    if rank == 0:
        if part is not None:                         # exactly this save's parts (not an interrupted one's)
            state = dict(state, parts=[PART.format(r) for r in range(world)])
        error = write_or_error(write_file, f"{directory}/{FILE}", state)
        if error is None:
            error = write_or_error(publish, cfg.out_dir, next_step, cfg.keep_checkpoints)
    if world > 1:                                    # rank 0's commit worked, or every rank stops here with it
        commit_or_fail(cfg, next_step, error, what)
    elif error is not None:
        remove_step_dir(cfg.out_dir, next_step)
        fail(error)


def write_or_error(write, *args):
    """None if write(*args) worked, else its SaveError's one line."""
    try:
        write(*args)
    except SaveError as e:
        return str(e)
    return None


def commit_or_fail(cfg, next_step, error, what):
    """Every rank's write worked, or each stops: the one that failed with its line, the others saying so; the
    failed save's step directory is removed (`latest` still names the previous one)."""
    if not dist.is_initialized():
        return
    if not agree(error, cfg.dist_timeout, what):
        if dist.get_rank() == 0:
            remove_step_dir(cfg.out_dir, next_step)
        if error is not None:
            fail(error, rank_local=True)
        fail_after_another_rank(f"{what} failed on another rank (its error line says why); the previous checkpoint "
                                f"is kept")


# ----------------------------------------------------------------------------------------------------------
# the one save and the one load every script calls. A rank passes what it holds (`held`): a ModuleState (its
# modules and a torch AdamW over their parameters, whole or TP slices) or train_zero's ShardState (ZeRO shards).
# Both speak in whole tensors by the single-device model's names, so every layout writes and reads one format.
#
#   held.whole()         (name, values, (key, holders, my index)) of every whole tensor this rank can produce:
#                        values [weight, exp_avg, exp_avg_sq, step] of a parameter, [tensor] of a buffer;
#                        whole(moments=False): [weight] only, nothing of AdamW gathered (for a sample)
#   held.shapes()        (name, full shape) of every tensor this rank takes its part of on load
#   held.restore(saved)  saved: {name: (whole value, {exp_avg, exp_avg_sq, step} or None)}: keep my part
#
# Saving never gathers the model on one rank. Each whole tensor is written by exactly one of the ranks holding
# it, the least loaded so far (by bytes), so every rank writes about 1/n of its copies' bytes, at once:
#
#     holders of a tensor      dp2: ranks {0,1}   tp2: {0,1} once gathered   pp2: its stage's rank   ep2: replicas
#     written by               the least loaded holder; the others drop their copy straight away

def optimizer_layout(gcfg, cfg):
    """(parameter names in the order of a single-device AdamW's state_dict, its param_groups, the GPT's
    state_dict keys with the parameter each names): the one layout every checkpoint is written in."""
    with torch.device("meta"):
        gpt = GPT(gcfg)
    names = {p: n for n, p in gpt.named_parameters()}
    reference = configure_optimizer(gpt.named_parameters(), cfg)       # holds no state: layout only
    order = [names[p] for g in reference.param_groups for p in g["params"]]
    keys = {key: names.get(t, key) for key, t in gpt.state_dict(keep_vars=True).items()}
    return order, reference.state_dict()["param_groups"], keys


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


def save(cfg, gcfg, next_step, held):
    """Every rank calls this after step next_step - 1: the tensors it is picked for form its part, written in
    parallel with the other ranks' (save_step); with one process, one file."""
    rngs = by_rank(rng_state())                      # each rank's own dropout stream
    fp8 = by_rank(fp8_state.histories(held.modules))     # and its own delayed-scaling amax histories
    writers, mine = Writers(), {}
    for name, values, (key, holders, me) in held.whole():
        if writers.mine(values[0], key, holders, me):
            mine[name] = [v.detach().cpu().clone() for v in values]
    order, param_groups, keys = optimizer_layout(gcfg, cfg)
    # one step tensor per parameter, as torch saves them: a shared one would be stepped once per parameter
    part = dict(model={key: mine[name][0] for key, name in keys.items() if name in mine},
                optimizer=dict(state={i: dict(step=mine[n][3].clone(), exp_avg=mine[n][1], exp_avg_sq=mine[n][2])
                                      for i, n in enumerate(order) if n in mine}))
    meta = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        meta = dict(model={}, optimizer=dict(state={}, param_groups=param_groups, names=order), step=next_step,
                    rng=rng_state(), rng_by_rank=rngs, fp8_by_rank=fp8, model_config=model_config(gcfg),
                    config=dict(vars(cfg), data_dir=os.path.abspath(cfg.data_dir)),   # the same from anywhere
                    corpus=corpus_of(cfg), scaler=held.scaler.state_dict() if held.scaler else None)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        meta["model"], meta["optimizer"]["state"] = part["model"], part["optimizer"]["state"]
        save_step(cfg, meta, next_step)
    else:
        save_step(cfg, meta, next_step, part)


def read_matching(out_dir, gcfg, cfg, shapes):
    """(checkpoint, AdamW moments by parameter name, None), or (None, None, why this rank cannot use it: missing
    on its node, unreadable, another model's, past this run's schedule, or a part of it this rank takes is
    damaged). Moments are matched by the names the checkpoint stores, never by position."""
    try:
        state, path = load_latest(out_dir)
    except (FileNotFoundError, ValueError) as e:
        return None, None, str(e)
    order, _, keys = optimizer_layout(gcfg, cfg)
    problem = compatibility_problem(state, path, gcfg, cfg, order, keys)
    if problem is not None:
        return None, None, problem
    by_index = state["optimizer"]["state"]
    names = state["optimizer"].get("names", order)   # earlier versions: this (identical) model's order
    moments = {name: by_index.get(i) for i, name in enumerate(names)}
    problem = rank_problem(state, path, shapes, moments)
    return (None, None, problem) if problem else (state, moments, None)


def start_from(cfg, env, gcfg, held):
    """The step a run starts at: its checkpoint's on --resume (load), else 0: with --init_from, every rank first
    keeps its part of a Hugging Face model's weights as a resume would (hf.init_from), AdamW fresh."""
    if cfg.resume:
        return load(cfg, env, gcfg, held)
    if cfg.init_from:
        from common.hf.interop import init_from     # here: interop reads checkpoint files (common.checkpoint.files)
        with torch.no_grad():
            init_from(cfg, env, gcfg, held)
    return 0


@torch.no_grad()
def load(cfg, env, gcfg, held):
    """Every rank reads the one checkpoint and keeps its part of what it holds; returns the step to continue
    from. A rank that cannot (no checkpoint on its node, unreadable, another model's) says why, and all stop."""
    state, moments, error = read_matching(cfg.out_dir, gcfg, cfg, held.shapes())
    fail_together(error, env)
    held.restore({name: (state["model"][name], moments.get(name)) for name, _ in held.shapes()})
    set_rng_state(own_rng_state(state))
    fp8_state.restore(held.modules, state.get("fp8_by_rank"), env.rank, env.world_size)
    if held.scaler and state.get("scaler"):         # the same on every rank (the overflow decision is global);
        held.scaler.load_state_dict(state["scaler"])    # a checkpoint of another dtype: the scaler starts afresh
    saved_seed = (state.get("config") or {}).get("seed", cfg.seed)
    if saved_seed != cfg.seed and env.rank == 0:
        print(f"warning: --seed {cfg.seed} differs from the checkpoint's {saved_seed}: from step {state['step']} "
              f"on, the batches and dropout masks differ from the original run's", flush=True)
    return state["step"]


def saved_buffers(module):
    """(name, buffer) of the buffers a checkpoint keeps by name: the persistent ones (an MoE block's load); not
    FP8's amax histories (per rank: common/checkpoint/fp8_state.py)."""
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, b


def named_parameters(modules):
    """(model name, parameter) of every distinct parameter of `modules` (a tied weight once)."""
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


def local_part(p, full, tp_group):
    """This rank's part of a whole value of parameter p (its TP slice, or all of it), in p's dtype and device."""
    return tp_slice(p, full.to(p), tp_group) if tp_group is not None else full.to(p)


def replicated(name):
    """holder(name) of a tensor every rank of the world holds whole (replicas: train_ddp, train_cp; train_tp
    once gathered; train_zero once a bucket is gathered): the ranks share the writing."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return "all", world, dist.get_rank() if dist.is_initialized() else 0


def only_mine(name):
    """holder(name) of a tensor no other rank holds (train_pp's stages): this rank writes it."""
    return "mine", 1, 0


class ModuleState:
    """What a rank holds when a torch AdamW steps its modules' parameters (the model, its pipeline chunks, its
    experts): whole tensors, or TP slices over tp_group. holder(name) -> (key, how many ranks hold that tensor
    whole, my index among them): replicated, only_mine, or a layout's own."""

    def __init__(self, modules, optimizer, holder, tp_group=None, scaler=None):
        self.modules, self.optimizer, self.holder, self.tp_group = modules, optimizer, holder, tp_group
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None   # fp16's loss scale

    def shapes(self):
        named = named_parameters(self.modules)
        tp = self.tp_group
        return ([(n, full_shape(p, tp) if tp is not None else tuple(p.shape)) for n, p in named]
                + [(n, tuple(b.shape)) for m in self.modules for n, b in saved_buffers(m)])

    def whole(self, moments=True):
        """TP slices gathered over tp_group (a collective every TP rank runs). AdamW state a skipped first step
        never created is zeros at step 0, as AdamW would create it. moments=False: the weights alone."""
        skip = tied_copies(self.modules)
        for name, p in named_parameters(self.modules):
            if name in skip:
                continue
            st = self.optimizer.state[p]
            values = [p, st.get("exp_avg", torch.zeros_like(p)), st.get("exp_avg_sq", torch.zeros_like(p))]
            values = values if moments else values[:1]
            if self.tp_group is not None:
                values = [tp_gather(p, t, self.tp_group) for t in values]
            step = [st.get("step", torch.tensor(0.0))] if moments else []
            yield name, [t.detach() for t in values] + step, self.holder(name)
        for m in self.modules:
            for name, b in saved_buffers(m):
                yield name, [b], self.holder(name)

    def restore(self, saved):
        params = named_parameters(self.modules)
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        local = {}                                   # this optimizer's state_dict, in its own order
        for name, p in params:
            weight, moments = saved[name]
            p.copy_(local_part(p, weight, self.tp_group))
            if moments is not None:
                local[index[id(p)]] = dict(step=moments["step"], **{k: local_part(p, moments[k], self.tp_group)
                                                                      for k in ("exp_avg", "exp_avg_sq")})
        self.optimizer.load_state_dict(dict(state=local, param_groups=self.optimizer.state_dict()["param_groups"]))
        for m in self.modules:
            for name, b in saved_buffers(m):       # an MoE block's load: the previous step's expert shares
                b.copy_(saved[name][0])


@torch.no_grad()
def gathered_values(shards, tp_group=None, moments=True):
    """(parameter name, [weight, exp_avg, exp_avg_sq]) of every parameter of ZeRO shards as whole tensors: each
    bucket's flat buffers all-gathered over its group in turn, TP slices then gathered over tp_group. Collectives
    every rank of those groups runs; only one bucket is whole at a time. moments=False: [weight] only."""
    for s in shards:
        flats = []
        for local in (s.master, s.exp_avg, s.exp_avg_sq) if moments else (s.master,):
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


class ShardState(ModuleState):
    """What a rank holds under ZeRO (train_zero's shards, stepped by its ShardedAdamW): its slice [lo, hi) of
    every shard's weights and AdamW moments. Whole tensors are all-gathered one bucket at a time; on load each
    shard keeps its slice of the whole values (Shard.flatten). `modules`: the model or chunks, for buffers."""

    def __init__(self, shards, optimizer, modules, holder, tp_group=None):
        super().__init__(modules, optimizer, holder, tp_group)
        self.shards = shards

    def whole(self, moments=True):
        skip, step = tied_copies(self.modules), [torch.tensor(float(self.optimizer.steps))] if moments else []
        for name, values in gathered_values(self.shards, self.tp_group, moments):
            if name not in skip:
                yield name, values + step, self.holder(name)
        for m in self.modules:
            for name, b in saved_buffers(m):
                yield name, [b], self.holder(name)

    def restore(self, saved):
        """Without AdamW moments (--init_from's weights), the moments and the step stay as they are: fresh."""
        for s in self.shards:
            values = [saved[n] for n in s.names]     # (whole weight, its moments or None) of the bucket's parameters
            parts = [{n: local_part(p, weight, self.tp_group) for n, p, (weight, _) in zip(s.names, s.params, values)}]
            if values[0][1] is not None:
                parts += [{n: local_part(p, moments[key], self.tp_group) for n, p, (_, moments) in
                           zip(s.names, s.params, values)} for key in ("exp_avg", "exp_avg_sq")]
                self.optimizer.steps = int(values[0][1]["step"])
            flats = [s.flatten(part) for part in parts]
            if s.stage < 3:
                s.full.copy_(flats[0])               # the parameters are views of it
            for t, full in zip((s.master, s.exp_avg, s.exp_avg_sq), flats):
                t.copy_(full[s.lo: s.hi])
        for m in self.modules:
            for name, b in saved_buffers(m):
                b.copy_(saved[name][0])


def should_save(cfg, step, last_step):
    """Whether a checkpoint is written after `step`: every --save_interval steps, and after the run's last step."""
    return step == last_step - 1 or (cfg.save_interval > 0 and (step + 1) % cfg.save_interval == 0)
