"""
common/checkpoint/fp8_state.py: delayed scaling's amax histories (kernels/fp8.py) in a checkpoint, so that an FP8 run resumes with
the scales it had.

    histories(modules)              {FP8 layer name: its [x, W, dy] x history_len amaxes}, this rank's
    restore(modules, by_rank)       checkpoint.load: this rank's own, or every saving rank's merged

A history is per rank, not per model: each rank pushes the amaxes of the micro-batches it computes (a dp rank's
own tokens, g/dp pushes a step where one device makes g), so no layout's history is another's. A checkpoint
keeps every rank's (like the RNG states). A resume on the same world takes its own back, and continues as the
unbroken run bit for bit; on another world each rank takes, per layer, the elementwise max over the saving ranks
that held it: a scale no larger than any of them used (no new overflow), continuing within FP8's bound
(docs/kernels.md). The dynamic recipes keep no state; their histories stay zero and are saved as such.
"""
import torch


def fp8_layers(modules):
    """(name, amax history tensor) of every FP8 layer of `modules`: Float8Linear's buffer, or the history of a
    tensor-parallel layer's FP8 gemms (converters/fp8_tp.py), named by the layer (one device's name)."""
    for module in modules:
        for name, m in module.named_modules():
            history = getattr(getattr(m, "gemm", None), "amax_history", None)
            history = getattr(m, "amax_history", history)
            if isinstance(history, torch.Tensor):
                yield name, history


def histories(modules):
    """This rank's histories, on the CPU, by layer name."""
    return {name: h.detach().cpu().clone() for name, h in fp8_layers(modules)}


def restore(modules, by_rank, rank, world):
    """Set this rank's histories from a checkpoint's per-rank list (None: an older checkpoint, zeros kept)."""
    if not by_rank:
        return
    if len(by_rank) == world:
        saved = by_rank[rank]
    else:
        saved = {}
        for part in by_rank:
            for name, h in part.items():
                saved[name] = torch.maximum(saved[name], h) if name in saved else h
    with torch.no_grad():
        for name, h in fp8_layers(modules):
            if name in saved:
                h.copy_(saved[name])
