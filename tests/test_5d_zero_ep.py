"""ZeRO with expert parallelism in train_5d: dense parameters sharded over dp x cp, each expert's over the ranks
holding it (edp). ZeRO-1 and ZeRO-2 with ep 2 reproduce train_single's MoE run (float64, real text across a
spike, clipping on, 1e-9 per step) and its router statistics, and a ZeRO-2 run with ep resumes as train_single.
ZeRO-3 with ep does too, an MoE block's experts gathered as a unit of their own, with ZeRO-3's bytes and plan.py's
model-state bytes."""
import pytest

from common.metrics import read_metrics
from distributed_helper import run_workers
from test_moe_layouts import MOE, _reference, _runs, assert_same_router
from train_helpers import assert_exact, curves, run_single, text_argv

CASES = {2: [dict(dp=2, ep=2, zero_stage=1), dict(dp=2, ep=2, zero_stage=2)],
         4: [dict(dp=2, tp=2, sp=True, ep=2, zero_stage=2), dict(dp=2, pp=2, ep=2, zero_stage=1),
             dict(dp=4, ep=2, zero_stage=1), dict(dp=4, ep=2, zero_stage=2)]}     # experts over 2 edp ranks


def test_zero_with_ep_is_train_single(text_data, tmp_path):
    ref = _reference(text_data, tmp_path, 2)
    for world, layouts in CASES.items():
        runs = [("train_5d", text_argv(text_data, str(tmp_path / f"{world}_{i}"), micro_batch_size=2, top_k=2, **MOE,
                                       **layout)) for i, layout in enumerate(layouts)]
        run_workers(_runs, world, args=(runs,), timeout=900)
        for i, layout in enumerate(layouts):
            assert_exact(curves(ref), curves(str(tmp_path / f"{world}_{i}")))
            assert_same_router(ref, str(tmp_path / f"{world}_{i}"))


def test_zero2_with_ep_resumes_as_train_single(text_data, tmp_path):
    out = str(tmp_path / "run")
    run_workers(_runs, 2, args=([("train_5d", text_argv(text_data, out, micro_batch_size=2, top_k=2, stop_step=10,
                                                         dp=2, ep=2, zero_stage=2, **MOE))],), timeout=900)
    run_single(text_argv(text_data, out, micro_batch_size=8, top_k=2, resume=True, **MOE))
    assert_exact(curves(_reference(text_data, tmp_path, 2)), curves(out))


def _zero3_runs(rank, world, argvs):
    """train_5d.main per argv in one process group; rank 0 returns, per run, every chunk's reductions as (ranks,
    padded values) and its model-state bytes."""
    import torch.distributed as dist
    import train_5d
    from common.metrics import model_state_bytes
    out = []
    for argv in argvs:
        result = train_5d.main(argv)
        axis = result["dp_axis"]
        buckets = [b for grads in axis.reductions() for b in grads.buckets]
        out.append(dict(units=[[(dist.get_world_size(g.group), sum(b.shard.padded for b in g.buckets)) for g in part]
                               for part in axis.grads_of],
                        states=model_state_bytes(result["chunks"], axis.shards, buckets)))
    return out if rank == 0 else None


def plan_states(layout):
    """plan.py's model-state bytes of pipeline rank 0 in float64 (twice its fp32 recipe): dense units over dp x cp,
    each MoE block's experts over edp."""
    from planner.inputs import Job, Layout
    from planner.memory import model_state
    from model import GPTConfig
    from test_5d import HEADS, H, T, VOCAB
    cfg = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=HEADS, n_embd=H, top_k=2, **MOE)
    sizes = {k: layout.get(k, 1) for k in ("dp", "tp", "cp", "pp", "ep")}
    job = Job(cfg, sizes["dp"] * sizes["tp"] * sizes["cp"] * sizes["pp"], 8, "h100", 8, precision="fp32")
    st = model_state(job, Layout(**sizes, schedule=layout.get("pp_schedule", "1f1b"), zero_stage=3), 0)[0]
    return dict(params=2 * st["params"], grads=2 * st["grads"], optim=2 * st["optimizer"])


ZERO3 = {2: [dict(dp=2, ep=2, reshard_after_forward=False)],
         4: [dict(dp=4, ep=2), dict(dp=2, tp=2, sp=True, ep=2), dict(dp=2, pp=2, ep=2, pp_schedule="zb1")]}


def test_zero3_with_ep_is_train_single(text_data, tmp_path):
    """ZeRO-3 with ep: each MoE block's experts a unit of their own over edp. train_single's losses, grad norms and
    router statistics; the dp axis sends each unit's all-gathers (before every F and B, or kept from F to B) and m
    reduce-scatters at (N-1)/N of its padded bytes, N its group's ranks (dp x cp, or edp for the experts); the
    model-state bytes are plan.py's."""
    from test_5d_zero3 import gathers_per_step
    ref = _reference(text_data, tmp_path, 2)
    for world, layouts in ZERO3.items():
        argvs = [text_argv(text_data, str(tmp_path / f"z3_{world}_{i}"), micro_batch_size=2, top_k=2, zero_stage=3,
                           **MOE, **layout) for i, layout in enumerate(layouts)]
        results = run_workers(_zero3_runs, world, args=(argvs,), timeout=900)[0]
        for i, (layout, result) in enumerate(zip(layouts, results)):
            out = str(tmp_path / f"z3_{world}_{i}")
            assert_exact(curves(ref), curves(out))
            assert_same_router(ref, out)
            m = 8 // (2 * layout["dp"])
            gathers = [gathers_per_step(layout.get("pp_schedule", "1f1b"), layout.get("pp", 1), m, 1, {c},
                                        layout.get("reshard_after_forward", True)) for c in range(len(result["units"]))]
            want = sum((g + m) * (n - 1) / n * 8 * padded
                       for g, part in zip(gathers, result["units"]) for n, padded in part)
            assert [n for part in result["units"] for n, _ in part] == [layout["dp"], layout["dp"] // 2]
            for row in read_metrics(out):
                assert row["comm_bytes_by_axis"]["dp"] == pytest.approx(want, rel=1e-12), (layout, row)
            assert result["states"] == plan_states(layout), layout
