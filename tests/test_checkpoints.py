"""Checkpoints (common/checkpoint/__init__.py): one format for every script, so any layout resumes any other
with the unbroken run's losses; step directories committed last (a crash leaves the previous one as latest),
the newest --keep_checkpoints kept; --resume auto (a node killed mid-run restarting under torchrun: test_multinode)."""
import errno
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

import train_single
from common.checkpoint import CKPT_DIR, FILE, latest_checkpoint, load_checkpoint, remove_stale_temp_files, save_step, step_dir
from distributed_helper import exit_code_and_stderr, recorded_runs, run_workers
from common.metrics import read_metrics
from train_helpers import assert_exact, curves, losses, run_single, text_argv, tiny_argv


def test_every_layout_resumes_every_other(text_reference, text_data, tmp_path):
    """One run carried through five scripts by its checkpoint: steps 0-4 as train_tp (tp 2), 5-9 train_pp (pp 2),
    10-14 train_zero (ZeRO-3), 15-19 train_5d (cp 2, across the spike), 20-21 train_single: the unbroken run's
    curve (float64, 1e-9)."""
    out = str(tmp_path / "run")
    legs = [("train_tp", dict(tp=2, micro_batch_size=4)), ("train_pp", dict(pp=2, micro_batch_size=2)),
            ("train_zero", dict(zero_stage=3, micro_batch_size=2)), ("train_5d", dict(cp=2, micro_batch_size=4))]
    for i, (script, flags) in enumerate(legs):
        argv = text_argv(text_data, out, stop_step=5 * (i + 1), resume=i > 0, **flags)
        run_workers(recorded_runs, 2, args=(script, [argv]), timeout=600)
        assert len(losses(out)) == 5 * (i + 1), script
    run_single(text_argv(text_data, out, micro_batch_size=8, resume=True))
    assert_exact(text_reference[0], curves(out))
    assert sorted(os.listdir(os.path.join(out, CKPT_DIR))) == ["latest", "step_00000020", "step_00000022"]


def test_expert_parallel_checkpoints_resume_anywhere(text_data, tmp_path):
    """A mixture of experts: steps 0-9 as train_ep (each rank 4 of 8 experts), 10-19 as train_5d (pp 2), 20-21 as
    train_single; the experts, the router's load buffers and their AdamW state carry over (float64, 1e-9)."""
    moe = dict(n_experts=8, top_k=2)
    ref = str(tmp_path / "single")
    run_single(text_argv(text_data, ref, micro_batch_size=8, **moe))
    out = str(tmp_path / "run")
    for i, (script, flags) in enumerate((("train_ep", dict(ep=2, micro_batch_size=4)),
                                         ("train_5d", dict(pp=2, micro_batch_size=2)))):
        argv = text_argv(text_data, out, stop_step=10 * (i + 1), resume=i > 0, **moe, **flags)
        run_workers(recorded_runs, 2, args=(script, [argv]), timeout=600)
    run_single(text_argv(text_data, out, micro_batch_size=8, resume=True, **moe))
    assert_exact(curves(ref), curves(out))


PARALLEL_SAVES = [dict(dp=2, tp=2, zero_stage=1), dict(dp=2, pp=2, n_experts=4, top_k=2, ep=2)]


