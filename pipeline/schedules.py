"""
pipeline/schedules.py: the pipeline schedules beyond train_pp.py's AFAB and 1F1B (interleaved, zb1, zbv,
dualpipev) as plain action lists, what every schedule's ranks send each other (comm_plan), and a simulator that
replays the lists to count bubbles and in-flight micro-batches. Needs only the standard library.

    python bench/print_schedule.py --pp 4 --n_microbatches 8 --schedule zb1     # print the timeline

A schedule is, for every pipeline rank, the ordered list of what it does in one optimizer step:
Action(kind, mb, chunk) with kind F (forward), B (backward) or W (weight gradient). Schedules without W
actions do the whole backward in B; zb1 splits it into B (input gradient, on the critical path) and W
(weight gradient, which nothing downstream waits for, so it can fill the bubbles). train_pp.make_schedule
builds any of them by name.
With V chunks per rank the model is cut into p*V stages; stage_of says which: dealt out round-robin
(placement "loop", virtual stage s = chunk * p + rank: stage 0 on rank 0, stage p on rank 0 again, ...), or
in a V for zbv and dualpipev (below).
comm_plan turns the action lists into what each rank launches: its actions with batches of sends and
receives between them, ordered so that NCCL's one-group-at-a-time rule can never deadlock.

Idle fraction of a step with F = B = W: (p-1)/(m+p-1) for afab and 1f1b, (p-1)/(V*m+p-1) interleaved
(bubble / V); zb1's bubble is (p-1)(F+B-W), with at most p micro-batches in flight per rank like 1f1b.

zbv and dualpipev place 2 chunks per rank in a V (placement "v"): rank r holds stages r and 2p-1-r, so the
activations run down the ranks and back up, stage p-1 -> p stays on rank p-1, and the first and last stage
(embedding and LM head, tied) share rank 0. Costs below are per chunk (half a rank's layers).
- zbv, ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 6): split B/W; with
  F = B = W zero bubble and 1F1B's peak memory (p micro-batches of a rank's layers = 2p chunks) on every
  rank. One step simulated: each rank busy without a gap, rank r from r*F on, so the idle is the skew of that
  parallelogram, (p-1)F per rank (the paper removes it across steps by post-validating the optimizer step),
  for m >= 2p-1; fewer micro-batches leave the V's warm-up short: max(p-1, 2(2p-1-m)) F.
- dualpipev, DualPipeV (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.2.1 Table 2, in the V form
  ("cut-in-half") of deepseek-ai/DualPipe's README): bubble (PP/2-1)(F&B + B - 3W) with PP = 2p stages, B a
  full backward, F&B an overlapped forward + backward pair; activations PP+1 = 2p+1 chunks per rank; m >= 2p.
  Here a pair runs one after the other (F&B = F+B) and every message leaves the moment it exists (DualPipe's
  pair sends after both halves, a full backward after its weight part), so the simulated idle is at most the
  formula, and with F = B = W it is (p-1)F per rank, as for zbv.

    zbv, p=2, m=4 (F=B=W=1):                 idle per rank = p-1 = 1, peak 2p = 4 chunks
    rank 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3.0 B0.0 W0.0 ... W3.0 .
    rank 1: .    F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1 ... W3.0
"""
from collections import Counter, defaultdict, namedtuple

Action = namedtuple("Action", "kind mb chunk")
Exchange = namedtuple("Exchange", "ops")     # one batch of point-to-point ops: ((kind, peer rank, message), ...)
SCHEDULES = ("afab", "1f1b", "interleaved", "zb1", "zbv", "dualpipev")   # by name: train_pp.make_schedule
V_SHAPED = ("zbv", "dualpipev")                  # 2 chunks per rank, placed in a V (stage_of)
SPLIT_BACKWARD = ("zb1", "zbv", "dualpipev")     # with W actions: pipeline/weight_grads.py's deferred dW


class Schedule(list):
    """The action lists of all p ranks (schedule[rank]) and the placement of their stages on the ranks."""

    def __init__(self, lists, placement="loop"):
        super().__init__(lists)
        self.placement = placement


def placement_of(name):
    """How schedule `name` places its stages: "v" for the V-shaped ones, else round-robin "loop"."""
    return "v" if name in V_SHAPED else "loop"


def schedule_placement(schedules):
    return getattr(schedules, "placement", "loop")    # a plain list of action lists: round-robin


# ----------------------------------------------------------------------------------------------------------
# the generators beyond AFAB and 1F1B (train_pp.py): one ordered action list per rank

