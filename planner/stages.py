"""
planner/stages.py: where a pipeline's stages are, for planner/memory.py and planner/comm.py: the blocks each pipeline
rank holds (its v chunks' stages, as pipeline/schedules.stage_of places them: round-robin, or in a V for zbv and
dualpipev), their sizes and MoE blocks, the ranks holding the ends, and the ranks whose memory can be the peak.
Each is cached per model shape (Job.shape): the search asks for them several times per layout and pipeline rank.

    stage_blocks(job, pp=4, v=2, rank=1)         # global block indices on rank 1, chunk 0 first
    peak_candidates(job, lay)                    # every rank, or the ends and the turn where no middle rank can peak
"""
from functools import lru_cache

from pipeline.schedules import placement_of, rank_of, stage_of
from planner.shape import block_numels, job_of_shape, stage_layer_counts


def stage_blocks(job, pp, v, rank, placement="loop"):
    """Global block indices on pipeline rank `rank`: its v chunks (stages stage_of(rank, c): rank, rank+p, ...
    round-robin; rank and 2p-1-rank in a V), stage k holding shape.stage_layer_counts' k-th share (L/(p*v)
    each when they divide and no end is cut), chunk 0 first."""
    return rank_blocks(job.shape, pp, v, rank, placement)


@lru_cache(maxsize=None)
def rank_blocks(shape, pp, v, rank, placement):
    """stage_blocks of a Job.shape, as a tuple (cached: the search asks for it several times per layout)."""
    counts = stage_layer_counts(job_of_shape(shape), pp * v)
    starts = [sum(counts[:k]) for k in range(pp * v)]
    stages = [stage_of(rank, c, pp, placement) for c in range(v)]
    return tuple(i for s in stages for i in range(starts[s], starts[s] + counts[s]))


@lru_cache(maxsize=None)
def block_sizes(shape, tp, ep, pp, v, rank, placement):
    """Parameters of each block on pipeline rank `rank` (shape.block_numels summed; a Job.shape)."""
    job = job_of_shape(shape)
    return tuple(sum(block_numels(job, tp, ep, job.cfg.is_moe_block(i)))
                 for i in rank_blocks(shape, pp, v, rank, placement))


def moe_blocks(job, pp, v, rank, placement="loop"):
    """How many of stage_blocks' blocks are MoE blocks (cached with them)."""
    return rank_moe_blocks(job.shape, pp, v, rank, placement)


@lru_cache(maxsize=None)
def rank_moe_blocks(shape, pp, v, rank, placement):
    """moe_blocks of a Job.shape."""
    cfg = job_of_shape(shape).cfg
    return sum(cfg.is_moe_block(i) for i in rank_blocks(shape, pp, v, rank, placement))


def end_ranks(lay):
    """(rank holding the first stage, rank holding the last stage): (0, p-1), or (0, 0) in a V."""
    return 0, rank_of(lay.pp * lay.v - 1, lay.pp, placement_of(lay.schedule))


def peak_candidates(job, lay):
    """The pipeline ranks memory evaluates, those whose memory can be the peak. Every rank where ranks differ in what
    they hold beyond in-flight micro-batches: stages of uneven size (cut ends, ends_as_layers, p*v not dividing L),
    MoE blocks falling differently on them, or a receive buffer per micro-batch (job.pp_recv_per_micro_batch: a
    middle rank holds m more than the first, which can outweigh the first's embedding). Else the ends and the turn:
    rank 0 (the first stage), the last stage's rank (the head) and p-1 (in a V the turn), as a middle rank holds the
    same blocks as these and no more in flight than one of them (memory.in_flight falls with the rank under 1f1b and
    interleaved, rises to p-1 in zbv's V, is even otherwise; tests/test_plan_memory.py holds the two equal)."""
    return peak_ranks(job.shape, lay.pp, lay.v, placement_of(lay.schedule), job.pp_recv_per_micro_batch)


@lru_cache(maxsize=None)
def peak_ranks(shape, pp, v, placement, recv_per_micro_batch):
    """peak_candidates of a Job.shape."""
    job = job_of_shape(shape)
    moe = {tuple(job.cfg.is_moe_block(i) for i in rank_blocks(shape, pp, v, r, placement)) for r in range(pp)}
    if len(set(stage_layer_counts(job, pp * v))) > 1 or len(moe) > 1 or recv_per_micro_batch:
        return tuple(range(pp))
    return tuple(sorted({0, rank_of(pp * v - 1, pp, placement), pp - 1}))


def layers_per_rank(job, lay):
    """Blocks on each pipeline rank (its v chunks' stages), uneven stages included."""
    return list(rank_layers(job.shape, lay.pp, lay.v, placement_of(lay.schedule)))


@lru_cache(maxsize=None)
def rank_layers(shape, pp, v, placement):
    """layers_per_rank of a Job.shape (cached: the search asks for it several times per layout)."""
    counts = stage_layer_counts(job_of_shape(shape), pp * v)
    return tuple(sum(counts[stage_of(r, c, pp, placement)] for c in range(v)) for r in range(pp))
