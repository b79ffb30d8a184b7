"""
bench/failure_battery.py: the failure battery, kept so that it can be rerun. About 500 cases of bad input
and bad luck over every script (train_single, ddp, zero stages 1-3, tp, cp, pp, ep, train_5d), each on a tiny
model and tiny random-token data, CPU and gloo, each classified by what actually happened:

    python bench/failure_battery.py                        # every case (about 20 minutes on 2 CPU cores)
    python bench/failure_battery.py --only "train_tp: "    # the cases whose name contains the text (repeatable)
    python bench/failure_battery.py --list                 # the case names
    ./bench.sh failures                                    # the full battery, from bench.sh

    clean error    nonzero exit, no traceback, at most one `error: ...` line per rank, one naming the flag or file
    ok             a case that must succeed did, with the right result (the unbroken run's losses, a checkpoint)
    skipped        this machine cannot test the case (the reason is given)
  and the outcomes the scripts promise never to have (docs/failures.md):
    traceback      a Python traceback or a native crash (abort, fatal signal) on a rank that was not the victim
    hang           a rank still running at its wall-clock limit (--timeout per run; for a killed or stopped
                   rank's peers: --dist_timeout plus a margin after the failure)
    silent wrong   exit 0 with a wrong result: bad input accepted, NaN in metrics.jsonl, losses after a resume
                   that differ from the unbroken run's, steps past --max_steps, stale temporary files kept
    data lost      a good checkpoint overwritten or removed, or no consistent checkpoint left (one whose every
                   *.pt file loads and holds finite numbers)
    unclear error  it failed without a traceback, but not with one `error:` line naming the flag or file
    refused        a case that must succeed exited with an error
    battery error  the battery itself failed on the case (a bug here, not in the scripts)

The table of every case and the totals per class are printed and written to bench/results/failures.md (the full
battery; with --only, only where --results says). Exit status 1 if any case is in one of the bad classes.
How a run is started and judged: bench/failure_runs.py.
"""
import argparse
import dataclasses
import datetime
import functools
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]   # run as a script
from failure_runs import (BROKEN, CLASSES, CLEAN, GOOD, HANG, LOST, OK, REFUSED, SILENT, SKIPPED, UNCLEAR,  # noqa: E402
                          Job, checkpoint_files, checkpoint_problem, data_kept, first_bad, free_port, judge_error,
                          judge_ok, judge_result, kill_everything_left, latest_step_dir, losses_by_step,
                          metric_rows, rank_env, snapshot, steps_logged, temp_files, wait_until)
from common.config import argv_of  # noqa: E402
from train_helpers import make_tiny_dataset  # noqa: E402

TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, global_batch_size=8, micro_batch_size=4,
            max_steps=6, warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_interval=0, log_interval=100,
            sample_tokens=0, dropout=0.0, device="cpu", dtype="float32", seed=1234)
EXACT = dict(dtype="float64")           # resume checks: float64, where any real difference stands out (1e-9)
SAVE_HEAVY = dict(n_layer=4, n_embd=128, max_steps=30, save_interval=1)   # saves long enough to be hit
RESUME = dict(max_steps=12)             # the good checkpoint of the resume cases is taken at step 6 of 12
DIST_TIMEOUT = 10                       # --dist_timeout of the killed / stopped rank cases
MARGIN = 20                             # seconds past --dist_timeout before a survivor counts as hung


@dataclass
class Layout:
    """One script in one layout: what every per-script case runs. nccl_aborts: launched under tests/nccl_abort.py,
    its collectives failing as NCCL's do (they return; the next one raises)."""
    name: str
    script: str
    world: int
    flags: dict = field(default_factory=dict)
    nccl_aborts: bool = False


LAYOUTS = [Layout("train_single", "train_single.py", 1), Layout("train_ddp", "train_ddp.py", 2),
           Layout("train_zero1", "train_zero.py", 2, dict(zero_stage=1)),
           Layout("train_zero2", "train_zero.py", 2, dict(zero_stage=2)),
           Layout("train_zero3", "train_zero.py", 2, dict(zero_stage=3)),
           Layout("train_tp", "train_tp.py", 2, dict(tp=2)), Layout("train_cp", "train_cp.py", 2, dict(cp=2)),
           Layout("train_pp", "train_pp.py", 2, dict(pp=2)),
           Layout("train_ep", "train_ep.py", 2, dict(ep=2, n_experts=2, top_k=1)),
           Layout("train_5d", "train_5d.py", 4, dict(tp=2, pp=2))]
BY_NAME = {layout.name: layout for layout in LAYOUTS}
NCCL_ABORTS = "tests/nccl_abort.py"     # SCRIPT ARGS: SCRIPT under a process group that fails as NCCL does


class Verdict(Exception):
    """Raised anywhere inside a case to end it with this (class, detail): a failed setup run, for instance."""


class Shared:
    """Runs that several cases use (a good checkpoint, an unbroken run's losses), each made once."""

    def __init__(self, root):
        self.root, self.values, self.locks, self.lock = root, {}, {}, threading.Lock()

    def once(self, key, make):
        with self.lock:
            lock = self.locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self.values:
                self.values[key] = make(os.path.join(self.root, key.replace(" ", "_")))
            return self.values[key]


class Box:
    """A case's own directory, the shared tiny dataset, the per-run wall-clock limit and the shared runs."""

    def __init__(self, root, data, timeout, shared):
        self.root, self.data, self.timeout, self.shared = root, data, timeout, shared
        self.count = 0
        os.makedirs(root)

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def start(self, layout, out, data=None, **flags):
        """Launch `layout` on the tiny setup with `flags` on top; the job's logs go to the case directory."""
        self.count += 1
        argv = argv_of({**TINY, **layout.flags, "data_dir": data or self.data, "out_dir": out, **flags})
        if layout.nccl_aborts:
            return Job.launch(NCCL_ABORTS, layout.world, [layout.script, *argv], self.root, f"run{self.count}")
        return Job.launch(layout.script, layout.world, argv, self.root, f"run{self.count}")

    def run(self, layout, out, data=None, **flags):
        return self.start(layout, out, data, **flags).wait(self.timeout)

    def copy(self, src, name="run"):
        dst = self.path(name)
        shutil.copytree(src, dst)
        return dst


# ----------------------------------------------------------------------------------------------------------
# shared runs

def checked(verdict, what):
    """A setup run's verdict: go on if it is ok, else end the case saying which setup failed."""
    if verdict[0] != OK:
        raise Verdict(verdict[0], f"setup ({what}): {verdict[1]}")


def good_checkpoint(box, layout):
    """A run of `layout` stopped at step 6 of 12 with its checkpoint: copied into the case as its `run`."""
    def make(out):
        run = box.run(layout, out, stop_step=6, **RESUME)
        checked(judge_ok(run, out, 6), "a good run to resume")
        return out
    return box.copy(box.shared.once(f"good {layout.name}", make))


def unbroken_losses(box, layout, **flags):
    """{step: loss} of an uninterrupted run of `layout` with `flags`: what a resumed run must reproduce."""
    def make(out):
        run = box.run(layout, out, **flags)
        checked(judge_ok(run, out, flags.get("max_steps", TINY["max_steps"])), "the unbroken run")
        return losses_by_step(metric_rows(out)[0])
    key = f"unbroken {layout.name} " + " ".join(f"{k}={v}" for k, v in sorted(flags.items()))
    return box.shared.once(key, make)


# ----------------------------------------------------------------------------------------------------------
# cases: bad flags and files (one run each, which must end in a clean error)

def bad_flags(layout, names, box, **flags):
    out = box.path("run")
    return judge_error(box.run(layout, out, **flags), names, out_dir=out)


def bad_data(layout, damage, names, box):
    """The tiny dataset with one file replaced (`damage`: {file name: bytes or None to delete})."""
    data = box.path("data")
    shutil.copytree(box.data, data)
    for name, content in damage.items():
        if content is None:
            os.remove(os.path.join(data, name))
        else:
            with open(os.path.join(data, name), "wb") as f:
                f.write(content)
    out = box.path("run")
    return judge_error(box.run(layout, out, data=data), names, out_dir=out)


