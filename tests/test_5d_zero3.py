"""train_5d.py --zero_stage 3: ZeRO-3 (FSDP) over dp x cp composed with tp (+SP), cp and pp under every schedule
(zb1, zbv, dualpipev: gathered for B, reduce-scattered after W) reproduces train_single.py in float64 at 1e-9 per step
(loss and grad norm) on real text across a gradient spike, clipping on, with and without resharding after forward;
the dp axis sends exactly ZeRO-3's bytes with the composed sizes (each chunk's units all-gathered as often as the
schedule needs them, reduce-scattered once per micro-batch), and the model states are plan.py's; a ZeRO-3 run
resumes as (tp 2, pp 2) and then as train_single."""
import pytest

from distributed_helper import run_workers
from common.metrics import read_metrics
from train_pp import make_schedule
from test_5d import HEADS, H, T, VOCAB, expected_bytes_by_axis
from train_helpers import MODELS, assert_exact, curves, losses, run_single, text_argv


def _runs(rank, world, argvs):
    """train_5d.main for each argv in one process group; rank 0 returns, per run, its padded units by chunk and
    what the byte formulas need."""
    import train_5d
    from common.metrics import model_state_bytes
    from pipeline.tied import tied_weight
    out = []
    for argv in argvs:
        result = train_5d.main(argv)
        axis = result["dp_axis"]
        tied = tied_weight(result["chunks"])
        buckets = [b for grads in axis.reductions() for b in grads.buckets]     # in the shards' order
        out.append(dict(sizes=result["grid"].sizes, states=model_state_bytes(result["chunks"], axis.shards, buckets),
                        padded_by_chunk=[sum(b.shard.padded for g in part for b in g.buckets)
                                         for part in axis.grads_of],
                        n_sp_shard=sum(g.numel() for p, g in axis.my_slices() if getattr(p, "sequence_parallel", 0)),
                        tied_padded=sum(s.padded for s in axis.shards if s.params[0] is tied and len(s.params) == 1)))
    return out if rank == 0 else None


def gathers_per_step(schedule, pp, m, v, chunks, reshard):
    """All-gathers of a unit that `chunks` use on pipeline rank 0 in one step: before every forward and every
    backward (resharding after forward), or, kept from a forward to the end of the next backward, only where it is
    not whole (W actions need no weights). A V's tied weight is one unit both its chunks use."""
    whole, count = False, 0
    for a in make_schedule(schedule, pp, m, v)[0]:
        if a.chunk not in chunks or a.kind not in "FB":
            continue
        count += not whole
        whole = a.kind == "F" and not reshard
    return count


def predicted_states(n_layer, v, schedule, dp, tp, cp, pp):
    """plan.py's model-state bytes of pipeline rank 0 (its units: a block each, the embedding and final norm), in
    float64: twice its fp32 recipe's 4 + 4 + 8 bytes per parameter, all three sharded over dp x cp."""
    from planner import memory as plan_memory
    from pipeline.schedules import placement_of
    from planner.inputs import Job
    from model import GPTConfig
    cfg = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=HEADS, n_embd=H)
    job = Job(cfg, dp * tp * cp * pp, 8, "h100", 8, precision="fp32")
    groups = plan_memory.flat_groups(job.shape, tp, 1, pp, v, 0, 3, job.bucket_mb, placement_of(schedule))
    st = plan_memory.zero_state_bytes(groups, dp * cp, 3, "fp32")
    return dict(params=2 * st["params"], grads=2 * st["grads"], optim=2 * st["optimizer"])


