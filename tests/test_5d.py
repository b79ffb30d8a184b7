"""train_5d.py: every axis alone and in combination reproduces train_single.py in float64 at 1e-9 per step (loss
and grad norm) on real text across a gradient spike, clipping on; bytes per axis equal each rung's formula;
with every degree 1 it is train_single bit for bit in fp32; bad layouts are one clear error."""
import json

import pytest

from distributed_helper import recorded_runs, run_workers
from common.metrics import read_metrics
from train_helpers import MODELS, TRITON_TWO_STEPS, assert_exact, curves, losses, run_single, text_argv, tiny_argv

H, T, HEADS, VOCAB = 32, 32, 4, 256        # the exactness checks' model (train_helpers.SPIKY, MODELS["L2"])


def _runs(rank, world, argvs):
    """train_5d.main for each argv in one process group; rank 0 returns its parameter count per run."""
    import train_5d
    from pipeline.tied import tied_weight
    out = []
    for argv in argvs:
        result = train_5d.main(argv)
        shards = result["dp_axis"].shards
        sp_slices = [g.numel() for p, g in result["dp_axis"].my_slices()
                     if getattr(p, "sequence_parallel", False)] if shards else []
        tied = [s.padded for s in shards if s.params[0] is tied_weight(result["chunks"])] if shards else []
        out.append(dict(n_params=sum(p.numel() for p in result["chunks"].parameters()),
                        n_padded=sum(s.padded for s in shards) if shards else None, sizes=result["grid"].sizes,
                        n_sp_shard=sum(sp_slices) if shards else 0, tied_padded=sum(tied)))
    return out if rank == 0 else None


def ar(n):
    return 2 * (n - 1) / n        # all-reduce: bytes sent per byte of the tensor (comm.py's ring convention)


def part(n):
    return (n - 1) / n            # all-gather, reduce-scatter