def bad_out_dir(layout, kind, box):
    """--out_dir that is a file, under a file, or in a directory this user cannot write."""
    blocker = box.path("blocker")
    if kind == "unwritable":
        if os.geteuid() == 0:
            return SKIPPED, "running as root: permission bits do not stop root's writes"
        os.makedirs(blocker, mode=0o500)
        out = os.path.join(blocker, "run")
    else:
        with open(blocker, "w") as f:
            f.write("a file\n")
        out = blocker if kind == "a file" else os.path.join(blocker, "run")
    try:
        return judge_error(box.run(layout, out), ["--out_dir"], out_dir=out)
    finally:
        if os.path.isdir(blocker):
            os.chmod(blocker, 0o700)


def device_cuda(layout, box):
    import torch
    if torch.cuda.is_available():
        return SKIPPED, "this machine has a GPU"
    return bad_flags(layout, ["--device", "CUDA"], box, device="cuda")


# ----------------------------------------------------------------------------------------------------------
# cases: resume from a missing, damaged or foreign checkpoint

def ckpt_names(out):
    return [os.path.join(out, "ckpt"), "--resume"]


def no_checkpoint(layout, box):
    out = box.path("run")
    return judge_error(box.run(layout, out, resume=True, **RESUME), ckpt_names(out), out_dir=out)


