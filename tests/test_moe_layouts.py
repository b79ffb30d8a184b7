"""A mixture of experts trains the same in every layout. With global-batch load balancing (routing.py, the
default) the objective does not depend on how the global batch is split, so train_single with one micro-batch
or four, train_ep, and train_5d with ep inside the grid (with dp, cp, tp + SP, pp) give the same losses, grad
norms and router statistics (float64 on real text, 1e-9 per step); with --aux_loss_scope micro they do not.
The ep axis of train_5d sends exactly what train_ep sends for the same tokens."""
import pytest

from distributed_helper import run_workers
from common.metrics import read_metrics
from train_helpers import assert_exact, curves, run_single, text_argv

MOE = dict(n_experts=8, moe_every=1)


def _runs(rank, world, runs):
    """(script, argv) runs in one process group."""
    import importlib
    for script, argv in runs:
        importlib.import_module(script).main(argv)


def _reference(text_data, tmp_path, top_k):
    out = str(tmp_path / f"single_top{top_k}")
    run_single(text_argv(text_data, out, micro_batch_size=8, top_k=top_k, **MOE))
    return out


def assert_same_router(ref_dir, out_dir):
    for a, b in zip(read_metrics(ref_dir), read_metrics(out_dir)):
        for key in ("tokens_per_expert_min", "tokens_per_expert_max", "dropped_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-9)


def test_splitting_the_batch_changes_nothing_with_global_balancing(text_data, tmp_path):
    ref = _reference(text_data, tmp_path, 2)
    for scope in ("global", "micro"):
        run_single(text_argv(text_data, str(tmp_path / scope), micro_batch_size=2, top_k=2, aux_loss_scope=scope,
                             **MOE))
    assert_exact(curves(ref), curves(str(tmp_path / "global")))
    assert_same_router(ref, str(tmp_path / "global"))
    micro, whole = curves(str(tmp_path / "micro"))[0], curves(ref)[0]
    assert max(abs(a - b) / b for a, b in zip(micro, whole)) > 1e-6, "per-micro-batch balancing is another objective"


CASES = {  # world: [(layout, top_k)]
    2: [(dict(dp=2, ep=2), 2), (dict(cp=2, ep=2), 1),
        (dict(tp=2, sp=True, zero_stage=1), 2),          # ep 1: whole experts on each TP rank, SP's token shards
        (dict(pp=2, recompute="full"), 1)],               # blocks recomputed in backward: routing counted once
    4: [(dict(tp=2, dp=2, ep=2, sp=True), 2), (dict(pp=2, dp=2, ep=2), 1), (dict(dp=4, ep=4), 2)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_train_5d_with_ep_is_train_single(text_data, tmp_path, world):
    runs = [("train_5d", text_argv(text_data, str(tmp_path / f"5d{i}"), micro_batch_size=2, top_k=k, **MOE,
                                   **layout)) for i, (layout, k) in enumerate(CASES[world])]
    if world == 2:     # train_ep on the same tokens: dp 2 x ep 2 in the grid is train_ep --ep 2
        runs.append(("train_ep", text_argv(text_data, str(tmp_path / "ep"), micro_batch_size=2, top_k=2, ep=2,
                                           **MOE)))
    run_workers(_runs, world, args=(runs,), timeout=900)
    refs = {k: _reference(text_data, tmp_path, k) for k in sorted({k for _, k in CASES[world]})}
    for i, (layout, k) in enumerate(CASES[world]):
        out = str(tmp_path / f"5d{i}")
        assert_exact(curves(refs[k]), curves(out))
        assert_same_router(refs[k], out)
    if world == 2:
        assert_exact(curves(refs[2]), curves(str(tmp_path / "ep")))
        for grid, ep in zip(read_metrics(str(tmp_path / "5d0")), read_metrics(str(tmp_path / "ep"))):
            sent = grid["comm_bytes_by_axis"]["ep"]
            assert sent > 0 and sent == ep["a2a_bytes"] + ep["counts_bytes"]


def test_resume_across_layouts_keeps_the_router_load(text_data, tmp_path):
    """The checkpoint carries each MoE block's load (the previous step's expert shares) with the weights: steps
    0-9 as train_5d (pp 2, ep 2), 10-19 as (tp 2 + SP, ep 2), 20-21 as train_single; the unbroken run's curve."""
    out = str(tmp_path / "run")
    for world, layout, stop in ((4, dict(pp=2, dp=2, ep=2), 10), (4, dict(tp=2, dp=2, ep=2, sp=True), 20)):
        argv = text_argv(text_data, out, micro_batch_size=2, top_k=2, stop_step=stop, resume=stop > 10, **MOE,
                         **layout)
        run_workers(_runs, world, args=([("train_5d", argv)],), timeout=900)
    run_single(text_argv(text_data, out, micro_batch_size=8, top_k=2, resume=True, **MOE))
    assert_exact(curves(_reference(text_data, tmp_path, 2)), curves(out))


@pytest.mark.parametrize("overrides,message", [
    (dict(dp=2, ep=4, n_experts=8), "--ep 4 must divide dp*cp = 2"),
    (dict(dp=2, ep=2, n_experts=3), "needs --n_experts > 0 and divisible by it"),
    (dict(dp=2, ep=2), "needs --n_experts > 0"),
    (dict(dp=2, ep=2, n_experts=4, moe_every=5), "--moe_every 5 > --n_layer: no MoE block"),
])
def test_bad_ep_layout_is_one_clear_error(tiny_data, tmp_path, monkeypatch, capsys, overrides, message):
    import train_5d
    from train_helpers import tiny_argv
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        train_5d.main(tiny_argv(tiny_data, str(tmp_path), **overrides))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
