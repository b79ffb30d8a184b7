"""What a run does with bad input and bad luck: one `error:` line (exit 2, no traceback) for a bad meta.json,
token file, --out_dir or --n_microbatches; a non-finite step skipped, and a diverged run stopped before it can
save over a good checkpoint, in every script; stale temporary files of killed saves removed; each rank's own
dropout stream restored on resume; character-level samples decoded."""
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train_single
from common import evaluation
from common.checkpoint import latest_checkpoint, load_checkpoint
from common.distributed import collective_failure
from distributed_helper import exit_code_and_stderr, free_port, recorded_runs, run_workers
from train_helpers import losses, make_tiny_dataset, run_single, text_argv, tiny_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_error_line(capsys, argv, script=train_single):
    """script.main(argv) must exit with code 2 and print exactly one `error:` line; returns it."""
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def strict_rows(out_dir):
    """metrics.jsonl parsed as strict JSON (NaN / Infinity are not JSON)."""
    def refuse(name):
        raise ValueError(f"{name} in metrics.jsonl")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


# ----------------------------------------------------------------------------------------------------------
# the NaN guard

def test_a_non_finite_step_is_skipped_and_the_run_goes_on(tiny_data, tmp_path, monkeypatch, capsys):
    """A NaN gradient norm at step 2: that step leaves weights and AdamW state alone, the run finishes, and the
    metrics row says null (valid JSON) where the value was not finite."""
    real, calls = train_single.clip_grad_norm, []

    def nan_at_step_2(*args, **kwargs):
        calls.append(None)
        norm = real(*args, **kwargs)
        return norm * float("nan") if len(calls) == 3 else norm
    monkeypatch.setattr(train_single, "clip_grad_norm", nan_at_step_2)
    out = str(tmp_path / "run")
    run_single(tiny_argv(tiny_data, out, max_steps=5))
    err = capsys.readouterr().err
    assert err.count("warning: step 2:") == 1 and "optimizer step skipped" in err and "error" not in err, err
    rows = [r for r in strict_rows(out) if "loss" in r]
    assert [r["grad_norm"] is None for r in rows] == [False, False, True, False, False]
    state = load_checkpoint(latest_checkpoint(out))
    assert state["step"] == 5 and int(state["optimizer"]["state"][0]["step"]) == 4    # 4 of 5 steps taken


DIVERGING = [("train_single", 1, {}), ("train_ddp", 2, {}), ("train_zero", 2, dict(zero_stage=1)),
             ("train_zero", 2, dict(zero_stage=3)), ("train_tp", 2, dict(tp=2)), ("train_cp", 2, dict(cp=2)),
             ("train_pp", 2, dict(pp=2)), ("train_ep", 2, dict(ep=2, n_experts=2, top_k=1))]


@pytest.mark.parametrize("script, world, flags", DIVERGING, ids=[f"{s}-{f}" for s, _, f in DIVERGING])
def test_a_diverged_run_stops_and_keeps_a_finite_checkpoint(tiny_data, tmp_path, script, world, flags):
    """--lr 1e30: step 0 is finite and saved, then every loss is NaN. Each rank skips the same steps (the loss
    and norm it decides on are global), the run stops after --max_bad_steps with exit 2 and the same error line on
    every rank (rank 0 alone warns of each skipped step), and the checkpoints saved after the skipped steps hold
    the finite weights of step 0."""
    out = str(tmp_path / "run")
    argv = tiny_argv(tiny_data, out, lr=1e30, min_lr=0, warmup_steps=0, max_steps=10, save_interval=1,
                     n_layer=2, max_bad_steps=2, **flags)
    results = run_workers(exit_code_and_stderr, world, args=(script, argv), timeout=300)
    assert [code for code, _ in results] == [2] * world, results
    err = results[0][1].strip().splitlines()
    assert err[0].startswith("warning: step 1:") and err[-1].startswith("error: step 2:"), err
    assert "2 steps in a row" in err[-1] and all(e.strip() == err[-1] for _, e in results[1:]), results
    rows = [r for r in strict_rows(out) if "loss" in r]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["loss"] is None
    state = load_checkpoint(latest_checkpoint(out))       # one checkpoint, of the last good step
    assert state["step"] == 2 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_non_finite_weights_are_never_saved(tmp_path, capsys):
    """The last line of defence: a save of inf/NaN weights is refused with one error line, and the good
    checkpoint stays the latest."""
    from types import SimpleNamespace
    from common.checkpoint import save_step
    cfg = SimpleNamespace(out_dir=str(tmp_path), keep_checkpoints=2, dist_timeout=60.0)
    save_step(cfg, dict(model={"w": torch.ones(2)}, step=1), 1)
    with pytest.raises(SystemExit) as stop:
        save_step(cfg, dict(model={"w": torch.tensor([1.0, float("inf")])}, step=2), 2)
    assert stop.value.code == 2 and "inf/NaN (w)" in capsys.readouterr().err
    assert load_checkpoint(latest_checkpoint(str(tmp_path)))["step"] == 1
    assert not os.path.exists(os.path.join(str(tmp_path), "ckpt", "step_00000002", "ckpt.pt"))