@pytest.mark.parametrize("flags", PARALLEL_SAVES, ids=["dp2-tp2-zero1", "dp2-pp2-ep2"])
def test_sharded_saves_are_written_by_every_rank_in_parts(text_data, tmp_path, flags):
    """train_5d at 4 ranks, saved after step 3: every rank writes one part (no rank gathers the model), each tensor
    once, about 1/holders of the bytes each; merged, they are train_single's checkpoint of the same 3 steps."""
    moe = {k: flags[k] for k in ("n_experts", "top_k") if k in flags}
    ref = str(tmp_path / "single")
    run_single(text_argv(text_data, ref, micro_batch_size=8, stop_step=3, **moe))
    out = str(tmp_path / "5d")
    run_workers(recorded_runs, 4, args=("train_5d", [text_argv(text_data, out, micro_batch_size=2, stop_step=3,
                                                               **flags)]), timeout=600)
    path = latest_checkpoint(out)
    index = torch.load(path, weights_only=True)
    assert index["parts"] == [f"part_{r:05d}.pt" for r in range(4)] and index["model"] == {}
    parts = [torch.load(os.path.join(os.path.dirname(path), name), weights_only=True) for name in index["parts"]]
    keys = [k for part in parts for k in part["model"] if k != "lm_head.weight"]     # (tied: written with wte)
    assert len(keys) == len(set(keys)), "a tensor written twice"
    sizes = [sum(t.numel() for t in part["model"].values()) for part in parts]
    assert max(sizes) < 0.6 * sum(sizes) and min(sizes) > 0, sizes              # whole model on one rank: 1.0
    single, merged = load_checkpoint(latest_checkpoint(ref)), load_checkpoint(path)
    assert merged["model"].keys() == single["model"].keys() and merged["step"] == 3
    for key, value in single["model"].items():
        assert torch.allclose(merged["model"][key], value, rtol=1e-9, atol=1e-12), key
    for i, st in single["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(merged["optimizer"]["state"][i][name], st[name], rtol=1e-9, atol=1e-15), (i, name)


# ----------------------------------------------------------------------------------------------------------
# resume compatibility: one check in checkpoint.load, whichever script loads

# (script, its layout, a model-defining flag changed against the checkpoint of tiny_argv's model: n_layer 2,
# n_head 4, n_embd 32, block_size 16, dense). n_head 2 keeps every tensor's shape: only the config can tell.
OTHER_MODELS = [("train_single", {}, dict(n_head=2)), ("train_ddp", {}, dict(n_layer=4)),
                ("train_zero", dict(zero_stage=1), dict(n_head=2)), ("train_zero", dict(zero_stage=3), dict(n_layer=4)),
                ("train_tp", dict(tp=2), dict(n_embd=48)), ("train_cp", dict(cp=2), dict(n_head=2)),
                ("train_pp", dict(pp=2), dict(n_layer=4)), ("train_ep", dict(ep=2, top_k=1), dict(n_experts=2)),
                ("train_5d", dict(dp=2), dict(block_size=32)), ("train_5d", dict(tp=2, pp=2), dict(n_head=2))]


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_data, tmp_path_factory):
    """A 2-step train_single run of tiny_argv's model with its checkpoint (copied by each test that resumes it)."""
    out = str(tmp_path_factory.mktemp("tiny_checkpoint") / "run")
    run_single(tiny_argv(tiny_data, out, max_steps=4, stop_step=2))
    return out


