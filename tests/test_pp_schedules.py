"""pipeline/schedules.py without processes: each schedule is complete and deadlock-free, its simulated bubble
equals the textbook formula, its peak in-flight micro-batches equal theory, and every stage boundary carries
exactly m activations forward and m gradients back. ZB-V and DualPipeV: the V placement, their orders equal
torch.distributed.pipelining's, their bubbles and peaks equal the papers' counts."""
from collections import Counter
from types import SimpleNamespace

import pytest

from pipeline.schedules import (SCHEDULES, SPLIT_BACKWARD, V_SHAPED, Action, message_order, peak_in_flight,
                                rank_of, render, sends_of, simulate, stage_of, theory_idle_fraction)
from train_pp import make_schedule


def configs(name):
    """(p, m, v) combinations the schedule accepts (train_pp.py rejects the others with an error)."""
    for p in range(1, 9):
        for m in range(1, 17):
            for v in ((2, 3, 4) if name == "interleaved" else (2,) if name in V_SHAPED else (1,)):
                if name not in ("afab", "zbv") and m < p or name == "interleaved" and m % p:
                    continue
                if name == "dualpipev" and m < 2 * p:
                    continue
                yield p, m, v


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_unit_of_work_once_in_dependency_order(name):
    for p, m, v in configs(name):
        scheds = make_schedule(name, p, m, v)
        for r, acts in enumerate(scheds):
            kinds = "FBW" if name in SPLIT_BACKWARD else "FB"
            assert Counter(acts) == Counter(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))
            pos = {a: j for j, a in enumerate(acts)}
            for i in range(m):
                for c in range(v):
                    assert pos[Action("F", i, c)] < pos[Action("B", i, c)]
                    if name in SPLIT_BACKWARD:
                        assert pos[Action("B", i, c)] < pos[Action("W", i, c)]
        simulate(scheds, p, v)          # raises if the ranks would wait on each other forever


@pytest.mark.parametrize("name", ["afab", "1f1b", "interleaved", "zb1"])
def test_idle_fraction_equals_theory(name):
    """F = B = W: (p-1)/(m+p-1) for afab and 1f1b, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) zb1; the same
    on every rank (each rank does the same work within the same makespan)."""
    for p, m, v in configs(name):
        sim = simulate(make_schedule(name, p, m, v), p, v)
        for idle in sim["idle"]:
            assert idle == (p - 1) * (1 if name == "zb1" else 3), (name, p, m, v)   # (p-1)(F+B-+W)
            assert idle / sim["makespan"] == pytest.approx(theory_idle_fraction(name, p, m, v), abs=1e-12)


@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (2, 3, 1), (1, 2, 2), (3, 1, 5)])
def test_bubble_in_time_units(f, b, w):
    """Absolute bubbles for unequal costs: 1f1b and afab (p-1)(F+B+W) per rank; interleaved with chunks of
    1/v the cost: v times smaller than 1f1b's; zb1 (p-1)(F+B-W) when F = B = W."""
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p + 1):
            for name in ("afab", "1f1b"):
                sim = simulate(make_schedule(name, p, m), p, f=f, b=b, w=w)
                assert sim["idle"] == [(p - 1) * (f + b + w)] * p
            if m % p == 0:
                for v in (2, 4):
                    whole = simulate(make_schedule("1f1b", p, m), p, f=v * f, b=v * b, w=v * w)
                    chunked = simulate(make_schedule("interleaved", p, m, v), p, v, f=f, b=b, w=w)
                    assert whole["idle"] == [v * i for i in chunked["idle"]]
                    assert whole["makespan"] - chunked["makespan"] == (p - 1) * (v - 1) * (f + b + w)
            zb = simulate(make_schedule("zb1", p, m), p, f=f, b=b, w=w)
            if f == b == w:
                assert zb["idle"] == [(p - 1) * (f + b - w)] * p
            assert zb["makespan"] < simulate(make_schedule("1f1b", p, m), p, f=f, b=b, w=w)["makespan"]


def test_message_latency():
    """Messages crossing ranks that arrive `latency` after their producer ends: AFAB's step grows by the 2(p-1)
    crossings of its fill and drain, (m+p-1)(F+B) + 2(p-1)L; 1F1B's steady state has no slack, so there every
    micro-batch waits for its messages too and the step grows more. Latency 0 is the default's free messages."""
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p):
            for lat in (0.5, 3):
                afab = simulate(make_schedule("afab", p, m), p, f=1, b=2, w=0, latency=lat)
                assert afab["makespan"] == (m + p - 1) * 3 + 2 * (p - 1) * lat, (p, m, lat)
                assert simulate(make_schedule("1f1b", p, m), p, f=1, b=2, w=0, latency=lat)["makespan"] > \
                    afab["makespan"], (p, m, lat)
            assert simulate(make_schedule("1f1b", p, m), p, latency=0) == simulate(make_schedule("1f1b", p, m), p)


