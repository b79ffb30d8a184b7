"""
checkpoint.py: atomic checkpoint files and RNG state, shared by every script.

A checkpoint is a dict of tensors and plain Python values (model and optimizer state dicts, the next step,
RNG states, the config). It is written to a temporary file and renamed into place, so a crash mid-write
never leaves a truncated checkpoint, and read back with weights_only=True (no pickled code is executed).
Data position needs no state: the batch of step s is a pure function of (seed, s) (data.py), so the step
number *is* the data position.
"""
import os
import re

import torch
import torch.distributed as dist

TEMP_FILE = re.compile(r"ckpt(_rank\d+)?\.pt\.tmp\.\d+")      # save_checkpoint's temporary files


def checkpoint_path(out_dir, rank=None):
    """out_dir/ckpt.pt, or out_dir/ckpt_rank{r}.pt for layouts that save one shard per rank."""
    return os.path.join(out_dir, "ckpt.pt" if rank is None else f"ckpt_rank{rank}.pt")


def save_checkpoint(path, state):
    """Write atomically; refuse (ValueError) a model with a non-finite value, so that a diverged run never
    replaces a good checkpoint (the NaN guard, optim.NonFiniteGuard, should have stopped it before)."""
    bad = [k for k, t in state["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"not saving {path}: the weights hold inf/NaN ({', '.join(bad[:3])}); the file on disk "
                         f"is kept")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def remove_stale_temp_files(out_dir):
    """Delete the temporary files of saves that were killed mid-write (the checkpoint they would have replaced
    is intact). Called before a run starts, by rank 0 only, when no save of this run can be under way."""
    if not os.path.isdir(out_dir):
        return
    stale = [name for name in os.listdir(out_dir) if TEMP_FILE.fullmatch(name)]
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    if stale:
        print(f"removed {len(stale)} temporary file(s) of interrupted checkpoint saves from {out_dir}", flush=True)


def load_checkpoint(path, device="cpu"):
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:   # truncated, empty, or not a checkpoint: torch raises several kinds
        raise ValueError(f"--resume: {path} is not a readable checkpoint ({type(e).__name__}: {e})") from e


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
    of a world of this size, else the one `rng` (a per-rank file, or a single-device checkpoint)."""
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