def damage_file(path, how):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "truncated":
            f.truncate(size // 2)
        elif how == "empty":
            f.truncate(0)
        else:                                   # garbage: random bytes of the same size
            f.write(random.Random(path).randbytes(size))


def damaged_checkpoint(layout, how, box):
    """Every *.pt file of the newest step directory truncated to half / emptied / overwritten with noise."""
    out = good_checkpoint(box, layout)
    for path in checkpoint_files(latest_step_dir(out)):
        damage_file(path, how)
    return judge_error(box.run(layout, out, resume=True, **RESUME), ckpt_names(out), out_dir=out)


def checkpoint_is_a_directory(layout, box):
    """Every *.pt file of the newest step directory replaced by a directory of the same name."""
    out = good_checkpoint(box, layout)
    for path in checkpoint_files(latest_step_dir(out)):
        os.remove(path)
        os.makedirs(path)
    return judge_error(box.run(layout, out, resume=True, **RESUME), ckpt_names(out), out_dir=out)


def other_model(layout, box):
    """Resume a checkpoint of n_embd 32 as n_embd 48: one error line, and the checkpoint stays as it was."""
    out = good_checkpoint(box, layout)
    before = snapshot(out)
    verdict = judge_error(box.run(layout, out, resume=True, n_embd=48, **RESUME), ckpt_names(out), out_dir=out)
    return data_kept(before, out) or verdict


def latest_is_a_directory(layout, box):
    """OUT_DIR/ckpt/latest is a directory: the run must refuse before training (or still leave a checkpoint)."""
    out = box.path("run")
    os.makedirs(os.path.join(out, "ckpt", "latest"))
    run = box.run(layout, out)
    if run.codes and all(code == 0 for code in run.codes):
        return judge_result(out, TINY["max_steps"])
    return judge_error(run, ["latest", "--out_dir"], out_dir=out)


# ----------------------------------------------------------------------------------------------------------
# cases: the NaN guard

def nan_guard_verdict(run, out):
    """--lr 1e6: either the guard stops the run (one error line) or the run stayed finite; either way no
    checkpoint may hold inf/NaN."""
    if run.codes and all(code == 0 for code in run.codes):
        return judge_ok(run, out, RESUME["max_steps"])
    verdict = judge_error(run, ["--max_bad_steps"], out_dir=out)
    problem = checkpoint_problem(out)
    return (LOST, problem) if problem and "inf/NaN" in problem else verdict


def huge_lr(layout, box):
    out = box.path("run")
    return nan_guard_verdict(box.run(layout, out, lr=1e6, save_interval=1, **RESUME), out)


def huge_lr_over_a_good_checkpoint(layout, box):
    out = good_checkpoint(box, layout)
    before = snapshot(out)
    verdict = nan_guard_verdict(box.run(layout, out, resume=True, lr=1e6, save_interval=1, **RESUME), out)
    return data_kept(before, out) or verdict


# ----------------------------------------------------------------------------------------------------------
# cases: resume must reproduce the unbroken run

def resume_with_dropout(layout, box):
    """Stop at step 3 of 6 and resume, dropout 0.1: the unbroken run's losses (float64) in every script."""
    flags = dict(dropout=0.1, **EXACT)
    reference = unbroken_losses(box, layout, **flags)
    out = box.path("run")
    checked(judge_ok(box.run(layout, out, stop_step=3, **flags), out, 3), "steps 0-2")
    return judge_ok(box.run(layout, out, resume=True, **flags), out, 6, reference)


CHAIN = ["train_single", "train_ddp", "train_zero1", "train_zero2", "train_zero3", "train_tp", "train_cp",
         "train_pp", "train_5d", "train_single"]
MOE = dict(n_experts=2, top_k=1)
MOE_CHAIN = [("train_ep", 2, dict(ep=2)), ("train_5d", 2, dict(dp=2, ep=2)), ("train_single", 1, {})]


def chain_layouts(moe):
    if not moe:
        return [BY_NAME[name] for name in CHAIN]
    return [Layout(name, f"{name}.py", world, {**flags, **MOE}) for name, world, flags in MOE_CHAIN]


def cross_layout(moe, box):
    """One run carried through several layouts by its checkpoint, 2 steps each: the unbroken train_single
    run's losses (float64, 1e-9)."""
    layouts = chain_layouts(moe)
    steps = 2 * len(layouts)
    flags = dict(max_steps=steps, **EXACT, **(MOE if moe else {}))
    reference = unbroken_losses(box, BY_NAME["train_single"], **flags)
    out = box.path("run")
    for i, layout in enumerate(layouts):
        run = box.run(layout, out, stop_step=2 * (i + 1), resume=i > 0, **flags)
        verdict = judge_ok(run, out, 2 * (i + 1), reference)
        if verdict[0] != OK:
            return verdict[0], f"leg {i + 1} ({layout.name}): {verdict[1]}"
    return OK, f"{steps} steps in {len(layouts)} legs: losses equal to train_single's unbroken run (float64, 1e-9)"


# ----------------------------------------------------------------------------------------------------------
# cases: crashes (a rank killed or stopped, kill -9 while saving)

def running_job(box, layout, out, **flags):
    """A job of `layout` that trains (almost) forever, once it has logged 3 steps."""
    job = box.start(layout, out, max_steps=100_000, warmup_steps=2, dist_timeout=DIST_TIMEOUT, **flags)
    if not wait_until(lambda: steps_logged(out) >= 3, job, box.timeout):
        raise Verdict(*judge_ok(job.wait(0), out, 3))       # it ended, or hung, before training: say how
    return job


def rank_failed(layout, victim, sig, box):
    """Rank `victim` killed (SIGKILL) or stopped (SIGSTOP) mid-run: every other rank must end by itself with a
    clean error within --dist_timeout (plus a margin for a busy machine)."""
    out = box.path("run")
    job = running_job(box, layout, out)
    job.signal(victim, sig)
    t0 = time.time()
    survivors = [r for r in range(layout.world) if r != victim]
    run = job.wait(DIST_TIMEOUT + MARGIN, survivors)
    cls, detail = judge_error(run, ranks=survivors)
    return cls, f"survivors ended {time.time() - t0:.1f} s after the {sig.name}: {detail}"


def kill_mid_save(layout, box, rounds=3):
    """kill -9 of every rank while a checkpoint is being written (a temporary file exists), `rounds` times, each
    restart with --resume auto: a consistent checkpoint after every kill, the temporary files of the killed
    saves removed, and the unbroken run's losses at the end."""
    flags = dict(SAVE_HEAVY, resume="auto")
    reference = unbroken_losses(box, layout, **SAVE_HEAVY)
    out, hits = box.path("run"), 0
    for _ in range(rounds):
        job = box.start(layout, out, **flags)
        hit = wait_until(lambda: temp_files(out) and latest_step_dir(out), job, box.timeout, interval=0.002)
        job.kill_all()
        hits += bool(hit)
        problem = checkpoint_problem(out)
        if problem:
            return LOST, f"after kill {hits}: {problem}"
    verdict = judge_ok(box.run(layout, out, **flags), out, SAVE_HEAVY["max_steps"], reference, rtol=1e-6)
    if verdict[0] == OK and temp_files(out):
        return SILENT, f"temporary files of killed saves left: {temp_files(out)[:2]}"
    return verdict[0], f"{hits} of {rounds} kills during a save; {verdict[1]}"


def all_ranks_killed(layout, seed, box):
    """Every rank killed at once at a random moment after the first checkpoint (--save_interval 1), then
    --resume auto: a consistent checkpoint, and the unbroken run's losses (the rows after it)."""
    flags = dict(max_steps=30, save_interval=1)
    reference = unbroken_losses(box, layout, **flags)
    out = box.path("run")
    job = box.start(layout, out, resume="auto", **flags)
    wait_until(lambda: latest_step_dir(out), job, box.timeout)
    time.sleep(random.Random(seed).uniform(0, 1.5))
    job.kill_all()
    problem = checkpoint_problem(out)
    if problem:
        return LOST, problem
    resumed_from = os.path.basename(latest_step_dir(out))
    verdict = judge_ok(box.run(layout, out, resume="auto", **flags), out, 30, reference, rtol=1e-6)
    return verdict[0], f"killed with {resumed_from} latest; {verdict[1]}"


def worker_pids(agent_pid):
    """The processes torchrun's agent started (its children)."""
    pids = []
    for task in os.listdir(f"/proc/{agent_pid}/task"):
        with open(f"/proc/{agent_pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def torchrun_restart(box):
    """train_ddp under `torchrun --max-restarts 1` with --resume auto: a worker killed after a checkpoint, the
    agent restarts both and the job finishes by itself with the unbroken run's losses."""
    layout = BY_NAME["train_ddp"]
    flags = dict(max_steps=30, save_interval=2, dist_timeout=60)
    reference = unbroken_losses(box, layout, **flags)
    out = box.path("run")
    argv = argv_of({**TINY, "data_dir": box.data, "out_dir": out, "resume": "auto", **flags})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2", layout.script, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = Job([(cmd, env)], box.root, "torchrun")
    if not wait_until(lambda: latest_step_dir(out), job, box.timeout):
        raise Verdict(*judge_ok(job.wait(0), out, 30))
    workers = worker_pids(job.procs[0].pid)
    os.kill(workers[-1], signal.SIGKILL)
    return judge_ok(job.wait(box.timeout), out, 30, reference, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# cases: resume compatibility (every loader x every model-defining field), a damaged value, the schedule

MODEL_CHANGES = [("n_layer", 4), ("n_head", 2), ("block_size", 32), ("vocab_size", 128)]
MOE_CHANGES = [("n_experts", 4), ("top_k", 2), ("moe_every", 2)]
MOE_LAYOUTS = [BY_NAME["train_ep"], Layout("train_5d_ep", "train_5d.py", 2, dict(dp=2, ep=2, n_experts=2, top_k=1))]


def other_vocab(box, vocab):
    """The tiny dataset with meta.json saying another vocab_size (its token ids stay below it)."""
    import json
    data = box.path("data")
    shutil.copytree(box.data, data)
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(data, "meta.json"), "w") as f:
        json.dump(dict(meta, vocab_size=vocab), f)
    return data


def changed_model(layout, field, value, box):
    """Resume the layout's own checkpoint with one model-defining field changed: one error line naming it, the
    checkpoint untouched."""
    out = good_checkpoint(box, layout)
    before = snapshot(out)
    if field == "vocab_size":
        run = box.run(layout, out, data=other_vocab(box, value), resume=True, **RESUME)
    else:
        run = box.run(layout, out, resume=True, **{field: value}, **RESUME)
    verdict = judge_error(run, [field], out_dir=out)
    return data_kept(before, out) or verdict


def poison_checkpoint(out, name="transformer.h.1.attn.c_attn.weight"):
    """One weight of the latest checkpoint set to NaN, in whichever file (ckpt.pt or a part) holds it."""
    import torch
    for path in checkpoint_files(latest_step_dir(out)):
        state = torch.load(path, weights_only=True)
        if name in state.get("model", {}):
            state["model"][name].view(-1)[0] = float("nan")
            torch.save(state, path)
            return
    raise Verdict(BROKEN, f"no checkpoint file holds {name}")


def nan_in_checkpoint(layout, box):
    out = good_checkpoint(box, layout)
    poison_checkpoint(out)
    return judge_error(box.run(layout, out, resume=True, **RESUME), ["inf/NaN"], out_dir=out)


def resume_past_schedule(layout, flag, box):
    """The checkpoint is at step 6: --max_steps 4, or --stop_step 3, ends before it."""
    out = good_checkpoint(box, layout)
    flags = dict(max_steps=4) if flag == "--max_steps" else dict(stop_step=3)
    return judge_error(box.run(layout, out, resume=True, **{**RESUME, **flags}), [flag], out_dir=out)


def missing_part(layout, box):
    """A sharded checkpoint with one part file deleted (a node's disk lost): one line naming it."""
    out = good_checkpoint(box, layout)
    parts = [p for p in checkpoint_files(latest_step_dir(out)) if "part_" in p]
    if not parts:
        return SKIPPED, "a one-file checkpoint has no parts"
    os.remove(parts[-1])
    return judge_error(box.run(layout, out, resume=True, **RESUME), [os.path.basename(parts[-1])], out_dir=out)


# ----------------------------------------------------------------------------------------------------------
# cases: one writer per out_dir, and world sizes a script does not take

def concurrent_writers(layout, box):
    """A second run on the out_dir of a running one: one error line naming the first (its pid); the first goes
    on, its metrics.jsonl stays whole."""
    out = box.path("run")
    first = running_job(box, layout, out)
    second = box.run(layout, out)
    alive = first.alive()
    first.kill_all()
    verdict = judge_error(second, ["is in use by another run"], out_dir=None)
    if verdict[0] == CLEAN and not alive:
        return SILENT, "the first run died when the second started"
    rows, problem = metric_rows(out)
    steps = [r["step"] for r in rows]
    if problem or steps != list(range(len(steps))):
        return SILENT, problem or f"metrics.jsonl steps {steps[:6]}... interleaved"
    return verdict


def stale_lock(layout, box):
    """A run killed with -9 leaves its lock file; the next run takes it over (a note) and trains."""
    out = box.path("run")
    running_job(box, layout, out).kill_all()
    run = box.run(layout, out)
    verdict = judge_ok(run, out, TINY["max_steps"])
    if verdict[0] == OK and "took over" not in run.outs[0]:
        return SILENT, "no note that a dead run's lock was taken over"
    return verdict


def single_under_torchrun(box):
    """train_single launched as 2 ranks (torchrun --nproc_per_node 2 train_single.py): each would train alone on
    one out_dir; refused before any work."""
    out = box.path("run")
    layout = Layout("train_single x2", "train_single.py", 2)
    verdict = judge_error(box.run(layout, out), ["one device"], out_dir=out)
    return (SILENT, "metrics.jsonl written") if os.path.exists(os.path.join(out, "metrics.jsonl")) else verdict


def stray_world_size(layout, box):
    """WORLD_SIZE=2 left in the shell, no RANK: train_single runs as one process (the unbroken run's losses); a
    parallel script refuses (it would split the batch for a rank that does not exist)."""
    out = box.path("run")
    argv = argv_of({**TINY, **layout.flags, "data_dir": box.data, "out_dir": out})
    env = dict(rank_env(0, 1, 0), WORLD_SIZE="2")
    run = Job([([sys.executable, layout.script, *argv], env)], box.root, "stray").wait(box.timeout)
    if layout.world == 1:
        return judge_ok(run, out, TINY["max_steps"], unbroken_losses(box, layout))
    return judge_error(run, ["WORLD_SIZE=2"], out_dir=out)


def bad_rank_env(box):
    """RANK=abc: one line naming it."""
    out = box.path("run")
    argv = argv_of({**TINY, "data_dir": box.data, "out_dir": out})
    env = dict(rank_env(0, 2, free_port()), RANK="abc")
    run = Job([([sys.executable, "train_ddp.py", *argv], env)], box.root, "rank").wait(box.timeout)
    return judge_error(run, ["RANK"], out_dir=out)


def lock_is_a_directory(layout, box):
    out = box.path("run")
    os.makedirs(os.path.join(out, "run.lock"))
    return judge_error(box.run(layout, out), ["run.lock"], out_dir=out)


# ----------------------------------------------------------------------------------------------------------
# cases: a full disk during a save (a real one: a small tmpfs; needs root to mount it)

def disk_full(layout, box, leave=24 * 1024):
    """The good checkpoint on a tmpfs filled up to `leave` bytes; the resumed run's save hits ENOSPC: one line
    naming the directory and ENOSPC on the rank(s) that hit it, every rank stopped, the checkpoint kept, no
    temporary file left."""
    import subprocess
    src = good_checkpoint(box, layout)
    disk = box.path("disk")
    os.makedirs(disk)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs) + 1024 * 1024
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", disk], capture_output=True)
    if mount.returncode != 0:
        return SKIPPED, "cannot mount a tmpfs here (needs root)"
    try:
        out = os.path.join(disk, "run")
        shutil.copytree(src, out)
        free = os.statvfs(disk)
        with open(os.path.join(disk, "filler"), "wb") as f:
            f.write(b"\0" * max(0, free.f_bavail * free.f_frsize - leave))
        before = snapshot(out)
        run = box.run(layout, out, resume=True, **RESUME)
        verdict = judge_error(run, ["ENOSPC"], out_dir=out)
        lost = data_kept(before, out)
        if lost:
            return lost
        if temp_files(out):
            return SILENT, f"temporary files left: {temp_files(out)[:2]}"
        if verdict[0] == CLEAN and disk not in verdict[1]:
            return UNCLEAR, f"does not name the directory: {verdict[1]}"
        return verdict
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True)