def test_max_bad_steps_must_be_positive(tiny_data, tmp_path, capsys):
    line = one_error_line(capsys, tiny_argv(tiny_data, str(tmp_path), max_bad_steps=0))
    assert "--max_bad_steps must be positive" in line


# ----------------------------------------------------------------------------------------------------------
# bad datasets: one line naming the file

def _dataset(path, meta=None, train=None, val=None):
    make_tiny_dataset(str(path))
    if meta is not None:
        (path / "meta.json").write_text(meta)
    for name, content in (("train.bin", train), ("val.bin", val)):
        if content is not None:
            (path / name).write_bytes(content)
    return str(path)


@pytest.mark.parametrize("damage, message", [
    (dict(meta='{"tokenizer": "byte"}'), "meta.json needs vocab_size"),
    (dict(meta='{"vocab_size": "many"}'), "meta.json needs vocab_size"),
    (dict(meta='{"vocab_size": 70000}'), "meta.json needs vocab_size, an integer in 1..65536"),
    (dict(meta='{"vocab_size": 32}'), "train.bin holds token id 63, but"),          # the data has ids up to 63
    (dict(meta="vocab_size = 64"), "meta.json is not valid JSON"),
    (dict(meta="[64]"), "meta.json is not a JSON object"),
    (dict(train=b""), "train.bin: cannot mmap an empty file"),
    (dict(val=b"\x01\x00\x02"), "val.bin: Size of available data is not a multiple"),
])
def test_a_bad_dataset_is_one_line_naming_the_file(tmp_path, capsys, damage, message):
    data = _dataset(tmp_path / "data", **damage)
    line = one_error_line(capsys, tiny_argv(data, str(tmp_path / "out")))
    assert message in line and data in line, line
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")             # no work started


def test_a_foreign_vocab_in_one_split_is_found_before_work(tmp_path):
    """Subprocess, as a user runs it: the val split holds ids past vocab_size; no traceback."""
    data = _dataset(tmp_path / "data", val=np.full(5000, 300, dtype=np.uint16).tobytes())
    proc = subprocess.run([sys.executable, "train_single.py", *tiny_argv(data, str(tmp_path / "out"))], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and "val.bin holds token id 300" in proc.stderr, proc.stderr


def test_a_pickle_that_runs_code_is_refused(tmp_path, capsys):
    """nanoGPT's meta.pkl is plain data; a pickle that would import and call something is not read."""
    data = _dataset(tmp_path / "data")
    os.remove(os.path.join(data, "meta.json"))
    with open(os.path.join(data, "meta.pkl"), "wb") as f:
        pickle.dump(dict(vocab_size=64, hook=os.getcwd), f)        # refers to posix.getcwd
    line = one_error_line(capsys, tiny_argv(data, str(tmp_path / "out")))
    assert "meta.pkl is not a readable nanoGPT meta.pkl" in line and "not plain data" in line, line


# ----------------------------------------------------------------------------------------------------------
# --out_dir: checked before any work

@pytest.mark.parametrize("case", ["a file", "under a file", "not writable", "ckpt is a file", "latest is a dir"])
def test_a_bad_out_dir_is_one_line_before_work(tiny_data, tmp_path, capsys, monkeypatch, case):
    (tmp_path / "file").write_text("not a directory")
    out, message = {"a file": (tmp_path / "file", "is a file, not a directory"),
                    "under a file": (tmp_path / "file" / "run", f"cannot be created: {tmp_path / 'file'} is a file"),
                    "not writable": (tmp_path / "ro" / "run", f"cannot be created: {tmp_path / 'ro'} is not writable"),
                    "ckpt is a file": (tmp_path / "run", "ckpt is a file"),
                    "latest is a dir": (tmp_path / "run", "ckpt/latest is a directory")}[case]
    if case == "not writable":      # root ignores permission bits: os.access answers as for a read-only mount
        os.makedirs(tmp_path / "ro")
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and os.path.basename(p) != "ro")
    if case == "ckpt is a file":
        os.makedirs(tmp_path / "run")
        (tmp_path / "run" / "ckpt").write_text("not a directory")
    if case == "latest is a dir":       # each save replaces the file `latest`: found now, not after the training
        os.makedirs(tmp_path / "run" / "ckpt" / "latest")
    line = one_error_line(capsys, tiny_argv(tiny_data, str(out)))
    assert message in line, line
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


