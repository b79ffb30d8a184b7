"""
collectives.py: the collectives crash course. Each collective parallel training is built from, written by
hand from send/recv beside torch.distributed's own, checked equal and timed side by side.

    torchrun --nproc_per_node 4 collectives.py                      # walk-through (CPU/gloo or GPU/NCCL)
    torchrun --nproc_per_node 4 collectives.py --numel 7            # uneven: 7 elements over 4 ranks
    torchrun --nproc_per_node 4 collectives.py --size 1 16 64       # bandwidth sweep (MiB), nccl-tests style

Ring all-reduce of S bytes over n ranks, the one picture to remember:
    reduce-scatter, n-1 steps: every rank sends one chunk to its right neighbour, which adds its own to it
        step 0:  r0 --c0--> r1    r1 --a1--> r2    r2 --b2--> r0
        step 1:  r0 --b20-> r1    r1 --c01-> r2    r2 --a12-> r0       (b20 = b2 + b0, ...)
        now r0 owns a012 (the full sum of chunk a), r1 owns b012, r2 owns c012
    all-gather, n-1 more steps: the finished chunks go round once more, copied instead of added
    each rank sends 2(n-1) chunks of S/n = 2(n-1)/n * S: almost flat in n, which is why rings scale.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import math
import time
from collections import namedtuple
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import comm, distributed
from common.comm import COMM


def chunk_sizes(numel, n):
    """Chunk lengths of torch.tensor_split, used for every split here: the first numel % n get one more."""
    return [numel // n + (i < numel % n) for i in range(n)]


def peer(group, group_rank):
    """P2P ops address global ranks; a building block thinks in ranks of its own group."""
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


def exchange(group, sends=(), recvs=()):
    """One step: this rank's (tensor, group rank) sends and recvs as ONE batch_isend_irecv, then wait.
    NCCL runs each batch as one group, groups in order, and pairs the k-th send a->b with the k-th recv on b
    from a; so every rank walks the same steps in the same order and no step waits on a later one."""
    ops = [comm.p2p_op("send", t, peer(group, dst), group) for t, dst in sends]
    ops += [comm.p2p_op("recv", t, peer(group, src), group) for t, src in recvs]
    for work in comm.batch_isend_irecv(ops):    # comm counts the bytes of every send
        work.wait()


# by hand, from send/recv. Every function takes (out, inp, group); in-place ones get out is inp.

def ring_reduce_scatter(out, inp, group=None):
    """n-1 steps; at step k rank r sends chunk r-k-1 right and adds chunk r-k-2 arriving from the left
    (the partial sum the left neighbour sent). Afterwards chunk r holds the sum over all ranks."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = inp.clone().view(-1).tensor_split(n)       # partial sums accumulate here, not in the input
    for k in range(n - 1):
        incoming = torch.empty_like(chunks[(r - k - 2) % n])
        exchange(group, [(chunks[(r - k - 1) % n], (r + 1) % n)], [(incoming, (r - 1) % n)])
        chunks[(r - k - 2) % n].add_(incoming)
    out.copy_(chunks[r])


def ring_all_gather(out, inp, group=None):
    """n-1 steps; at step k rank r forwards chunk r-k and receives chunk r-k-1 straight into place."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = out.view(-1).tensor_split(n)
    chunks[r].copy_(inp)
    for k in range(n - 1):
        exchange(group, [(chunks[(r - k) % n], (r + 1) % n)], [(chunks[(r - k - 1) % n], (r - 1) % n)])


def ring_all_reduce(out, inp, group=None):
    """In place, literally reduce-scatter then all-gather: 2(n-1) steps of one chunk each."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    mine = out.new_empty(chunk_sizes(out.numel(), n)[r])
    ring_reduce_scatter(mine, out, group)
    ring_all_gather(out, mine, group)