CASES = {
    2: [("L2", dict(dp=2)), ("L2", dict(dp=2, reshard_after_forward=False))],
    4: [("L2", dict(dp=2, tp=2, sp=True)), ("L2", dict(dp=2, pp=2)),
        ("L4", dict(dp=2, pp=2, pp_schedule="interleaved", pp_virtual=2)), ("L2", dict(dp=2, cp=2)),
        ("L2", dict(dp=2, pp=2, reshard_after_forward=False)),
        ("L4", dict(dp=2, pp=2, pp_schedule="interleaved", pp_virtual=2, reshard_after_forward=False)),
        ("L4", dict(dp=2, pp=2, pp_schedule="zb1")), ("L4", dict(dp=2, pp=2, pp_schedule="zbv", pp_virtual=2)),
        ("L4", dict(dp=2, pp=2, pp_schedule="zbv", pp_virtual=2, reshard_after_forward=False)),
        ("L4", dict(dp=2, pp=2, pp_schedule="dualpipev", pp_virtual=2, micro_batch_size=1))],
    8: [("L2", dict(tp=2, sp=True, cp=2, pp=2))],     # the dp x cp group is cp's 2 ranks: every axis at 8 ranks
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_zero3_float64_parity_and_bytes(text_reference_for, text_data, tmp_path, world):
    cases = [(model, {"micro_batch_size": 2, "zero_stage": 3, **opts}) for model, opts in CASES[world]]
    argvs = [text_argv(text_data, str(tmp_path / f"run{i}"), **MODELS[model], **opts)
             for i, (model, opts) in enumerate(cases)]
    results = run_workers(_runs, world, args=(argvs,), timeout=1500)[0]
    for i, ((model, opts), result) in enumerate(zip(cases, results)):
        out = str(tmp_path / f"run{i}")
        assert_exact(text_reference_for(model)[0], curves(out))
        sizes = {k: opts.get(k, 1) for k in ("dp", "tp", "cp", "pp")}
        assert result["sizes"] == sizes
        m, v = 8 // (opts["micro_batch_size"] * sizes["dp"]), opts.get("pp_virtual", 1)
        schedule, reshard = opts.get("pp_schedule", "1f1b"), opts.get("reshard_after_forward", True)
        padded = result["padded_by_chunk"]
        gathers = [gathers_per_step(schedule, sizes["pp"], m, v, {c}, reshard) for c in range(len(padded))]
        assert gathers == [2 * m] * len(padded) if reshard else all(g < 2 * m for g in gathers), gathers
        v_shaped = schedule in ("zbv", "dualpipev")
        want = expected_bytes_by_axis(micro=opts["micro_batch_size"], n_layer=MODELS[model].get("n_layer", 2), v=v,
                                      sp=opts.get("sp", False), n_padded=sum(padded), zero_stage=3,
                                      n_sp_shard=result["n_sp_shard"], tied_padded=result["tied_padded"],
                                      v_shaped=v_shaped, **sizes)
        # each chunk's units: its all-gathers and m reduce-scatters, at (N-1)/N of their padded bytes; in a V the
        # tied weight (chunk 0's unit) is gathered for chunk 1's actions too
        n = sizes["dp"] * sizes["cp"]
        shared = gathers_per_step(schedule, sizes["pp"], m, v, {0, 1}, reshard) - gathers[0] if v_shaped else 0
        want["dp"] = sum((g + m) * (n - 1) / n * 8 * p for g, p in zip(gathers, padded))
        want["dp"] += shared * (n - 1) / n * 8 * result["tied_padded"]
        assert result["states"] == predicted_states(MODELS[model].get("n_layer", 2), v, schedule, **sizes), opts
        for row in read_metrics(out):
            got = row["comm_bytes_by_axis"]
            for axis, value in want.items():
                assert got[axis] == pytest.approx(value, rel=1e-12, abs=1e-9), (opts, axis, got, want)
            assert row["tokens"] == (row["step"] + 1) * 8 * T


def _resume_runs(rank, world, argvs):
    import train_5d
    for argv in argvs:
        train_5d.main(argv)


def test_zero3_resharding_resume(text_reference, text_data, tmp_path):
    """Steps 0-9 as ZeRO-3 over (dp 2, cp 2), 10-19 as (tp 2, pp 2), 20-21 as train_single: the unbroken run's
    losses and grad norms (float64, 1e-9)."""
    out = str(tmp_path / "run")
    run_workers(_resume_runs, 4, args=([text_argv(text_data, out, dp=2, cp=2, zero_stage=3, micro_batch_size=2,
                                                  stop_step=10)],))
    assert len(losses(out)) == 10
    run_workers(_resume_runs, 4, args=([text_argv(text_data, out, tp=2, pp=2, micro_batch_size=2, resume=True,
                                                  stop_step=20)],))
    assert len(losses(out)) == 20
    run_single(text_argv(text_data, out, micro_batch_size=8, resume=True))
    assert_exact(text_reference[0], curves(out))


def _peak_whole_units(rank, world, argv):
    """train_5d.main with every unit's gather and free followed: (the most units whole at once, root units)."""
    import train_5d
    import train_zero
    whole, peak, gather, free = set(), [0], train_zero.Shard.gather, train_zero.Shard.free

    def followed_gather(shard, *args):
        gather(shard, *args)
        whole.add(shard)
        peak[0] = max(peak[0], len(whole))

    def followed_free(shard):
        free(shard)
        whole.discard(shard)
    train_zero.Shard.gather, train_zero.Shard.free = followed_gather, followed_free
    axis = train_5d.main(argv)["dp_axis"]
    return peak[0], len(axis.shards) - sum(len(chunk.transformer["h"]) for chunk in axis.chunks)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1"])
def test_zero3_holds_a_block_and_the_next(tiny_data, tmp_path, schedule):
    """8 layers on 2 stages: a rank holds its roots whole from the start of a forward or backward to its end, and of
    its 4 blocks the one computing and the one prefetched, in B too when the weight gradients wait for W (the
    hooks free a block once the gradient reaches the block below)."""
    from train_helpers import tiny_argv
    argv = tiny_argv(tiny_data, str(tmp_path), n_layer=8, dp=2, pp=2, zero_stage=3, micro_batch_size=2,
                     pp_schedule=schedule, max_steps=2)
    for peak, roots in run_workers(_peak_whole_units, 4, args=(argv,)):
        assert peak == roots + 2, (peak, roots)