# ----------------------------------------------------------------------------------------------------------
# a rank that dies mid-run: the others end at once with one line, not a traceback through the training loop

def test_a_collective_failure_is_named_in_one_line():
    gloo = RuntimeError("[/src/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5357: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging. GLHF!")
    assert collective_failure(gloo) == "Read error [127.0.0.1]:5357: Connection reset by peer"
    closed = RuntimeError("Application timeout caused pair closure")      # a pair an earlier timeout closed
    assert collective_failure(closed) == "Application timeout caused pair closure"
    assert collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert collective_failure(ValueError("/gloo/ but not a RuntimeError")) is None


@pytest.mark.parametrize("message, kind", [
    ("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48030: Connection reset by peer", "peer gone"),
    ("[/x/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:5357", "peer gone"),
    ("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete",
     "timed out"),
    ("Application timeout caused pair closure", "timed out"),
    ("NCCL communicator was aborted on rank 1.", "peer gone"),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 30000 "
     "milliseconds before timing out.", "timed out"),
    # without blocking wait, torch's watchdog aborts the communicator and the next collective says why
    ("NCCL communicator was aborted on rank 0.  Original reason for failure was: [Rank 0] Watchdog caught collective "
     "operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 30012 milliseconds before timing out.",
     "timed out"),
    ("NCCL communicator was aborted on rank 0.  Original reason for failure was: NCCL error: remote process exited or "
     "there was a network error, NCCL version 2.27.5", "peer gone"),
])
def test_a_failed_collective_says_whether_a_peer_is_gone_or_timed_out(message, kind):
    """The one classifier of every barrier and collective: a dead peer is never reported as a timeout (nor the
    advice to raise --dist_timeout given for one)."""
    from common.distributed import describe_failure, failure_kind
    reason = collective_failure(RuntimeError(message) if "gloo" in message or "Application" in message
                                else torch.distributed.DistBackendError(message))
    assert failure_kind(reason) == kind
    line = describe_failure(reason, "the checkpoint save of step 4", 30)
    if kind == "timed out":
        assert "waited longer than --dist_timeout 30 s" in line and "raise --dist_timeout" in line, line
    else:
        assert "another rank exited" in line and "--dist_timeout" not in line, line


def test_a_failed_multi_process_run_exits_with_its_code_before_teardown(monkeypatch):
    """distributed.destroy_at_exit after errors.fail on 2 ranks: the group is left, then os._exit(2), so gloo threads
    that outlive the group cannot abort the process in the interpreter's teardown. One rank (tests in this process),
    or no failure: no hard exit."""
    from common import distributed, errors
    calls = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append("destroyed"))
    monkeypatch.setattr(distributed.os, "_exit", lambda code: calls.append(code))
    for world, failed in ((2, 2), (1, 2), (2, None)):
        monkeypatch.setattr(distributed.dist, "get_world_size", lambda: world)
        monkeypatch.setitem(errors.FAILED, "code", failed)
        distributed.destroy_at_exit()
    assert calls == ["destroyed", 2, "destroyed", "destroyed"]


def test_a_killed_rank_ends_the_other_with_one_error_line(tiny_data, tmp_path):
    """train_ddp on 2 processes started as torchrun starts them; rank 1 is killed after 2 steps: rank 0 exits 2
    with one `error:` line within seconds (not --dist_timeout) and no traceback."""
    out = tmp_path / "run"
    argv = tiny_argv(tiny_data, str(out), max_steps=100_000, dist_timeout=120)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "train_ddp.py", *argv], cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in (0, 1)]
    try:
        metrics = out / "metrics.jsonl"
        while not metrics.exists() or metrics.read_text().count("\n") < 2:
            assert procs[0].poll() is None, procs[0].communicate()[1]
            time.sleep(0.05)
        procs[1].kill()
        err = procs[0].communicate(timeout=60)[1]
    finally:
        for p in procs:
            p.kill()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert procs[0].returncode == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: a collective failed: another rank exited"), err