def interleaved(p, m, rank, v):
    """1F1B over V chunks per rank (Megatron's order): micro-batches go through a chunk in groups of p,
    forwards chunk 0 -> V-1, backwards V-1 -> 0. Needs m divisible by p."""
    total = m * v

    def unit(k, backward):
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    acts = [Action("F", *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        acts += [Action("F", *unit(warmup + k, False)), Action("B", *unit(k, True))]
    return acts + [Action("B", *unit(k, True)) for k in range(total - warmup, total)]


def zb_h1(p, m, rank):
    """ZB-H1 (Qi et al. 2023): 1F1B's order with the backward split in B and W, and rank r running each W
    r micro-batches late, after a later B. So the input gradients race down the pipeline at B per hop instead
    of B+W, the late Ws fill what was cool-down bubble, and a rank holds at most (p-r) + r = p micro-batches."""
    warmup = min(p - rank - 1, m)
    acts = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            acts.append(Action("F", warmup + i, 0))
        acts.append(Action("B", i, 0))
        if i - rank >= 0:
            acts.append(Action("W", i - rank, 0))
    return acts + [Action("W", i, 0) for i in range(max(m - rank, 0), m)]


class _Counted:
    """Builds a V schedule's list: add(kind, chunk) appends that chunk's next micro-batch of that kind."""

    def __init__(self):
        self.actions, self.next = [], Counter()

    def add(self, kind, chunk):
        self.actions.append(Action(kind, self.next[kind, chunk], chunk))
        self.next[kind, chunk] += 1
        return self.actions[-1]


def zb_v(p, m, rank):
    """ZB-V (Qi et al. 2024, Sec. 6): chunk 0 (stage rank) on the way down, chunk 1 (stage 2p-1-rank) on the
    way up. Warm-up: 2(p-rank)-1 forwards of chunk 0, then rank pairs F1 F0, then p-rank rounds of F1 B1 W1
    (the bottom of the V turns around at once); steady state F0 B0 W0 F1 B1 W1; cool-down: rank pairs B0 B1,
    then p-rank rounds of B0 W0 and the late Ws. Laid out for max(m, 2p-1) micro-batches, the ones past m
    dropped, so any m runs (with a larger bubble below 2p-1)."""
    n, s = max(m, 2 * p - 1), _Counted()
    for _ in range(2 * (p - rank) - 1):
        s.add("F", 0)
    for _ in range(rank):
        s.add("F", 1), s.add("F", 0)
    for _ in range(p - rank):
        s.add("F", 1), s.add("B", 1), s.add("W", 1)
    while s.next["F", 1] < s.next["F", 0] or s.next["F", 0] < n:
        if s.next["F", 0] < n:
            s.add("F", 0)
        s.add("B", 0), s.add("W", 0), s.add("F", 1), s.add("B", 1), s.add("W", 1)
    for _ in range(rank):
        s.add("B", 0), s.add("B", 1)
    for _ in range(p - rank):
        s.add("B", 0), s.add("W", 0)
    for chunk in (1, 0):
        while s.next["W", chunk] < n:
            s.add("W", chunk)
    return [a for a in s.actions if a.mb < m]


def dualpipe_v(p, m, rank):
    """DualPipeV (DeepSeek-V3's DualPipe cut in half; deepseek-ai/DualPipe's dualpipev.py), 8 phases:
    2(p-rank-1) F0; rank+1 pairs F0 F1; p-rank-1 rounds of split B1, its W, F1; the main phase of m-2p+rank+1
    rounds F0 & B1, F1 & B0 (a forward with another micro-batch's full backward, which DualPipe overlaps);
    p-rank-1 rounds of B1, F1 & B0; rank+1 pairs B1 B0 whose second half splits off W (from B1 on odd ranks,
    from B0 on even ones); p-rank-1 rounds of a late W and a split B0; the last rank+1 late Ws (oldest first).
    A full backward is B then its own W at once (the gradient leaves after B); a split one queues its W.
    Needs m >= 2p."""
    s, late = _Counted(), []

    def backward(chunk, split):
        b = s.add("B", chunk)
        if split:
            late.append(Action("W", b.mb, chunk))
        else:
            s.add("W", chunk)

    def late_w():
        s.actions.append(late.pop(0))
        s.next["W", s.actions[-1].chunk] += 1

    for _ in range(2 * (p - rank - 1)):
        s.add("F", 0)
    for _ in range(rank + 1):
        s.add("F", 0), s.add("F", 1)
    for _ in range(p - rank - 1):
        backward(1, True), late_w(), s.add("F", 1)
    for _ in range(m - 2 * p + rank + 1):
        s.add("F", 0), backward(1, False), s.add("F", 1), backward(0, False)
    for _ in range(p - rank - 1):
        backward(1, False), s.add("F", 1), backward(0, False)
    for i in range(rank + 1):
        split_from = i > (rank + 1) // 2 or i == (rank + 1) // 2 and rank % 2 == 1
        backward(1, split_from)
        backward(0, i >= (rank + 1) // 2)
    for _ in range(p - rank - 1):
        late_w(), backward(0, True)
    while late:
        late_w()
    return s.actions


# ----------------------------------------------------------------------------------------------------------
# who talks to whom: shared by the simulator and by train_pp.py's runner, which launches its sends and
# receives in the batches of comm_plan (NCCL-safe: both sides of a message in the same round)

def stage_of(rank, chunk, p, placement="loop"):
    """The stage that chunk `chunk` of `rank` holds. Chunk c covers stages c*p .. c*p+p-1 in both placements:
    "loop" deals them to ranks 0..p-1; "v" does so on even chunks and back p-1..0 on odd ones (the V)."""
    return chunk * p + (p - 1 - rank if placement == "v" and chunk % 2 else rank)


def rank_of(stage, p, placement="loop"):
    """The rank holding `stage` (its chunk there is stage // p)."""
    chunk, i = divmod(stage, p)
    return p - 1 - i if placement == "v" and chunk % 2 else i


def sends_of(action, rank, p, v, placement="loop"):
    """(dst_rank, message) sent after `action`: message = (what, mb, receiving stage)."""
    s, last = stage_of(rank, action.chunk, p, placement), p * v - 1
    if action.kind == "F" and s < last:
        return [(rank_of(s + 1, p, placement), ("act", action.mb, s + 1))]
    if action.kind == "B" and s > 0:
        return [(rank_of(s - 1, p, placement), ("grad", action.mb, s - 1))]
    return []


def recvs_of(action, rank, p, v, placement="loop"):
    """(src_rank, message) that `action` must receive before it can run."""
    s, last = stage_of(rank, action.chunk, p, placement), p * v - 1
    if action.kind == "F" and s > 0:
        return [(rank_of(s - 1, p, placement), ("act", action.mb, s))]
    if action.kind == "B" and s < last:
        return [(rank_of(s + 1, p, placement), ("grad", action.mb, s))]
    return []


def message_order(schedules, src, dst, p, v):
    """The messages rank src sends to rank dst in one step, in sending order."""
    place = schedule_placement(schedules)
    return [msg for a in schedules[src] for d, msg in sends_of(a, src, p, v, place) if d == dst]


def comm_plan(schedules, p, v):
    """Each rank's actions with the batches of point-to-point ops launched between them, NCCL-safe.

    NCCL runs each batch as one group, a rank's groups one after another, and a group ends only when each op
    has met its partner in the partner's running group (nccl_check.py). So every message gets a round: the
    simulated time its producer ends. The sender sends it, and the receiver posts its receive, in the batch
    of that round, and every rank launches its rounds in time order. The earliest unfinished round then runs on
    every rank that has it, holding both sides of all its messages, and ends: no group ever waits on one its
    partner has not reached. A rank sends at most one message per round, so each pair sees its messages in the
    same order.
    Where between the actions a batch goes does not change that order, only how early a receive is posted: each
    batch goes out as soon as it can, right after the action that produced its send, and a batch of receives
    only right after the rank's batch before it. Every action before a round's batch then ends by the round in
    the simulation and needs only earlier rounds, so every rank still reaches each round. gloo moves a message
    only once its receive is posted, so a receive posted just before the action that needs it would put the
    transfer on the critical path; posted early, it arrives while the rank computes (NCCL runs the groups in the
    same order wherever they are launched)."""
    sim, place = simulate(schedules, p, v), schedule_placement(schedules)
    rounds = [defaultdict(list) for _ in range(p)]      # rank -> round -> its ops
    ready = [{} for _ in range(p)]                       # rank -> round -> index of the action after its send
    for r, timeline in enumerate(sim["timeline"]):
        for i, (_, end, a) in enumerate(timeline):
            for dst, msg in sends_of(a, r, p, v, place):
                if dst != r:                             # a message to this rank's own next chunk: no p2p
                    rounds[r][end].append(("send", dst, msg))
                    rounds[dst][end].append(("recv", r, msg))
                    ready[r][end] = i + 1
    plans = []
    for r, timeline in enumerate(sim["timeline"]):
        before, at = defaultdict(list), 0                # action index -> the batches launched just before it
        for t, ops in sorted(rounds[r].items()):
            at = max(at, ready[r].get(t, 0))
            before[at].append(Exchange(tuple(ops)))
        plan = []
        for i, (_, _, a) in enumerate(timeline):
            plan += before[i] + [a]
        plans.append(plan + before[len(timeline)])
    return plans


# ----------------------------------------------------------------------------------------------------------
# the simulator

def simulate(schedules, p, v=1, f=1, b=1, w=1, latency=0):
    """Replay the action lists with costs F=f, B=b, W=w per chunk (a B with no W in the schedule costs b+w)
    and a message from another rank arriving `latency` after its producer ends (default: free, instant
    communication): each rank runs its list in order, an action starting as soon as the rank is free and what it
    receives has arrived. Returns a dict with per-rank `timeline` [(start, end, action)], `makespan`, `idle` per
    rank (and `idle_share`, idle / makespan) and `peak_in_flight` (micro-batch-chunks whose activations are
    held: forward done, weight gradient not yet). Measured costs give the bubble those costs leave (train_pp logs
    it per step, at its actions' median F, B and W); a latency, what every message crossing ranks adds."""
    split = any(a.kind == "W" for acts in schedules for a in acts)
    cost, place = dict(F=f, B=b if split else b + w, W=w), schedule_placement(schedules)
    done = {}                                   # (kind, mb, stage) -> end time
    free, pos = [0] * p, [0] * p
    timeline = [[] for _ in range(p)]
    remaining = sum(len(a) for a in schedules)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                a = schedules[r][pos[r]]
                s = stage_of(r, a.chunk, p, place)
                deps = [(("F", a.mb, s), 0)] if a.kind != "F" else []      # (what it waits for, its delay)
                deps += [(("B", a.mb, s), 0)] if a.kind == "W" else []
                deps += [((("F", m_, st - 1) if what == "act" else ("B", m_, st + 1)), latency if src != r else 0)
                         for src, (what, m_, st) in recvs_of(a, r, p, v, place)]
                if any(d not in done for d, _ in deps):
                    break
                start = max([free[r]] + [done[d] + delay for d, delay in deps])
                free[r] = done[(a.kind, a.mb, s)] = start + cost[a.kind]
                timeline[r].append((start, free[r], a))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedules[r][pos[r]] for r in range(p) if pos[r] < len(schedules[r])}
            raise RuntimeError(f"schedule deadlocks: ranks wait forever at {stuck}")
    makespan = max(free)
    busy = [sum(e - s for s, e, _ in tl) for tl in timeline]
    return dict(timeline=timeline, makespan=makespan, idle=[makespan - x for x in busy],
                idle_share=[1 - x / makespan for x in busy],
                peak_in_flight=[peak_in_flight(acts) for acts in schedules])


def peak_in_flight(actions):
    """Most micro-batch-chunks whose activations one rank holds at once (freed by B, or by W when split)."""
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    held = peak = 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == release)
        peak = max(peak, held)
    return peak


def theory_idle_fraction(name, p, m, v=1):
    """Textbook bubble / step time with F=B=W: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), zb1 a third
    of 1f1b's bubble: (p-1)(F+B-W) = (p-1) units in a step of 3m + (p-1); zbv and dualpipev (p-1) chunk
    units in a step of 6m + (p-1), zbv with m < 2p-1 2(2p-1-m) (the module docstring)."""
    if name in V_SHAPED:
        idle = max(p - 1, 2 * (2 * p - 1 - m)) if name == "zbv" else p - 1
        return idle / (6 * m + idle)
    if name == "zb1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / ((v if name == "interleaved" else 1) * m + p - 1)


def render(sim, v=1):
    """ASCII timeline: one row per rank, one cell per time unit, F3 = forward of micro-batch 3
    (F3.1: of chunk 1), '.' = idle. Costs must be integers."""
    cells = []
    for tl in sim["timeline"]:
        row = ["."] * sim["makespan"]
        for start, end, a in tl:
            for t in range(start, end):
                row[t] = f"{a.kind}{a.mb}" + (f".{a.chunk}" if v > 1 else "")
        cells.append(row)
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"rank {r}: " + " ".join(c.ljust(width) for c in row) for r, row in enumerate(cells))