def expected_bytes_by_axis(dp=1, tp=1, cp=1, pp=1, sp=False, micro=2, n_layer=2, v=1, cp_layout="zigzag",
                           n_params=0, n_padded=None, zero_stage=0, n_sp_shard=0, tied_padded=0, value_bytes=8,
                           v_shaped=False, gathers=0):
    """Bytes global rank 0 (first stage; tp, cp, dp index 0) sends in one step, per axis: each rung's formula
    (tests/test_tp.py, test_cp.py, test_pp.py, test_ddp.py) with the composed step's sizes."""
    m, t_local, layers = 8 // (micro * dp), T // cp, n_layer // pp      # rank 0 holds n_layer / pp blocks
    first, last = True, pp == 1 or v_shaped      # in a V, pipeline rank 0 holds the first and the last stage
    S, N = micro * t_local * H * value_bytes, micro * t_local           # one activation, tokens per micro-batch
    if not sp:   # train_tp: 4 all-reduces per block; embedding output; LM-head input grad; 3 for the loss
        tp_micro = (4 * layers + first + last) * ar(tp) * S
    else:        # block 10 gathers / scatters; embedding 2; head 3
        tp_micro = (10 * layers + 2 * first + 3 * last) * part(tp) * S
    tp_micro += last * 3 * ar(tp) * N * value_bytes
    sp_grads = n_sp_shard if zero_stage >= 2 else 6 * H * layers + 2 * H * last   # ZeRO-2/3: my shards' part
    tp_step = m * tp_micro + (ar(tp) * value_bytes * sp_grads if sp else 0)
    kv = 2 * micro * t_local * (H // tp) * value_bytes                  # train_cp: this rank's K and V
    ring = (cp - 1) * 2 * kv + (cp if cp_layout != "allgather" else cp - 1) * kv
    cp_step = m * layers * ring if cp > 1 else 0
    act = micro * (t_local // (tp if sp else 1)) * H * value_bytes      # train_pp: one message
    pp_step = 0
    if pp > 1 and v_shaped:   # rank 0: stage 0's output forward, stage 2p-1's input gradient back; one tied copy
        pp_step = m * act * 2
    elif pp > 1:  # the first rank sends 2V - 1 messages per micro-batch; the tied weight's two copies all-reduce
        tied = tied_padded // (dp * cp) if zero_stage >= 2 else (VOCAB // tp) * H   # ZeRO-2/3: my shard of it
        pp_step = m * act * (2 * v - 1) + tied * value_bytes * ar(2)
    if n_padded is not None:      # train_zero: reduce-scatters (ZeRO-2/3: one per micro-batch) + all-gathers of
        scatters = m if zero_stage >= 2 else 1        # the padded buckets (ZeRO-3: `gathers` per unit, the
        dp_step = (scatters + (gathers if zero_stage == 3 else 1)) * part(dp * cp) * value_bytes * n_padded
        return dict(dp=dp_step, tp=tp_step, cp=cp_step, pp=pp_step,   # schedule's count); the norm's scalar
                    mp=ar(dp * tp * cp * pp) * value_bytes)           # over all ranks
    return dict(dp=ar(dp * cp) * value_bytes * n_params, tp=tp_step, cp=cp_step, pp=pp_step,
                mp=ar(tp * pp) * value_bytes)


CASES = {
    2: [("L2", dict(dp=2)), ("L2", dict(tp=2, sp=True)), ("L2", dict(cp=2, micro_batch_size=4)),
        ("L2", dict(pp=2)), ("L2", dict(tp=2))],
    4: [("L2", dict(dp=2, tp=2)), ("L2", dict(tp=2, pp=2, sp=True)), ("L2", dict(tp=2, cp=2, sp=True)),
        ("L2", dict(cp=2, pp=2)), ("L2", dict(dp=2, cp=2, cp_layout="ring")), ("L2", dict(dp=2, pp=2)),
        ("L4", dict(pp=2, tp=2, pp_schedule="interleaved", pp_virtual=2)),
        ("L4", dict(pp=2, cp=2, pp_schedule="zb1", cp_layout="allgather")),
        ("L2", dict(dp=2, tp=2, sp=True, zero_stage=1)), ("L2", dict(dp=2, pp=2, zero_stage=1)),
        ("L2", dict(dp=2, cp=2, zero_stage=1)), ("L2", dict(dp=2, tp=2, sp=True, zero_stage=2)),
        ("L4", dict(dp=2, pp=2, pp_schedule="zbv", pp_virtual=2, zero_stage=1)),
        ("L4", dict(cp=2, pp=2, pp_schedule="dualpipev", pp_virtual=2)),
        ("L2", dict(dp=2, pp=2, zero_stage=2)), ("L2", dict(dp=2, cp=2, zero_stage=2)),
        ("L4", dict(dp=2, pp=2, pp_schedule="interleaved", pp_virtual=2, zero_stage=2)),
        ("L4", dict(tp=2, pp=2, sp=True, pp_schedule="zb1")), ("L4", dict(tp=2, pp=2, pp_schedule="zbv", pp_virtual=2)),
        ("L4", dict(tp=2, pp=2, sp=True, pp_schedule="dualpipev", pp_virtual=2)),
        ("L4", dict(dp=2, pp=2, pp_schedule="zb1", zero_stage=2)),
        ("L4", dict(dp=2, pp=2, pp_schedule="zbv", pp_virtual=2, zero_stage=2)),
        ("L4", dict(cp=2, pp=2, pp_schedule="dualpipev", pp_virtual=2, zero_stage=2))],
    8: [("L2", dict(dp=2, tp=2, pp=2, sp=True)), ("L2", dict(tp=2, cp=2, pp=2)), ("L2", dict(dp=2, tp=2, cp=2))],
    16: [("L2", dict(dp=2, tp=2, cp=2, pp=2, sp=True))],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_float64_parity_and_bytes_per_axis(text_reference_for, text_data, tmp_path, world):
    cases = [(model, {"micro_batch_size": 2, **opts}) for model, opts in CASES[world]]
    argvs = [text_argv(text_data, str(tmp_path / f"run{i}"), **MODELS[model], **opts)
             for i, (model, opts) in enumerate(cases)]
    results = run_workers(_runs, world, args=(argvs,), timeout=900)[0]
    for i, ((model, opts), result) in enumerate(zip(cases, results)):
        out = str(tmp_path / f"run{i}")
        assert_exact(text_reference_for(model)[0], curves(out))
        sizes = {k: opts.get(k, 1) for k in ("dp", "tp", "cp", "pp")}
        sizes["dp"] = world // (sizes["tp"] * sizes["cp"] * sizes["pp"])
        assert result["sizes"] == sizes
        want = expected_bytes_by_axis(micro=opts["micro_batch_size"], n_layer=MODELS[model].get("n_layer", 2),
                                      v=opts.get("pp_virtual", 1), sp=opts.get("sp", False),
                                      cp_layout=opts.get("cp_layout", "zigzag"), n_params=result["n_params"],
                                      n_padded=result["n_padded"], zero_stage=opts.get("zero_stage", 0),
                                      n_sp_shard=result["n_sp_shard"], tied_padded=result["tied_padded"],
                                      v_shaped=opts.get("pp_schedule") in ("zbv", "dualpipev"), **sizes)
        for row in read_metrics(out):
            got = row["comm_bytes_by_axis"]
            for axis, value in want.items():
                assert got[axis] == pytest.approx(value, rel=1e-12, abs=1e-9), (opts, axis, got, want)
            assert row["comm_bytes"] == pytest.approx(sum(want.values()), rel=1e-12)
            assert row["tokens"] == (row["step"] + 1) * 8 * T      # counted once, not per tp / cp / pp rank


def _bitwise(rank, world, argv):
    import train_5d
    return train_5d.main(argv)["grid"].sizes


def test_uneven_stages_are_train_single(text_reference_for, text_data, tmp_path):
    """--pp_uneven: 4 layers on 3 stages (2, 1, 1: train_pp's split and plan.py's) under 1f1b; plan.py's launch
    line for a layout whose stages do not divide the layers carries the flag."""
    import plan
    out = str(tmp_path / "run")
    run_workers(_runs, 3, args=([text_argv(text_data, out, **MODELS["L4"], pp=3, micro_batch_size=2,
                                           pp_uneven=True)],), timeout=900)
    assert_exact(text_reference_for("L4")[0], curves(out))
    job = plan.build_job(plan.parse_args(["--n_layer", "3", "--n_embd", "64", "--n_head", "4", "--vocab", "64",
                                          "--gpus", "2", "--seq", "32", "--global_batch_tokens", "256"], ""))
    row = plan.evaluate(job, plan.Layout(dp=1, pp=2, micro_batch_size=1))
    assert plan.launch_command(job, row).endswith("--pp_uneven")
    assert "--pp_uneven" not in plan.launch_command(job, plan.evaluate(job, plan.Layout(dp=2, micro_batch_size=1)))


def test_all_degrees_one_is_train_single_bit_for_bit(text_data, tmp_path):
    """fp32, every degree 1: the same micro-batches through the pipeline runner give train_single's exact losses."""
    opts = dict(dtype="float32", micro_batch_size=4, max_steps=12)
    ref = run_single(text_argv(text_data, str(tmp_path / "single"), **opts))[0]
    run_workers(_bitwise, 1, args=(text_argv(text_data, str(tmp_path / "5d"), tp=1, **opts),))
    assert losses(str(tmp_path / "5d")) == ref


def test_dropout_under_tp_draws_train_tps_masks(text_data, tmp_path):
    """With dropout, train_5d tp 2 (built on the meta device) draws the same per-rank and shared masks as train_tp
    tp 2: the same losses and grad norms (float64), so its TP ranks' replicated copies stay equal."""
    runs = {}
    for script in ("train_tp", "train_5d"):
        out = str(tmp_path / script)
        run_workers(recorded_runs, 2, args=(script, [text_argv(text_data, out, tp=2, dropout=0.1, max_steps=8)]),
                    timeout=600)
        runs[script] = curves(out)
    assert_exact(runs["train_tp"], runs["train_5d"])


def test_default_layout_shows_more_than_one_axis(tiny_data, tmp_path):
    sizes = run_workers(_bitwise, 4, args=(tiny_argv(tiny_data, str(tmp_path), max_steps=1),))[0]
    assert sizes == dict(tp=2, cp=1, dp=1, pp=2)


@pytest.mark.parametrize("world,overrides,message", [
    (4, dict(tp=2, pp=4), "does not divide the world size"),
    (4, dict(tp=2, dp=4), "!= world size"),
    (4, dict(tp=4, n_head=6, n_embd=48), "n_head=6 is not divisible by tp=4"),
    (4, dict(pp=4, n_layer=6), "does not split evenly into pp*pp_virtual=4 stages"),
    (4, dict(cp=4, block_size=18, cp_layout="ring"), "must be a multiple of 4 (--cp_layout ring"),
    (2, dict(cp=2, block_size=6), "must be a multiple of 4 (--cp_layout zigzag"),
    (2, dict(pp=2, global_batch_size=2, micro_batch_size=2), "needs at least as many micro-batches as stages"),
    (2, dict(pp=2, pp_schedule="zbv"), "pass --pp_virtual 2"),
    (2, dict(pp=2, pp_schedule="dualpipev", pp_virtual=2, n_layer=4, micro_batch_size=4), "dualpipev needs"),
    (2, dict(dp=2, zero_stage=3, pp_schedule="interleaved", pp_virtual=2, n_layer=4), "interleaved needs --pp > 1"),
    (2, dict(tp=2, fp8="blockwise"), "--fp8 blockwise with tp=2 needs n_embd/tp (32/2) a multiple of 128"),
    (2, dict(tp=2, fp8="blockwise", arch="llama", n_embd=256, n_kv_head=2, ffn_hidden=512),   # k, v: 64 rows a rank
     "--fp8 blockwise with tp=2 needs n_kv_head*head_dim/tp (128/2) a multiple of 128"),
    (2, dict(tp=2, fp8="blockwise", arch="llama", n_embd=256, ffn_hidden=384),                # gate, up: 192 a rank
     "--fp8 blockwise with tp=2 needs ffn_hidden/tp (384/2) a multiple of 128"),
    (2, dict(tp=2, zero_stage=3), "with dp*cp = 1 there is nothing to shard"),
    (4, dict(dp=2, tp=2, zero_stage=3, fp8="tensorwise", fp8_all_gather=True), "--fp8_all_gather with --tp > 1"),
    (2, dict(tp=2, sp=True, block_size=15, cp_layout="ring"), "block_size/cp=15 is not divisible by tp=2"),
])
def test_bad_layout_is_one_clear_error(tiny_data, tmp_path, monkeypatch, capsys, world, overrides, message):
    import train_5d
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as e:
        train_5d.main(tiny_argv(tiny_data, str(tmp_path), **overrides))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "metrics.jsonl").exists()


def _resume_runs(rank, world, argvs):
    import train_5d
    for argv in argvs:
        train_5d.main(argv)


def test_resharding_resume(text_reference, text_data, tmp_path):
    """One checkpoint in train_single's layout carries a run across layouts: steps 0-9 as (tp 2, pp 2), 10-19 as
    (dp 2, cp 2) with ZeRO-1, 20-21 as train_single; the losses are the unbroken run's (float64, 1e-9)."""
    out = str(tmp_path / "run")
    run_workers(_resume_runs, 4, args=([text_argv(text_data, out, tp=2, pp=2, micro_batch_size=2, stop_step=10)],))
    assert len(losses(out)) == 10
    run_workers(_resume_runs, 4, args=([text_argv(text_data, out, dp=2, cp=2, zero_stage=1, micro_batch_size=2,
                                                  resume=True, stop_step=20)],))
    assert len(losses(out)) == 20
    run_single(text_argv(text_data, out, micro_batch_size=8, resume=True))
    assert_exact(text_reference[0], curves(out))


def test_evaluation_matches_single(text_data, tmp_path):
    """Validation loss through the grid (pipeline forward, TP with SP, CP) equals train_single's."""
    opts = dict(max_steps=3, eval_interval=2, eval_iters=2, micro_batch_size=2)
    run_single(text_argv(text_data, str(tmp_path / "single"), **opts))
    run_workers(_resume_runs, 8, args=([text_argv(text_data, str(tmp_path / "5d"), tp=2, sp=True, cp=2, pp=2,
                                                  **opts)],))
    val = [[r["val_loss"] for r in map(json.loads, open(tmp_path / d / "metrics.jsonl")) if "val_loss" in r]
           for d in ("single", "5d")]
    assert len(val[0]) == 2 and val[1] == pytest.approx(val[0], rel=1e-9)


def test_kernels_and_fp8_apply_in_stages(text_data, text_reference_triton, tmp_path):
    """With tp 1, the rungs' fused kernels (Triton, here interpreted on CPU) and FP8 GEMMs run inside pipeline
    stages as in train_single: the same curve as train_single with the same flags, and FP8 really on. FP8 runs in
    float64 (the GEMMs still take e4m3 / e5m2 operands): in fp32 the pipeline's other summation order of the tied
    embedding's gradient (1e-7) flips a quantization step within a few steps and is amplified to 1e-4, hiding a
    real difference; in float64 the two runs quantize alike."""
    fp8 = dict(fp8="tensorwise", micro_batch_size=2, max_steps=6)
    runs = dict(triton=dict(kernels="triton", **TRITON_TWO_STEPS), fp8=fp8)
    argvs = [text_argv(text_data, str(tmp_path / name), pp=2, **o) for name, o in runs.items()]
    run_workers(_resume_runs, 2, args=(argvs,), timeout=600)
    assert_exact(text_reference_triton, curves(str(tmp_path / "triton")), rtol=1e-12)   # train_single's, the same flags
    ref = run_single(text_argv(text_data, str(tmp_path / "single_fp8"), **fp8), both_curves=True)[0]
    assert_exact(ref, curves(str(tmp_path / "fp8")))
    plain = run_single(text_argv(text_data, str(tmp_path / "plain"), micro_batch_size=2, max_steps=6))[0]
    assert abs(plain[-1] - losses(str(tmp_path / "fp8"))[-1]) > 1e-4, "FP8 must change the numbers"


def test_launches_are_nccl_safe(tiny_data, tmp_path):
    """What every rank launched in real gloo runs (ring and zigzag attention, pipeline with TP and SP inside,
    gradient buckets, the tied pair, evaluation, expert parallelism, ZeRO-3 with FP8 gathers) replayed under NCCL's
    rules (nccl_check.py), with every barrier and *_object helper recorded beside comm.py's launches: no deadlock."""
    from common.nccl_check import check
    layouts = [dict(tp=2, sp=True, cp=2, pp=2, cp_layout="ring", eval_interval=1, eval_iters=1),
               dict(dp=2, cp=2, pp=2, cp_layout="zigzag", zero_stage=1),
               dict(cp=2, pp=2, pp_schedule="interleaved", pp_virtual=2, n_layer=4, cp_layout="allgather"),
               dict(dp=2, tp=2, sp=True, pp=2, ep=2, n_experts=4),         # experts' all_to_all inside stages
               dict(dp=2, cp=2, pp=2, pp_schedule="dualpipev", pp_virtual=2, n_layer=4, global_batch_size=16),
               dict(dp=2, cp=2, pp=2, zero_stage=3, fp8="delayed", fp8_all_gather=True)]   # ZeRO-3's FP8 gathers
    argvs = [tiny_argv(tiny_data, str(tmp_path / f"run{i}"), max_steps=2, micro_batch_size=2, **o)
             for i, o in enumerate(layouts)]
    logs = run_workers(recorded_runs, 8, args=("train_5d", argvs), timeout=600)
    for i, layout in enumerate(layouts):
        launches = [logs[r][i] for r in range(8)]
        assert any(op[0] == "send" for groups in launches for g in groups for op in g), "nothing recorded"
        assert any(op[0] == "coll" and op[2] == 0 for groups in launches for g in groups for op in g), "no barrier"
        assert check(launches) == [], layout


def _sample_gathers(rank, world, argv):
    """train_5d.main with the sample on; the elements checkpoint.py all-gathered after training (for the sample)."""
    import train_5d
    from common import checkpoint, metrics
    gathered, training = [], [True]
    real_gather, real_close = checkpoint.all_gather, metrics.MetricsLogger.close

    def counting_gather(out, t, group=None):
        if not training[0]:
            gathered.append(out.numel())
        return real_gather(out, t, group=group)

    def close(self):
        training[0] = False
        real_close(self)
    checkpoint.all_gather, metrics.MetricsLogger.close = counting_gather, close
    result = train_5d.main(argv)
    return sum(gathered), sum(p.numel() for p in result["chunks"].parameters())


def test_sample_gathers_weights_not_adam_moments(tiny_data, tmp_path):
    """The end-of-run sample needs the weights: under ZeRO the shards' AdamW moments stay where they are."""
    argv = tiny_argv(tiny_data, str(tmp_path), dp=2, zero_stage=1, max_steps=1, sample_tokens=4)
    for gathered, n_params in run_workers(_sample_gathers, 2, args=(argv,)):
        assert n_params <= gathered < 1.5 * n_params, f"{gathered} elements gathered for {n_params} weights"


def test_whole_model_fits_counts_free_and_cached_device_memory(monkeypatch):
    """The sample's check (startup.fits_on_device) on a GPU, faked: the driver's free bytes plus the allocator's
    reserved-but-unused bytes; host memory is not checked."""
    import torch
    from common.startup import fits_on_device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100, 1000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 300)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 250)
    cuda = torch.device("cuda")
    assert fits_on_device(150, cuda) and not fits_on_device(151, cuda)
    assert fits_on_device(10 ** 15, torch.device("cpu"))


def _sample_when_too_large(rank, world, argv):
    """train_5d.main with the sample on and a rank 0 device too small for it: (its stdout, gathers of the model)."""
    import contextlib
    import io
    import train_5d
    from compose import whole_model
    gathers, real_gather = [], whole_model.gather_whole
    whole_model.fits_on_device = lambda n_bytes, device: False
    whole_model.gather_whole = lambda held, grid: gathers.append(1) or real_gather(held, grid)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_5d.main(argv)
    return out.getvalue(), len(gathers)


def test_sample_is_skipped_with_one_line_when_the_model_does_not_fit(tiny_data, tmp_path):
    """A model larger than rank 0's free device memory is not gathered there after training: every rank skips the
    sample (rank 0's answer, broadcast), rank 0 says so in one line, nothing is gathered."""
    argv = tiny_argv(tiny_data, str(tmp_path), dp=2, zero_stage=1, max_steps=1, sample_tokens=4)
    for rank, (text, gathers) in enumerate(run_workers(_sample_when_too_large, 2, args=(argv,))):
        skipped = [line for line in text.splitlines() if line.startswith("sample: skipped:")]
        assert len(skipped) == (rank == 0) and "---- sample ----" not in text, text
        assert gathers == 0