# ----------------------------------------------------------------------------------------------------------
# cases: a peer gone during a save, a rank that never starts, collectives.py

def signalled_during_save(layout, box, sig):
    """A save-heavy run whose last rank gets `sig` while a checkpoint is being written: (what the other ranks did,
    waited for up to --dist_timeout plus a margin, the out_dir, those ranks)."""
    out = box.path("run")
    job = box.start(layout, out, dist_timeout=DIST_TIMEOUT, **SAVE_HEAVY)
    if not wait_until(lambda: temp_files(out) and latest_step_dir(out), job, box.timeout, interval=0.002):
        raise Verdict(*judge_ok(job.wait(0), out, SAVE_HEAVY["max_steps"]))
    victim = layout.world - 1
    job.signal(victim, sig)
    survivors = [r for r in range(layout.world) if r != victim]
    return job.wait(DIST_TIMEOUT + MARGIN, survivors), out, survivors


def killed_during_save(layout, box):
    """The last rank killed (-9) while a checkpoint is being written: the survivors end within --dist_timeout with
    one line saying a rank exited (not a timeout), and a consistent checkpoint is left."""
    run, out, survivors = signalled_during_save(layout, box, signal.SIGKILL)
    cls, detail = judge_error(run, ranks=survivors)
    if cls == CLEAN and "raise --dist_timeout" in detail:
        return UNCLEAR, f"a killed peer reported as a timeout: {detail}"
    problem = checkpoint_problem(out)
    return (LOST, problem) if problem else (cls, detail)


def stopped_during_save(layout, box):
    """The last rank stopped (SIGSTOP) while a checkpoint is being written, and left stopped: the survivors end
    within --dist_timeout with one line saying they timed out, and `latest` never names the step it did not finish
    (under NCCL's aborts the commit's all-reduce would return each survivor's own "no error")."""
    run, out, survivors = signalled_during_save(layout, box, signal.SIGSTOP)
    problem = checkpoint_problem(out)
    return (LOST, problem) if problem else judge_error(run, ["--dist_timeout"], ranks=survivors)


def never_started(script, box, world=2):
    """Only rank 0 of `world` is launched: it gives up the rendezvous after --dist_timeout with one line."""
    out = box.path("run")
    argv = argv_of({**TINY, "data_dir": box.data, "out_dir": out, "dist_timeout": 3}) if script != "collectives.py" \
        else ["--dist_timeout", "3"]
    run = Job([([sys.executable, script, *argv], rank_env(0, world, free_port()))], box.root, "alone").wait(60)
    return judge_error(run, ["could not join"])


def collectives_run(box, world=4, args=()):
    """collectives.py's README command: every rank exits 0 with no abort at exit."""
    run = Job.launch("collectives.py", world, ["--dist_timeout", "60", *args], box.root, "coll").wait(box.timeout)
    bad = first_bad(run, range(world))
    if bad:
        return bad
    if any(run.codes):
        return REFUSED, f"exit {run.codes}: {run.errs[0].strip()[-200:]}"
    return OK, f"{world} ranks, exit 0 everywhere"


def collectives_rank_killed(box):
    """Rank 1 of 2 killed during the bandwidth sweep: rank 0 ends with one line."""
    job = Job.launch("collectives.py", 2, ["--size", "8", "8", "8", "8", "8", "8", "--dist_timeout",
                                           str(DIST_TIMEOUT)], box.root, "coll")
    time.sleep(4)
    job.signal(1, signal.SIGKILL)
    run = job.wait(DIST_TIMEOUT + MARGIN, [0])
    if run.codes[0] == 0:
        return SKIPPED, "the sweep ended before the kill"
    return judge_error(run, ranks=[0])


def bad_tool_args(cmd, world, names, box):
    """collectives.py or `python -m common.data` with a bad argument: one line naming it."""
    run = Job([(cmd, rank_env(r, world, free_port())) for r in range(world)], box.root, "tool").wait(box.timeout)
    return judge_error(run, names)


def data_tool(box, what):
    """python -m common.data over a good dataset with a bad --input: one line, the dataset untouched."""
    good = box.path("data")
    shutil.copytree(box.data, good)
    before = {n: open(os.path.join(good, n), "rb").read() for n in os.listdir(good)}
    path = box.path("input.txt")
    if what == "a directory":
        os.makedirs(path)
    elif what != "missing":
        with open(path, "wb") as f:
            f.write({"empty": b"", "one byte": b"x"}[what])
    run = Job([([sys.executable, "-m", "common.data", "--input", path, "--out_dir", good], rank_env(0, 1, 0))],
              box.root, "data").wait(box.timeout)
    verdict = judge_error(run, ["--input", "token"])
    after = {n: open(os.path.join(good, n), "rb").read() for n in os.listdir(good)}
    return (LOST, "the good dataset was overwritten") if after != before else verdict


def range_cases():
    """Every entry point x the ranges of its flags."""
    cases = []
    bad = [("--seed 2**63", ["--seed"], dict(seed=2 ** 63)), ("--dist_timeout 1e-9", ["--dist_timeout"],
           dict(dist_timeout=1e-9)), ("--micro_batch_size -1", ["--micro_batch_size"], dict(micro_batch_size=-1)),
           ("--dropout nan", ["--dropout"], dict(dropout="nan")), ("--warmup_steps -1", ["--warmup_steps"],
           dict(warmup_steps=-1)), ("--eval_iters 0", ["--eval_iters"], dict(eval_iters=0))]
    for layout in LAYOUTS:
        cases += [(f"{layout.name}: {what}", functools.partial(bad_flags, layout, names, **flags))
                  for what, names, flags in bad]
    cases += [flag_case("train_single", "--capacity_factor inf", ["--capacity_factor"], n_experts=2,
                        capacity_factor="inf"),
              flag_case("train_ep", "--aux_loss_coef nan", ["--aux_loss_coef"], aux_loss_coef="nan"),
              flag_case("train_ddp", "--bucket_mb nan", ["--bucket_mb"], bucket_mb="nan"),
              flag_case("train_5d", "--seed 2**63-2 on 4 ranks (seed + rank overflows)", ["--seed"], seed=2 ** 63 - 2),
              flag_case("train_tp", "--tp 0", ["--tp"], tp=0), flag_case("train_pp", "--pp_virtual 0",
                                                                         ["--pp_virtual"], pp_virtual=0)]
    tool = [sys.executable, "collectives.py"]
    for what, argv in (("--numel -3", ["--numel", "-3"]), ("--size nan", ["--size", "nan"]),
                       ("--size 0", ["--size", "0"]), ("--device tpu", ["--device", "tpu"]),
                       ("--dist_timeout 1e-9", ["--dist_timeout", "1e-9"]), ("--numel 10**6", ["--numel", "1000000"])):
        cases.append((f"collectives.py: {what}", functools.partial(bad_tool_args, tool + argv, 2, [argv[0]])))
    for what in ("missing", "a directory", "empty", "one byte"):
        cases.append((f"common.data: --input {what} over a good dataset", functools.partial(data_tool, what=what)))
    cases.append(("common.data: --out_dir a file", functools.partial(
        bad_tool_args, [sys.executable, "-m", "common.data", "--input", "README.md", "--out_dir", "README.md"], 1,
        ["--out_dir"])))
    return cases


