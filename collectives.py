"""
collectives.py: the collectives crash course. Each collective that parallel training is built from, written
by hand from send/recv beside torch.distributed's own, checked equal and timed side by side.

    torchrun --nproc_per_node 4 collectives.py                      # walk-through (CPU/gloo or GPU/NCCL)
    torchrun --nproc_per_node 4 collectives.py --numel 7            # uneven: 7 elements over 4 ranks
    torchrun --nproc_per_node 4 collectives.py --size 1M 16M 64M    # bandwidth sweep, nccl-tests style

For broadcast, reduce, all_reduce, gather, all_gather, scatter, reduce_scatter, all_to_all and barrier it
prints what every rank holds before and after, the bytes each rank sends by hand (counted by comm.py, whose
convention is the ring algorithms': S = full tensor bytes, n = group size; all_reduce 2(n-1)/n*S,
reduce_scatter and all_gather (n-1)/n*S, all_to_all (n-1)/n of its input, send S) and whether the
hand-written result equals the library's. The one picture, ring all-reduce of chunks [a|b|c] on 3 ranks:

    reduce-scatter, n-1 steps: every rank sends one chunk to its right neighbour, which adds its own to it
        step 0:  r0 --c0--> r1    r1 --a1--> r2    r2 --b2--> r0
        step 1:  r0 --b20-> r1    r1 --c01-> r2    r2 --a12-> r0       (b20 = b2 + b0, ...)
        now r0 owns a012 (the full sum of chunk a), r1 owns b012, r2 owns c012
    all-gather, n-1 more steps: the finished chunks go round once more, copied instead of added
    each rank sends 2(n-1) chunks of S/n = 2(n-1)/n * S: almost flat in n, which is why rings scale.

A length that n does not divide is split as torch.tensor_split does (the first L % n chunks one longer).
Every p2p step is NCCL-safe: this rank's send and recv go in ONE batch_isend_irecv (one NCCL group), every
rank walks the same steps in the same order, and the k-th send a->b meets the k-th recv on b from a.
"""
import argparse
import math
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import comm
from comm import COMM


