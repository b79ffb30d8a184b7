"""train_pp.py's point-to-point traffic is NCCL-safe: nccl_check.py catches known-bad orderings (hand-built, and
the launch order of the runner before comm_plan, which hung interleaved 1F1B), every schedule's comm_plan passes
for p = 2..8 and a range of V and m (replayed in pure python) and posts each receive as early as its round allows,
and real gloo runs of train_pp launch exactly the plan, recorded at the comm.py layer, and pass the checker with
their collectives and evaluation included."""
from collections import deque

import pytest

from distributed_helper import recorded_runs, run_workers
from common.nccl_check import check, first_ops, interleaving, replay
from pipeline.schedules import SCHEDULES, V_SHAPED, Exchange, comm_plan, message_order, recvs_of, sends_of
from train_pp import make_schedule
from train_helpers import tiny_argv

H, T = 32, 16                                   # tiny_argv's n_embd and block_size


def plan_launches(plans, nbytes=1, comm="world"):
    """The groups comm_plan has each rank launch, in nccl_check's format (pipeline rank = global rank)."""
    return [[[(kind, peer, nbytes, comm) for kind, peer, _ in item.ops] for item in plan
             if isinstance(item, Exchange)] for plan in plans]


def old_runner_launches(schedules, p, v):
    """The groups the runner launched before comm_plan: before each action, the previous action's sends in
    one batch with the receives this action needs (and whatever the sender sent before them)."""
    out = []
    for r in range(p):
        expected = {src: deque(message_order(schedules, src, r, p, v)) for src in range(p) if src != r}
        posted, pending, groups = set(), [], []
        for a in schedules[r] + [None]:               # None: the final flush of the last sends
            ops = [("send", dst, 1) for dst in pending]
            for src, msg in recvs_of(a, r, p, v) if a else []:
                while src != r and msg not in posted:
                    posted.add(expected[src].popleft())
                    ops.append(("recv", src, 1))
            if ops:
                groups.append(ops)
            pending = [dst for dst, _ in sends_of(a, r, p, v) if dst != r] if a else []
        out.append(groups)
    return out


def test_checker_rules_on_hand_built_launches():
    both_send_first = [[[("send", 1, 8)], [("recv", 1, 8)]], [[("send", 0, 8)], [("recv", 0, 8)]]]
    problems = check(both_send_first)
    assert len(problems) == 2 and all("deadlock" in p for p in problems)
    assert "rank 0 waits in group 0 on send #0 to 1 (rank 1 holds it in group 1, runs group 0)" in problems[0]
    assert check([[[("send", 1, 8), ("recv", 1, 8)]], [[("recv", 0, 8), ("send", 0, 8)]]]) == []   # batched
    assert check([[[("send", 1, 8)], [("recv", 1, 8)]], [[("recv", 0, 8)], [("send", 0, 8)]]]) == []  # ordered
    # NCCL may buffer small sends, but still sets each connection up on the host: there both sides block
    assert replay(both_send_first, eager_bytes=8) == []
    assert check(both_send_first, eager_bytes=8)[0].startswith("connection setup: deadlock: rank 0")
    assert first_ops([[[("send", 1, 8), ("send", 1, 8)], [("recv", 1, 8)]]]) == [[[("send", 1, 8)], [("recv", 1, 8)]]]
    # pairing in order: the k-th send meets the k-th receive, which must be as large; a lost message hangs
    assert "sends 8 bytes into a 4-byte receive" in check([[[("send", 1, 8)]], [[("recv", 0, 4)]]])[0]
    assert "has no partner on rank(s) [1]" in check([[[("send", 1, 8)]], []])[0]
    # collectives of two communicators started in opposite orders; and a rank skipping a world collective
    ab = [("coll", None, 4, (0, 1))], [("coll", None, 4, (0, 1, 2))]
    assert any("deadlock" in p for p in check([[ab[0], ab[1]], [ab[1], ab[0]], [ab[1]]]))
    assert check([[ab[0], ab[1]], [ab[0], ab[1]], [ab[1]]]) == []
    # rule 5: a buffered send and a collective two ranks share, in opposite orders: the replay passes, the order not
    buffered = [[[("send", 1, 4, (0, 1, 2))], ab[0]], [ab[0], [("recv", 0, 4, (0, 1, 2))]], []]
    assert replay(buffered, eager_bytes=8) == [] and interleaving(buffered)[0].startswith(
        "order: ranks 0 and 1 share send #0 to 1 and collective #0 on (0, 1)")
    assert "no partner on rank(s) [2]" in check([[[("coll", None, 4)]], [[("coll", None, 4)]], []])[0]


