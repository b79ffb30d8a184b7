"""
collectives.py: every hand-written collective equals torch.distributed's at 2, 3 and 4 gloo ranks, on lengths
n divides and lengths it does not (some ranks even get empty chunks), also inside a subgroup; and it sends
exactly the bytes of the ring convention comm.py counts with.
"""
import contextlib
import io
import math
import time
from types import SimpleNamespace

import pytest

from distributed_helper import run_workers


def expected_bytes(op, S, n, rank, root=0):
    """Bytes `rank` sends in the hand-written op when n divides the tensor (S = full tensor bytes)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * S
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * S
    if op == "broadcast":                           # chain root -> root+1 -> ...: the last forwards nothing,
        return 0 if rank == (root - 1) % n else S   # so the mean is comm.broadcast's (n-1)/n*S
    if op == "reduce":
        return 0 if rank == root else S
    if op == "gather":
        return 0 if rank == root else S / n
    if op == "scatter":
        return (n - 1) / n * S if rank == root else 0
    assert op == "barrier"
    return 4 * math.ceil(math.log2(n))


def _init():
    from common import distributed
    return distributed.init_distributed(SimpleNamespace(device="cpu", dist_timeout=60))


def _all_collectives(rank, world_size, numels):
    """(group, op, numel, group size, group rank, equal to torch's, bytes sent) for every collective, on the
    world and, with 3+ ranks, on a subgroup without global rank 0 (so group ranks differ from global ones)."""
    import torch.distributed as dist
    import collectives
    _init()
    sub_ranks = list(range(1, world_size)) if world_size > 2 else list(range(world_size))
    sub = dist.new_group(sub_ranks)
    rows = []
    for name, group, members in (("world", None, range(world_size)), ("sub", sub, sub_ranks)):
        if rank not in members:
            continue
        for op in collectives.COLLECTIVES:
            for numel in numels:
                *_, sent, same = collectives.run_both(op, numel, group)
                rows.append((name, op, numel, dist.get_world_size(group), dist.get_rank(group), same, sent))
    dist.barrier()
    return rows


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_by_hand_equals_torch_and_counts_ring_bytes(world_size):
    n = world_size
    numels = [4 * n] + sorted({4 * n + 3, n - 1, 1})     # even; uneven; fewer elements than ranks
    results = run_workers(_all_collectives, world_size, args=(numels,), timeout=120)
    rows = [row for per_rank in results for row in per_rank]
    assert len(rows) == 9 * len(numels) * (n + (n - 1 if n > 2 else n))
    for _, op, numel, size, group_rank, same, sent in rows:
        assert same, (op, numel, size, group_rank)
        if numel % size == 0:
            assert sent == expected_bytes(op, 4 * numel, size, group_rank), (op, numel, size, group_rank)
    # uneven: per rank the bytes depend on which chunk it skips, but summed over the ranks the ring ops
    # still move (n-1) (or 2(n-1)) full tensors, and gather / scatter everything but the root's chunk
    import collectives
    for op in collectives.COLLECTIVES:
        for numel in numels[1:]:
            sent = [r[-1] for r in rows if r[:3] == ("world", op, numel)]
            S, root_chunk = 4 * numel, 4 * collectives.chunk_sizes(numel, n)[0]
            total = {"gather": S - root_chunk, "scatter": S - root_chunk}.get(
                op, sum(expected_bytes(op, S, n, r) for r in range(n)))
            assert sum(sent) == pytest.approx(total), (op, numel, sent)


def _barrier_holds(rank, world_size, delay_s):
    import torch
    import torch.distributed as dist
    import collectives
    _init()
    leaves = []
    for fn in (collectives.dissemination_barrier, collectives.COLLECTIVES["barrier"].torch):
        dist.barrier()
        t0 = time.perf_counter()
        time.sleep(delay_s * rank)                  # rank r arrives r * delay late
        fn(torch.zeros(1), torch.zeros(1), None)
        leaves.append(time.perf_counter() - t0)
    return leaves


def test_barrier_waits_for_the_last_rank():
    delay = 0.2                                     # rank 2 arrives 0.4 s late; a broken barrier lets rank 0
    for leaves in run_workers(_barrier_holds, 3, args=(delay,), timeout=120):   # go at once; allow skew
        assert min(leaves) >= 1.5 * delay, leaves


def _run_main(rank, world_size, argv):
    import collectives
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        collectives.main(argv)
    return out.getvalue()


def test_walk_through_and_sweep_print_every_collective():
    text = run_workers(_run_main, 2, args=(["--numel", "5"],), timeout=120)[0]
    assert text.count("by hand == torch.distributed: True") == 9
    assert "rank 1: [10, 11, 12, 13, 14]" in text and "-> [10, 12, 14, 16, 18]" in text   # all_reduce
    sweep = run_workers(_run_main, 2, args=(["--size", "0.00390625"],), timeout=120)[0]
    assert "busbw" in text and "busbw" in sweep and "== " not in sweep   # the walk-through ends with a 1 MiB sweep
    rows = [line.split() for line in sweep.strip().splitlines()[1:]]
    assert [r[0] for r in rows] == ["broadcast", "reduce", "all_reduce", "gather", "all_gather", "scatter",
                                    "reduce_scatter", "all_to_all"]
    for row in rows:                               # bytes, then (us, algbw, busbw) for torch and by hand
        assert int(row[1]) == 4096 and float(row[2]) > 0 and float(row[5]) > 0 and len(row) == 8


@pytest.mark.parametrize("argv, flag", [(["--numel", "-3"], "--numel"), (["--numel", "100000"], "--numel"),
                                        (["--size", "nan"], "--size"), (["--size", "0"], "--size"),
                                        (["--size", "1", "-2"], "--size"), (["--device", "tpu"], "--device"),
                                        (["--dist_timeout", "1e-9"], "--dist_timeout"),
                                        (["--dist_timeout", "inf"], "--dist_timeout")])
def test_bad_arguments_are_one_line_before_any_group(argv, flag, capsys):
    """Checked before the process group starts: one `error:` line naming the flag, exit code 2."""
    import collectives
    with pytest.raises(SystemExit) as e:
        collectives.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag}"), lines