def _launch(script, argv, world, ranks, port, **env):
    """Processes of `ranks` (of a world of `world`) as torchrun starts them; (Popen, ...)."""
    base = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS="1", **env)
    return [subprocess.Popen([sys.executable, script, *argv], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=dict(base, RANK=str(r), LOCAL_RANK=str(r))) for r in ranks]


def test_a_rank_that_never_starts_is_one_line_within_dist_timeout(tiny_data, tmp_path):
    """Rank 1 of 2 is never launched: rank 0 gives up the rendezvous after --dist_timeout with one line."""
    (proc,) = _launch("train_ddp.py", tiny_argv(tiny_data, str(tmp_path / "run"), dist_timeout=2), 2, [0],
                      free_port())
    out, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and "could not join the process group of 2 rank(s)" in lines[0], err


def test_a_single_device_script_refuses_a_world_of_several_ranks(tiny_data, tmp_path):
    """train_single under torchrun on 2 ranks would train twice on one out_dir: each rank exits 2 before any work,
    each with the same line. A WORLD_SIZE without RANK (a stray shell variable) is not a world: one process, the whole
    batch, the same losses as without it; a parallel script refuses it (it would split the batch)."""
    procs = _launch("train_single.py", tiny_argv(tiny_data, str(tmp_path / "a"), max_steps=3), 2, [0, 1], free_port())
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    lines = [line for _, err in outputs for line in err.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0] == lines[1], lines          # each rank says it (torchrun may kill one first)
    assert "trains on one device" in lines[0] and "WORLD_SIZE=2" in lines[0], lines
    assert not os.path.exists(tmp_path / "a" / "metrics.jsonl")
    reference = run_single(tiny_argv(tiny_data, str(tmp_path / "b"), max_steps=3))[0]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "train_single.py", *tiny_argv(tiny_data, str(tmp_path / "c"), max_steps=3)],
                         cwd=ROOT, text=True, capture_output=True, env=dict(env, WORLD_SIZE="4"), timeout=120)
    assert run.returncode == 0 and "without RANK" in run.stdout, run.stderr
    assert losses(str(tmp_path / "c")) == reference
    run = subprocess.run([sys.executable, "train_ddp.py", *tiny_argv(tiny_data, str(tmp_path / "d"), max_steps=3)],
                         cwd=ROOT, text=True, capture_output=True, env=dict(env, WORLD_SIZE="2"), timeout=120)
    lines = run.stderr.strip().splitlines()      # a parallel script would split the batch: refused
    assert run.returncode == 2 and len(lines) == 1 and "WORLD_SIZE=2 is set but RANK is not" in lines[0], lines


def test_one_run_writes_an_out_dir_and_a_dead_ones_lock_is_taken_over(tiny_data, tmp_path):
    """A second run on a busy out_dir stops before any work with one line naming the first (pid, host); its
    files are untouched. A lock left by a killed run is taken over with a note."""
    out = str(tmp_path / "run")
    argv = tiny_argv(tiny_data, out, max_steps=100_000, save_interval=5)
    first = subprocess.Popen([sys.executable, "train_single.py", *argv], cwd=ROOT, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not metrics.exists() or metrics.read_text().count("\n") < 2:
            assert first.poll() is None, first.communicate()[1]
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "train_single.py", *argv], cwd=ROOT, text=True,
                                capture_output=True, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"is in use by another run (pid {first.pid} on host " in lines[0], lines
        assert first.poll() is None                 # the first run goes on
    finally:
        first.kill()
        first.wait()
    rows = strict_rows(out)                         # every row whole: no second writer interleaved
    assert [r["step"] for r in rows] == list(range(len(rows)))
    shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)      # what the killed run published goes (a new
    os.remove(os.path.join(out, "metrics.jsonl"))                       # run would refuse it); its lock file stays
    again = subprocess.run([sys.executable, "train_single.py", *tiny_argv(tiny_data, out, max_steps=2)], cwd=ROOT,
                           text=True, capture_output=True, timeout=120)
    assert again.returncode == 0 and f"took over {os.path.realpath(out)}/run.lock from pid {first.pid}" in again.stdout


