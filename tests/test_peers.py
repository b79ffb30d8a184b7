"""Every peer in bench/ (the other side of each ratio the README reports: bench/peer_*.py) runs two steps at the
smallest shape and writes its metrics rows, so a rename in the rungs it builds on cannot break it silently (two
once did: the TP+SP and PP ratios could not be reproduced). Timing is bench.sh's job; this only checks they run.

nanoGPT is not vendored (bench/peer_nanogpt.py drives a checkout of it): its case runs where NANOGPT_DIR names one.
"""
import glob
import json
import os
import sys

import pytest

from distributed_helper import exit_code_and_stderr, run_workers
from train_helpers import tiny_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")

PEERS = {  # case: (script, ranks, [flags of each run]); the runs of a case share one group of worker processes
    "torch_ddp": ("peer_torch_ddp", 2, [{}]),
    "fsdp2": ("peer_fsdp2", 2, [{}]),
    "fsdp2_tp": ("peer_fsdp2_tp", 4, [dict(dp=2, tp=2)]),
    "tp_dtensor": ("peer_tp_dtensor", 2, [dict(tp=2, grad_clip=0), dict(tp=2, sp=True, grad_clip=0)]),  # (no norm
    "torch_pipelining": ("peer_torch_pipelining", 2, [                                 # over DTensor shards)
        dict(pp=2, pp_schedule=schedule, pp_virtual=chunks, n_layer=2 * chunks, n_microbatches=4, global_batch_size=8)
        for schedule, chunks in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2))]),
    "nanogpt": ("peer_nanogpt", 1, [{}]),
}


def peer_runs(rank, world_size, script, argvs):
    """A worker: bench/`script`.main(argv) for each argv, as exit_code_and_stderr runs a rung."""
    sys.path.insert(0, BENCH)
    return [exit_code_and_stderr(rank, world_size, script, argv) for argv in argvs]


def test_every_peer_has_a_case():
    scripts = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(BENCH, "peer_*.py"))}
    assert scripts == {script for script, _, _ in PEERS.values()}


@pytest.mark.parametrize("case", sorted(PEERS))
def test_a_peer_runs_two_steps(case, tiny_data, tmp_path):
    script, ranks, runs = PEERS[case]
    if script == "peer_nanogpt":
        if not os.environ.get("NANOGPT_DIR"):
            pytest.skip("NANOGPT_DIR names no nanoGPT checkout (nanoGPT is not vendored)")
        runs = [dict(nanogpt_dir=os.environ["NANOGPT_DIR"])]
    small = dict(max_steps=2, warmup_steps=1, global_batch_size=4, micro_batch_size=2)
    argvs = [tiny_argv(tiny_data, str(tmp_path / str(i)), **{**small, **flags}) for i, flags in enumerate(runs)]
    results = run_workers(peer_runs, ranks, args=(script, argvs), timeout=300)
    for i, flags in enumerate(runs):
        assert [rank[i][0] for rank in results] == [0] * ranks, (flags, [rank[i] for rank in results])
        rows = [json.loads(line) for line in open(tmp_path / str(i) / "metrics.jsonl")]
        steps = [r for r in rows if "loss" in r]
        assert [r["step"] for r in steps] == [0, 1] and all(r["loss"] > 0 for r in steps), (flags, rows)
