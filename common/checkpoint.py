"""
checkpoint.py: the one checkpoint of every script and layout, in train_single.py's form (the model's state_dict by
its single-device names, AdamW's state in a single-device optimizer's order, next step, RNG states, config), so any
layout or world size resumes any other. Two calls, whatever a rank holds (the API is at the bottom):

    checkpoint.save(cfg, model_cfg, next_step, held)       every rank, after a step
    start = checkpoint.load(cfg, env, model_cfg, held)     every rank, on --resume

A save is a step directory whose completeness is committed last:

    OUT_DIR/ckpt/step_00000010/part_00000.pt ... part_00007.pt   every rank's part, written at once
    ... barrier: every part is on disk ...
    OUT_DIR/ckpt/step_00000010/ckpt.pt   {step, rng, config, AdamW param_groups, parts: [...]}   by rank 0
    OUT_DIR/ckpt/latest                  "step_00000010", published by rank 0 (temporary file + os.replace)

so a crash at any moment leaves `latest` naming a complete checkpoint; resume reads it (or, if it was lost, the
newest complete step directory). A one-process run writes ckpt.pt alone, with everything in it. Reading merges the
parts into the one-file form, memory-mapped, so a rank that keeps a slice of each tensor reads little more than its
slice. After publishing, all but the newest --keep_checkpoints step directories are removed. Files are read with
weights_only=True (no pickled code is executed). Data position needs no state: the batch of step s is a pure
function of (seed, s) (data.py), so the step number *is* the data position.
"""
import os
import re
import shutil

import torch
import torch.distributed as dist

from common.comm import all_gather
from common.distributed import fail_together
from common.errors import fail
from common.optim import configure_optimizer
from common.tp_shards import full_shape, tp_gather, tp_slice
from model import GPT

CKPT_DIR, FILE, LATEST = "ckpt", "ckpt.pt", "latest"
STEP_DIR = re.compile(r"step_(\d{8})")
PART = "part_{:05d}.pt"                                               # a rank's part of a sharded save
TEMP_FILE = re.compile(r"(ckpt(_rank\d+)?\.pt|part_\d+\.pt|latest)\.tmp\.\d+")   # temporary files of killed saves
LEGACY = "ckpt.pt"                                                    # OUT_DIR/ckpt.pt of earlier versions


def step_dir(out_dir, step):
    return os.path.join(out_dir, CKPT_DIR, f"step_{step:08d}")


def complete_steps(out_dir):
    """Steps whose directory holds its checkpoint file (renamed into place only once fully written), oldest first."""
    root = os.path.join(out_dir, CKPT_DIR)
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = [int(m.group(1)) for m in map(STEP_DIR.fullmatch, names) if m]
    return sorted(s for s in steps if os.path.isfile(os.path.join(step_dir(out_dir, s), FILE)))


def latest_checkpoint(out_dir):
    """The checkpoint file to resume from, or None: the step directory `latest` names, else the newest complete
    one (latest lost), else an earlier version's OUT_DIR/ckpt.pt."""
    try:
        with open(os.path.join(out_dir, CKPT_DIR, LATEST)) as f:
            path = os.path.join(out_dir, CKPT_DIR, f.read().strip(), FILE)
        if os.path.isfile(path):
            return path
    except OSError:
        pass
    steps = complete_steps(out_dir)
    if steps:
        return os.path.join(step_dir(out_dir, steps[-1]), FILE)
    legacy = os.path.join(out_dir, LEGACY)
    return legacy if os.path.isfile(legacy) else None


def per_rank_files(out_dir):
    """ckpt_rank{r}.pt files of earlier versions' tp / pp / ep runs (this version cannot read them)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(n for n in names if re.fullmatch(r"ckpt_rank\d+\.pt", n))


def missing_checkpoint_message(out_dir):
    old = per_rank_files(out_dir)
    if old:
        return (f"--resume: {out_dir} holds only per-rank checkpoints of an earlier version ({', '.join(old[:2])}"
                f"{', ...' if len(old) > 2 else ''}), which this version does not read; resume them with the "
                f"version that wrote them, or start without --resume")
    return f"--resume: no checkpoint at {os.path.join(out_dir, CKPT_DIR)} (no complete step directory)"


def resolve_resume(value, out_dir):
    """--resume (yes), --resume auto (yes if a complete checkpoint exists, else start fresh), or no: a bool.
    ValueError where auto would silently drop an earlier version's per-rank checkpoints."""
    if value != "auto":
        return value == "yes"
    if latest_checkpoint(out_dir) is not None:
        return True
    if per_rank_files(out_dir):
        raise ValueError(missing_checkpoint_message(out_dir))
    return False


