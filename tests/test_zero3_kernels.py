"""ZeRO-3 (train_zero.py, train_5d.py) with the fused modules of kernels/apply.py and with torch.compile.

--kernels triton (interpreted, float64) with ZeRO-3 is train_single --kernels triton at 1e-9, at dp 2 and at
(dp 2, pp 2): the gather hooks work on FusedBlock (fused LayerNorms, bias+GeLU, flash attention) and on the fused
LM head, which computes the tied weight's gradient in its forward from the root unit gathered then; that gradient
lands with the embedding's and is reduce-scattered with it. --compile with ZeRO-3 compiles each block's forward
inside the hooks (kernels/apply.compile_block): no graph break, the same all-gathers, frees and reduce-scatters
per step as the eager hooks make, and train_single's curve in float64 at 1e-9 (the float64 contract's reference
itself: inductor reorders float64 sums only, ~1e-16 here, so train_single --compile has that curve too, and its
first steps are the session's text_reference). Bytes per step are ZeRO-3's formula (train_zero), or the unfused
layout's (train_5d, whose formula tests/test_5d_zero3.py asserts)."""
from distributed_helper import run_workers
from common.metrics import read_metrics
from train_helpers import TRITON_TWO_STEPS, assert_exact, curves, text_argv


def _runs(rank, world, jobs):
    """(script, argv) each; per run this rank returns, per step, the collectives it launched and the units it
    freed, the kinds of modules it ran, and the graph breaks torch.compile met."""
    import importlib
    import torch._dynamo
    import train_zero
    from common.comm import COMM
    from common.metrics import MetricsLogger
    frees, steps = [0], []
    free, log_step = train_zero.Shard.free, MetricsLogger.log_step

    def counted_free(shard):
        frees[0] += 1
        free(shard)

    def counted_log_step(logger, *args, **kwargs):      # the step is over: its counts, before the next reset
        steps.append(dict(COMM.calls, free=frees[0]))
        frees[0] = 0
        log_step(logger, *args, **kwargs)
    train_zero.Shard.free, MetricsLogger.log_step = counted_free, counted_log_step
    out = []
    for script, argv in jobs:
        steps.clear()
        torch._dynamo.utils.counters.clear()
        result = importlib.import_module(script).main(argv)
        model = result.get("model") or result.get("chunks")
        out.append(dict(steps=list(steps), kinds={type(m).__name__ for m in model.modules()},
                        units=len(result.get("shards") or []),
                        breaks=sum(torch._dynamo.utils.counters["graph_break"].values())))
        torch._dynamo.reset()
    return out


def _zero3_bytes(padded, dp, grad_acc, b=8):
    """train_zero's ZeRO-3 per step (its docstring): all-gather forward + backward and a reduce-scatter per
    micro-batch, (N-1)/N of the padded units each, + the squared gradient norm's all-reduce (float64 here)."""
    ring = (dp - 1) / dp
    return grad_acc * ring * padded * 3 * b + 2 * ring * b


def test_zero3_with_triton_kernels_and_compile(text_data, text_reference, text_reference_triton, tmp_path):
    """train_zero at dp 2: --kernels triton against train_single --kernels triton, --compile against train_single's
    first steps (module docstring); each step all-gathers every unit twice per micro-batch (forward, backward),
    frees it twice and reduce-scatters it once, with or without compile."""
    dirs = {name: str(tmp_path / name) for name in ("triton", "compile")}
    jobs = [("train_zero", text_argv(text_data, dirs["triton"], zero_stage=3, kernels="triton", **TRITON_TWO_STEPS)),
            ("train_zero", text_argv(text_data, dirs["compile"], zero_stage=3, compile=True, **TRITON_TWO_STEPS))]
    runs = run_workers(_runs, 2, args=(jobs,), timeout=900)[0]
    triton, compiled = runs
    assert {"FusedBlock", "FusedLayerNorm", "FlashAttentionCore", "FusedLMHead"} <= triton["kinds"], triton["kinds"]
    assert_exact(text_reference_triton, curves(dirs["triton"]))
    steps = TRITON_TWO_STEPS["max_steps"]        # warmup: their learning rates do not depend on max_steps
    assert_exact([c[:steps] for c in text_reference[0]], curves(dirs["compile"]))
    assert compiled["breaks"] == 0                      # the hooks are outside the compiled blocks
    grad_acc, units = 8 // (2 * TRITON_TWO_STEPS["micro_batch_size"]), triton["units"]
    want = dict(all_gather=2 * units * grad_acc, free=2 * units * grad_acc, reduce_scatter=units * grad_acc,
                all_reduce=1)
    for run, out_dir in zip(runs, (dirs["triton"], dirs["compile"])):
        assert run["units"] == 3 and run["steps"] == [want] * 2, run["steps"]
        for row in read_metrics(out_dir):
            assert row["comm_bytes"] == _zero3_bytes(row["padded_params"], 2, grad_acc), row


def test_zero3_with_triton_kernels_under_pipeline(text_data, text_reference_triton, tmp_path):
    """train_5d at (dp 2, pp 2), 1F1B: the last stage's fused LM head computes the tied weight's gradient from its
    own root unit, gathered for its forward; the curve is train_single --kernels triton's and the dp axis sends
    what the unfused layout sends."""
    dirs = {name: str(tmp_path / name) for name in ("fused", "plain")}
    layout = dict(dp=2, pp=2, zero_stage=3, **TRITON_TWO_STEPS)
    jobs = [("train_5d", text_argv(text_data, dirs["fused"], kernels="triton", **layout)),
            ("train_5d", text_argv(text_data, dirs["plain"], **layout))]
    runs = run_workers(_runs, 4, args=(jobs,), timeout=900)
    kinds = set().union(*(rank[0]["kinds"] for rank in runs))
    assert {"FusedBlock", "FusedLayerNorm", "FlashAttentionCore", "FusedLMHead"} <= kinds, kinds
    assert_exact(text_reference_triton, curves(dirs["fused"]))
    fused, plain = ([r["comm_bytes_by_axis"]["dp"] for r in read_metrics(dirs[d])] for d in ("fused", "plain"))
    assert fused == plain and all(b > 0 for b in fused), (fused, plain)