def in_own_directory(rank, world_size, where, argv):
    """A worker: train_ddp's main(argv) from the directory where[rank] (a node with its own disk, to a relative
    --out_dir); (exit code, this rank's stderr)."""
    os.chdir(where[rank])
    return exit_code_and_stderr(rank, world_size, "train_ddp", argv)


def test_an_out_dir_only_rank_0_sees_is_one_line_at_start(tiny_data, tmp_path):
    """--out_dir on a node-local disk (here: a relative path, rank 1 in another directory): each rank's part would
    land on its own node and only rank 0's node would hold the checkpoint; refused at start with one line."""
    where = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for d in where:
        os.makedirs(d)
    argv = tiny_argv(tiny_data, "run", max_steps=2)
    (code0, err0), (code1, err1) = run_workers(in_own_directory, 2, args=(where, argv), timeout=120)
    assert code0 == 2 and code1 == 2, (err0, err1)
    lines = err1.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: --out_dir run is not the directory rank 0 "
                                                   "writes: this node sees no run.lock there"), lines
    assert not os.path.exists(tmp_path / "node0" / "run" / "metrics.jsonl")


@pytest.mark.parametrize("flag, value", [("seed", 2 ** 63), ("seed", -1), ("dist_timeout", 1e-9),
                                         ("dist_timeout", "nan"), ("capacity_factor", "inf"), ("aux_loss_coef", "nan"),
                                         ("n_embd", -4), ("micro_batch_size", 0), ("dropout", "nan")])
def test_every_shared_flag_has_a_range(tiny_data, tmp_path, capsys, flag, value):
    line = one_error_line(capsys, tiny_argv(tiny_data, str(tmp_path), **{flag: value}))
    assert f"--{flag}" in line, line