def chunk_sizes(numel, n):
    """Lengths of torch.tensor_split(x, n) for x of numel elements."""
    return [numel // n + (i < numel % n) for i in range(n)]


def peer(group, group_rank):
    """P2P ops address global ranks; a building block thinks in ranks of its own group."""
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


def exchange(group, sends=(), recvs=()):
    """One step: all of this rank's (tensor, group rank) sends and recvs in ONE batch, then wait for it."""
    ops = [comm.p2p_op("send", t, peer(group, dst), group) for t, dst in sends]
    ops += [comm.p2p_op("recv", t, peer(group, src), group) for t, src in recvs]
    for work in comm.batch_isend_irecv(ops):    # comm counts the bytes of every send
        work.wait()


# ----------------------------------------------------------------------------------------------------------
# by hand, from send/recv. Every function takes (out, inp, group); in-place ones get out is inp.

def ring_reduce_scatter_chunks(chunks, group):
    """n-1 steps; at step k rank r sends chunk r-k-1 right and adds chunk r-k-2 arriving from the left
    (the partial sum the left neighbour sent). Afterwards chunks[r] holds the sum over all ranks."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for k in range(n - 1):
        incoming = torch.empty_like(chunks[(r - k - 2) % n])
        exchange(group, [(chunks[(r - k - 1) % n], (r + 1) % n)], [(incoming, (r - 1) % n)])
        chunks[(r - k - 2) % n].add_(incoming)


def ring_all_gather_chunks(chunks, group):
    """n-1 steps; at step k rank r forwards chunk r-k and receives chunk r-k-1 straight into place."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for k in range(n - 1):
        exchange(group, [(chunks[(r - k) % n], (r + 1) % n)], [(chunks[(r - k - 1) % n], (r - 1) % n)])


def ring_all_reduce(out, inp, group=None):
    """Reduce-scatter then all-gather over the same chunks: 2(n-1) steps, in place."""
    chunks = out.view(-1).tensor_split(dist.get_world_size(group))
    ring_reduce_scatter_chunks(chunks, group)
    ring_all_gather_chunks(chunks, group)


def ring_reduce_scatter(out, inp, group=None):
    chunks = inp.clone().view(-1).tensor_split(dist.get_world_size(group))   # leave the input untouched
    ring_reduce_scatter_chunks(chunks, group)
    out.copy_(chunks[dist.get_rank(group)])


def ring_all_gather(out, inp, group=None):
    chunks = out.view(-1).tensor_split(dist.get_world_size(group))
    chunks[dist.get_rank(group)].copy_(inp)
    ring_all_gather_chunks(chunks, group)


def chain(buf, group, towards_root, root=0, piece_bytes=1 << 20):
    """A pipelined chain through all ranks. buf is cut in pieces and piece j leaves chain position p at step
    j + p, so the far end is done after pieces + n - 2 steps instead of pieces * (n - 1). Away from the root
    every rank copies what arrives (broadcast); towards the root it adds its own piece first (reduce)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pieces = buf.view(-1).tensor_split(max(1, min(buf.numel(), n * math.ceil(buf.nbytes / piece_bytes))))
    order = [(root + i) % n for i in range(n)]            # broadcast: root -> root+1 -> ... -> root-1
    if towards_root:
        order = order[1:] + order[:1]                      # reduce: root+1 -> ... -> root-1 -> root
    p = order.index(r)
    for step in range(len(pieces) + n - 2):
        out_j, in_j = step - p, step - p + 1               # piece to forward / piece arriving from p-1
        sends = [(pieces[out_j], order[p + 1])] if p < n - 1 and 0 <= out_j < len(pieces) else []
        recvs = [(torch.empty_like(pieces[in_j]), order[p - 1])] if p > 0 and 0 <= in_j < len(pieces) else []
        exchange(group, sends, recvs)
        for incoming, _ in recvs:
            pieces[in_j].add_(incoming) if towards_root else pieces[in_j].copy_(incoming)


def chain_broadcast(out, inp, group=None):
    chain(out, group, towards_root=False)


def chain_reduce(out, inp, group=None):
    """The root ends with the sum; the other ranks are left holding partial sums (as NCCL's reduce may)."""
    chain(out, group, towards_root=True)


def direct_gather(out, inp, group=None, root=0):
    """Every rank sends its shard straight to the root, which receives all n-1 in one batch."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r != root:
        return exchange(group, sends=[(inp, root)])
    chunks = out.view(-1).tensor_split(n)
    chunks[r].copy_(inp)
    exchange(group, recvs=[(chunks[s], s) for s in range(n) if s != root])


def direct_scatter(out, inp, group=None, root=0):
    """The root sends chunk d to rank d, all n-1 sends in one batch."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r != root:
        return exchange(group, recvs=[(out, root)])
    chunks = inp.view(-1).tensor_split(n)
    out.copy_(chunks[r])
    exchange(group, sends=[(chunks[d], d) for d in range(n) if d != root])


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


# ----------------------------------------------------------------------------------------------------------
# the library's, same signature. The flat all-gather / reduce-scatter and gather / scatter want equal
# shards, so an uneven split is zero-padded to ceil(L/n) per rank and the padding dropped afterwards.

def padded_rows(x, n):
    """[n, ceil(L/n)]: row i holds tensor_split chunk i of x, zero-padded."""
    m = math.ceil(x.numel() / n)
    return torch.stack([F.pad(c, (0, m - c.numel())) for c in x.view(-1).tensor_split(n)])


def unpadded(rows, numel):
    return torch.cat([row[:s] for row, s in zip(rows, chunk_sizes(numel, len(rows)))])


def torch_all_gather(out, inp, group=None):
    rows = padded_rows(out, dist.get_world_size(group))
    comm.all_gather(rows.view(-1), F.pad(inp, (0, rows.shape[1] - inp.numel())), group=group)
    out.copy_(unpadded(rows, out.numel()))


def torch_gather(out, inp, group=None, root=0):
    """Non-roots pass an `out` too, only for its length: it tells them how far to pad their shard."""
    rows = padded_rows(out, dist.get_world_size(group))
    rows_at_root = list(rows) if dist.get_rank(group) == root else None
    dist.gather(F.pad(inp, (0, rows.shape[1] - inp.numel())), rows_at_root, dst=peer(group, root), group=group)
    out.copy_(unpadded(rows, out.numel()))


def torch_reduce_scatter(out, inp, group=None):
    rows = padded_rows(inp, dist.get_world_size(group))
    mine = rows.new_empty(rows.shape[1])
    comm.reduce_scatter(mine, rows.view(-1), group=group)
    out.copy_(mine[:out.numel()])


def torch_scatter(out, inp, group=None, root=0):
    rows = padded_rows(inp, dist.get_world_size(group))
    mine = rows.new_empty(rows.shape[1])
    dist.scatter(mine, list(rows) if dist.get_rank(group) == root else None, src=peer(group, root), group=group)
    out.copy_(mine[:out.numel()])


def torch_all_to_all(out, inp, group=None):
    n = dist.get_world_size(group)
    comm.all_to_all(out, inp, [out.numel() // n] * n, chunk_sizes(inp.numel(), n), group=group)


def torch_broadcast(out, inp, group=None):
    comm.broadcast(out, src=peer(group, 0), group=group)


def torch_reduce(out, inp, group=None):
    dist.reduce(out, dst=peer(group, 0), group=group)


def torch_all_reduce(out, inp, group=None):
    comm.all_reduce(out, group=group)


def torch_barrier(out, inp, group=None):
    dist.barrier(group=group)


# ----------------------------------------------------------------------------------------------------------
# the course

class Collective(NamedTuple):
    what: str
    by_hand: Callable
    library: Callable
    root_only: str          # "before" / "after": only the root's input / output means anything (root = 0)
    formula: str            # bytes each rank sends by hand, S = full tensor bytes
    bus_factor: Callable    # nccl-tests' busbw = algbw * bus_factor(n): the per-link rate, comparable across n


COLLECTIVES = {
    "broadcast": Collective("the root's tensor to every rank (initial weights)", chain_broadcast,
                            torch_broadcast, "before", "S, but 0 on the chain's last rank", lambda n: 1),
    "reduce": Collective("the sum of all ranks' tensors, on the root", chain_reduce, torch_reduce,
                         "after", "S, but 0 on the root", lambda n: 1),
    "all_reduce": Collective("the sum on every rank (DP gradients, TP outputs)", ring_all_reduce,
                             torch_all_reduce, "", "2(n-1)/n*S", lambda n: 2 * (n - 1) / n),
    "gather": Collective("every rank's shard, concatenated on the root", direct_gather, torch_gather,
                         "after", "S/n, but 0 on the root", lambda n: (n - 1) / n),
    "all_gather": Collective("every rank's shard, concatenated on every rank (ZeRO-3, SP)",
                             ring_all_gather, torch_all_gather, "", "(n-1)/n*S", lambda n: (n - 1) / n),
    "scatter": Collective("chunk r of the root's tensor to rank r", direct_scatter, torch_scatter,
                          "before", "(n-1)/n*S on the root, 0 elsewhere", lambda n: (n - 1) / n),
    "reduce_scatter": Collective("chunk r of the sum to rank r (ZeRO-2 gradients, SP)", ring_reduce_scatter,
                                 torch_reduce_scatter, "", "(n-1)/n*S", lambda n: (n - 1) / n),
    "all_to_all": Collective("chunk d of rank r's input to rank d, as its chunk r (MoE dispatch)",
                             pairwise_all_to_all, torch_all_to_all, "", "(n-1)/n*S", lambda n: (n - 1) / n),
    "barrier": Collective("no rank leaves before every rank has arrived", dissemination_barrier,
                          torch_barrier, "", "ceil(log2 n) tokens of 4 bytes", lambda n: 0),
}


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
    """The library's version, then the hand-written one on fresh buffers. Returns this rank's input, both
    outputs, the bytes COMM counted for the hand-written one and whether the outputs agree."""
    c = COLLECTIVES[op]
    inp, out = make_buffers(op, numel, group, device)
    before = inp.clone()
    c.library(out, inp, group)       # first: NCCL wants every rank of a group in the group's first p2p batch
    inp, mine = make_buffers(op, numel, group, device)
    COMM.reset()
    c.by_hand(mine, inp, group)
    same = torch.equal(mine, out) or (c.root_only == "after" and dist.get_rank(group) != 0)
    return before, out, mine, COMM.bytes_sent, same


def time_both(op, numel, group, device, reps=10, rounds=5):
    """Seconds per call [library, by hand]: alternating rounds of `reps` calls, median round, slowest rank."""
    c, times = COLLECTIVES[op], [[], []]
    inp, out = make_buffers(op, numel, group, device)
    for _ in range(rounds):
        for fn, t in zip((c.library, c.by_hand), times):
            fn(out, inp, group)      # warm-up (in-place ops keep summing: harmless for timing)
            comm_sync(device, group)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(out, inp, group)
            comm_sync(device, group)
            t.append((time.perf_counter() - t0) / reps)
    medians = torch.tensor([sorted(t)[rounds // 2] for t in times], device=device, dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    return medians.tolist()


def comm_sync(device, group):
    if device.type == "cuda":        # kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(device)
    dist.barrier(group=group)


def barrier_rows(group, device, delay_s=0.02):
    """Rank r arrives r * 20 ms late; a correct barrier lets nobody leave before the last one arrives."""
    r, row = dist.get_rank(group), []
    for name, fn in (("torch", torch_barrier), ("by hand", dissemination_barrier)):
        comm_sync(device, group)
        t0 = time.perf_counter()
        time.sleep(delay_s * r)
        fn(*make_buffers("barrier", 1, group, device), group)
        row.append(f"{name}: arrives +{delay_s * r * 1e3:.0f} ms, leaves +{(time.perf_counter() - t0) * 1e3:.0f} ms")
    return "   ".join(row)


def show(t, limit=12):
    values = " ".join(f"{v:g}" for v in t.view(-1)[:limit].tolist())
    return f"[{values}{' ...' if t.numel() > limit else ''}]"


def gathered(obj, group):
    """Every rank's obj, on rank 0 (None elsewhere): rank 0 prints, so the output comes in rank order."""
    objs = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, objs, dst=peer(group, 0), group=group)
    return objs


def walk_through(op, numel, group, device, time_numel):
    c, r = COLLECTIVES[op], dist.get_rank(group)
    before, _, mine, sent, same = run_both(op, numel, group, device)
    before_view = show(before) if c.root_only != "before" or r == 0 else "-"
    after_view = show(mine) if c.root_only != "after" or r == 0 else "-"
    row = barrier_rows(group, device) if op == "barrier" else f"{before_view:<26} -> {after_view}"
    rows, sent, same = gathered(row, group), gathered(sent, group), gathered(same, group)
    t_lib, t_hand = time_both(op, time_numel, group, device)
    if r == 0:
        print(f"\n== {op}: {c.what}")
        print("\n".join(f"  rank {s}: {row}" for s, row in enumerate(rows)))
        print(f"  bytes sent by hand: {' '.join(f'{b:g}' for b in sent)}   ({c.formula}, S = {4 * numel})")
        print(f"  by hand == torch.distributed: {all(same)}   at {time_numel * 4 / 2**20:g} MiB: "
              f"torch {t_lib * 1e6:.0f} us, by hand {t_hand * 1e6:.0f} us")


def parse_size(text):
    """'64M' -> bytes (K, M, G are powers of two)."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    if text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def sweep(sizes, group, device, reps):
    """nccl-tests' bandwidths: algbw = S / time, busbw = algbw * bus_factor(n), S = full tensor bytes."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r == 0:
        print(f"{'op':<15}{'bytes':>11}{'torch us':>10}{'algbw':>8}{'busbw':>8}{'hand us':>10}{'algbw':>8}"
              f"{'busbw':>8}   GB/s, {n} ranks, {device.type}")
    for size in sizes:
        numel = max(n, parse_size(size) // 4 // n * n)    # n divides it: the library's versions need no padding
        for op, c in list(COLLECTIVES.items())[:-1]:      # all but the barrier, which moves no data
            times = time_both(op, numel, group, device, reps=reps)
            cols = "".join(f"{t * 1e6:>10.0f}{4 * numel / t / 1e9:>8.2f}{4 * numel / t / 1e9 * c.bus_factor(n):>8.2f}"
                           for t in times)
            if r == 0:
                print(f"{op:<15}{4 * numel:>11}{cols}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=0, help="elements of the shown tensors (default: 2 per rank)")
    p.add_argument("--time_numel", type=int, default=2 ** 18, help="elements of the walk-through's timed tensor")
    p.add_argument("--size", nargs="+", help="bandwidth sweep over these sizes in bytes (K/M/G suffixes)")
    p.add_argument("--reps", type=int, default=10, help="calls per timed round in the sweep")
    p.add_argument("--device", default="auto", help="auto: cuda (NCCL) when a GPU is present, else cpu (gloo)")
    p.add_argument("--dist_timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    env = comm.init_distributed(args)
    if args.size:
        sweep(args.size, None, env.device, args.reps)
    else:
        for op in COLLECTIVES:
            walk_through(op, args.numel or 2 * env.world_size, None, env.device, args.time_numel)
    comm.destroy()


if __name__ == "__main__":
    main()