def non_finite_entries(state):
    """Names of the model entries of a checkpoint (or a part of one) that hold inf or NaN."""
    return [k for k, t in state["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]


def write_file(path, state):
    """Write atomically: a temporary file, flushed to disk, then renamed into place."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())                         # on disk before it is renamed into place (a node crash too)
    os.replace(tmp, path)


def publish(out_dir, step, keep):
    """Commit step `step` as the latest checkpoint, then remove the step directories that are not among the
    newest `keep` (and any newer than `step`: left by a run that crashed before publishing them)."""
    root = os.path.join(out_dir, CKPT_DIR)
    tmp = os.path.join(root, f"{LATEST}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"step_{step:08d}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    steps = [int(m.group(1)) for m in map(STEP_DIR.fullmatch, os.listdir(root)) if m]
    kept = [s for s in complete_steps(out_dir) if s <= step][-keep:]     # never an interrupted save's directory
    for s in steps:
        if s not in kept:
            shutil.rmtree(step_dir(out_dir, s), ignore_errors=True)


def refuse_non_finite(cfg, state, next_step):
    """Stop every rank, keeping the checkpoints on disk, if any rank's part of this save holds inf/NaN: a diverged
    run never replaces a good checkpoint (the NaN guard, optim.NonFiniteGuard, should have stopped it before)."""
    bad = non_finite_entries(state) if state is not None else []
    flag = torch.tensor(float(len(bad) > 0))
    if dist.is_initialized():                        # every rank decides alike
        on_gpu = dist.get_backend() == "nccl"        # (NCCL reduces GPU tensors only)
        flag = flag.to(torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        where = f"the weights hold inf/NaN ({', '.join(bad[:3])})" if bad else "another rank's weights hold inf/NaN"
        fail(f"not saving step {next_step} to {cfg.out_dir}: {where}; the checkpoints on disk are kept",
             rank_local=bool(bad))


def save_step(cfg, state, next_step, part=None):
    """Every rank of the run calls this after step next_step - 1. `state`: the checkpoint (train_single's layout,
    or its metadata when the weights come in parts) on rank 0, None elsewhere. `part`: this rank's part of a
    sharded save (`save`: every rank passes one, maybe empty), else None. Parts are written
    in parallel, then a barrier, then rank 0 writes ckpt.pt and publishes the step as latest: a crash at any
    point leaves the previous complete checkpoint as latest."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    refuse_non_finite(cfg, part if part is not None else state, next_step)
    directory = step_dir(cfg.out_dir, next_step)
    if part is not None:
        write_file(os.path.join(directory, PART.format(rank)), part)
    if dist.is_initialized():
        try:
            dist.barrier()                           # every part is on disk (bounded by --dist_timeout)
        except RuntimeError as e:                    # DistBackendError: a timeout, or a rank gone
            fail(f"waited longer than --dist_timeout {cfg.dist_timeout:g} s for the checkpoint save of step "
                 f"{next_step} ({type(e).__name__}); raise --dist_timeout", rank_local=True)
    if rank == 0:
        if part is not None:                         # exactly this save's parts (not an interrupted one's)
            state = dict(state, parts=[PART.format(r) for r in range(world)])
        write_file(os.path.join(directory, FILE), state)
        publish(cfg.out_dir, next_step, cfg.keep_checkpoints)


def remove_stale_temp_files(out_dir):
    """Delete the temporary files of saves that were killed mid-write (the checkpoint they would have replaced
    is intact). Called before a run starts, by rank 0 only, when no save of this run can be under way."""
    root = os.path.join(out_dir, CKPT_DIR)
    dirs = [out_dir, root] + [os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) else [])]
    stale = [os.path.join(d, n) for d in dirs if os.path.isdir(d) for n in os.listdir(d) if TEMP_FILE.fullmatch(n)]
    for path in stale:
        os.remove(path)
    if stale:
        print(f"removed {len(stale)} temporary file(s) of interrupted checkpoint saves from {out_dir}", flush=True)


def rng_state():
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_states_by_rank():
    """Every rank's RNG state, in rank order, on rank 0 (None elsewhere): for a checkpoint that rank 0 writes for
    ranks that each draw their own dropout stream (seed + rank), so that each resumes its own."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [rng_state()]
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rng_state(), states, dst=0)
    return states


def own_rng_state(state):
    """This rank's RNG state from a checkpoint: its own from `rng_by_rank` when the checkpoint has one per rank
    of a world of this size, else the one `rng` (a single-device checkpoint, or another world size)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_rank = state.get("rng_by_rank")
    return by_rank[rank] if by_rank is not None and len(by_rank) == world else state["rng"]


def set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def unwrap(model):
    """The module whose state_dict has clean names (no `_orig_mod.` from torch.compile)."""
    return getattr(model, "_orig_mod", model)


