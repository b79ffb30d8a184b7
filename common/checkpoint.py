"""
checkpoint.py: step directories committed atomically, and RNG state, shared by every script.

Every script writes one format, train_single.py's (model state_dict, AdamW state in a single-device
optimizer's order, next step, RNG states, config), so any layout resumes any other (the sharded layouts
gather it with zero_checkpoint.py). A save is a step directory whose completeness is committed last:

    OUT_DIR/ckpt/step_00000010/ckpt.pt     written by rank 0 (temporary file, then renamed into place)
    ... barrier: every rank's part is on disk ...
    OUT_DIR/ckpt/latest                    "step_00000010", published by rank 0 (temporary file + os.replace)

so a crash at any moment leaves `latest` naming a complete checkpoint; resume reads it (or, if it was lost, the
newest complete step directory). The sharded layouts never gather the whole model on one rank: each rank writes
the whole tensors it was picked to write (zero_checkpoint.save_parts), in parallel, and ckpt.pt lists the parts:

    OUT_DIR/ckpt/step_00000010/part_00000.pt ... part_00007.pt     every rank, at once (before the barrier)
    OUT_DIR/ckpt/step_00000010/ckpt.pt   {step, rng, config, AdamW param_groups, parts: [...]}  (after it)

A part holds some of the consolidated checkpoint's entries (model weights by name, AdamW states by index), so
load_checkpoint merges them into the one-file form; parts are memory-mapped, so a rank that keeps a slice of
each tensor (resharding at load) reads little more than its slice. After publishing, all but the newest --keep_checkpoints step directories are
removed. Files are read with weights_only=True (no pickled code is executed). Data position needs no state:
the batch of step s is a pure function of (seed, s) (data.py), so the step number *is* the data position.
"""
import os
import re
import shutil

import torch
import torch.distributed as dist

from common.errors import fail

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


def save_checkpoint(path, state):
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
    sharded save (zero_checkpoint.save_parts: every rank passes one, maybe empty), else None. Parts are written
    in parallel, then a barrier, then rank 0 writes ckpt.pt and publishes the step as latest: a crash at any
    point leaves the previous complete checkpoint as latest."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    refuse_non_finite(cfg, part if part is not None else state, next_step)
    directory = step_dir(cfg.out_dir, next_step)
    if part is not None:
        save_checkpoint(os.path.join(directory, PART.format(rank)), part)
    if dist.is_initialized():
        try:
            dist.barrier()                           # every part is on disk (bounded by --dist_timeout)
        except RuntimeError as e:                    # DistBackendError: a timeout, or a rank gone
            fail(f"waited longer than --dist_timeout {cfg.dist_timeout:g} s for the checkpoint save of step "
                 f"{next_step} ({type(e).__name__}); raise --dist_timeout", rank_local=True)
    if rank == 0:
        if part is not None:                         # exactly this save's parts (not an interrupted one's)
            state = dict(state, parts=[PART.format(r) for r in range(world)])
        save_checkpoint(os.path.join(directory, FILE), state)
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