def test_checker_catches_the_old_interleaved_deadlock():
    """The issue's case (README's example, --pp 2 --pp_schedule interleaved --pp_virtual 2, 4 micro-batches):
    each rank waits in a group whose partner op the other rank posts only in its next group."""
    scheds = make_schedule("interleaved", 2, 4, 2)
    problems = check(old_runner_launches(scheds, 2, 2))
    assert [p.split(" waits")[0] for p in problems] == ["run: deadlock: rank 0", "run: deadlock: rank 1"]
    assert check(old_runner_launches(make_schedule("interleaved", 4, 8, 2), 4, 2))
    assert check(old_runner_launches(make_schedule("1f1b", 4, 8), 4, 1)) == []   # 1f1b was lucky
    assert check(plan_launches(comm_plan(scheds, 2, 2))) == []


def _configs(name):
    for p in range(2, 9):
        for v in (2, 3, 4) if name == "interleaved" else (2,) if name in V_SHAPED else (1,):
            for m in sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p}):
                if (name in ("afab", "zbv") or m >= p) and (name != "interleaved" or m % p == 0) \
                        and (name != "dualpipev" or m >= 2 * p):
                    yield p, v, m


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_nccl_safe(name):
    """comm_plan for every p in 2..8, V and m the flags allow: the actions are the schedule's, each pair's
    messages are received in the order they are sent, and the launches pass the checker."""
    for p, v, m in _configs(name):
        scheds = make_schedule(name, p, m, v)
        plans = comm_plan(scheds, p, v)
        for r in range(p):
            assert [a for a in plans[r] if not isinstance(a, Exchange)] == scheds[r]
            for src in range(p):
                got = [msg for item in plans[r] if isinstance(item, Exchange)
                       for kind, peer, msg in item.ops if kind == "recv" and peer == src]
                assert got == (message_order(scheds, src, r, p, v) if src != r else []), (name, p, v, m, r)
        assert check(plan_launches(plans)) == [], (name, p, v, m)
        for r in range(p):
            assert_batches_go_out_early(plans[r], r, p, v, scheds.placement)


def assert_batches_go_out_early(plan, rank, p, v, placement):
    """Each batch right after what it waits for: one holding a send after the action producing it (other batches
    between them at most), one of receives only after the rank's batch before it (or first in the step), so a
    receive is posted as early as the order of the rounds allows (gloo moves a message only once it is posted)."""
    for i, item in enumerate(plan):
        if not isinstance(item, Exchange):
            continue
        before = [x for x in plan[:i] if not isinstance(x, Exchange)]
        sent = [msg for kind, _, msg in item.ops if kind == "send"]
        if sent:
            produced = [msg for _, msg in sends_of(before[-1], rank, p, v, placement)]
            assert all(msg in produced for msg in sent), (rank, i, item, before[-1])
        else:
            assert i == 0 or isinstance(plan[i - 1], Exchange), (rank, i, item, plan[i - 1])


# (world, schedule, virtual, micro-batches, layers, eval_interval): the case that deadlocked, every schedule, m not a
# multiple of p, and one run per world evaluating (forward_only_loss's lone sends) after every step
RUNS = [(2, "afab", 1, 3, 2, 0), (2, "1f1b", 1, 2, 2, 1), (2, "zb1", 1, 4, 2, 0), (2, "interleaved", 2, 4, 4, 0),
        (2, "zbv", 2, 3, 4, 1), (2, "dualpipev", 2, 4, 4, 0),
        (4, "1f1b", 1, 8, 4, 1), (4, "zb1", 1, 4, 4, 0), (4, "interleaved", 2, 4, 8, 0), (4, "zbv", 2, 8, 8, 0),
        (4, "dualpipev", 2, 8, 8, 1)]


@pytest.mark.parametrize("world", [2, 4])
def test_recorded_gloo_runs_launch_the_plan_and_pass(world, tmp_path, tiny_data):
    steps, runs = 2, [r for r in RUNS if r[0] == world]
    argvs = [tiny_argv(tiny_data, str(tmp_path / f"{name}{v}"), pp=world, pp_schedule=name, pp_virtual=v,
                       n_microbatches=m, global_batch_size=2 * m, n_layer=layers, max_steps=steps,
                       eval_interval=ev, eval_iters=2) for _, name, v, m, layers, ev in runs]
    logs = run_workers(recorded_runs, world, args=("train_pp", argvs), timeout=300)
    for i, (_, name, v, m, _, ev) in enumerate(runs):
        launches = [logs[r][i] for r in range(world)]
        assert check(launches) == [], (name, v, m)
        if ev:                                   # evaluation's lone sends are not in the plan
            continue
        plan = plan_launches(comm_plan(make_schedule(name, world, m, v), world, v), 2 * T * H * 4,
                             tuple(range(world)))
        for r in range(world):
            p2p = [g for g in launches[r] if g[0][0] != "coll"]
            assert p2p == plan[r] * steps, (name, v, m, r)