def chain(out, inp, group=None, reduce=False, piece_bytes=1 << 18):
    """Broadcast along the chain 0 -> 1 -> ... -> n-1, or reduce along n-1 -> ... -> 0, adding on the way.
    Pipelined: the tensor is cut in pieces and piece j leaves chain position p at step j + p, so the far end
    is done after pieces + n - 2 steps instead of pieces * (n - 1), and every link is busy at once."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pieces = out.view(-1).tensor_split(max(1, min(out.numel(), math.ceil(out.nbytes / piece_bytes))))
    order = list(reversed(range(n))) if reduce else list(range(n))
    p = order.index(r)
    for step in range(len(pieces) + n - 2):
        send_j, recv_j = step - p, step - p + 1          # the piece this rank forwards / receives now
        sends = [(pieces[send_j], order[p + 1])] if p < n - 1 and 0 <= send_j < len(pieces) else []
        recvs = [(torch.empty_like(pieces[recv_j]), order[p - 1])] if p > 0 and 0 <= recv_j < len(pieces) else []
        exchange(group, sends, recvs)
        for incoming, _ in recvs:
            if reduce:
                pieces[recv_j].add_(incoming)         # the partial sum of every rank behind this one
            else:
                pieces[recv_j].copy_(incoming)


def direct_gather(out, inp, group=None):
    """Every rank sends its shard straight to the root, which receives all n-1 in one batch."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r != 0:
        return exchange(group, sends=[(inp, 0)])
    chunks = out.view(-1).tensor_split(n)
    chunks[0].copy_(inp)
    exchange(group, recvs=[(chunks[s], s) for s in range(1, n)])


def direct_scatter(out, inp, group=None):
    """The root sends chunk d to rank d, all n-1 sends in one batch."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r != 0:
        return exchange(group, recvs=[(out, 0)])
    chunks = inp.view(-1).tensor_split(n)
    out.copy_(chunks[0])
    exchange(group, sends=[(chunks[d], d) for d in range(1, n)])


def pairwise_all_to_all(out, inp, group=None):
    """Chunk d of rank r's input becomes chunk r of rank d's output. n-1 shift steps: at step k every rank
    sends to r+k and receives from r-k, so each step is a permutation and every link carries one chunk."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    sends, recvs = inp.view(-1).tensor_split(n), out.view(-1).tensor_split(n)
    recvs[r].copy_(sends[r])
    for k in range(1, n):
        exchange(group, [(sends[(r + k) % n], (r + k) % n)], [(recvs[(r - k) % n], (r - k) % n)])


def dissemination_barrier(out, inp, group=None):
    """ceil(log2 n) rounds of a 1-element token: in round i rank r signals r + 2^i and waits for r - 2^i.
    After round i a rank has heard, directly or not, from 2^(i+1) ranks; after the last, from all."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for i in range(math.ceil(math.log2(n))):
        exchange(group, [(inp, (r + 2 ** i) % n)], [(torch.empty_like(inp), (r - 2 ** i) % n)])


# torch's, same signature. It wants equal shards: an uneven split is zero-padded to ceil(L/n) per rank.

def padded_rows(x, n):
    """[n, ceil(L/n)]: row i holds tensor_split chunk i of x, zero-padded; a view of x when n divides L."""
    if x.numel() % n == 0:
        return x.view(n, -1)                        # even: torch reads and writes x itself, no copies
    m = math.ceil(x.numel() / n)
    return torch.stack([F.pad(c, (0, m - c.numel())) for c in x.view(-1).tensor_split(n)])


def torch_all_gather(out, inp, group=None, to_root=False):
    """comm's flat all-gather, or dist.gather to the root (non-roots pass `out` only for its length)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    rows = padded_rows(out, n)
    shard = F.pad(inp, (0, rows.shape[1] - inp.numel()))
    if to_root:
        dist.gather(shard, list(rows) if r == 0 else None, dst=peer(group, 0), group=group)
    else:
        comm.all_gather(rows.view(-1), shard, group=group)
    if out.numel() % n:                             # drop the padding
        out.copy_(torch.cat([row[:s] for row, s in zip(rows, chunk_sizes(out.numel(), n))]))


