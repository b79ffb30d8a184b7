"""What NCCL does differently from gloo, checked on CPU. Its failures (tests/nccl_abort.py): a collective that times
out returns with this rank's own value and the error surfaces at the next one; a checkpoint commit decided under
those rules never publishes a step that a stalled rank did not finish, and never prunes the good checkpoint before
it. Its launch order: --tp_overlap gets one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) before the GPU is set."""
import contextlib
import io
import os
import time

import pytest
import torch

from distributed_helper import run_workers

TIMEOUT_S = 1.0          # --dist_timeout of these runs: a rank stalls for STALL_S, past it
STALL_S = 2.5


def stand_in_semantics(rank, world_size):
    """Rank 1 enters the all-reduce late: rank 0's call returns with its own value, no raise; its next collective
    raises the aborted communicator's error naming the timeout. A gloo side group raises at once."""
    import nccl_abort
    nccl_abort.install()
    import torch.distributed as dist
    from datetime import timedelta
    from common.distributed import collective_failure, failure_kind
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    if rank == 1:
        time.sleep(STALL_S)
        return None
    x = torch.tensor([1.0])
    dist.all_reduce(x)                               # gloo would raise here
    try:
        dist.barrier()
        next_call = "returned"
    except RuntimeError as e:
        next_call = failure_kind(collective_failure(e))
    try:
        dist.all_reduce(torch.tensor([1.0]), group=side)
        side_call = "returned"
    except RuntimeError as e:
        side_call = failure_kind(collective_failure(e) or str(e))
    return x.item(), next_call, side_call


def test_the_stand_in_fails_as_nccl_does():
    own, next_call, side_call = run_workers(stand_in_semantics, 2, timeout=60)[0]
    assert own == 1.0                      # this rank's own value, where the sum would be 3
    assert next_call == "timed out"        # the abort surfaces at the next collective, with the watchdog's reason
    assert side_call != "returned"         # the gloo side group raises itself (its peer is gone or late)


def stand_in_p2p(rank, world_size):
    """Rank 1 never sends: rank 0's batched receive is launched and waited for without a raise, its buffer as it was;
    its next p2p call (a lone send) raises the aborted communicator's error."""
    import nccl_abort
    nccl_abort.install()
    import torch.distributed as dist
    from datetime import timedelta
    from common import comm
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    if rank == 1:
        time.sleep(STALL_S)
        return None
    buf = torch.tensor([7.0])
    for work in comm.batch_isend_irecv([comm.p2p_op("recv", buf, 1)]):
        work.wait()                                  # gloo would raise here
    try:
        comm.send(torch.tensor([1.0]), 1)
        next_call = "returned"
    except RuntimeError as e:
        next_call = str(e)
    return buf.item(), next_call


def test_the_stand_in_aborts_p2p_as_nccl_does():
    own, next_call = run_workers(stand_in_p2p, 2, timeout=60)[0]
    assert own == 7.0                                # the receive's buffer untouched: no error where it was waited
    assert "NCCL communicator was aborted" in next_call, next_call


