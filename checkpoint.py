"""
checkpoint.py: atomic checkpoint files and RNG state, shared by every script.

A checkpoint is a dict of tensors and plain Python values (model and optimizer state dicts, the next step,
RNG states, the config). It is written to a temporary file and renamed into place, so a crash mid-write
never leaves a truncated checkpoint, and read back with weights_only=True (no pickled code is executed).
Data position needs no state: the batch of step s is a pure function of (seed, s) (data.py), so the step
number *is* the data position.
"""
import os

import torch


def checkpoint_path(out_dir, rank=None):
    """out_dir/ckpt.pt, or out_dir/ckpt_rank{r}.pt for layouts that save one shard per rank."""
    return os.path.join(out_dir, "ckpt.pt" if rank is None else f"ckpt_rank{rank}.pt")


def save_checkpoint(path, state):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


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


def set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def unwrap(model):
    """The module whose state_dict has clean names (no `_orig_mod.` from torch.compile)."""
    return getattr(model, "_orig_mod", model)