def torch_reduce_scatter(out, inp, group=None, from_root=False):
    """comm's flat reduce-scatter, or dist.scatter from the root: a reduce-scatter without the sum."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    rows = padded_rows(inp, n)
    mine = rows.new_empty(rows.shape[1])
    if from_root:
        dist.scatter(mine, list(rows) if r == 0 else None, src=peer(group, 0), group=group)
    else:
        comm.reduce_scatter(mine, rows.view(-1), group=group)
    out.copy_(mine[:out.numel()])


# what it does; by hand; torch's; the bytes each rank sends by hand (S = full tensor bytes)
Collective = namedtuple("Collective", "what by_hand torch formula")
COLLECTIVES = {
    "broadcast": Collective("the root's tensor to every rank (initial weights)", chain,
                            lambda out, inp, g: comm.broadcast(out, src=peer(g, 0), group=g),
                            "S, but 0 on the chain's last rank"),
    "reduce": Collective("the sum of all ranks' tensors, on the root", partial(chain, reduce=True),
                         lambda out, inp, g: dist.reduce(out, dst=peer(g, 0), group=g), "S, but 0 on the root"),
    "all_reduce": Collective("the sum on every rank (DP gradients, TP outputs)", ring_all_reduce,
                             lambda out, inp, g: comm.all_reduce(out, group=g), "2(n-1)/n*S"),
    "gather": Collective("every rank's shard, concatenated on the root", direct_gather,
                         partial(torch_all_gather, to_root=True), "S/n, but 0 on the root"),
    "all_gather": Collective("every rank's shard, concatenated on every rank (ZeRO-3, SP)", ring_all_gather,
                             torch_all_gather, "(n-1)/n*S"),
    "scatter": Collective("chunk r of the root's tensor to rank r", direct_scatter,
                          partial(torch_reduce_scatter, from_root=True), "(n-1)/n*S on the root, 0 elsewhere"),
    "reduce_scatter": Collective("chunk r of the sum to rank r (ZeRO-2 gradients, SP)", ring_reduce_scatter,
                                 torch_reduce_scatter, "(n-1)/n*S"),
    "all_to_all": Collective("chunk d of rank r's input to rank d, as its chunk r (MoE dispatch)",
                             pairwise_all_to_all, lambda out, inp, g: comm.all_to_all(   # output: even split
                                 out, inp, None, chunk_sizes(inp.numel(), dist.get_world_size(g)), group=g),
                             "(n-1)/n*S"),
    "barrier": Collective("no rank leaves before every rank has arrived", dissemination_barrier,
                          lambda out, inp, g: dist.barrier(group=g), "ceil(log2 n) 4-byte tokens"),
}
# the root is rank 0 of the group; only its input (before) or output (after) means anything
ROOT_ONLY = {"broadcast": "before", "scatter": "before", "reduce": "after", "gather": "after"}


def make_buffers(op, numel, group, device):
    """(inp, out) of `op` on this rank for a full tensor of numel elements: small integers in float32, so
    every summation order gives the same bits and the two versions can be compared exactly."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    mine = chunk_sizes(numel, n)[r]
    full = (torch.arange(numel, device=device) % 10 + 10 * r).float()
    if op in ("broadcast", "reduce", "all_reduce"):
        return full, full
    if op in ("gather", "all_gather"):
        return full[:mine].clone(), torch.zeros(numel, device=device)
    if op in ("scatter", "reduce_scatter"):
        return full, torch.zeros(mine, device=device)
    if op == "all_to_all":
        return full, torch.zeros(n * mine, device=device)
    return torch.zeros(1, device=device), torch.zeros(1, device=device)