# ----------------------------------------------------------------------------------------------------------
# reading: a checkpoint in train_single's one-file form, its parts merged in

def read_file(path, device, mmap=False):
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except Exception as e:   # truncated, empty, missing, or not a checkpoint: torch raises several kinds
        raise ValueError(f"--resume: {path} is not a readable checkpoint ({type(e).__name__}: {e})") from e


def load_checkpoint(path, device="cpu"):
    """The checkpoint in train_single's one-file form; a sharded save's parts are merged in (memory-mapped)."""
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    state = read_file(path, device)
    for name in state.pop("parts", []):
        part = read_file(os.path.join(os.path.dirname(path), name), device, mmap=device == "cpu")
        state["model"].update(part["model"])
        state["optimizer"]["state"].update(part["optimizer"]["state"])
    return state


def load_latest(out_dir, device="cpu"):
    """(the checkpoint to resume from, its path); FileNotFoundError or ValueError carry one clear line."""
    path = latest_checkpoint(out_dir)
    if path is None:
        raise FileNotFoundError(missing_checkpoint_message(out_dir))
    return load_checkpoint(path, device), path


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
    rngs = rng_states_by_rank()                      # each rank's own dropout stream
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
        meta = dict(model={}, optimizer=dict(state={}, param_groups=param_groups), step=next_step, rng=rng_state(),
                    rng_by_rank=rngs, config=dict(vars(cfg)))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        meta["model"], meta["optimizer"]["state"] = part["model"], part["optimizer"]["state"]
        save_step(cfg, meta, next_step)
    else:
        save_step(cfg, meta, next_step, part)


def read_matching(out_dir, gcfg, cfg, shapes):
    """(checkpoint, None), or (None, why this rank cannot use it: missing on its node, unreadable, or another
    model's: other entries, or other shapes of the ones this rank takes its part of)."""
    try:
        state, path = load_latest(out_dir)
    except (FileNotFoundError, ValueError) as e:
        return None, str(e)
    expected = set(optimizer_layout(gcfg, cfg)[2])
    extra, missing = sorted(set(state["model"]) - expected), sorted(expected - set(state["model"]))
    if extra or missing:
        return None, (f"checkpoint {path} does not match this model: " + "; ".join(
            f"{what} {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
            for what, names in (("it has", extra), ("it lacks", missing)) if names))
    for name, shape in shapes:
        value = state["model"][name]
        if tuple(value.shape) != shape:
            return None, f"checkpoint {path} does not match this model: {name} {tuple(value.shape)} vs {shape}"
    return state, None


@torch.no_grad()
def load(cfg, env, gcfg, held):
    """Every rank reads the one checkpoint and keeps its part of what it holds; returns the step to continue
    from. A rank that cannot (no checkpoint on its node, unreadable, another model's) says why, and all stop."""
    state, error = read_matching(cfg.out_dir, gcfg, cfg, held.shapes())
    fail_together(error, env)
    order = optimizer_layout(gcfg, cfg)[0]
    moments = {name: state["optimizer"]["state"].get(i) for i, name in enumerate(order)}
    held.restore({name: (state["model"][name], moments.get(name)) for name, _ in held.shapes()})
    set_rng_state(own_rng_state(state))
    return state["step"]


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

    def __init__(self, modules, optimizer, holder, tp_group=None):
        self.modules, self.optimizer, self.holder, self.tp_group = modules, optimizer, holder, tp_group

    def shapes(self):
        named = named_parameters(self.modules)
        tp = self.tp_group
        return ([(n, full_shape(p, tp) if tp is not None else tuple(p.shape)) for n, p in named]
                + [(n, tuple(b.shape)) for m in self.modules for n, b in m.named_buffers()])

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
            for name, b in m.named_buffers():
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
            for name, b in m.named_buffers():       # an MoE block's load: the previous step's expert shares
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
            for name, b in m.named_buffers():
                yield name, [b], self.holder(name)

    def restore(self, saved):
        for s in self.shards:
            parts = [{n: local_part(p, saved[n][0] if i == 0 else saved[n][1][key], self.tp_group)
                      for n, p in zip(s.names, s.params)} for i, key in enumerate(("weight", "exp_avg", "exp_avg_sq"))]
            weights, m, v = (s.flatten(part) for part in parts)
            if s.stage < 3:
                s.full.copy_(weights)                # the parameters are views of it
            for t, full in ((s.master, weights), (s.exp_avg, m), (s.exp_avg_sq, v)):
                t.copy_(full[s.lo: s.hi])
        self.optimizer.steps = int(next(moments for _, moments in saved.values() if moments is not None)["step"])
        for m in self.modules:
            for name, b in m.named_buffers():
                b.copy_(saved[name][0])
