"""
common/checkpoint/rank_states.py: what each rank of a run keeps for itself and a checkpoint keeps for every rank (rank 0 writes the
metadata): the RNG streams (each rank draws its own dropout stream, seed + rank) and, through `by_rank`, FP8's
amax histories (common/checkpoint/fp8_state.py). checkpoint.py saves and restores them with the model.
"""
import torch
import torch.distributed as dist


def rng_state():
    """The CPU generator's state, and the current GPU's (not every GPU's: a node with fewer GPUs resumes too) where
    this rank computes on a GPU. CUDA is initialised exactly then: a --device cpu rank on a GPU machine never
    touched it, and asking for a GPU's state would open a context on GPU 0 (memory, and a process on that GPU)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def by_rank(state):
    """Every rank's `state`, in rank order, on rank 0 (None elsewhere): for a checkpoint that rank 0 writes for
    ranks that each keep their own (RNG states: each draws its own dropout stream, seed + rank; FP8 histories)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [state]
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, states, dst=0)
    return states


def own_rng_state(state):
    """This rank's RNG state from a checkpoint: its own from `rng_by_rank` when the checkpoint has one per rank
    of a world of this size, else the one `rng` (a single-device checkpoint, or another world size)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_rank = state.get("rng_by_rank")
    return by_rank[rank] if by_rank is not None and len(by_rank) == world else state["rng"]


def set_rng_state(state):
    """Restore the CPU state, and the current GPU's: saved as one state (this version), or as one per GPU of the
    saving node (earlier versions: this device's, or the first if the node had fewer)."""
    torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_initialized():         # a CPU rank (see rng_state), or no GPU here
        return
    if isinstance(cuda, (list, tuple)):
        if not cuda:
            return
        index = torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(cuda)
