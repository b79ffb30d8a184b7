"""pipeline_schedules.py without processes: each schedule is complete and deadlock-free, its simulated bubble
equals the textbook formula, its peak in-flight micro-batches equal theory, and every stage boundary carries
exactly m activations forward and m gradients back."""
from collections import Counter

import pytest

from pipeline_schedules import (Action, make_schedule, message_order, peak_in_flight, render, sends_of,
                                simulate, stage_of, theory_idle_fraction)


def configs(name):
    """(p, m, v) combinations the schedule accepts (train_pp.py rejects the others with an error)."""
    for p in range(1, 9):
        for m in range(1, 17):
            for v in ((2, 3, 4) if name == "interleaved" else (1,)):
                if name != "afab" and m < p or name == "interleaved" and m % p:
                    continue
                yield p, m, v


@pytest.mark.parametrize("name", ["afab", "1f1b", "interleaved", "zb1"])
def test_every_unit_of_work_once_in_dependency_order(name):
    for p, m, v in configs(name):
        scheds = make_schedule(name, p, m, v)
        for r, acts in enumerate(scheds):
            kinds = "FBW" if name == "zb1" else "FB"
            assert Counter(acts) == Counter(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))
            pos = {a: j for j, a in enumerate(acts)}
            for i in range(m):
                for c in range(v):
                    assert pos[Action("F", i, c)] < pos[Action("B", i, c)]
                    if name == "zb1":
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


@pytest.mark.parametrize("name", ["afab", "1f1b", "interleaved", "zb1"])
def test_each_boundary_carries_m_activations_and_m_gradients(name):
    for p, m, v in configs(name):
        scheds = make_schedule(name, p, m, v)
        msgs = Counter()
        for r, acts in enumerate(scheds):
            sent = [msg for a in acts for _, msg in sends_of(a, r, p, v)]
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