def stalled_save(rank, world_size, out_dir):
    """Step 1 saved by both ranks; step 2's part write stalls on rank 1 past --dist_timeout. Returns (exit code,
    stderr) of this rank's second save."""
    import nccl_abort
    nccl_abort.install()
    from common import checkpoint
    from common.config import Config
    from common.distributed import init_distributed
    cfg = Config(out_dir=out_dir, keep_checkpoints=1, dist_timeout=TIMEOUT_S, device="cpu")
    init_distributed(cfg)

    def state(step):
        return dict(model={}, optimizer=dict(state={}), step=step) if rank == 0 else None

    def part(step):
        return dict(model={f"w{rank}": torch.full((4,), float(step))}, optimizer=dict(state={}))

    checkpoint.save_step(cfg, state(1), 1, part(1))
    write = checkpoint.write_file

    def slow_write(path, obj):
        time.sleep(STALL_S)
        write(path, obj)

    if rank == 1:
        checkpoint.write_file = slow_write
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            checkpoint.save_step(cfg, state(2), 2, part(2))
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def test_a_save_stalled_past_dist_timeout_never_moves_latest(tmp_path):
    """The commit waits for every part over a collective that raises: with NCCL's aborts, an all-reduce on the
    training communicator would return rank 0's own "no error", and rank 0 would publish step 2 without rank 1's
    part and prune step 1 (--keep_checkpoints 1): no complete checkpoint left."""
    from common.checkpoint import latest_checkpoint, load_checkpoint
    out = str(tmp_path / "run")
    (code0, err0), (code1, _) = run_workers(stalled_save, 2, args=(out,), timeout=60)
    assert code0 == 2 and code1 == 2
    assert err0.count("error:") == 1 and "--dist_timeout" in err0, err0
    latest = latest_checkpoint(out)
    assert os.path.basename(os.path.dirname(latest)) == "step_00000001"
    state = load_checkpoint(latest)                  # every part of it is there
    assert sorted(state["model"]) == ["w0", "w1"] and float(state["model"]["w1"][0]) == 1.0


