"""
pipeline/tied.py: a tied weight (an embedding and LM head, one Parameter) of a model cut into pipeline stages
(train_pp.py, and train_5d.py through it). A stage lists what it shares in `tied`: pipeline/stages.py's
SequentialStage finds it by identity (what `before` and `after` both hold), pipeline/gpt_stages.py's PipelineStage is
model.py's GPT's wte.

The tie joins the first stage to the last. Where the two stages sit on different ranks (round-robin placement,
p > 1), each rank holds a copy; summing the two gradients keeps the copies equal (identical grads + identical
AdamW = identical copies) and the global grad norm counts the weight once. Where one rank holds both ends (p == 1,
or the V placement of zbv and dualpipev, stages 0 and 2p-1 on rank 0), both stages share one Parameter and
autograd sums its gradient: no copy, no communication.

    rank:          0            1           2           3
    round-robin:   wte ....................................... lm_head (copy)   all-reduce the pair (0, 3)
    V:             wte + lm_head (one Parameter)                                nothing to sync
"""
from common import comm
from common.comm import clip_grad_norm
from pipeline.schedules import rank_of


def tied_ranks(p, v, placement="loop"):
    """Pipeline ranks of the first and the last stage: one rank when it holds both."""
    return sorted({0, rank_of(p * v - 1, p, placement)})


def tied_pair_group(p, v, placement="loop"):
    """The two ranks whose tied copies are summed (every rank creates it, two use it); None if one rank holds
    both ends. Pipeline rank = global rank here (train_pp.py); train_5d.py builds its own pairs."""
    ranks = tied_ranks(p, v, placement)
    return comm.new_group(ranks) if len(ranks) == 2 else None


def tied_weight(chunks):
    """The tied weight on this rank (None in the middle of the pipeline, or where nothing is tied): the first
    stage's, or the last stage's copy (one Parameter when both stages are on this rank)."""
    return next((p for c in chunks for p in c.tied), None)


def tied_copy(chunks, tied_group):
    """The tied weight on this rank when it is one of two copies whose gradients are summed, else None: not on a
    rank holding both ends (one Parameter), even if a group was made for the pair."""
    w = tied_weight(chunks)
    both_ends = any(c.first for c in chunks) and any(c.last for c in chunks)
    return w if tied_group is not None and not both_ends else None


def tied_grads_sync(chunks, tied_group):
    """Sum the tied weight's gradient over its two copies (first and last stage), in place."""
    w = tied_copy(chunks, tied_group)
    if w is not None:
        comm.all_reduce(w.grad, group=tied_group)


def clip_stage_grads(chunks, max_norm, group, device):
    """The global grad norm over all stages of `group` (the tied weight counted once: the last stage's copy is
    left out), and every gradient, both copies included, scaled to at most max_norm (0: no clipping)."""
    copy = tied_weight(chunks) if not any(c.first for c in chunks) else None
    owned = [q.grad for q in chunks.parameters() if q is not copy]
    return clip_grad_norm(owned, max_norm, group=group, device=device, dtype=owned[0].dtype,
                          replicas=[copy.grad] if copy is not None else [])