def run_both(op, numel, group=None, device="cpu"):
    """torch's version, then the hand-written one on fresh buffers. Returns this rank's input, both outputs,
    the bytes COMM counted for the hand-written one and whether the outputs agree."""
    c = COLLECTIVES[op]
    inp, out = make_buffers(op, numel, group, device)
    before = inp.clone()
    c.torch(out, inp, group)         # first: NCCL wants every rank of a group in the group's first p2p batch
    inp, mine = make_buffers(op, numel, group, device)
    COMM.reset()
    c.by_hand(mine, inp, group)
    same = torch.equal(mine, out) or (ROOT_ONLY.get(op) == "after" and dist.get_rank(group) != 0)
    return before, out, mine, COMM.bytes_sent, same


def time_both(op, numel, group, device, reps=10):
    """Seconds per call [torch, by hand]: calls alternate, each between barriers; median, slowest rank."""
    c, times = COLLECTIVES[op], [[], []]
    inp, out = make_buffers(op, numel, group, device)
    for _ in range(reps + 1):                       # the first round warms up (in-place ops keep summing)
        for fn, t in zip((c.torch, c.by_hand), times):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn(out, inp, group)
            if device.type == "cuda":                # kernels run asynchronously: wait before reading the clock
                torch.cuda.synchronize(device)
            t.append(time.perf_counter() - t0)
    medians = torch.tensor([sorted(t[1:])[reps // 2] for t in times], device=device, dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    return medians.tolist()


def walk_through(op, numel, group, device):
    c, n, r = COLLECTIVES[op], dist.get_world_size(group), dist.get_rank(group)
    before, _, mine, sent, same = run_both(op, numel, group, device)
    row = f"{str(before.int().tolist()) if ROOT_ONLY.get(op) != 'before' or r == 0 else '-':<34} -> "
    row += str(mine.int().tolist()) if ROOT_ONLY.get(op) != "after" or r == 0 else "-"
    views = [None] * n if r == 0 else None           # printed by rank 0 alone, so they come in rank order
    dist.gather_object((row, sent, same), views, dst=peer(group, 0), group=group)
    if r == 0:
        print(f"\n== {op}: {c.what}")
        if op != "barrier":                          # a barrier moves no data worth showing
            print("\n".join(f"  rank {s}: {row}" for s, (row, _, _) in enumerate(views)))
        print(f"  bytes sent by hand: {' '.join(f'{v[1]:g}' for v in views)} ({c.formula}, S = {4 * numel})"
              f"   by hand == torch.distributed: {all(v[2] for v in views)}")


def sweep(sizes, group, device):
    """nccl-tests' bandwidths: algbw = S / time with S = full tensor bytes, busbw = algbw * bus factor."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r == 0:
        print(f"\n{'op':<15}{'bytes':>11}{'torch us':>10}{'algbw':>8}{'busbw':>8}{'hand us':>10}{'algbw':>8}"
              f"{'busbw':>8}   GB/s, {n} ranks, {device.type}")
    for mib in sizes:
        S = 4 * max(n, int(mib * 2 ** 18) // n * n)   # float32 elements that n divides: torch needs no padding
        for op, c in list(COLLECTIVES.items())[:-1]:  # all but the barrier, which moves no data
            times = time_both(op, S // 4, group, device)
            # nccl-tests' bus factor: each chain link carries all of S, each ring link (n-1)/n of it (twice)
            bus = 1 if op in ("broadcast", "reduce") else (n - 1) / n * (2 if op == "all_reduce" else 1)
            cols = [f"{t * 1e6:>10.0f}{S / t / 1e9:>8.2f}{S / t / 1e9 * bus:>8.2f}" for t in times]
            if r == 0:
                print(f"{op:<15}{S:>11}{''.join(cols)}")


def main(argv=None):
    from common.config import parse_collectives_args
    args = parse_collectives_args(argv, __doc__)   # --numel --size --device --dist_timeout, each checked
    env = distributed.init_distributed(args)
    if not args.size:
        for op in COLLECTIVES:
            walk_through(op, args.numel or 2 * env.world_size, None, env.device)
    sweep(args.size or [1.0], None, env.device)    # after the walk-through: both versions timed at 1 MiB


if __name__ == "__main__":
    main()
    distributed.destroy()    # leave the group together, then exit without the interpreter's teardown
