"""--profile (profiling.py, driven by metrics.MetricsLogger) and bench/timeline.py: one Chrome trace per rank with
comm.py's collectives labelled, and the per-rank intervals the timeline draws, on 2-rank pp and cp runs."""
import json
import os
import sys

import pytest

from distributed_helper import run_workers
from train_helpers import run_single, tiny_argv

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import timeline  # noqa: E402

PROFILE = dict(max_steps=5, profile=2, micro_batch_size=2)     # steps 0, 1 warm-up; 2, 3 recorded


def trace_names(path):
    with open(path) as f:
        return [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def test_profile_writes_a_trace_of_the_recorded_steps(tmp_path, tiny_data, capsys):
    out = str(tmp_path / "single")
    run_single(tiny_argv(tiny_data, out, **PROFILE))
    names = trace_names(os.path.join(out, "trace_rank0.json"))
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any(n.startswith("Optimizer.step#") for n in names)
    assert "Self CPU time total" in capsys.readouterr().out          # the top-operators table
    rows, windows = timeline.timeline(out)
    assert list(rows) == [0] and not any(k in ("communication", "wait") for _, _, k in rows[0])


def test_profile_off_writes_nothing(tmp_path, tiny_data):
    out = str(tmp_path / "off")
    run_single(tiny_argv(tiny_data, out, max_steps=3))
    assert not [f for f in os.listdir(out) if f.startswith("trace_")]


def test_negative_profile_is_a_config_error(tmp_path, tiny_data, capsys):
    with pytest.raises(SystemExit) as e:
        run_single(tiny_argv(tiny_data, str(tmp_path / "bad"), profile=-1))
    assert e.value.code == 2 and "--profile must be >= 0" in capsys.readouterr().err


def _profiled_runs(rank, world_size, runs):
    import train_cp
    import train_pp
    for script, argv in runs:
        (train_pp if script == "pp" else train_cp).main(argv)


def check_timeline(out_dir, world):
    rows, windows = timeline.timeline(out_dir)
    assert sorted(rows) == list(range(world))                        # one row per rank
    for rank, intervals in rows.items():
        kinds = {k for _, _, k in intervals}
        assert {"communication", "wait", "compute", "backward", "optimizer"} <= kinds
        for (s0, e0, _), (s1, e1, _) in zip(intervals, intervals[1:]):
            assert s0 < e0 <= s1                                     # disjoint, in time order
        start, end = windows[rank]
        assert start <= intervals[0][0] and intervals[-1][1] <= end + 1e-6
    assert min(w[0] for w in windows.values()) == 0.0
    fractions = timeline.busy_fractions(rows, windows)
    assert all(0 < sum(f.values()) <= 1 + 1e-9 for f in fractions.values())
    png = timeline.main([out_dir])
    assert os.path.getsize(png) > 0


def test_pp_and_cp_traces_make_a_timeline(tmp_path, tiny_data):
    pp, cp = str(tmp_path / "pp"), str(tmp_path / "cp")
    runs = [("pp", tiny_argv(tiny_data, pp, pp=2, **PROFILE)), ("cp", tiny_argv(tiny_data, cp, cp=2, **PROFILE))]
    run_workers(_profiled_runs, 2, args=(runs,), timeout=600)
    for out in (pp, cp):
        names = trace_names(os.path.join(out, "trace_rank1.json"))
        assert any(n.startswith("comm:batch_isend_irecv [0, 1]") for n in names)   # p2p, labelled by comm.py
        assert any(n.startswith("comm:wait batch_isend_irecv") for n in names)     # and its wait
        assert any(n == "comm:all_reduce [0, 1]" for n in names)
        check_timeline(out, 2)
    # the pipeline runner's actions and the ring attention's steps are ranges of their own
    assert {"pp:F mb0 chunk0", "pp:B mb0 chunk0"} <= set(trace_names(os.path.join(pp, "trace_rank1.json")))
    assert {"cp:ring step 1", "cp:ring step 1 backward"} <= set(trace_names(os.path.join(cp, "trace_rank0.json")))


def _async_collective_labels(rank, world_size):
    from types import SimpleNamespace

    import torch
    from torch.profiler import profile

    from common import comm, distributed
    distributed.init_distributed(SimpleNamespace(device="cpu", dist_timeout=60.0))
    t = torch.ones(4)
    plain = comm.all_reduce(t, async_op=True)
    plain.wait()
    with profile() as prof:
        work = comm.all_reduce(t, async_op=True)
        work.wait()
        works = comm.batch_isend_irecv([comm.p2p_op("send", t, 1 - rank), comm.p2p_op("recv", torch.empty(4), 1 - rank)])
        for w in works:
            w.wait()
    names = {e.name for e in prof.events()}
    return type(plain).__name__, type(work).__name__, type(works[0]).__name__, sorted(n for n in names
                                                                                      if n.startswith("comm:"))


def test_comm_labels_only_while_profiling():
    for rank, (plain, labelled, p2p, names) in enumerate(run_workers(_async_collective_labels, 2)):
        assert plain != "LabelledWork" and labelled == p2p == "LabelledWork"     # off: torch's own Work, untouched
        peer = 1 - rank
        assert names == ["comm:all_reduce [0, 1]", f"comm:batch_isend_irecv [0, 1] -> [{peer}]",
                         "comm:wait all_reduce [0, 1]", f"comm:wait batch_isend_irecv [0, 1] -> [{peer}]"]