def new_class_cases():
    """Another model's checkpoint, shared out_dirs, a full disk, a dead peer during a save, a rank that never
    starts, collectives.py, each over every script it applies to."""
    cases = []
    for layout in LAYOUTS:
        name = layout.name
        cases += [(f"{name}: resume with {field} {value}", functools.partial(changed_model, layout, field, value))
                  for field, value in MODEL_CHANGES]
        cases += [(f"{name}: checkpoint holding NaN", functools.partial(nan_in_checkpoint, layout)),
                  (f"{name}: resume past --max_steps", functools.partial(resume_past_schedule, layout, "--max_steps")),
                  (f"{name}: resume past --stop_step", functools.partial(resume_past_schedule, layout, "--stop_step")),
                  (f"{name}: disk full during the save", functools.partial(disk_full, layout)),
                  (f"{name}: run.lock is a directory", functools.partial(lock_is_a_directory, layout))]
        if layout.world > 1:
            cases += [(f"{name}: a part file missing", functools.partial(missing_part, layout)),
                      (f"{name}: rank {layout.world - 1} killed during a save",
                       functools.partial(killed_during_save, layout))]
    for layout in MOE_LAYOUTS:
        cases += [(f"{layout.name}: resume with {field} {value}", functools.partial(changed_model, layout, field,
                                                                                  value)) for field, value in MOE_CHANGES]
    cases.append(("train_single: dense checkpoint resumed with --n_experts 2",
                  functools.partial(changed_model, BY_NAME["train_single"], "n_experts", 2)))
    for name in ("train_single", "train_ddp", "train_tp", "train_5d"):
        cases += [(f"{name}: a second run on a busy out_dir", functools.partial(concurrent_writers, BY_NAME[name])),
                  (f"{name}: a killed run's lock is taken over", functools.partial(stale_lock, BY_NAME[name]))]
    cases += [("train_single launched as 2 ranks", single_under_torchrun),
              ("train_single: stray WORLD_SIZE=2 without RANK", functools.partial(stray_world_size,
                                                                                  BY_NAME["train_single"])),
              ("train_ddp: stray WORLD_SIZE=2 without RANK", functools.partial(stray_world_size, BY_NAME["train_ddp"])),
              ("train_ddp: RANK=abc", bad_rank_env),
              ("train_ddp: rank 1 never starts", functools.partial(never_started, "train_ddp.py")),
              ("train_5d: ranks 1-3 never start", functools.partial(never_started, "train_5d.py", world=4)),
              ("collectives.py: rank 1 never starts", functools.partial(never_started, "collectives.py")),
              ("collectives.py: rank 1 killed during the sweep", collectives_rank_killed)]
    cases += [(f"collectives.py on 4 ranks, run {i}", collectives_run) for i in range(1, 7)]
    return cases + range_cases()


# ----------------------------------------------------------------------------------------------------------
# cases: kinds of input the checks above never tried (odd spellings, prefixes, sizes past memory, launcher
# variables, data files that are pipes, links or of another width, bench.sh's arguments)

def env_case(layout, env, names, box):
    """`layout` launched with `env` on top of torchrun's variables: one line naming the variable."""
    out = box.path("run")
    argv = argv_of({**TINY, **layout.flags, "data_dir": box.data, "out_dir": out})
    port = free_port()
    run = Job([([sys.executable, layout.script, *argv], {**rank_env(r, layout.world, port), **env})
               for r in range(layout.world)], box.root, "env").wait(box.timeout)
    return judge_error(run, names, out_dir=out)


def odd_data(layout, what, box):
    """A token file that is a pipe (opening it waits for a writer), a dangling link, or of uint32 ids (small ids
    read as valid uint16 ones); meta.json saying vocab_size true."""
    import numpy as np
    data = box.path("data")
    shutil.copytree(box.data, data)
    train = os.path.join(data, "train.bin")
    if what == "a pipe":
        os.remove(train)
        os.mkfifo(train)
    elif what == "a dangling link":
        os.remove(train)
        os.symlink(box.path("nowhere"), train)
    elif what == "uint32 ids":
        np.fromfile(train, dtype=np.uint16).astype(np.uint32).tofile(train)
    else:
        with open(os.path.join(data, "meta.json"), "w") as f:
            f.write('{"vocab_size": true}')
    out = box.path("run")
    return judge_error(box.run(layout, out, data=data), ["train.bin", "meta.json"], out_dir=out)


def odd_out_dir(layout, what, box):
    """OUT_DIR/metrics.jsonl a pipe (the run's first open waited for ever), OUT_DIR/ckpt a dangling link (the first
    save failed, after the training)."""
    out = box.path("run")
    os.makedirs(out)
    if what == "metrics.jsonl a pipe":
        os.mkfifo(os.path.join(out, "metrics.jsonl"))
    else:
        os.symlink(box.path("nowhere"), os.path.join(out, "ckpt"))
    run = box.run(layout, out)
    return judge_error(run, ["--out_dir"])


def bench_sh(argv, env, names, box):
    """bench.sh with a bad sweep name or knob: one line before it installs, prepares or runs anything."""
    run = Job([(["bash", "bench.sh", *argv], dict(os.environ, PYTHON=sys.executable, **env))], box.root,
              "bench").wait(box.timeout)
    return judge_error(run, names)


def input_class_cases():
    cases = [flag_case("train_single", "--n_layer 1_0 (Python reads 10)", ["--n_layer"], n_layer="1_0"),
             flag_case("train_ddp", "--lr \u0661e-3 (an Arabic digit)", ["--lr"], lr="\u0661e-3"),
             flag_case("train_single", "--n_l 2 (a prefix of --n_layer)", ["--n_l"], n_l=2),
             flag_case("train_tp", "--max_steps 10**8 (past 8-digit step directories)", ["--max_steps"],
                       max_steps=10 ** 8),
             flag_case("train_zero1", "--global_batch_size 2**64", ["--global_batch_size"], global_batch_size=2 ** 64),
             flag_case("train_single", "--sample_tokens 10**9", ["--sample_tokens"], sample_tokens=10 ** 9),
             flag_case("train_single", "--n_embd 100000 --n_layer 100 (past memory)", ["GiB"], n_embd=100000,
                       n_layer=100),
             flag_case("train_ddp", "--micro_batch_size 10**7 (past memory)", ["GiB"], micro_batch_size=10 ** 7,
                       global_batch_size=2 * 10 ** 7),
             flag_case("train_5d", "--n_embd 16384 --n_layer 64 (past memory on 4 ranks)", ["GiB"], n_embd=16384,
                       n_layer=64),
             flag_case("train_single", "--n_experts 2 --moe_every 7 (no MoE block)", ["--moe_every"], n_experts=2,
                       moe_every=7),
             flag_case("train_single", "--device cuda:99999999999999999999", ["--device"],
                       device="cuda:99999999999999999999")]
    for name, env, names in (("train_single", dict(OMP_NUM_THREADS="0"), ["OMP_NUM_THREADS"]),
                             ("train_ddp", dict(OMP_NUM_THREADS="four"), ["OMP_NUM_THREADS"]),
                             ("train_ddp", dict(LOCAL_RANK="5"), ["LOCAL_RANK"])):
        shown = " ".join(f"{k}={v}" for k, v in env.items())
        cases.append((f"{name}: {shown}", functools.partial(env_case, BY_NAME[name], env, names)))
    for name in ("train_single", "train_ddp"):
        cases += [(f"{name}: train.bin {what}", functools.partial(odd_data, BY_NAME[name], what))
                  for what in ("a pipe", "a dangling link", "uint32 ids")]
    cases.append(("train_single: meta.json with vocab_size true", functools.partial(odd_data, BY_NAME["train_single"],
                                                                                   "vocab true")))
    for name in ("train_single", "train_tp"):
        cases += [(f"{name}: out_dir's {what}", functools.partial(odd_out_dir, BY_NAME[name], what))
                  for what in ("metrics.jsonl a pipe", "ckpt a dangling link")]
    for what, cmd, names in (("collectives.py: --size 1_0", ["collectives.py", "--size", "1_0"], ["--size"]),
                             ("collectives.py: --num 4 (a prefix)", ["collectives.py", "--num", "4"], ["--num"]),
                             ("plan.py: --tp 4 (a prefix of --tp_overlap)", ["plan.py", "--model", "gpt2", "--tp", "4"],
                              ["--tp"])):
        cases.append((what, functools.partial(bad_tool_args, [sys.executable, *cmd], 1, names)))
    for argv, env, names in ((["nosuch"], {}, ["nosuch"]), (["single"], dict(STEPS="1e3"), ["STEPS"]),
                             (["single"], dict(STEPS="3", WARMUP="5"), ["WARMUP"]), ([], {}, ["sweep"])):
        shown = " ".join([*(f"{k}={v}" for k, v in env.items()), "bench.sh", *argv])
        cases.append((shown, functools.partial(bench_sh, argv, env, names)))
    return cases