def test_tp_overlap_sets_one_hardware_queue_before_the_device_is_picked(monkeypatch, capsys):
    """--tp_overlap needs kernels dispatched in launch order (CUDA_DEVICE_MAX_CONNECTIONS=1), set before the CUDA
    context exists (pick_device makes it); a user's value is kept, with a warning if it is not 1; other runs keep the
    driver's default."""
    from types import SimpleNamespace
    from common import distributed
    seen = []

    def pick_device(requested, local_rank, world_size=1):
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        return torch.device("cpu")

    monkeypatch.setattr(distributed, "pick_device", pick_device)
    for name in ("CUDA_DEVICE_MAX_CONNECTIONS", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")              # (so that monkeypatch restores what was there, or nothing)
        monkeypatch.delenv(name)
    cfg = SimpleNamespace(device="cpu", dist_timeout=10.0, tp_overlap=False)
    distributed.init_distributed(cfg, need_group=False)
    cfg.tp_overlap = True
    distributed.init_distributed(cfg, need_group=False)
    assert seen == [None, "1"]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    distributed.init_distributed(cfg, need_group=False)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and "CUDA_DEVICE_MAX_CONNECTIONS=8" in capsys.readouterr().err


@pytest.mark.parametrize("sizes, ep, made, trivial, names", [  # made (and of size 1) before sharing: 30 (8), 48 (0), 18 (16), 40 (16)
    (dict(tp=2, cp=1, dp=2, pp=2), 1, 22, 8, 5),   # dp_cp is dp (cp 1), the tied pairs are the pp groups (pp 2)
    (dict(tp=2, cp=2, dp=2, pp=2), 1, 40, 0, 6),
    (dict(tp=1, cp=1, dp=4, pp=1), 1, 5, 4, 2),    # tp, cp, pp and mp of one rank each: one group per rank
    (dict(tp=1, cp=1, dp=4, pp=2), 2, 26, 8, 6)])  # with experts: ep and edp carved out of dp
@pytest.mark.parametrize("bound", [False, True])
def test_each_layout_makes_one_communicator_per_distinct_group(monkeypatch, sizes, ep, made, trivial, names, bound):
    """The process groups the grid makes (each an NCCL communicator): one per distinct (axis, ranks) of several
    ranks, and one per rank for every group of one (which sends no bytes). With the default group bound to a GPU
    (NCCL) each name's groups come from one split_group call, and every rank's one-rank group from one more: `names`
    world-wide splits in all, never one per group; on gloo one new_group per group (docs/nccl.md)."""
    import math
    from types import SimpleNamespace
    from common import grid as G
    calls, caller = [], [0]

    def new_group(ranks, timeout_s=None):
        calls.append([tuple(ranks)])
        return object()

    def split_group(split_ranks, timeout=None):       # each rank's own group of the split, None where it is in none
        calls.append([tuple(r) for r in split_ranks])
        return object() if any(caller[0] in r for r in split_ranks) else None

    monkeypatch.setattr(G, "new_group", new_group)
    monkeypatch.setattr(G.dist, "split_group", split_group)
    monkeypatch.setattr(G.dist, "group", SimpleNamespace(WORLD=SimpleNamespace(bound_device_id="cuda:0" if bound else None)))
    world = math.prod(sizes.values())
    grids = []
    for rank in range(world):
        caller[0] = rank
        grids.append(G.build_grid(sizes, rank, 10, ep))
    per_rank = names if bound else made
    assert len(calls) == world * per_rank and all(g.communicators == made and g.creations == names for g in grids)
    made_groups = [r for call in calls[:per_rank] for r in call]
    assert len(made_groups) == made and sum(len(r) == 1 for r in made_groups) == trivial
    for call in calls[:per_rank]:                     # a split's groups are disjoint (split_group's rule)
        assert len({r for ranks in call for r in ranks}) == sum(map(len, call))
    for rank, g in enumerate(grids):                  # each name's group holds exactly its members, this rank among them
        for name, lists in g.members.items():
            mine = [r for r in lists if rank in r]
            assert (getattr(g.groups, name) is None) == (not mine)
    assert grids[0].groups.dp_cp is grids[0].groups.dp if sizes["cp"] == 1 else grids[0].groups.dp_cp is not grids[0].groups.dp


def test_two_communicators_interleave_in_the_same_order_on_every_rank(tiny_data, tmp_path):
    """NCCL's rule for communicators in use together (nccl_check rule 5), on a real train_5d pattern: dp 2 x pp 2
    interleaved, where the DP buckets of a chunk are launched by the schedule as its last backward ends, between the
    p2p of the other chunk on the PP communicator. The recorded launches hold that pattern, and every pair of ranks issues what it shares in one
    order; the same launches with rank 1's last dp all-reduce issued after the loss's are named (a bucket
    moved past its next p2p group is not: a global order still exists, and the replay agrees)."""
    from common.nccl_check import check, interleaving, replay
    from distributed_helper import recorded_runs
    from train_helpers import tiny_argv
    argv = tiny_argv(tiny_data, str(tmp_path / "run"), dp=2, pp=2, pp_schedule="interleaved",
                     pp_virtual=2, n_layer=4, global_batch_size=16, micro_batch_size=2, max_steps=1, bucket_mb=0.001)
    launches = [log[0] for log in run_workers(recorded_runs, 4, args=("train_5d", [argv]), timeout=300)]
    assert check(launches) == []
    dp_ranks = ((0, 1), (2, 3))                      # stage 0's dp group, stage 1's
    for r, groups in enumerate(launches):            # a dp all-reduce with pp p2p on both sides of it
        kinds = [("dp" if g[0][3] in dp_ranks else "coll") if g[0][0] == "coll" else "p2p" for g in groups]
        inside = [i for i in range(1, len(kinds) - 1) if kinds[i] == "dp" and "p2p" in kinds[:i] and "p2p" in kinds[i + 1:]]
        assert inside, (r, kinds)
    world = [i for i, g in enumerate(launches[1]) if g[0][0] == "coll" and g[0][3] == (0, 1, 2, 3)][0]
    last = max(i for i, g in enumerate(launches[1][:world]) if g[0][3] == dp_ranks[0])
    moved = [list(groups) for groups in launches]     # rank 1: its last dp all-reduce after the loss's
    moved[1].insert(world, moved[1].pop(last))
    problems = interleaving(moved)
    assert len(problems) == 1 and problems[0].startswith("order: ranks 0 and 1 share collective #"), problems
    assert "on (0, 1) and collective #" in problems[0] and "on (0, 1, 2, 3)" in problems[0]
    assert any("deadlock" in p for p in check(moved))
