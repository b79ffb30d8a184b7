"""train_pp.py on gloo: every schedule reproduces train_single.py (losses and final weights), schedules with
the same arithmetic agree bit for bit, the tied embedding's two copies stay identical, and the bytes each rank
sends equal m activations forward and m gradients back per stage boundary, exactly."""
import json

import numpy as np
import pytest
import torch

from distributed_helper import run_workers
from common.metrics import read_metrics
from pipeline.schedules import V_SHAPED, placement_of, rank_of
from train_helpers import (EXACT, MODELS, assert_exact, assert_same_losses, assert_same_weights, curves, run_single,
                           text_argv, tiny_argv)

H, T, VOCAB_PADDED = 32, 16, 64          # tiny_argv's n_embd and block_size; the tiny dataset's vocab (64)


def gather_full_state(chunks, gcfg, group, v, device, placement="loop"):
    """{GPT parameter name: tensor} on pipeline rank 0 (None elsewhere), every other rank sending its own: the
    whole trained model, to compare with train_single's."""
    import torch.distributed as dist
    from common import comm
    from model import GPT
    from pipeline.gpt_stages import PipelineStage
    from pipeline.stages import layer_split
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    ranges, full = layer_split(gcfg.n_layer, p * v), {}
    with torch.device("meta"):
        meta_gpt = GPT(gcfg)
    for s in range(p * v):
        owner = rank_of(s, p, placement)
        if rank not in (0, owner):
            continue
        if owner == rank:
            params = dict(chunks[s // p].named_parameters())
        else:                                    # rank 0 learns names and shapes without allocating
            params = dict(PipelineStage(meta_gpt, ranges[s], s == 0, s == p * v - 1).named_parameters())
        for name, param in params.items():
            if name == "transformer.wte.weight" and s > 0:    # the tied copy: rank 0 has wte
                continue
            if rank == owner == 0:
                full[name] = param.detach().clone()
            elif rank == owner:
                comm.send(param.detach().contiguous(), dist.get_global_rank(group, 0), group=group)
            else:
                full[name] = torch.empty(param.shape, device=device, dtype=next(chunks.parameters()).dtype)
                comm.recv(full[name], dist.get_global_rank(group, owner), group=group)
    return full if rank == 0 else None


def _pp_runs(rank, world_size, runs):
    """Several train_pp.main configurations in one process group; per run: rank's bytes, and on rank 0 the
    gathered full weights and the metrics rows. Tensors travel as numpy (by value)."""
    import train_pp
    out = []
    for argv in runs:
        r = train_pp.main(argv)
        v = r["cfg"].pp_virtual
        full = gather_full_state(r["chunks"], r["gcfg"], r["group"], v, torch.device("cpu"),
                                          placement_of(r["cfg"].pp_schedule))
        tied = {n: p.detach().numpy().copy() for n, p in r["chunks"].named_parameters()
                if n.endswith(("wte.weight", "lm_head.weight"))}
        out.append(dict(p2p=r["p2p_bytes"], comm=r["comm_bytes"], tied=tied, idle=r["idle"],
                        full=None if full is None else {n: t.numpy().copy() for n, t in full.items()},
                        rows=read_metrics(r["cfg"].out_dir) if rank == 0 else None))
    return out


def _expected_bytes(rank, p, v, m, micro, v_shaped=False):
    """Point-to-point bytes of one step: m activations (fp32, micro*T*h) out of every stage but the last,
    m gradients out of every stage but the first; in a V rank 0 holds the first and the last stage and rank
    p-1 hands stage p-1's output to stage p itself: 2m messages on those two, 4m on the others."""
    boundaries = 2 * v - (rank == 0) - (rank == p - 1)
    if v_shaped:
        boundaries = 0 if p == 1 else 2 if rank in (0, p - 1) else 4
    return m * micro * T * H * 4 * boundaries


def _expected_total(rank, p, v, m, micro, v_shaped=False):
    """Plus the step's collectives: the tied embedding's gradient all-reduce between first and last rank
    (2 ranks: S; none in a V, where rank 0 holds both), the squared grad norm all-reduce (2(p-1)/p * 4 bytes)
    and the loss broadcast."""
    tied = VOCAB_PADDED * H * 4 if rank in (0, p - 1) and not v_shaped else 0
    return _expected_bytes(rank, p, v, m, micro, v_shaped) + tied + 2 * (p - 1) / p * 4 + (p - 1) / p * 4


def _check_against_single(tmp_path, tiny_data, world, cases):
    """cases: [(name, overrides)]; runs them all on `world` ranks, checks each against train_single."""
    runs = [tiny_argv(tiny_data, str(tmp_path / name), pp=world, **kw) for name, kw in cases]
    results = run_workers(_pp_runs, world, args=(runs,), timeout=600)
    refs = {}
    for i, (name, kw) in enumerate(cases):
        key = tuple(sorted((k, v) for k, v in kw.items() if k in ("n_layer", "global_batch_size",
                                                                    "micro_batch_size", "grad_clip")))
        if key not in refs:
            single_kw = dict(key)
            refs[key] = run_single(tiny_argv(tiny_data, str(tmp_path / f"single{len(refs)}"), **single_kw))
        ref_losses, ref_state = refs[key]
        per_rank = [r[i] for r in results]
        rows = per_rank[0]["rows"]
        assert_same_losses(ref_losses, [row["loss"] for row in rows])
        assert_same_weights(ref_state, {n: torch.from_numpy(a) for n, a in per_rank[0]["full"].items()})
        # counted bytes: exactly theory, on every rank, and in every metrics row of rank 0
        v, v_shaped = kw.get("pp_virtual", 1), kw["pp_schedule"] in V_SHAPED
        micro = kw.get("micro_batch_size", 4)
        m = kw.get("global_batch_size", 8) // micro
        for r, res in enumerate(per_rank):
            assert res["p2p"] == _expected_bytes(r, world, v, m, micro, v_shaped), (name, r, res["p2p"])
            assert res["comm"] == pytest.approx(_expected_total(r, world, v, m, micro, v_shaped), rel=1e-12), \
                (name, r)
        assert all(row["p2p_bytes"] == _expected_bytes(0, world, v, m, micro, v_shaped) for row in rows)
        assert all(0 <= row["bubble_sim_run"] < 1 for row in rows)     # simulated at the step's own F:B:W
        # the tied embedding: the copy on the last stage is bit-identical to the first stage's (in a V both
        # stages are rank 0's, one Parameter)
        last_rank = rank_of(world * v - 1, world, placement_of(kw["pp_schedule"]))
        first = [a for n, a in per_rank[0]["tied"].items() if n.endswith("wte.weight")][0]
        last = [a for n, a in per_rank[last_rank]["tied"].items() if n.endswith(("lm_head.weight", "wte.weight"))][-1]
        np.testing.assert_array_equal(first, last)
        if v_shaped:
            assert all(not res["tied"] for res in per_rank[1:])     # no copy of the embedding off rank 0
        print(f"{name}: measured idle per rank {[round(x, 3) for x in per_rank[0]['idle']]}, "
              f"simulated {rows[-1]['bubble_sim']:.3f}")
    return {name: [row["loss"] for row in r["rows"]] for (name, _), r in zip(cases, results[0])}


@pytest.mark.parametrize("world,cases", [
    (2, [("afab", "L2", dict()), ("1f1b", "L2", dict()), ("zb1", "L2", dict(micro_batch_size=2)),
         ("interleaved", "L4", dict(pp_virtual=2, micro_batch_size=2)),
         ("1f1b", "GQA", dict())]),                          # GQA, and an untied head: nothing tied across stages
    (4, [("1f1b", "L4", dict(micro_batch_size=2)), ("zb1", "L4", dict(micro_batch_size=1)),
         ("interleaved", "L8", dict(pp_virtual=2, micro_batch_size=2))])])
def test_float64_parity_exact(text_reference_for, text_data, tmp_path, world, cases):
    """float64 on real text across a gradient spike, clipping on: every schedule reproduces train_single within
    1e-9 per step (loss and global grad norm over the stages) and in the final weights."""
    runs = [text_argv(text_data, str(tmp_path / f"{name}_{model}"), pp=world, pp_schedule=name, **MODELS[model], **kw)
            for name, model, kw in cases]
    results = run_workers(_pp_runs, world, args=(runs,), timeout=600)[0]
    for (name, model, kw), argv, result in zip(cases, runs, results):
        ref = text_reference_for(model)
        assert_exact(ref[0], curves(argv[argv.index("--out_dir") + 1]))
        assert_same_weights(ref[1], {n: torch.from_numpy(a) for n, a in result["full"].items()}, rtol=EXACT)


@pytest.mark.parametrize("world,cases", [
    (2, [("zbv", "L4", 2), ("zbv", "L4", 1), ("dualpipev", "L4", 2), ("dualpipev", "L4", 1)]),
    (4, [("zbv", "L8", 2), ("zbv", "L8", 1), ("dualpipev", "L8", 1)])])
def test_float64_parity_exact_v_schedules(text_reference_for, text_data, tmp_path, world, cases):
    """ZB-V and DualPipeV (V placement, split backward) reproduce train_single within 1e-9 per step and in the
    final weights, for m = global / micro micro-batches (dualpipev needs m >= 2p)."""
    runs = [text_argv(text_data, str(tmp_path / f"{name}_mb{micro}"), pp=world, pp_schedule=name, pp_virtual=2,
                      micro_batch_size=micro, **MODELS[model]) for name, model, micro in cases]
    results = run_workers(_pp_runs, world, args=(runs,), timeout=900)[0]
    for (name, model, micro), argv, result in zip(cases, runs, results):
        ref = text_reference_for(model)
        assert_exact(ref[0], curves(argv[argv.index("--out_dir") + 1]))
        assert_same_weights(ref[1], {n: torch.from_numpy(a) for n, a in result["full"].items()}, rtol=EXACT)


def test_pp2_every_schedule_matches_single(tmp_path, tiny_data):
    cases = [
        ("afab_m2", dict(pp_schedule="afab")),
        ("1f1b_m2", dict(pp_schedule="1f1b")),
        ("zb1_m2", dict(pp_schedule="zb1")),
        ("1f1b_m4", dict(pp_schedule="1f1b", micro_batch_size=2)),
        ("zb1_m4", dict(pp_schedule="zb1", micro_batch_size=2)),
        ("afab_m3", dict(pp_schedule="afab", global_batch_size=6, micro_batch_size=2)),
        ("1f1b_m3", dict(pp_schedule="1f1b", global_batch_size=6, micro_batch_size=2)),
        ("zb1_m3", dict(pp_schedule="zb1", global_batch_size=6, micro_batch_size=2)),
        # without clipping: the global norm sums per-rank partial norms, whose rounding depends on the split
        ("1f1b_L4", dict(pp_schedule="1f1b", n_layer=4, grad_clip=0.0)),
        ("interleaved_m2", dict(pp_schedule="interleaved", pp_virtual=2, n_layer=4, grad_clip=0.0)),
        ("interleaved_m4", dict(pp_schedule="interleaved", pp_virtual=2, n_layer=4, micro_batch_size=2)),
        ("zbv_m4", dict(pp_schedule="zbv", pp_virtual=2, n_layer=4, micro_batch_size=2)),
        ("dualpipev_m4", dict(pp_schedule="dualpipev", pp_virtual=2, n_layer=4, micro_batch_size=2)),
    ]
    losses = _check_against_single(tmp_path, tiny_data, 2, cases)
    # the same arithmetic in a different order of work: bit-identical fp32 losses
    assert losses["afab_m2"] == losses["1f1b_m2"]
    assert losses["afab_m3"] == losses["1f1b_m3"]
    assert losses["interleaved_m2"] == losses["1f1b_L4"]


def test_pp4_schedules_match_single(tmp_path, tiny_data):
    cases = [
        ("1f1b_m4", dict(pp_schedule="1f1b", n_layer=4, micro_batch_size=2)),
        ("zb1_m5", dict(pp_schedule="zb1", n_layer=4, global_batch_size=10, micro_batch_size=2)),
        ("afab_m4", dict(pp_schedule="afab", n_layer=4, micro_batch_size=2)),
        ("interleaved_m4", dict(pp_schedule="interleaved", pp_virtual=2, n_layer=8, micro_batch_size=2)),
        ("zbv_m4", dict(pp_schedule="zbv", pp_virtual=2, n_layer=8, micro_batch_size=2)),
        ("dualpipev_m8", dict(pp_schedule="dualpipev", pp_virtual=2, n_layer=8, micro_batch_size=1)),
    ]
    losses = _check_against_single(tmp_path, tiny_data, 4, cases)
    assert losses["afab_m4"] == losses["1f1b_m4"]


@pytest.mark.parametrize("overrides, world, message", [
    (dict(pp=2, n_layer=3), 2, "does not split evenly"),
    (dict(pp=2, n_layer=1), 2, "fewer than pp*pp_virtual"),
    (dict(pp=4, n_layer=4, pp_schedule="1f1b"), 4, "at least as many micro-batches"),
    (dict(pp=2, pp_schedule="interleaved", pp_virtual=1), 2, "needs --pp_virtual >= 2"),
    (dict(pp=2, pp_schedule="interleaved", pp_virtual=2, n_layer=4, global_batch_size=12), 2, "divisible by --pp"),
    (dict(pp=2, pp_virtual=2, n_layer=4), 2, "applies only to --pp_schedule interleaved"),
    (dict(pp=2, pp_schedule="zbv", n_layer=4), 2, "2 chunks per rank in a V (rank r holds stages r and 2p-1-r)"),
    (dict(pp=2, pp_schedule="dualpipev", pp_virtual=2, n_layer=4), 2, "dualpipev needs n_microbatches (2) >= 2 *"),
    (dict(pp=2, global_batch_size=10), 2, "not divisible by micro_batch_size"),
    (dict(pp=2, n_microbatches=3), 2, "not divisible by --n_microbatches"),
    (dict(pp=2), 4, "must equal the world size"),
])
def test_bad_input_is_one_clear_error(tmp_path, tiny_data, monkeypatch, capsys, overrides, world, message):
    import train_pp
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as e:
        train_pp.main(tiny_argv(tiny_data, str(tmp_path), **overrides))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1, err


def test_resume_and_eval(tmp_path, tiny_data):
    """Stopping at step 4 and resuming from the per-rank checkpoints gives the uninterrupted run's losses bit
    for bit; evaluation through the pipeline runs and writes val rows."""
    common = dict(pp=2, pp_schedule="zb1", max_steps=8, eval_interval=4, eval_iters=2)
    runs = [tiny_argv(tiny_data, str(tmp_path / "whole"), **common),
            tiny_argv(tiny_data, str(tmp_path / "parts"), stop_step=4, **common),
            tiny_argv(tiny_data, str(tmp_path / "parts"), resume=True, **common)]
    whole, _, resumed = run_workers(_pp_runs, 2, args=(runs,), timeout=600)[0]
    assert [r["loss"] for r in resumed["rows"]] == [r["loss"] for r in whole["rows"]]
    run_single(tiny_argv(tiny_data, str(tmp_path / "single"), max_steps=8, eval_interval=4, eval_iters=2))
    vals = {}
    for name in ("whole", "single"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            vals[name] = [row for row in map(json.loads, f) if "val_loss" in row]
    assert [row["step"] for row in vals["whole"]] == [0, 4, 7]
    for a, b in zip(vals["single"], vals["whole"], strict=True):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)


def _pp_sample(rank, world_size, argv):
    """A worker: train_pp.main with the sample on, where building a GPT once training is over fails (the whole model
    on one rank, or even on the meta device to gather it by name); this rank's stdout."""
    import contextlib
    import io
    import model
    import train_pp
    from common import metrics
    close = metrics.MetricsLogger.close

    def close_then_forbid_gpt(self):
        close(self)

        def no_gpt(*args, **kwargs):
            raise AssertionError("the sample built a whole GPT after training")
        model.GPT.__init__ = no_gpt
    metrics.MetricsLogger.close, out = close_then_forbid_gpt, io.StringIO()
    with contextlib.redirect_stdout(out):
        train_pp.main(argv)
    return out.getvalue()


def sample_text(stdout):
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("zbv", 2)])
def test_sample_runs_through_the_pipeline(schedule, v, text_data, tmp_path, capsys):
    """The end-of-run sample is train_single's (float64: the same logits, the same seed), every rank running only
    its own stages: no rank holds the whole model, as none could when it does not fit one device."""
    argv = text_argv(text_data, str(tmp_path / "pp"), max_steps=3, sample_tokens=24, n_layer=4)
    run_single(text_argv(text_data, str(tmp_path / "single"), max_steps=3, sample_tokens=24, n_layer=4))
    expected = sample_text(capsys.readouterr().out)
    outs = run_workers(_pp_sample, 2, args=(argv + ["--pp", "2", "--pp_schedule", schedule, "--pp_virtual", str(v)],))
    assert sample_text(outs[0]) == expected and len(expected) >= 24
    assert "---- sample ----" not in outs[1]          # rank 0 prints it