# ----------------------------------------------------------------------------------------------------------
# cases: what an export writes and an import reads, entry points' bounds, the environment (docs/failures.md's
# classes 1, 4, 5 and 6)

def tool_case(cmd, env, names, box):
    """One command (`env` on top of this environment) that must end in one line naming one of `names`; stdout
    counts too (bench/gpu_check.sh reports there)."""
    run = Job([(cmd, {**rank_env(0, 1, 0), **env})], box.root, "tool").wait(box.timeout)
    return judge_error(dataclasses.replace(run, errs=[o + e for o, e in zip(run.outs, run.errs)]), names)


def gpu_check_case(argv, env, names, box):
    return tool_case(["bash", "bench/gpu_check.sh", *argv], {"PYTHON": sys.executable, **env}, names, box)


def warned(layout, names, box, **flags):
    """Hyperparameters that train degenerately: the run goes on, with a warning line naming them."""
    out = box.path("run")
    run = box.run(layout, out, **flags)
    verdict = judge_ok(run, out, TINY["max_steps"])
    warnings = [line for line in run.outs[0].splitlines() if line.startswith("warning: ")]
    if verdict[0] == OK and not any(name in line for line in warnings for name in names):
        return SILENT, f"no warning naming {' or '.join(names)}"
    return verdict


def lone_rank(script, rank, env, names, box):
    """One rank of two started alone (rank 0 never comes), or with a launch environment no launcher makes."""
    out = box.path("run")
    argv = argv_of({**TINY, "data_dir": box.data, "out_dir": out, "dist_timeout": 3})
    run = Job([([sys.executable, script, *argv], {**rank_env(rank, 2, free_port()), **env})], box.root,
              "lone").wait(box.timeout)
    return judge_error(run, names, out_dir=out)


def export(out, hf_dir, *flags):
    return [sys.executable, "-m", "common.hf", "export", out, hf_dir, *flags]


def export_case(what, box):
    """python -m common.hf export of a good checkpoint: a weight past float16's range (--dtype float16), an HF_DIR
    holding a file of the user's, a dangling HF_DIR link. One line; nothing written, the user's file kept."""
    import torch
    out, hf_dir = good_checkpoint(box, BY_NAME["train_single"]), box.path("hf")
    flags = ["--no_tokenizer"]
    if what == "float16 overflow":
        path = os.path.join(latest_step_dir(out), "ckpt.pt")
        state = torch.load(path, weights_only=True)
        state["model"]["transformer.h.0.mlp.c_fc.weight"].view(-1)[0] = 1e6
        torch.save(state, path)
        flags.append("--dtype=float16")
    elif what == "a user's file in HF_DIR":
        os.makedirs(hf_dir)
        with open(os.path.join(hf_dir, "notes.txt"), "w") as f:
            f.write("mine")
    else:
        os.symlink(box.path("nowhere"), hf_dir)
    verdict = tool_case(export(out, hf_dir, *flags), {}, ["float16", "HF_DIR"], box)
    if what == "a user's file in HF_DIR" and os.listdir(hf_dir) != ["notes.txt"]:
        return LOST, f"HF_DIR now holds {sorted(os.listdir(hf_dir))}"
    if what == "float16 overflow" and os.path.exists(hf_dir):
        return SILENT, "HF_DIR written"
    return verdict


def export_files(hf_dir):
    return {n: open(os.path.join(hf_dir, n), "rb").read() for n in os.listdir(hf_dir)} if os.path.isdir(hf_dir) \
        else None


def export_killed(seed, box):
    """An export over an earlier one (another dtype), SIGKILLed at a random moment: HF_DIR is the earlier export or
    the new one, whole; the next export leaves no temporary directory beside it."""
    out, hf_dir, ref = good_checkpoint(box, BY_NAME["train_single"]), box.path("hf"), box.path("ref")
    for target, dtype in ((ref, "float32"), (hf_dir, "bfloat16")):
        run = Job([(export(out, target, f"--dtype={dtype}", "--no_tokenizer"), rank_env(0, 1, 0))], box.root,
                  "ex").wait(box.timeout)
        if run.codes[0] != 0:
            return BROKEN, f"the setup export failed: {run.errs[0].strip()[-200:]}"
    before, wanted = export_files(hf_dir), export_files(ref)
    job = Job([(export(out, hf_dir, "--dtype=float32", "--no_tokenizer"), rank_env(0, 1, 0))], box.root, "kill")
    time.sleep(random.Random(seed).uniform(0.5, 4.0))
    job.signal(0, signal.SIGKILL)
    job.wait(box.timeout)
    if export_files(hf_dir) not in (before, wanted):
        return LOST, f"HF_DIR is neither export whole: {sorted(export_files(hf_dir) or [])}"
    run = Job([(export(out, hf_dir, "--dtype=float32", "--no_tokenizer"), rank_env(0, 1, 0))], box.root,
              "again").wait(box.timeout)
    left = sorted(n for n in os.listdir(box.root) if n.startswith("hf."))
    if run.codes[0] != 0 or left or export_files(hf_dir) != wanted:
        return SILENT, f"the next export: exit {run.codes[0]}, left {left}"
    return OK, "HF_DIR whole after the kill; nothing left after the next export"


def init_from_case(what, box):
    """--init_from an export of a good checkpoint with an extra tensor (an untied head the model would drop) or a
    NaN weight: one line naming it, before any step."""
    from safetensors.torch import load_file, save_file
    out, hf_dir = good_checkpoint(box, BY_NAME["train_single"]), box.path("hf")
    run = Job([(export(out, hf_dir, "--no_tokenizer"), rank_env(0, 1, 0))], box.root, "ex").wait(box.timeout)
    if run.codes[0] != 0:
        return BROKEN, f"the setup export failed: {run.errs[0].strip()[-200:]}"
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    if what == "an untied head":
        tensors["embed_out.weight"] = tensors["gpt_neox.embed_in.weight"] + 1
    else:
        tensors["gpt_neox.layers.1.mlp.dense_4h_to_h.weight"].view(-1)[3] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    run_dir = box.path("run2")
    return judge_error(box.run(BY_NAME["train_single"], run_dir, init_from=hf_dir), ["--init_from"], out_dir=run_dir)


def interrupted(layout, box):
    """Ctrl-C (SIGINT to every rank, as a terminal sends it) while training: rank 0 prints one `interrupted:` line
    naming the checkpoint kept, which is consistent; no traceback."""
    out = box.path("run")
    job = running_job(box, layout, out, save_interval=2)
    if not wait_until(lambda: latest_step_dir(out) is not None, job, box.timeout):
        return BROKEN, "no checkpoint before the interrupt"
    for rank in range(layout.world):
        job.signal(rank, signal.SIGINT)
    run = job.wait(DIST_TIMEOUT + MARGIN)
    if run.hung:
        return HANG, f"rank(s) {run.hung} still running after Ctrl-C"
    lines = [line for err in run.errs for line in err.strip().splitlines()]
    problem = checkpoint_problem(out)
    if problem:
        return LOST, problem
    if len(lines) != 1 or not lines[0].startswith("interrupted: ") or "--resume" not in lines[0]:
        return UNCLEAR, f"stderr: {lines[:3]}"
    return CLEAN, lines[0]