def test_peak_in_flight_micro_batches():
    """afab holds all m; 1f1b p - rank (Korthikanti et al.); zb1 at most p on every rank (Qi et al.: the same
    peak as 1f1b), though its late weight gradients fill the later ranks up to it."""
    for p, m, _ in configs("1f1b"):
        assert simulate(make_schedule("afab", p, m), p)["peak_in_flight"] == [m] * p
        assert simulate(make_schedule("1f1b", p, m), p)["peak_in_flight"] == [p - r for r in range(p)]
        zb = simulate(make_schedule("zb1", p, m), p)["peak_in_flight"]
        assert max(zb) == p and zb[0] == p
    # interleaved: rank r holds its 2(p-r-1) + (v-1)p warm-up chunks plus one, each 1/v of a stage
    for p, m, v in configs("interleaved"):
        got = simulate(make_schedule("interleaved", p, m, v), p, v)["peak_in_flight"]
        assert got == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_boundary_carries_m_activations_and_m_gradients(name):
    """Round-robin: rank r sends m(2v - [r = 0] - [r = p-1]) messages; in a V, rank 0 (first and last stage)
    2m and every other rank 4m, rank p-1's to itself (stage p-1 -> p) included."""
    for p, m, v in configs(name):
        scheds = make_schedule(name, p, m, v)
        msgs, place = Counter(), scheds.placement
        for r, acts in enumerate(scheds):
            sent = [msg for a in acts for _, msg in sends_of(a, r, p, v, place)]
            if name in V_SHAPED:
                assert len(sent) == m * (2 if r == 0 else 4) if p > 1 else len(sent) == 2 * m
            else:
                assert len(sent) == m * (2 * v - (r == 0) - (r == p - 1)) if p > 1 else len(sent) == m * 2 * (v - 1)
            msgs.update((what, stage) for what, _, stage in sent)
        S = p * v
        assert msgs == Counter({**{("act", s): m for s in range(1, S)}, **{("grad", s): m for s in range(S - 1)}})


def test_message_order_follows_the_sender():
    """The receiver posts receives in this order; it must be the sender's order, e.g. interleaved p=2, where
    rank 0 sends activations (stages 0->1, 2->3) and gradients (2->1) to rank 1 intermixed."""
    scheds = make_schedule("interleaved", 2, 4, 2)
    order = message_order(scheds, 0, 1, 2, 2)
    expected = [msg for a in scheds[0] for d, msg in sends_of(a, 0, 2, 2) if d == 1]
    assert order == expected and len(order) == 4 * 3
    assert {what for what, _, _ in order} == {"act", "grad"}
    assert stage_of(1, 1, 2) == 3


