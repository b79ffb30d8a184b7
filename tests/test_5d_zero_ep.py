"""ZeRO with expert parallelism in train_5d: dense parameters sharded over dp x cp, each expert's over the ranks
holding it (edp). ZeRO-1 and ZeRO-2 with ep 2 reproduce train_single's MoE run (float64, real text across a
spike, clipping on, 1e-9 per step) and its router statistics, and a ZeRO-2 run with ep resumes as train_single."""
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