def _copy(src, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("script, layout, changed", OTHER_MODELS,
                         ids=[f"{s}-{'-'.join(map(str, lay.values()))}-{next(iter(c))}" for s, lay, c in OTHER_MODELS])
def test_another_models_checkpoint_is_one_line_in_every_loader(tiny_data, tiny_checkpoint, tmp_path, script, layout,
                                                               changed):
    """Every loader refuses a checkpoint whose model-defining fields differ, naming the field, both values and what
    may change on resume, before any work; the checkpoint stays as it was."""
    out = _copy(tiny_checkpoint, tmp_path)
    before = {p: open(os.path.join(dp, p), "rb").read() for dp, _, fs in os.walk(out) for p in fs if p.endswith(".pt")}
    argv = tiny_argv(tiny_data, out, max_steps=4, resume=True, **layout, **changed)
    world = 1 if script == "train_single" else 4 if layout.get("tp") == 2 and layout.get("pp") == 2 else 2
    if world == 1:
        results = [exit_code_and_stderr(0, 1, script, argv)]
    else:
        results = run_workers(exit_code_and_stderr, world, args=(script, argv), timeout=300)
    name, value = next(iter(changed.items()))
    assert [code for code, _ in results] == [2] * world, results
    for _, err in results:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "does not match this model: --" in lines[0], lines
        assert f"--{name} " in lines[0] and f"vs {value} in this run" in lines[0] and "you may change" in lines[0]
    after = {p: open(os.path.join(dp, p), "rb").read() for dp, _, fs in os.walk(out) for p in fs if p.endswith(".pt")}
    assert after == before


def _rewrite(out, edit):
    """Apply edit(state) to the newest checkpoint file (a one-process save: everything is in it)."""
    path = latest_checkpoint(out)
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def test_adam_moments_are_matched_by_name_not_position(tiny_data, tiny_checkpoint, tmp_path):
    """The same checkpoint with its optimizer entries stored in reverse order (names and moments together): the
    resumed run is bit-identical to resuming the original, since each moment goes to the parameter it names."""
    ref = _copy(tiny_checkpoint, tmp_path / "a")
    reference = run_single(tiny_argv(tiny_data, ref, max_steps=4, resume=True))[0]

    def reverse(state):
        names, moments = state["optimizer"]["names"], state["optimizer"]["state"]
        n = len(names)
        state["optimizer"]["names"] = names[::-1]
        state["optimizer"]["state"] = {n - 1 - i: m for i, m in moments.items()}
    out = _copy(tiny_checkpoint, tmp_path / "b")
    _rewrite(out, reverse)
    assert run_single(tiny_argv(tiny_data, out, max_steps=4, resume=True))[0] == reference


@pytest.mark.parametrize("damage, message", [
    (lambda s: s["model"]["transformer.h.1.attn.c_proj.weight"].fill_(float("nan")),
     "inf/NaN in transformer.h.1.attn.c_proj.weight;"),
    (lambda s: s["optimizer"]["state"][0]["exp_avg_sq"].fill_(float("inf")), "inf/NaN in "),
    (lambda s: s["model"].update(extra=torch.zeros(2)), "it has extra"),
    (lambda s: s["optimizer"]["names"].__setitem__(0, "transformer.h.9.mlp.c_fc.weight"), "optimizer state names"),
    (lambda s: s["optimizer"]["state"].pop(3), "lacks the optimizer state of"),
    (lambda s: s.update(step=7), "is at step 7, past --max_steps 4"),
], ids=["nan-weight", "inf-moment", "extra-entry", "foreign-optimizer-name", "missing-moment", "step-past-schedule"])
def test_a_damaged_or_unusable_checkpoint_is_one_line_on_load(tiny_data, tiny_checkpoint, tmp_path, damage, message):
    out = _copy(tiny_checkpoint, tmp_path)
    _rewrite(out, damage)
    code, err = exit_code_and_stderr(0, 1, "train_single", tiny_argv(tiny_data, out, max_steps=4, resume=True))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --resume: ") and message in lines[0], lines


def test_a_non_finite_value_is_found_on_load_in_a_sharded_layout(tiny_data, tiny_checkpoint, tmp_path):
    """train_tp: the rank that takes the damaged tensor names it, the other says another rank failed."""
    out = _copy(tiny_checkpoint, tmp_path)
    _rewrite(out, lambda s: s["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0].fill_(float("nan")))
    results = run_workers(exit_code_and_stderr, 2, args=("train_tp", tiny_argv(tiny_data, out, max_steps=4,
                                                                                resume=True, tp=2)), timeout=300)
    assert [code for code, _ in results] == [2, 2], results
    lines = [line for _, err in results for line in err.strip().splitlines()]
    assert any("inf/NaN in transformer.h.0.mlp.c_fc.weight" in line for line in lines), lines


def test_only_the_current_gpus_rng_state_is_saved_and_restored(monkeypatch):
    """A checkpoint of a node with 8 GPUs (an earlier version saved every device's state) resumes on a node with
    one: the current device's state is set, never an index the node lacks; this version saves one state. A rank
    that computes on the CPU of a GPU machine (CUDA never initialised) neither saves nor sets a GPU's state: that
    would open a context on GPU 0."""
    from common.checkpoint import rank_states
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)      # --device cpu on a GPU machine
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: pytest.fail("a CPU rank asked for a GPU's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: pytest.fail("a CPU rank set a GPU's state"))
    assert set(rank_states.rng_state()) == {"cpu"}
    rank_states.set_rng_state(dict(cpu=torch.get_rng_state(), cuda=torch.tensor([5], dtype=torch.uint8)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)       # a rank on a GPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: calls.append(int(state[0])))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every GPU's state restored"))
    assert int(rank_states.rng_state()["cuda"][0]) == 7
    cpu = torch.get_rng_state()
    rank_states.set_rng_state(dict(cpu=cpu, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)]))
    rank_states.set_rng_state(dict(cpu=cpu, cuda=torch.tensor([5], dtype=torch.uint8)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)   # local rank 3 of a node, 2 states saved
    rank_states.set_rng_state(dict(cpu=cpu, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(2)]))
    assert calls == [0, 5, 0]


# ----------------------------------------------------------------------------------------------------------
# a full disk during a save

def _disk_full_after(monkeypatch, nbytes):
    """Every checkpoint file write fails with ENOSPC after nbytes bytes, as a full disk does."""
    from common.checkpoint import files as checkpoint_files
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > nbytes:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(checkpoint_files, "open", lambda path, mode="r", **kw: Full(real_open(path, mode, **kw))
                        if ".tmp." in str(path) else real_open(path, mode, **kw), raising=False)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tiny_data, tiny_checkpoint,
                                                                                 tmp_path, monkeypatch):
    out = _copy(tiny_checkpoint, tmp_path)
    before = latest_checkpoint(out)
    _disk_full_after(monkeypatch, 1000)
    code, err = exit_code_and_stderr(0, 1, "train_single", tiny_argv(tiny_data, out, max_steps=4, resume=True))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: cannot write a checkpoint to {step_dir(out, 4)} (ENOSPC: No space left"), lines
    assert latest_checkpoint(out) == before and load_checkpoint(before)["step"] == 2
    leftovers = [f for _, _, fs in os.walk(out) for f in fs if ".tmp." in f]
    assert leftovers == [] and not os.path.exists(step_dir(out, 4))


def _full_disk_on_rank_1(rank, world_size, argv):
    if rank == 1:
        import pytest as _pytest
        with _pytest.MonkeyPatch.context() as mp:
            _disk_full_after(mp, 100)
            return exit_code_and_stderr(rank, world_size, "train_zero", argv)
    return exit_code_and_stderr(rank, world_size, "train_zero", argv)


def test_a_full_disk_on_one_rank_of_a_sharded_save_stops_every_rank(tiny_data, tiny_checkpoint, tmp_path):
    """ZeRO-3 on 2 ranks, rank 1's part hits ENOSPC: both exit 2 (rank 1 naming the directory and ENOSPC, rank 0
    saying another rank failed), latest still names the previous checkpoint, no temporary file is left."""
    out = _copy(tiny_checkpoint, tmp_path)
    before = latest_checkpoint(out)
    argv = tiny_argv(tiny_data, out, max_steps=4, resume=True, zero_stage=3)
    results = run_workers(_full_disk_on_rank_1, 2, args=(argv,), timeout=300)
    assert [code for code, _ in results] == [2, 2], results
    assert "ENOSPC" in results[1][1] and "error: rank 1: cannot write a checkpoint to" in results[1][1], results
    assert "failed on another rank" in results[0][1] and len(results[0][1].strip().splitlines()) == 1, results
    assert latest_checkpoint(out) == before
    assert [f for _, _, fs in os.walk(out) for f in fs if ".tmp." in f] == []


def _cfg(out_dir, keep=2):
    return SimpleNamespace(out_dir=out_dir, keep_checkpoints=keep, dist_timeout=1.0)


def _state(step):
    return dict(model={"w": torch.full((2,), float(step))}, step=step)


def test_step_directories_commit_last_and_keep_the_newest(tmp_path):
    out = str(tmp_path)
    assert latest_checkpoint(out) is None
    for step in (2, 4, 6):
        save_step(_cfg(out), _state(step), step)
    assert sorted(os.listdir(tmp_path / CKPT_DIR)) == ["latest", "step_00000004", "step_00000006"]
    assert (tmp_path / CKPT_DIR / "latest").read_text() == "step_00000006\n"
    assert latest_checkpoint(out) == os.path.join(step_dir(out, 6), FILE)
    # killed after writing step 8 but before publishing it: latest still names step 6
    os.makedirs(step_dir(out, 8))
    torch.save(_state(8), os.path.join(step_dir(out, 8), FILE))
    assert latest_checkpoint(out) == os.path.join(step_dir(out, 6), FILE)
    # killed while writing step 10: only a temporary file, which the next start removes
    os.makedirs(step_dir(out, 10))
    (tmp_path / CKPT_DIR / "step_00000010" / f"{FILE}.tmp.99").write_bytes(b"half")
    remove_stale_temp_files(out)
    assert os.listdir(step_dir(out, 10)) == []
    # latest lost: the newest complete step directory (10 holds no file)
    os.remove(tmp_path / CKPT_DIR / "latest")
    assert latest_checkpoint(out) == os.path.join(step_dir(out, 8), FILE)
    # the resumed run saves step 8 again: the directory newer than it goes, and with keep 1 the older ones
    save_step(_cfg(out, keep=1), _state(8), 8)
    assert sorted(os.listdir(tmp_path / CKPT_DIR)) == ["latest", "step_00000008"]


def test_an_interrupted_saves_directory_is_never_kept_over_a_complete_one(tmp_path):
    """A crash mid-save leaves step_5 with parts but no ckpt.pt; the next save keeps the newest complete ones."""
    out = str(tmp_path)
    save_step(_cfg(out), _state(4), 4)
    os.makedirs(step_dir(out, 5))
    torch.save({}, os.path.join(step_dir(out, 5), "part_00000.pt"))
    save_step(_cfg(out), _state(6), 6)
    assert sorted(os.listdir(os.path.join(out, CKPT_DIR))) == ["latest", "step_00000004", "step_00000006"]


def test_resume_auto_starts_fresh_then_resumes(tiny_data, tmp_path, capsys):
    out = str(tmp_path / "run")
    first = run_single(tiny_argv(tiny_data, out, max_steps=6, stop_step=3, resume="auto"))[0]
    assert len(first) == 3 and latest_checkpoint(out).endswith(os.path.join("step_00000003", FILE))
    resumed = run_single(tiny_argv(tiny_data, out, max_steps=6, resume="auto"))[0]
    straight = run_single(tiny_argv(tiny_data, str(tmp_path / "straight"), max_steps=6))[0]
    assert resumed == straight and "steps 3..5" in capsys.readouterr().out


def test_an_earlier_versions_ckpt_pt_is_still_resumed(tiny_data, tmp_path):
    out = tmp_path / "run"
    run_single(tiny_argv(tiny_data, str(out), max_steps=6, stop_step=3))
    os.replace(latest_checkpoint(str(out)), out / "ckpt.pt")       # as an earlier version left it
    shutil.rmtree(out / CKPT_DIR)
    resumed = run_single(tiny_argv(tiny_data, str(out), max_steps=6, resume=True))[0]
    assert resumed == run_single(tiny_argv(tiny_data, str(tmp_path / "straight"), max_steps=6))[0]


def test_per_rank_files_of_an_earlier_version_are_one_clear_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    os.makedirs(out)
    (out / "ckpt_rank0.pt").write_bytes(b"x")
    for resume in ("yes", "auto"):
        with pytest.raises(SystemExit) as e:
            train_single.main(tiny_argv(tiny_data, str(out), resume=resume))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "per-rank checkpoints of an earlier version" in err[0], err


@pytest.mark.parametrize("left", ["checkpoint", "metrics"])
def test_a_fresh_run_never_overwrites_what_another_run_published(tiny_data, tmp_path, capsys, left):
    """A run started without --resume in an out_dir that holds another run's checkpoint or metrics rows stops in one
    line before any work (it would truncate the metrics and prune the checkpoints); --resume auto continues there,
    and a directory holding anything else is used as it is."""
    out = tmp_path / "run"
    run_single(tiny_argv(tiny_data, str(out), max_steps=2, save_interval=2 if left == "checkpoint" else 0))
    published = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix in (".pt", ".jsonl")}
    assert published and capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_single.main(tiny_argv(tiny_data, str(out), max_steps=4))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert f"--out_dir {out} holds" in err[0] and "--resume auto continues that run" in err[0], err
    assert {p: p.read_bytes() for p in published} == published                 # nothing touched
    resumed = run_single(tiny_argv(tiny_data, str(out), max_steps=4, resume="auto"))[0]
    assert len(resumed) == 4
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("kept")
    run_single(tiny_argv(tiny_data, str(other), max_steps=1))
    assert (other / "notes.txt").read_text() == "kept"


def resumed_at_the_end(rank, world_size, runs):
    """A worker: each (script, argv) of runs in turn, on these ranks; the steps each one logged."""
    import importlib
    steps = []
    for script, argv in runs:
        importlib.import_module(script).main(argv)
        steps.append(len(read_metrics(argv[argv.index("--out_dir") + 1])))
    return steps


def test_a_resume_at_the_last_step_ends_cleanly_in_every_script(tiny_data, tmp_path):
    """A checkpoint written at --max_steps, resumed by every script (--resume, the same --max_steps): no step runs,
    no script fails on what its loop never set (train_pp returned its last step's bytes), metrics stay as they were."""
    runs, layouts = [], [("train_ddp", {}), ("train_zero", dict(zero_stage=3)), ("train_tp", dict(tp=2)),
                         ("train_cp", dict(cp=2)), ("train_pp", dict(pp=2)), ("train_5d", dict(pp=2))]
    for script, flags in layouts:
        out = str(tmp_path / script)
        run_single(tiny_argv(tiny_data, out, max_steps=2, save_interval=2))
        runs.append((script, tiny_argv(tiny_data, out, max_steps=2, resume="yes", **flags)))
    moe = str(tmp_path / "train_ep")
    run_single(tiny_argv(tiny_data, moe, max_steps=2, save_interval=2, n_experts=2))
    runs.append(("train_ep", tiny_argv(tiny_data, moe, max_steps=2, resume="yes", n_experts=2, ep=2)))
    assert run_workers(resumed_at_the_end, 2, args=(runs,))[0] == [2] * len(runs)


def test_fp16_loss_scale_goes_on_from_the_checkpoint(tiny_data, tmp_path):
    """--dtype float16's GradScaler state (its scale, lowered by overflows, and its growth count) is in the
    checkpoint and goes on from there: a resume that restarted it at 65536 would train on other gradients."""
    out = str(tmp_path / "run")
    run_single(tiny_argv(tiny_data, out, max_steps=2, save_interval=2, dtype="float16"))
    path = latest_checkpoint(out)
    state = load_checkpoint(path)
    assert state["scaler"]["scale"] == 65536.0 and state["scaler"]["_growth_tracker"] == 2, state["scaler"]
    state["scaler"].update(scale=1024.0, _growth_tracker=7)     # as if overflows had lowered it
    torch.save(state, path)
    run_single(tiny_argv(tiny_data, out, max_steps=3, save_interval=3, dtype="float16", resume="yes"))
    after = load_checkpoint(latest_checkpoint(out))["scaler"]
    assert (after["scale"], after["_growth_tracker"]) == (1024.0, 8), after      # one more step from there


def test_an_out_dir_the_filesystem_cannot_hold_is_one_line_at_start(tiny_data, tmp_path, capsys, monkeypatch):
    """An --out_dir whose checkpoint files would pass the filesystem's path limit is refused before any work (not at
    the first save, hours in); a filesystem that refuses flock is named as such, not as a run holding the lock."""
    import fcntl

    def no_locks(f, operation):                                      # as NFS without its lock daemon answers
        raise OSError(errno.ENOLCK, "No locks available")
    deep = str(tmp_path / "/".join(["d" * 200] * 21))               # > 4096 bytes with the checkpoint's names
    for out, message in ((deep, "its checkpoint files would have paths of"), (str(tmp_path / "nolock"),
                                                                           "its filesystem refuses file locks")):
        if out != deep:
            monkeypatch.setattr(fcntl, "flock", no_locks)
        with pytest.raises(SystemExit) as e:
            train_single.main(tiny_argv(tiny_data, out, max_steps=1))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not os.path.exists(tmp_path / ("d" * 200))                # refused before anything was created
