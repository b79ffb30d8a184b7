"""
bench/failure_runs.py: how bench/failure_battery.py runs a script and judges what happened.

    job = Job.launch("train_tp.py", 2, argv, logdir, "resume")   # one process per rank, torchrun's environment
    job.signal(1, signal.SIGSTOP)                                 # inject a failure while it runs
    run = job.wait(limit=60)                                      # exit codes and stderr of every rank
    verdict = judge_error(run, names=["--lr"])                    # (class, detail)

A multi-rank run is started the way torchrun starts its workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT in each process's environment) but without torchrun's elastic agent, which would kill every rank as
soon as one fails: here a killed or stopped rank's peers must end by themselves, which is what the scripts
promise (docs/failures.md). A one-rank run is plain `python SCRIPT.py`, as a user types it.

Checkpoints are found without knowing their layout inside a step directory: OUT_DIR/ckpt/latest names a step
directory, and every *.pt file in it belongs to that checkpoint.
"""
import glob
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CLEAN, OK, SKIPPED = "clean error", "ok", "skipped"
TRACEBACK, HANG, SILENT, LOST = "traceback", "hang", "silent wrong", "data lost"
UNCLEAR, REFUSED, BROKEN = "unclear error", "refused", "battery error"
GOOD = (CLEAN, OK, SKIPPED)
CLASSES = GOOD + (TRACEBACK, HANG, SILENT, LOST, UNCLEAR, REFUSED, BROKEN)

ERROR_LINE = re.compile(r"^(?:[\w.\-/]+: )?error: ")         # ours, or argparse's "train_x.py: error: ..."
NATIVE_CRASH = ("terminate called", "Segmentation fault", "Fatal Python error")
LIVE = set()                                                   # every process started, for cleanup on exit


# ----------------------------------------------------------------------------------------------------------
# running

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port):
    """torchrun's variables for one worker; none for a one-rank run (plain python)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"                # ranks share 2 cores: one thread each, as the tests do
    if world > 1:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


@dataclass
class Run:
    """What a finished job left: per rank its exit code (negative: killed by that signal) and stderr."""
    codes: list
    errs: list
    outs: list
    hung: list          # ranks still alive at the wall-clock limit (killed by us)
    seconds: float


class Job:
    """Processes started together, each with its own stdout / stderr file and process group."""

    def __init__(self, commands, logdir, tag):
        self.logs = [(os.path.join(logdir, f"{tag}.{i}.out"), os.path.join(logdir, f"{tag}.{i}.err"))
                     for i in range(len(commands))]
        self.procs, self.t0 = [], time.time()
        for (cmd, env), (out, err) in zip(commands, self.logs):
            with open(out, "w") as fo, open(err, "w") as fe:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            self.procs.append(proc)
            LIVE.add(proc)

    @classmethod
    def launch(cls, script, world, argv, logdir, tag):
        port = free_port()
        return cls([([sys.executable, script, *argv], rank_env(r, world, port)) for r in range(world)], logdir, tag)

    def alive(self, ranks=None):
        ranks = range(len(self.procs)) if ranks is None else ranks
        return [r for r in ranks if self.procs[r].poll() is None]

    def signal(self, rank, sig):
        if self.procs[rank].poll() is None:
            os.kill(self.procs[rank].pid, sig)

    def wait(self, limit, ranks=None):
        """Wait until `ranks` (default all) have exited or `limit` seconds have passed since now; then kill
        whatever is left (a stopped rank too) and collect every rank's exit code and output."""
        deadline = time.time() + limit
        while self.alive(ranks) and time.time() < deadline:
            time.sleep(0.05)
        hung = self.alive(ranks)
        self.kill_all()
        errs, outs = [], []
        for out, err in self.logs:
            with open(err, errors="replace") as f:
                errs.append(f.read())
            with open(out, errors="replace") as f:
                outs.append(f.read())
        return Run([p.returncode for p in self.procs], errs, outs, hung, time.time() - self.t0)

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)        # its group: torchrun's workers too
            p.wait()
            LIVE.discard(p)


def kill_everything_left():
    for p in list(LIVE):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def wait_until(condition, job, limit, interval=0.05):
    """Poll condition() until it holds (True), the job has ended, or limit seconds pass (False)."""
    deadline = time.time() + limit
    while time.time() < deadline and job.alive():
        if condition():
            return True
        time.sleep(interval)
    return condition()