def test_seed_plus_rank_must_fit_in_63_bits(tiny_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    line = one_error_line(capsys, tiny_argv(tiny_data, str(tmp_path), seed=2 ** 63 - 2))
    assert "--seed must be at most 2**63 - 4" in line, line


# ----------------------------------------------------------------------------------------------------------
# --n_microbatches

def test_negative_n_microbatches_is_one_line(tiny_data, tmp_path, capsys):
    import train_pp
    line = one_error_line(capsys, tiny_argv(tiny_data, str(tmp_path), pp=1, n_microbatches=-2), train_pp)
    assert "--n_microbatches must be >= 1, or 0" in line and "got -2" in line, line


# ----------------------------------------------------------------------------------------------------------
# stale temporary files of killed saves

def test_stale_temporary_checkpoint_files_are_removed_at_start(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    os.makedirs(out)
    stale = ["ckpt.pt.tmp.4242", "ckpt_rank1.pt.tmp.77"]
    kept = ["ckpt.pt.tmp.notes", "mine.pt.tmp.1", "ckpt.pt"]
    for name in stale + kept:
        (out / name).write_bytes(b"x")
    with pytest.raises(SystemExit):             # ckpt.pt is junk: the resume fails, after the clean-up
        train_single.main(tiny_argv(tiny_data, str(out), resume=True))
    assert sorted(os.listdir(out)) == sorted(kept + ["run.lock"])     # (the lock: this run writes here)
    assert "removed 2 temporary file(s) of interrupted checkpoint saves" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# per-rank RNG: resume with dropout is exact in every script that allows dropout (train_cp refuses it)

DROPOUT_RESUMES = [("train_ddp", {}), ("train_zero", dict(zero_stage=1)), ("train_zero", dict(zero_stage=3)),
                   ("train_tp", dict(tp=2)), ("train_pp", dict(pp=2)),
                   ("train_ep", dict(ep=2, n_experts=4, top_k=2)), ("train_5d", dict(dp=2)), ("train_5d", dict(tp=2))]


@pytest.mark.parametrize("script, flags", DROPOUT_RESUMES, ids=[f"{s}-{f}" for s, f in DROPOUT_RESUMES])
def test_resume_with_dropout_is_exact_per_rank(text_data, tmp_path, script, flags):
    def argv(out, **kw):
        return text_argv(text_data, str(tmp_path / out), dropout=0.1, max_steps=6, **flags, **kw)
    runs = [argv("straight"), argv("split", stop_step=3), argv("split", resume=True)]
    run_workers(recorded_runs, 2, args=(script, runs), timeout=600)
    straight, split = losses(str(tmp_path / "straight")), losses(str(tmp_path / "split"))
    assert len(split) == 6 and split == straight, (split, straight)
    state = load_checkpoint(latest_checkpoint(str(tmp_path / "split")))
    same_stream = "tp" in flags                      # TP ranks must draw the same masks (replicated activations)
    assert len(state["rng_by_rank"]) == 2 and torch.equal(*(s["cpu"] for s in state["rng_by_rank"])) == same_stream


# ----------------------------------------------------------------------------------------------------------
# samples of character-level data (nanoGPT's shakespeare_char layout: meta.pkl with stoi / itos)

def _char_dataset(path, text):
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    os.makedirs(path)
    n = int(0.9 * len(ids))
    ids[:n].tofile(os.path.join(path, "train.bin"))
    ids[n:].tofile(os.path.join(path, "val.bin"))
    with open(os.path.join(path, "meta.pkl"), "wb") as f:
        pickle.dump(dict(vocab_size=len(chars), itos=dict(enumerate(chars)), stoi=stoi), f)
    return str(path), text[n:]


def test_character_level_samples_are_decoded(tmp_path, capsys):
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 60
    data, val_text = _char_dataset(tmp_path / "chars", text)
    run_single(tiny_argv(data, str(tmp_path / "out"), max_steps=2, sample_tokens=20))
    sample = capsys.readouterr().out.split("---- sample ----\n")[1].split("\n----------------")[0]
    assert sample[:16] in val_text and set(sample) <= set(text), repr(sample)       # the prompt, then text
    assert evaluation.decode([0, 1, 2], {"vocab_size": 3, "itos": ["a", "b", "c"]}) == "abc"   # meta.json's list
    with pytest.raises(ValueError, match="tokenizer 'synthetic' is unknown"):
        evaluation.decode([1, 2], {"vocab_size": 64, "tokenizer": "synthetic"})


def test_nccl_collectives_stay_asynchronous_and_the_watchdog_aborts_without_killing(monkeypatch):
    """Before an NCCL group is built: no blocking wait (every wait() would stall the host until its collective is
    done), and the watchdog's error handling set to 2 (abort the communicators, keep the process), so a dead or
    stuck peer raises in the training thread's next collective, where the one-line handler sees it. torchrun's own
    1 counts as unset; a value the user chose is kept."""
    from common.distributed import nccl_error_defaults
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    nccl_error_defaults()
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ and "NCCL_BLOCKING_WAIT" not in os.environ
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")       # torchrun gives every worker 1 unless told otherwise
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    nccl_error_defaults()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    nccl_error_defaults()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ


def test_a_gpu_index_the_node_lacks_is_one_line(monkeypatch):
    """--device cuda:3 (or local rank 3) on a node with 2 GPUs: a ValueError naming the range, not CUDA's trace."""
    from common.distributed import pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"--device cuda:3 \(local rank 3\): this node has 2 GPU\(s\), cuda:0..cuda:1"):
        pick_device("cuda", 3)



def test_each_rank_on_its_own_gpu_and_never_two_on_one(monkeypatch):
    """SLURM-style launches give each rank its own CUDA_VISIBLE_DEVICES: local rank 3 sees one GPU, its cuda:0
    (it was refused with the advice to launch fewer ranks). torchrun shares a node's GPUs: there local rank 3 of
    a node showing one GPU is still refused. --device cuda:1 on several ranks of a node that shows them 2 GPUs
    would put all on GPU 1, which NCCL refuses at init with an error that blamed MASTER_ADDR: refused first."""
    from common.distributed import pick_device
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert pick_device("cuda", 3, world_size=8) == torch.device("cuda", 0)
    assert pick_device("cuda:0", 3, world_size=8) == torch.device("cuda", 0)      # each rank's cuda:0 differs
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=3 shows this rank 1 GPU\(s\), cuda:0..cuda:0; launch "
                                         r"at most 1 ranks per node"):
        pick_device("cuda", 3, world_size=8)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--device cuda:1 puts every rank of this node on GPU 1, but NCCL needs one "
                                         r"GPU per rank: use --device cuda"):
        pick_device("cuda:1", 0, world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")                  # one rank per node: its pinned GPU is fine
    assert pick_device("cuda:1", 0, world_size=2) == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 0)] * 2 + [torch.device("cuda", 1)]
