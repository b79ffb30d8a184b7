"""ZeRO-3 (train_zero.py, train_5d.py) with the fused modules of kernels/apply.py and with torch.compile.

--kernels triton (interpreted, float64) with ZeRO-3 is train_single --kernels triton at 1e-9, at dp 2 and at
(dp 2, pp 2): the gather hooks work on FusedBlock (fused LayerNorms, bias+GeLU, flash attention) and on the fused
LM head, which computes the tied weight's gradient in its forward from the root unit gathered then; that gradient
lands with the embedding's and is reduce-scattered with it. Under zb1 and zbv the head's dW waits for W, which
computes the logits again: its unit stays gathered from B until that W (compose/kept_units.py).
--compile with ZeRO-3 compiles each block's forward inside the hooks (kernels/apply.compile_block): no graph
break, the same all-gathers, frees and reduce-scatters per step as the eager hooks make, and train_single's curve
in float64 at 1e-9 (the float64 contract's reference itself: inductor reorders float64 sums only, ~1e-16 here,
so train_single --compile has that curve too, and its first steps are the session's text_reference). Bytes per
step are ZeRO-3's formula (train_zero), or the unfused layout's (train_5d, whose formula tests/test_5d_zero3.py
asserts)."""
from distributed_helper import run_workers
from common.metrics import read_metrics
from train_pp import make_schedule
from train_helpers import MODELS, TRITON_TWO_STEPS, assert_exact, curves, text_argv


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
                        units=len(result["shards"] if "shards" in result else result["dp_axis"].shards),
                        breaks=sum(torch._dynamo.utils.counters["graph_break"].values()), **unit_uses(result)))
        torch._dynamo.reset()
    return out


def unit_uses(result):
    """train_5d's ZeRO-3: units each chunk gathers (a V's shared root unit in both), the chunks that gather the LM
    head's unit, this rank's pipeline rank."""
    if "dp_axis" not in result:
        return {}
    head = next((c.lm_head.weight for c in result["chunks"] if c.last), None)
    units_of = result["dp_axis"].units_of
    return dict(uses=sum(len(units) for units in units_of), pp_rank=result["grid"].coords["pp"],
                head_uses=[i for i, units in enumerate(units_of) if any(p is head for u in units for p in u.params)])


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


def head_gathers_saved(actions, head_uses):
    """All-gathers of the fused LM head's unit that a split backward saves in `actions` (a rank's schedule): the
    head's chunk keeps the unit from each B until that micro-batch's W, so an F or B of a chunk gathering it
    (`head_uses`: in a V both) finds it whole while a W is still to come."""
    held, saved = 0, 0
    for a in actions if head_uses else ():
        saved += a.kind in "FB" and a.chunk in head_uses and held > 0
        held += (a.chunk == max(head_uses)) * ((a.kind == "B") - (a.kind == "W"))
    return saved


def test_zero3_with_triton_kernels_under_pipeline(text_data, text_reference_triton, text_reference_for, tmp_path):
    """train_5d at (dp 2, pp 2), 1F1B: the last stage's fused LM head computes the tied weight's gradient from its
    own root unit, gathered for its forward; the curve is train_single --kernels triton's and the dp axis sends
    what the unfused layout sends. zb1, and zbv (4 blocks; train_single's first steps, which the float64 kernels
    match at 1e-15): the head's unit kept from B until its W recomputes the logits; every rank gathers each unit
    before each F and B it is not kept for and frees it as often (none left whole), and reduce-scatters each once
    a micro-batch."""
    dirs = {name: str(tmp_path / name) for name in ("fused", "plain", "zb1", "zbv")}
    layout = dict(dp=2, pp=2, zero_stage=3, **TRITON_TWO_STEPS)
    jobs = [("train_5d", text_argv(text_data, dirs["fused"], kernels="triton", **layout)),
            ("train_5d", text_argv(text_data, dirs["plain"], **layout)),
            ("train_5d", text_argv(text_data, dirs["zb1"], kernels="triton", pp_schedule="zb1", **layout)),
            ("train_5d", text_argv(text_data, dirs["zbv"], kernels="triton", pp_schedule="zbv", pp_virtual=2,
                                   **MODELS["L4"], **layout))]
    runs = run_workers(_runs, 4, args=(jobs,), timeout=900)
    kinds = set().union(*(rank[0]["kinds"] for rank in runs))
    assert {"FusedBlock", "FusedLayerNorm", "FlashAttentionCore", "FusedLMHead"} <= kinds, kinds
    assert_exact(text_reference_triton, curves(dirs["fused"]))
    assert_exact(text_reference_triton, curves(dirs["zb1"]))
    steps = TRITON_TWO_STEPS["max_steps"]        # warmup: their learning rates do not depend on max_steps
    assert_exact([c[:steps] for c in text_reference_for("L4")[0]], curves(dirs["zbv"]))
    fused, plain = ([r["comm_bytes_by_axis"]["dp"] for r in read_metrics(dirs[d])] for d in ("fused", "plain"))
    assert fused == plain and all(b > 0 for b in fused), (fused, plain)
    m = 8 // (2 * TRITON_TWO_STEPS["micro_batch_size"])
    for rank_runs in runs:
        for schedule, run in zip(("1f1b", "1f1b", "zb1", "zbv"), rank_runs):
            actions = make_schedule(schedule, 2, m, 2 if schedule == "zbv" else 1)[run["pp_rank"]]
            saved = head_gathers_saved(actions, run["head_uses"]) if schedule != "1f1b" else 0
            gathers = 2 * m * run["uses"] - saved
            want = dict(all_gather=gathers, free=gathers, reduce_scatter=m * run["units"])
            assert all({k: s[k] for k in want} == want for s in run["steps"]), (schedule, run, saved)
