"""
nccl_check.py: would these launches deadlock under NCCL? gloo runs every send and recv on its own, so a CPU
test passes orderings that hang on GPUs; this replays what each rank launched under NCCL's rules instead.

    comm.LAUNCH_LOG = []                        # in every rank, before the run (comm.py records each launch)
    ...                                         # the run; then gather: launches[rank] = that rank's LAUNCH_LOG
    problems = nccl_check.check(launches)       # [] when safe; else which rank waits on what, and why

launches[rank] is the rank's groups in launch order; a group is a list of (kind, peer, nbytes[, comm]):
kind "send" / "recv" with the peer's global rank, or "coll" (peer None) for a collective; comm names the
communicator (comm.py: the group's global ranks; default "world"). The rules replayed:
1. Each batch_isend_irecv, lone send or recv, or collective is one group; a rank runs its groups one after
   another, in launch order. (Groups on different communicators may overlap on a GPU: that only helps.)
2. The k-th send from a to b on a communicator pairs with the k-th recv on b from a there, of the same size;
   the k-th collective of a communicator pairs with the k-th of each of its members.
3. A group ends when every op in it has met its partners in the partners' *running* groups. That is NCCL's
   contract; it may buffer a small message (the send ends alone, the recv once the send started): pass
   eager_bytes to replay that too. A safe run without buffering is safe with it.
4. The first op of each connection (a's first send to b with b's first receive from a; a communicator's first
   collective) is a blocking setup on the host when its group is launched, buffered or not: the first ops
   alone, in launch order, must pass 1-3 unbuffered. (Implied by 1-3 when eager_bytes is 0.)
5. Two ranks issue the operations they share (a collective of a communicator holding both, a message between them)
   in the same order, whatever communicators they are on: NCCL's rule for communicators used concurrently (a kernel
   waiting for its peers can hold the SMs another communicator's kernel needs): a DP bucket launched inside the
   pipeline schedule and the loss's all-reduce after it, on two dp peers. Rules 1-3 unbuffered imply it (a rank
   runs one group at a time, so a cycle through any number of ranks hangs there); checked apart, it names the two
   operations, and holds where buffering lets rules 1-3 pass.
"""
from collections import defaultdict


def _op(op):
    """(kind, peer, nbytes, comm): hand-written launches may leave out comm ("world")."""
    return tuple(op) + ("world",) * (4 - len(op))


def _keys(launches):
    """Name every op by what its partners share: ("p2p", comm, src, dst, k) or ("coll", comm, k)."""
    keyed, sizes = [], {}
    for r, groups in enumerate(launches):
        seen, mine = defaultdict(int), []
        for group in groups:
            keys = []
            for kind, peer, nbytes, comm in map(_op, group):
                k = seen[kind, peer, comm]
                seen[kind, peer, comm] += 1
                if kind == "coll":
                    key = ("coll", comm, k)
                else:
                    key = ("p2p", comm) + ((r, peer) if kind == "send" else (peer, r)) + (k,)
                keys.append(key)
                sizes.setdefault(key, {})[r] = nbytes
            mine.append(keys)
        keyed.append(mine)
    return keyed, sizes


def _members(key, n):
    if key[0] == "p2p":
        return {key[2], key[3]}
    return set(range(n)) if key[1] == "world" else set(key[1])


def _describe(key, rank):
    if key[0] == "coll":
        return f"collective #{key[2]} on {key[1]}"
    src, dst, k = key[2:]
    return f"send #{k} to {dst}" if rank == src else f"recv #{k} from {src}"


def _partners(rank, at, cur):
    """Where the partners of `rank`'s op stand: the group holding it, and the group each one runs."""
    text = ", ".join(f"rank {q} holds it in group {g}, runs group {cur[q]}" for q, g in at.items() if q != rank)
    return text or "no partner"


def replay(launches, what="run", eager_bytes=0):
    """Rules 1-3: run every rank's groups, an op ending when its partners' running groups hold it. Returns
    the problems: ops without a partner (or of another size) and, if stuck, who waits on whom."""
    n = len(launches)
    keyed, sizes = _keys(launches)
    where = defaultdict(dict)                   # key -> {rank: index of the group holding it}
    for r, groups in enumerate(keyed):
        for g, keys in enumerate(groups):
            for key in keys:
                where[key][r] = g
    problems = []
    for key, at in where.items():
        missing = _members(key, n) - set(at)
        if missing:
            problems.append(f"{what}: rank {min(at)}'s {_describe(key, min(at))} has no partner on rank(s) "
                            f"{sorted(missing)}")
        elif key[0] == "p2p" and len(set(sizes[key].values())) > 1:
            problems.append(f"{what}: {_describe(key, key[2])} sends {sizes[key][key[2]]} bytes into a "
                            f"{sizes[key][key[3]]}-byte receive")
    cur, done, progress = [0] * n, set(), True          # done: (key, rank) for each side that ended
    while progress:
        progress = False
        for r in range(n):
            while cur[r] < len(keyed[r]):
                for key in keyed[r][cur[r]]:
                    at = where[key]
                    if _members(key, n) != set(at):
                        continue
                    if key[0] == "p2p" and sizes[key][key[2]] <= eager_bytes:    # buffered
                        if r == key[2] or cur[key[2]] >= at[key[2]]:
                            done.add((key, r))
                    elif all(cur[q] == g for q, g in at.items()):
                        done.update((key, q) for q in at)
                if not all((key, r) in done for key in keyed[r][cur[r]]):
                    break
                cur[r] += 1
                progress = True
    for r in range(n):
        if cur[r] < len(keyed[r]):
            waits = [f"{_describe(key, r)} ({_partners(r, where[key], cur)})"
                     for key in keyed[r][cur[r]] if (key, r) not in done]
            problems.append(f"{what}: deadlock: rank {r} waits in group {cur[r]} on " + "; ".join(waits))
    return problems


def first_ops(launches):
    """Each rank's groups reduced to the first op of each connection and communicator (rule 4); group
    indices are kept (empty groups pass at once)."""
    out = []
    for groups in launches:
        seen, mine = set(), []
        for group in groups:
            firsts = []
            for op in group:
                kind, peer, _, comm = _op(op)
                if (kind, peer, comm) not in seen:
                    seen.add((kind, peer, comm))
                    firsts.append(op)
            mine.append(firsts)
        out.append(mine)
    return out


def interleaving(launches):
    """Rule 5: for each pair of ranks, the first pair of operations they share that one issues in the other order
    (by group index: ops in one group have no order)."""
    keyed, _ = _keys(launches)
    n, problems = len(launches), []
    index = [{key: g for g, keys in enumerate(groups) for key in keys} for groups in keyed]
    for a in range(n):
        for b in range(a + 1, n):
            shared = sorted(((g, index[b][key], key) for key, g in index[a].items()
                             if key in index[b] and {a, b} <= _members(key, n)), key=lambda t: t[:2])
            for (ga, gb, x), (ga2, gb2, y) in zip(shared, shared[1:]):
                if gb2 < gb:
                    problems.append(f"order: ranks {a} and {b} share {_describe(x, a)} and {_describe(y, a)}; "
                                    f"rank {a} issues them in this order (groups {ga}, {ga2}), rank {b} in the "
                                    f"other (groups {gb}, {gb2})")
                    break
    return problems


def check(launches, eager_bytes=0):
    """The problems NCCL would have with these launches (rules 1-3, then 4, then 5); [] when it would run through."""
    return (replay(launches, eager_bytes=eager_bytes) or replay(first_ops(launches), "connection setup")
            or interleaving(launches))