def round3_cases():
    cases = []
    for what, argv, env, names in (
            ("--budget_s nan", ["--budget_s", "nan"], {}, ["--budget_s"]),
            ("--only zzz (no row)", ["--only", "zzz"], {}, ["--only"]),
            ("--dry --only ddp-2 (no such row on one GPU)", ["--dry", "--only", "ddp-2"], {}, ["--only"]),
            ("--out README.md (a file)", ["--out", "README.md"], {}, ["--out"]),
            ("--plan_sweep --dry --plan_gpus 0", ["--plan_sweep", "--dry", "--plan_gpus", "0"], {}, ["--plan_gpus"]),
            ("--plan_sweep --dry --plan_gpu v100", ["--plan_sweep", "--dry", "--plan_gpu", "v100"], {}, ["--plan_gpu"]),
            ("PYTHON=/bin/echo", [], dict(PYTHON="/bin/echo"), ["PYTHON"])):
        cases.append((f"gpu_check.sh: {what}", functools.partial(gpu_check_case, argv, env, names)))
    single = BY_NAME["train_single"]
    cases += [("train_single: --lr 0.5 --weight_decay 2 (warned)", functools.partial(
                  warned, single, ["--weight_decay"], lr=0.5, weight_decay=2.0, min_lr=0.0)),
              ("train_ddp: --warmup_steps 10 > --max_steps 6 (warned)", functools.partial(
                  warned, BY_NAME["train_ddp"], ["--warmup_steps"], warmup_steps=10)),
              ("train_single: --compile with CXX=no-such-g++", functools.partial(
                  env_case, Layout("train_single", "train_single.py", 1, dict(compile=True)),
                  dict(CXX="no-such-g++"), ["--compile"])),
              ("train_ddp: RANK=0 without MASTER_ADDR/MASTER_PORT", functools.partial(
                  lone_rank, "train_ddp.py", 0, dict(WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="", MASTER_PORT=""),
                  ["RANK"])),
              ("train_ddp: MASTER_PORT=29x", functools.partial(env_case, BY_NAME["train_ddp"], dict(MASTER_PORT="29x"),
                                                              ["MASTER_PORT"])),
              ("train_ddp: rank 0 never starts (rank 1 alone)", functools.partial(
                  lone_rank, "train_ddp.py", 1, {}, ["MASTER_ADDR"])),
              ("train_5d: rank 0 never starts (rank 1 alone)", functools.partial(
                  lone_rank, "train_5d.py", 1, {}, ["MASTER_ADDR"]))]
    cases += [(f"common.hf export: {what}", functools.partial(export_case, what))
              for what in ("float16 overflow", "a user's file in HF_DIR", "a dangling HF_DIR link")]
    cases += [(f"common.hf export killed over an earlier one, run {i}", functools.partial(export_killed, i))
              for i in range(1, 4)]
    cases += [(f"train_single: --init_from with {what}", functools.partial(init_from_case, what))
              for what in ("an untied head", "a NaN weight")]
    cases += [(f"{name}: Ctrl-C", functools.partial(interrupted, BY_NAME[name])) for name in ("train_single",
                                                                                             "train_ddp")]
    return cases


# ----------------------------------------------------------------------------------------------------------
# the case list

def per_layout_cases(layout):
    """The cases repeated for every script."""
    name, cases = layout.name, []

    def add(what, fn, *args, **kwargs):
        cases.append((f"{name}: {what}", functools.partial(fn, layout, *args, **kwargs)))
    add("--resume with no checkpoint", no_checkpoint)
    for how in ("truncated", "garbage", "empty"):
        add(f"{how} checkpoint", damaged_checkpoint, how)
    add("checkpoint file is a directory", checkpoint_is_a_directory)
    add("resume with another model shape (n_embd 48)", other_model)
    add("ckpt/latest is a directory", latest_is_a_directory)
    add("--lr 1e6 (NaN guard)", huge_lr)
    add("--lr 1e6 resumed over a good checkpoint", huge_lr_over_a_good_checkpoint)
    if name == "train_cp":           # its distributed attention has no dropout: the flag is refused
        add("--dropout 0.1 (refused: no attention dropout)", bad_flags, ["--dropout"], dropout=0.1)
    else:
        add("resume with dropout 0.1 is exact", resume_with_dropout)
    add("kill -9 during checkpoint saves x3, then resume", kill_mid_save)
    if layout.world > 1:
        last = layout.world - 1
        add(f"rank {last} killed", rank_failed, last, signal.SIGKILL)
        add(f"rank {last} SIGSTOPped", rank_failed, last, signal.SIGSTOP)
    return cases


def flag_case(layout_name, what, names, **flags):
    layout = BY_NAME[layout_name]
    return f"{layout_name}: {what}", functools.partial(bad_flags, layout, names, **flags)


def flag_cases():
    """Bad values of the shared flags (the parsing is shared, so train_single and one distributed script)."""
    cases = []
    for name in ("train_single", "train_ddp"):
        cases += [flag_case(name, "--lr -1", ["--lr"], lr=-1),
                  flag_case(name, "--lr inf", ["--lr"], lr="inf"),
                  flag_case(name, "--lr nan", ["--lr"], lr="nan"),
                  flag_case(name, "--weight_decay -5", ["--weight_decay"], weight_decay=-5),
                  (f"{name}: --device cuda without a GPU", functools.partial(device_cuda, BY_NAME[name])),
                  flag_case(name, "--device tpu", ["--device"], device="tpu"),
                  flag_case(name, "--dist_timeout 0", ["--dist_timeout"], dist_timeout=0),
                  flag_case(name, "--dist_timeout -1", ["--dist_timeout"], dist_timeout=-1),
                  flag_case(name, "--seed -1", ["--seed"], seed=-1),
                  flag_case(name, '--out_dir ""', ["--out_dir"], out_dir=""),
                  flag_case(name, "--stop_step 8 --max_steps 5", ["--stop_step"], stop_step=8, max_steps=5),
                  flag_case(name, "--stop_step -3", ["--stop_step"], stop_step=-3)]
        for kind in ("a file", "under a file", "unwritable"):
            cases.append((f"{name}: --out_dir {kind}", functools.partial(bad_out_dir, BY_NAME[name], kind)))
    cases += [flag_case("train_single", "--dropout 1.5", ["--dropout"], dropout=1.5),
              flag_case("train_single", "--max_bad_steps 0", ["--max_bad_steps"], max_bad_steps=0),
              flag_case("train_single", "--keep_checkpoints 0", ["--keep_checkpoints"], keep_checkpoints=0),
              flag_case("train_single", "--block_size 0", ["--block_size"], block_size=0),
              flag_case("train_single", "--resume sometimes", ["--resume"], resume="sometimes")]
    return cases


def layout_flag_cases():
    """Each script's own layout flags, bad."""
    return [flag_case("train_ddp", "--global_batch_size 6 (not micro x dp)", ["global_batch_size"],
                      global_batch_size=6),
            flag_case("train_ddp", "--bucket_mb 0", ["--bucket_mb"], bucket_mb=0),
            flag_case("train_zero1", "--zero_stage 4", ["--zero_stage"], zero_stage=4),
            flag_case("train_zero3", "--fp8_all_gather with --fp8 rowwise", ["--fp8_all_gather"], fp8="rowwise",
                      fp8_all_gather=True),
            flag_case("train_tp", "--tp 2 with n_head 3", ["n_head"], n_head=3, n_embd=48),
            flag_case("train_tp", "--tp 3 on 2 ranks", ["--tp"], tp=3),
            flag_case("train_tp", "--sp with block_size 15", ["block_size"], sp=True, block_size=15),
            flag_case("train_cp", "--cp 3 on 2 ranks", ["--cp"], cp=3),
            flag_case("train_cp", "--block_size 6 (zigzag needs a multiple of 4)", ["--block_size"], block_size=6),
            flag_case("train_pp", "--pp 2 with n_layer 3", ["n_layer"], n_layer=3),
            flag_case("train_pp", "--pp 3 on 2 ranks", ["--pp"], pp=3),
            flag_case("train_pp", "interleaved with --pp_virtual 1", ["--pp_virtual"], pp_schedule="interleaved"),
            flag_case("train_pp", "--n_microbatches -2", ["--n_microbatches"], n_microbatches=-2),
            flag_case("train_ep", "--n_experts 3 with --ep 2", ["--n_experts"], n_experts=3),
            flag_case("train_ep", "--n_experts 0", ["--n_experts"], n_experts=0),
            flag_case("train_ep", "--top_k 3 of 2 experts", ["--top_k"], top_k=3),
            flag_case("train_ep", "--ep 3 on 2 ranks", ["--ep"], ep=3),
            flag_case("train_5d", "--tp 3 on 4 ranks", ["tp"], tp=3, pp=1),
            flag_case("train_5d", "--dp 3 on 4 ranks", ["dp"], dp=3),
            flag_case("train_5d", "--zero_stage 3", ["--zero_stage"], zero_stage=3),
            flag_case("train_5d", "--tp 2 with n_head 3", ["n_head"], n_head=3, n_embd=48),
            flag_case("train_5d", "--n_microbatches -2", ["--n_microbatches"], n_microbatches=-2)]


