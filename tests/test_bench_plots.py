"""bench/plot_run.py (curves of runs from metrics.jsonl, overlaid), the ratio chart bench/harness.py writes beside
each table, and bench/memory_chart.py's memory per rank against plan.py: the data each picture is drawn from, and
the PNG written."""
import json
import os
import shutil
import sys

import pytest

from distributed_helper import run_workers
from train_helpers import run_single, tiny_argv

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import harness  # noqa: E402
import memory_chart  # noqa: E402
import plot_run  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC


def test_plot_run_overlays_runs(tmp_path, tiny_data):
    single = str(tmp_path / "single")
    run_single(tiny_argv(tiny_data, single, max_steps=6, eval_interval=2, eval_iters=2))
    curves = plot_run.run_curves(single)
    assert curves["loss"][0] == list(range(6)) and len(curves["tokens_per_s"][1]) == 6
    assert curves["val_loss"][0] == [0, 2, 4, 5]                 # every eval_interval and the last step
    assert all(0 < v < 100 for v in curves["mfu"][1])            # percent

    # a second run as a resumed peer writes it: steps 3..4 logged twice (the later row wins), MFU unknown
    peer = str(tmp_path / "peer")
    shutil.copytree(single, peer)
    with open(os.path.join(peer, "metrics.jsonl"), "a") as f:
        for step in (3, 4):
            f.write(json.dumps(dict(step=step, loss=1.0 + step, tokens_per_s=10.0, mfu=None)) + "\n")
    peer_curves = plot_run.run_curves(peer)
    assert peer_curves["loss"][0] == list(range(6))
    assert peer_curves["loss"][1][3:5] == [4.0, 5.0]
    assert 3 not in peer_curves["mfu"][0] and 4 not in peer_curves["mfu"][0]

    out = str(tmp_path / "both.png")
    assert plot_run.main([single, peer, "--out", out, "--smooth", "3"]) == out and is_png(out)
    assert plot_run.main([single]) == os.path.join(single, "curves.png") and is_png(out)


def test_running_mean():
    assert plot_run.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot_run.running_mean([2.0, 4.0], 1) == [2.0, 4.0]


def test_labels_keep_runs_apart():
    assert plot_run.labels_for(["a/single", "b/5d"]) == ["single", "5d"]
    assert plot_run.labels_for(["a/run", "b/run"]) == ["a/run", "b/run"]


def test_harness_writes_the_ratio_chart(tmp_path):
    entries = [("torch DDP", "torch DDP", 1.0, 1.0, 1.0), ("ours", "torch DDP", 1.07, 0.98, 1.12),
               ("FSDP2", "FSDP2", 1.0, 1.0, 1.0), ("ZeRO-3", "FSDP2", 0.91, 0.88, 0.95)]
    path = str(tmp_path / "ddp.png")
    assert harness.write_chart(entries, path, "ddp") == path and is_png(path)


# ----------------------------------------------------------------------------------------------------------
# bench/memory_chart.py: counted memory per rank against plan.py

MEMORY_LAYOUTS = ["dp2 zero1", "tp2 sp", "pp2 1f1b"]


def _measure_memory(rank, world, labels, data_dir, out_root):
    return memory_chart.measure_layouts(labels, data_dir, out_root)


def test_memory_counted_equals_plan(tmp_path, tiny_data):
    """Model-state bytes per rank of live train_5d runs equal plan.py's to the byte (ZeRO-1 padding, TP shards,
    pipeline stages with the tied embedding on both ends); activations, the peak a step holds, within 2%."""
    measured = sum(run_workers(_measure_memory, 2, args=(MEMORY_LAYOUTS, tiny_data, str(tmp_path / "runs")),
                               timeout=300), [])
    rows = memory_chart.compare(measured)
    assert [(r["layout"], r["pp_rank"]) for r in rows] == [("dp2 zero1", 0), ("tp2 sp", 0), ("pp2 1f1b", 0),
                                                           ("pp2 1f1b", 1)]
    for r in rows:
        assert r["alike"]
        for part in ("params", "grads", "optimizer"):
            assert r["measured"][part] == r["predicted"][part] > 0, (r["layout"], part)
        assert r["measured"]["activations"] == pytest.approx(r["predicted"]["activations"], rel=0.02)
    first, last = rows[2:]
    assert first["measured"]["activations"] > last["measured"]["activations"]    # 1f1b: 2 in flight vs 1

    md = memory_chart.write_table(rows, str(tmp_path / "memory.md"))
    table = [line for line in open(md) if line.startswith("| ") and not line.startswith("| layout")]
    assert [line.split(" | ")[0][2:] for line in table] == [r["layout"] for r in rows]
    png = memory_chart.write_chart(rows, str(tmp_path / "memory.png"))
    assert is_png(png)