# ----------------------------------------------------------------------------------------------------------
# reading what a run left

def metric_rows(out_dir):
    """(step rows of metrics.jsonl as strict JSON, a problem or None). NaN / Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} in metrics.jsonl")
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return [], "no metrics.jsonl"
    try:
        with open(path) as f:
            rows = [json.loads(line, parse_constant=refuse) for line in f if line.strip()]
    except ValueError as e:
        return [], f"metrics.jsonl is not valid JSON ({e})"
    return [r for r in rows if "loss" in r], None


def losses_by_step(rows):
    """step -> loss, the later row winning (a resumed run logs the steps since its checkpoint again)."""
    return {r["step"]: r["loss"] for r in rows}


def steps_logged(out_dir):
    return len(losses_by_step(metric_rows(out_dir)[0]))


def latest_step_dir(out_dir):
    """The step directory `latest` names, else (latest lost) the newest one holding a *.pt file, else None."""
    root = os.path.join(out_dir, "ckpt")
    try:
        with open(os.path.join(root, "latest")) as f:
            named = os.path.join(root, f.read().strip())
        if checkpoint_files(named):
            return named
    except OSError:
        pass
    dirs = [d for d in sorted(glob.glob(os.path.join(root, "step_*"))) if checkpoint_files(d)]
    return dirs[-1] if dirs else None


def checkpoint_files(step_dir):
    return sorted(p for p in glob.glob(os.path.join(step_dir, "*.pt")) if os.path.isfile(p))


def temp_files(out_dir):
    return [p for p in glob.glob(os.path.join(out_dir, "**", "*.tmp.*"), recursive=True)]


def non_finite(obj):
    """The first non-finite floating tensor inside a loaded checkpoint, as a key path, or None."""
    import torch
    if isinstance(obj, torch.Tensor):
        return "" if obj.is_floating_point() and not torch.isfinite(obj).all() else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        where = non_finite(value)
        if where is not None:
            return f"{key}.{where}".rstrip(".")
    return None


def checkpoint_problem(out_dir):
    """None if OUT_DIR holds a consistent checkpoint (every *.pt of the latest step directory loads and is
    finite, and every part its ckpt.pt names is there), else what is wrong with it."""
    import torch
    step_dir = latest_step_dir(out_dir)
    if step_dir is None:
        return "no checkpoint left"
    for path in checkpoint_files(step_dir):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:      # whatever torch raises for a damaged file
            return f"{os.path.relpath(path, out_dir)} does not load ({type(e).__name__})"
        where = non_finite(state)
        if where is not None:
            return f"{os.path.relpath(path, out_dir)} holds inf/NaN at {where}"
        missing = [p for p in (state.get("parts", []) if isinstance(state, dict) else []) if not os.path.isfile(os.path.join(step_dir, p))]
        if missing:                 # a commit that went ahead without every rank's part
            return f"{os.path.relpath(path, out_dir)} names parts that are not there: {missing[:2]}"
    return None


def snapshot(out_dir):
    """The latest checkpoint as (its step directory, {file: sha1}), to tell later whether it survived."""
    step_dir = latest_step_dir(out_dir)
    files = checkpoint_files(step_dir) if step_dir else []
    return step_dir, {p: hashlib.sha1(open(p, "rb").read()).hexdigest() for p in files}


def data_kept(before, out_dir):
    """(LOST, detail) if the checkpoint `before` (a snapshot) was damaged and nothing newer and good replaced
    it, else None."""
    problem = checkpoint_problem(out_dir)
    if problem:
        return LOST, problem
    old_dir, old_files = before
    new_dir = latest_step_dir(out_dir)
    if os.path.basename(new_dir) < os.path.basename(old_dir):
        return LOST, f"latest went back from {os.path.basename(old_dir)} to {os.path.basename(new_dir)}"
    if new_dir == old_dir and snapshot(out_dir)[1] != old_files:
        return LOST, f"{os.path.basename(old_dir)} was rewritten"
    return None


# ----------------------------------------------------------------------------------------------------------
# judging

def crashed(run, ranks):
    """How some rank of `ranks` crashed (a Python traceback, a native abort, a fatal signal), or None."""
    for r in ranks:
        err = run.errs[r]
        if "Traceback (most recent call last)" in err:
            tail = [line for line in err.strip().splitlines() if line and not line.startswith(" ")]
            return f"rank {r}: {tail[-1] if tail else 'Traceback'}"
        for sign in NATIVE_CRASH:
            if sign in err:
                return f"rank {r}: {sign}"
        if run.codes[r] is not None and run.codes[r] < 0:
            return f"rank {r}: killed by {signal.Signals(-run.codes[r]).name}"
    return None


def error_lines(err):
    return [line for line in err.splitlines() if ERROR_LINE.match(line)]


def first_bad(run, ranks):
    """The hang or crash among `ranks`, as (class, detail), or None."""
    hung = [r for r in run.hung if r in ranks]
    if hung:
        return HANG, f"rank(s) {hung} still running at the wall-clock limit"
    crash = crashed(run, ranks)
    return (TRACEBACK, crash) if crash else None


def judge_error(run, names=(), ranks=None, out_dir=None):
    """A case that must end in a clean error: every judged rank exits nonzero, none prints a traceback, each
    prints at most one `error:` line and some line names one of `names` (a flag or file)."""
    ranks = range(len(run.codes)) if ranks is None else ranks
    bad = first_bad(run, ranks)
    if bad:
        return bad
    if all(run.codes[r] == 0 for r in ranks):
        return SILENT, "exit 0: accepted" + (f" ({describe_run(out_dir)})" if out_dir else "")
    lines = {r: error_lines(run.errs[r]) for r in ranks}
    if any(run.codes[r] == 0 for r in ranks):
        return UNCLEAR, f"ranks exited {[run.codes[r] for r in ranks]}"
    many = [r for r in ranks if len(lines[r]) > 1]
    if many:
        return UNCLEAR, f"rank {many[0]} printed {len(lines[many[0]])} error lines: {lines[many[0]][:2]}"
    found = [line for r in ranks for line in lines[r]]
    if not found:
        last = [line for r in ranks for line in run.errs[r].strip().splitlines()[-1:]]
        return UNCLEAR, f"no `error:` line (exit {[run.codes[r] for r in ranks]}; stderr ends {last[:1]})"
    if names and not any(name in line for line in found for name in names):
        return UNCLEAR, f"does not name {' or '.join(names)}: {found[0]}"
    return CLEAN, found[0]


def describe_run(out_dir):
    rows, problem = metric_rows(out_dir)
    if problem:
        return problem
    losses = losses_by_step(rows)
    nan = sum(1 for v in losses.values() if v is None or not math.isfinite(v))
    return f"{len(losses)} steps logged" + (f", {nan} without a finite loss" if nan else "")


def judge_ok(run, out_dir, steps, reference=None, rtol=1e-9):
    """A case that must succeed: exit 0 everywhere, metrics.jsonl valid JSON with finite losses for exactly steps
    0..steps-1 (equal to `reference`, {step: loss}, within rtol), and a consistent checkpoint left."""
    ranks = range(len(run.codes))
    bad = first_bad(run, ranks)
    if bad:
        return bad
    if any(run.codes):
        lines = [line for r in ranks for line in error_lines(run.errs[r])]
        return REFUSED, f"exit {run.codes}: {lines[0] if lines else run.errs[0].strip()[-200:]}"
    return judge_result(out_dir, steps, reference, rtol)


def judge_result(out_dir, steps, reference=None, rtol=1e-9):
    """The files a successful run left: see judge_ok."""
    rows, problem = metric_rows(out_dir)
    if problem:
        return SILENT, problem
    losses = losses_by_step(rows)
    if sorted(losses) != list(range(steps)):
        got = sorted(losses)
        return SILENT, f"steps {got[:1]}..{got[-1:]} ({len(got)}) logged, expected 0..{steps - 1}"
    if any(v is None or not math.isfinite(v) for v in losses.values()):
        return SILENT, "a non-finite loss in metrics.jsonl"
    for s in sorted(set(reference or {}) & set(losses)):
        a, b = reference[s], losses[s]
        if abs(a - b) > rtol * abs(a):
            return SILENT, f"step {s}: loss {b!r}, the unbroken run's {a!r}"
    problem = checkpoint_problem(out_dir)
    if problem:
        return LOST, problem
    return OK, f"{steps} steps" + (", losses equal to the unbroken run's" if reference else "")