def uint16(*ids):
    import numpy as np
    return np.array(ids, dtype=np.uint16).tobytes()


def data_cases():
    """Bad datasets, on one rank and on two (where a rank-local error must still end every rank)."""
    damages = [("meta.json without vocab_size", {"meta.json": b'{"tokenizer": "byte"}'}, ["meta.json"]),
               ("meta.json with vocab_size 32 (ids reach 63)", {"meta.json": b'{"vocab_size": 32}'}, ["train.bin"]),
               ("meta.json with vocab_size 70000", {"meta.json": b'{"vocab_size": 70000}'}, ["meta.json"]),
               ("meta.json not JSON", {"meta.json": b"vocab_size = 64"}, ["meta.json"]),
               ("no meta.json", {"meta.json": None}, ["meta.json", "meta.pkl"]),
               ("empty train.bin", {"train.bin": b""}, ["train.bin"]),
               ("odd-sized val.bin", {"val.bin": b"\x01\x00\x02"}, ["val.bin"]),
               ("train.bin shorter than block_size", {"train.bin": uint16(*range(10))}, ["train.bin"]),
               ("no train.bin", {"train.bin": None}, ["train.bin"])]
    return [(f"{name}: {what}", functools.partial(bad_data, BY_NAME[name], damage, names))
            for name in ("train_single", "train_ddp") for what, damage, names in damages]


def nccl_abort_cases():
    """The save and resume cases of the sharded layouts again, under tests/nccl_abort.py: a failed collective
    returns as NCCL's do under asynchronous error handling, and only the next one raises."""
    cases = []
    for name in ("train_ddp", "train_zero2", "train_5d"):
        layout = dataclasses.replace(BY_NAME[name], name=f"{name} (NCCL aborts)", nccl_aborts=True)
        last = layout.world - 1
        cases += [(f"{layout.name}: rank {last} killed during a save", functools.partial(killed_during_save, layout)),
                  (f"{layout.name}: rank {last} stopped during a save", functools.partial(stopped_during_save, layout)),
                  (f"{layout.name}: a part file missing", functools.partial(missing_part, layout)),
                  (f"{layout.name}: resume with dropout", functools.partial(resume_with_dropout, layout)),
                  (f"{layout.name}: kill -9 during saves, then --resume auto", functools.partial(kill_mid_save,
                                                                                                 layout))]
    return cases


def crash_cases():
    cases = [(f"train_tp: both ranks killed at once, then --resume auto (#{i})",
              functools.partial(all_ranks_killed, BY_NAME["train_tp"], i)) for i in range(1, 5)]
    ep4 = Layout("train_ep", "train_ep.py", 4, dict(ep=2, n_experts=2, top_k=1, micro_batch_size=2))
    cases += [("train_ep (4 ranks, 2 expert groups): rank 3 SIGSTOPped",
               functools.partial(rank_failed, ep4, 3, signal.SIGSTOP)),
              ("train_ddp: rank 0 killed", functools.partial(rank_failed, BY_NAME["train_ddp"], 0, signal.SIGKILL)),
              ("train_5d: rank 0 SIGSTOPped", functools.partial(rank_failed, BY_NAME["train_5d"], 0, signal.SIGSTOP)),
              ("cross-layout resume: " + " -> ".join(CHAIN), functools.partial(cross_layout, False)),
              ("cross-layout resume (MoE): train_ep -> train_5d -> train_single", functools.partial(cross_layout, True)),
              ("train_ddp: torchrun --max-restarts 1, a worker killed", torchrun_restart)]
    return cases


SELFCHECK = {   # scripts whose outcome is known, to show that the classifier reports each class
    "raises": "raise RuntimeError('a deliberate failure')\n",
    "prints one error line": "import sys\nprint('error: --flag is bad', file=sys.stderr)\nsys.exit(2)\n",
    "sleeps": "import time\ntime.sleep(600)\n",
}


def selfcheck(kind, box):
    """A fake script expected to fail cleanly naming --flag: `raises` must read traceback, `sleeps` hang (after
    3 s, not --timeout: the check is quick)."""
    script = box.path("fake.py")
    with open(script, "w") as f:
        f.write(SELFCHECK[kind])
    return judge_error(Job.launch(script, 1, [], box.root, "fake").wait(min(box.timeout, 3)), ["--flag"])


def all_cases(with_selfcheck=False):
    cases = [case for layout in LAYOUTS for case in per_layout_cases(layout)]
    cases += flag_cases() + layout_flag_cases() + data_cases() + crash_cases() + new_class_cases()
    cases += input_class_cases() + round3_cases() + nccl_abort_cases()
    if with_selfcheck:
        cases += [(f"selfcheck: a script that {kind}", functools.partial(selfcheck, kind)) for kind in SELFCHECK]
    return cases


# ----------------------------------------------------------------------------------------------------------
# running the battery and reporting

def run_case(fn, box):
    t0 = time.time()
    try:
        cls, detail = fn(box)
    except Verdict as v:
        cls, detail = v.args
    except Exception as e:      # a bug of the battery itself: reported as such, the other cases go on
        cls, detail = BROKEN, f"{type(e).__name__}: {e} ({traceback.format_exc().strip().splitlines()[-3].strip()})"
    return cls, detail, time.time() - t0


def markdown(results, argv, seconds):
    from harness import machine_description
    totals = {cls: sum(1 for _, c, _, _ in results if c == cls) for cls in CLASSES}
    bad = sum(n for cls, n in totals.items() if cls not in GOOD)
    lines = [f"## Failure battery: {len(results)} cases, {bad} bad", "",
             f"`python bench/failure_battery.py{' ' + shlex.join(argv) if argv else ''}` on "
             f"{machine_description()}, {datetime.date.today()}, {seconds / 60:.0f} min. Classes: "
             f"bench/failure_battery.py's docstring; {', '.join(GOOD)} are the good ones.", "",
             "| class | cases |", "|---|---|"]
    lines += [f"| {cls} | {n} |" for cls, n in totals.items() if n or cls not in GOOD]
    lines += ["", "| # | case | outcome | detail | s |", "|---|---|---|---|---|"]
    for i, (name, cls, detail, secs) in enumerate(results, 1):
        text = detail.replace("|", "\\|").replace("\n", " ")
        text = text if len(text) <= 220 else text[:217] + "..."
        outcome = cls if cls in GOOD else f"**{cls}**"
        lines.append(f"| {i} | {name} | {outcome} | {text} | {secs:.0f} |")
    return "\n".join(lines) + "\n", bad


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", default=[], help="run the cases whose name contains this text "
                   "(repeat for several)")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once (1: serial, steadiest timings)")
    p.add_argument("--timeout", type=float, default=180, help="wall-clock limit of each run, seconds")
    p.add_argument("--results", default=None, help="markdown output (default: bench/results/failures.md for the "
                   "full battery, none with --only)")
    p.add_argument("--selfcheck", action="store_true", help="add fake cases that must read traceback and hang")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories (printed) for a look")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cases = [(n, fn) for n, fn in all_cases(args.selfcheck) if not args.only or any(o in n for o in args.only)]
    if args.list or not cases:
        print("\n".join(n for n, _ in cases) or "no case matches --only")
        return 0 if cases else 2
    results_path = args.results or (None if args.only else os.path.join(HERE, "results", "failures.md"))
    root = tempfile.mkdtemp(prefix="failure_battery_")
    data = make_tiny_dataset(os.path.join(root, "data"))
    shared = Shared(os.path.join(root, "shared"))
    os.makedirs(shared.root)
    t0 = time.time()
    results = [None] * len(cases)

    def one(i):
        name, fn = cases[i]
        cls, detail, secs = run_case(fn, Box(os.path.join(root, f"case{i + 1:03d}"), data, args.timeout, shared))
        results[i] = (name, cls, detail, secs)
        print(f"[{i + 1:3d}/{len(cases)}] {cls:13s} {name} ({secs:.0f} s): {detail}", flush=True)
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, range(len(cases))))
    finally:
        kill_everything_left()
        if args.keep:
            print(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    table, bad = markdown(results, argv, time.time() - t0)
    print("\n" + table)
    if results_path:
        with open(results_path, "w") as f:
            f.write(table)
        print(f"written to {results_path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