def test_simulator_detects_a_deadlock():
    """A schedule whose last rank wants micro-batch 1 before 0 while rank 0 waits for 0's gradient."""
    scheds = make_schedule("1f1b", 2, 2)
    scheds[0] = [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)]
    scheds[1] = [Action("F", 1, 0), Action("B", 1, 0), Action("F", 0, 0), Action("B", 0, 0)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(scheds, 2)


def test_ascii_timeline():
    sim = simulate(make_schedule("1f1b", 2, 2), 2)
    assert render(sim) == ("rank 0: F0 F1 .  .  B0 B0 .  B1 B1\n"
                           "rank 1: .  F0 B0 B0 F1 B1 B1 .  . ")
    zb = render(simulate(make_schedule("zb1", 2, 2), 2)).splitlines()
    assert zb == ["rank 0: F0 F1 .  B0 W0 B1 W1", "rank 1: .  F0 B0 F1 B1 W0 W1"]
    assert "F1.1" in render(simulate(make_schedule("interleaved", 2, 2, 2), 2, 2), v=2)
    assert peak_in_flight(make_schedule("zb1", 2, 2)[1]) == 2
    # ZB-V: chunk 1 (stage 2p-1-r) turns around at the bottom of the V at once; the picture of the docstring
    zbv = render(simulate(make_schedule("zbv", 2, 4, 2), 2, 2), v=2).splitlines()
    assert zbv[0].startswith("rank 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3.0 B0.0 W0.0")
    assert zbv[1].startswith("rank 1: .    F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1")


def test_v_placement():
    """Rank r holds stages r and 2p-1-r: the first and the last stage on rank 0, stage p-1 -> p on rank p-1."""
    for p in range(1, 9):
        assert [[stage_of(r, c, p, "v") for c in (0, 1)] for r in range(p)] == [[r, 2 * p - 1 - r] for r in range(p)]
        assert all(rank_of(stage_of(r, c, p, "v"), p, "v") == r for r in range(p) for c in range(4))
        assert make_schedule("zbv", p, 2 * p, 2).placement == "v"
    assert make_schedule("interleaved", 4, 8, 2).placement == "loop" and stage_of(1, 1, 4) == 5
    with pytest.raises(ValueError, match="2 chunk"):
        make_schedule("dualpipev", 2, 4, 1)


def _torch_order(schedule_class, p, m, rank):
    """torch.distributed.pipelining's action list of `rank` in ours: I -> B, a full backward -> B W, an
    overlapped forward + backward -> its two halves."""
    from torch.distributed.pipelining import schedules as ts
    kinds = {ts.FORWARD: "F", ts.BACKWARD_INPUT: "B", ts.BACKWARD_WEIGHT: "W", ts.FULL_BACKWARD: "BW"}
    state = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    out = []

    def add(a):
        for sub in a.sub_actions if a.computation_type == ts.OVERLAP_F_B else [a]:
            out.extend(Action(k, sub.microbatch_index, int(sub.stage_index != rank))
                       for k in kinds[sub.computation_type])

    for a in schedule_class._calculate_single_rank_operations(state, rank):
        if a is not None:
            add(a)
    return out


@pytest.mark.parametrize("name, torch_name", [("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")])
def test_v_schedules_are_torchs_orders(name, torch_name):
    """The same action lists as torch.distributed.pipelining's ScheduleZBVZeroBubble (from the ZB authors'
    code) and ScheduleDualPipeV (from deepseek-ai/DualPipe), for every p <= 8 and m."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, torch_name, None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip(f"this torch has no {torch_name} action lists")
    for p, m, _ in configs(name):
        ours = make_schedule(name, p, m, 2)
        assert all(ours[r] == _torch_order(cls, p, m, r) for r in range(p)), (name, p, m)


def test_zbv_zero_bubble_and_1f1b_memory():
    """ZB-V (Qi et al. 2024, Sec. 6), F = B = W: every rank works without a gap from r*F on (zero bubble; the
    idle of one step is the parallelogram's skew, (p-1)F per rank), and holds 2p chunks = 1F1B's p
    micro-batches of its layers at peak, on every rank, for m >= 2p-1. Fewer micro-batches: idle
    max(p-1, 2(2p-1-m)), peak m + 1 on rank 0."""
    for p, m, v in configs("zbv"):
        sim = simulate(make_schedule("zbv", p, m, v), p, v)
        idle = max(p - 1, 2 * (2 * p - 1 - m))
        assert sim["idle"] == [idle] * p and sim["makespan"] == 6 * m + idle, (p, m)
        assert idle / sim["makespan"] == pytest.approx(theory_idle_fraction("zbv", p, m, 2), abs=1e-12)
        if m >= 2 * p - 1:
            for r, timeline in enumerate(sim["timeline"]):
                assert [(s, e) for s, e, _ in timeline] == [(r + i, r + i + 1) for i in range(6 * m)]
            assert sim["peak_in_flight"] == [2 * p] * p
        else:
            assert sim["peak_in_flight"][0] == m + 1


@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 3, 1), (3, 2, 2), (1, 3, 3)])
def test_dualpipev_bubble_and_memory(f, b, w):
    """DualPipeV (DeepSeek-V3 report, Table 2; DualPipe's README): bubble (PP/2-1)(F&B + B - 3W) with PP = 2p
    stages, B a full backward (b + w here), F&B a forward and a backward (f + b + w, one after the other on
    one stream); activations PP+1 = 2p+1 chunks per rank. Our messages leave the moment they exist, so the
    simulated idle is at most the formula, and (p-1)F with F = B = W."""
    for p, m, v in configs("dualpipev"):
        sim = simulate(make_schedule("dualpipev", p, m, v), p, v, f, b, w)
        formula = (p - 1) * ((f + b + w) + (b + w) - 3 * w)
        assert len(set(sim["idle"])) == 1 and sim["idle"][0] <= formula, (p, m, sim["idle"], formula)
        assert sim["makespan"] == 2 * m * (f + b + w) + sim["idle"][0]
        if f == b == w:
            assert sim["idle"] == [(p - 1) * f] * p
            assert sim["idle"][0] / sim["makespan"] == pytest.approx(theory_idle_fraction("dualpipev", p, m, 2))
        assert sim["peak_in_flight"] == [2 * p + 1] * p
