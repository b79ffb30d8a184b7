"""
common/cp_layout.py: context parallelism's layouts (train_cp.py, whose docstring draws them): which positions of a
sequence each of cp ranks holds (ring: one chunk; zigzag and allgather: chunks r and 2cp-1-r), and which blocks of
a rank's queries against which keys are not fully masked. Torch and the stdlib only.
"""
import functools

import torch


def chunk_runs(layout, seq_len, cp, rank):
    """(global start, length) of each contiguous run of positions `rank` holds, in local order."""
    if layout == "ring":                       # one contiguous chunk per rank
        return [(rank * (seq_len // cp), seq_len // cp)]
    c = seq_len // (2 * cp)                    # zigzag and allgather: chunks rank and 2cp-1-rank
    return [(rank * c, c), ((2 * cp - 1 - rank) * c, c)]


def local_positions(layout, seq_len, cp, rank, device="cpu"):
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in chunk_runs(layout, seq_len, cp, rank)])


def ring_step_blocks(layout, rank, src, local_len):
    """[(query rows, key rows, causal)] of this rank's queries against rank src's K/V that are not fully
    masked. Local positions increase with the local index in both layouts, so the diagonal is plain causal."""
    full, half = slice(0, local_len), local_len // 2
    if src == rank:
        return [(full, full, True)]
    if layout == "ring":
        return [(full, full, False)] if src < rank else []     # later chunks are entirely in the future
    if src < rank:           # zigzag: both my chunks come after src's early chunk, before its late one
        return [(full, slice(0, half), False)]
    return [(slice(half, local_len), full, False)]             # only my late chunk sees src's two chunks


def score_elements(layout, seq_len, cp, rank):
    """Attention score elements (unmasked query-key pairs) this rank computes per sequence and head: the blocks
    its attention runs (the metric attn_score_elements multiplies it by batch x heads x layers x forwards)."""
    if layout == "allgather":
        blocks = allgather_blocks(layout, seq_len, cp, rank)
    else:
        blocks = [b for s in range(cp) for b in ring_step_blocks(layout, rank, (rank - s) % cp, seq_len // cp)]
    return sum((r.stop - r.start) * (r.stop - r.start + 1) // 2 if causal else (r.stop - r.start) * (c.stop - c.start)
               for r, c, causal in blocks)


def allgather_blocks(layout, seq_len, cp, rank):
    """Each local run against the gathered sequence: its own positions (causal) and everything before."""
    blocks, local = [], 0
    for start, length in chunk_runs(layout, seq_len, cp, rank):
        rows = slice(local, local + length)
        blocks.append((rows, slice(start, start + length), True))    # first: every row gets a finite lse
        if start > 0:
            blocks.append((rows, slice(0, start), False))
        local += length
    return blocks


@functools.lru_cache(maxsize=None)
def global_order(layout, seq_len, cp, device):
    """Index that sorts the rank-major concatenation of all local chunks into global position order. Built once
    on the device (every layer uses it three times a micro-batch: a host-built index is a copy and a sync each)."""
    return torch.cat([local_positions(layout, seq_len, cp, i, device) for i in range(cp)]).argsort()
