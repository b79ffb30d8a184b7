"""
common/checkpoint/files.py: the files under OUT_DIR that checkpoint.py reads and writes, and the lock that makes one run
their only writer. Where the files are, how a save lands atomically, how a full disk is reported, and which
temporary files a killed save leaves:

    OUT_DIR/run.lock                               pid and host of the run writing here (flock'ed while it runs)
    OUT_DIR/ckpt/step_00000010/part_00000.pt ...   every rank's part of a sharded save
    OUT_DIR/ckpt/step_00000010/ckpt.pt             written last, by rank 0: the step directory is complete
    OUT_DIR/ckpt/latest                            "step_00000010" (temporary file + os.replace)

Every file is written as `NAME.tmp.PID` and renamed into place once flushed to disk, so a reader sees a whole file
or none. A write that fails (a full disk: ENOSPC, a quota, an I/O error) removes its temporary file and raises
SaveError naming the directory and the error; the checkpoint that `latest` names is untouched.
"""
import atexit
import errno
import os
import re
import shutil
import socket

import torch

CKPT_DIR, FILE, LATEST = "ckpt", "ckpt.pt", "latest"
STEP_DIR = re.compile(r"step_(\d{8})")
PART = "part_{:05d}.pt"                                               # a rank's part of a sharded save
TEMP_FILE = re.compile(r"(ckpt(_rank\d+)?\.pt|part_\d+\.pt|latest)\.tmp\.\d+")   # temporary files of killed saves
LEGACY = "ckpt.pt"                                                    # OUT_DIR/ckpt.pt of earlier versions
LOCK = "run.lock"


def step_dir(out_dir, step):
    return os.path.join(out_dir, CKPT_DIR, f"step_{step:08d}")


def complete_steps(out_dir):
    """Steps whose directory holds its checkpoint file (renamed into place only once fully written), oldest first."""
    root = os.path.join(out_dir, CKPT_DIR)
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = [int(m.group(1)) for m in map(STEP_DIR.fullmatch, names) if m]
    return sorted(s for s in steps if os.path.isfile(os.path.join(step_dir(out_dir, s), FILE)))


def latest_checkpoint(out_dir):
    """The checkpoint file to resume from, or None: the step directory `latest` names, else the newest complete
    one (latest lost), else an earlier version's OUT_DIR/ckpt.pt."""
    try:
        with open(os.path.join(out_dir, CKPT_DIR, LATEST)) as f:
            path = os.path.join(out_dir, CKPT_DIR, f.read().strip(), FILE)
        if os.path.isfile(path):
            return path
    except (OSError, UnicodeDecodeError):
        pass
    steps = complete_steps(out_dir)
    if steps:
        return os.path.join(step_dir(out_dir, steps[-1]), FILE)
    legacy = os.path.join(out_dir, LEGACY)
    return legacy if os.path.isfile(legacy) else None


def published_by_a_run(out_dir):
    """What a run left in out_dir that a fresh run would destroy: its checkpoint, its metrics rows; '' if none."""
    found = []
    checkpoint = latest_checkpoint(out_dir)
    if checkpoint is not None:
        found.append(f"a checkpoint ({os.path.relpath(checkpoint, out_dir)})")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return " and ".join(found)


def per_rank_files(out_dir):
    """ckpt_rank{r}.pt files of earlier versions' tp / pp / ep runs (this version cannot read them)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(n for n in names if re.fullmatch(r"ckpt_rank\d+\.pt", n))


def kept_checkpoint(out_dir):
    """What a run stopped now (Ctrl-C, a full disk) leaves for --resume, in words."""
    path = latest_checkpoint(out_dir)
    if path is None:
        return f"no checkpoint in {out_dir} yet: a new run starts from step 0"
    step = STEP_DIR.fullmatch(os.path.basename(os.path.dirname(path)))
    return (f"{out_dir} keeps the checkpoint {'of step ' + str(int(step.group(1))) if step else path}: run the same "
            f"command with --resume to continue from it")


def missing_checkpoint_message(out_dir):
    old = per_rank_files(out_dir)
    if old:
        return (f"--resume: {out_dir} holds only per-rank checkpoints of an earlier version ({', '.join(old[:2])}"
                f"{', ...' if len(old) > 2 else ''}), which this version does not read; resume them with the "
                f"version that wrote them, or start without --resume")
    return f"--resume: no checkpoint at {os.path.join(out_dir, CKPT_DIR)} (no complete step directory)"


def resolve_resume(value, out_dir):
    """--resume (yes), --resume auto (yes if a complete checkpoint exists, else start fresh), or no: a bool.
    ValueError where auto would silently drop an earlier version's per-rank checkpoints, and where a fresh run would
    overwrite what an earlier run published there (its metrics.jsonl truncated, its checkpoints pruned away)."""
    if value == "yes":
        return True
    if value != "auto":
        published = published_by_a_run(out_dir)
        if published and not held_by_another_run(out_dir):     # (if it runs, lock_out_dir names it instead)
            raise ValueError(f"--out_dir {out_dir} holds {published} of an earlier run, which a new run would overwrite: "
                             f"--resume auto continues that run; to start another, choose a new --out_dir (or remove "
                             f"the old one yourself)")
        return False
    if latest_checkpoint(out_dir) is not None:
        return True
    if per_rank_files(out_dir):
        raise ValueError(missing_checkpoint_message(out_dir))
    return False


# ----------------------------------------------------------------------------------------------------------
# writing: atomic files, and one line when the disk refuses

class SaveError(OSError):
    """A checkpoint file could not be written; str() is the one line to print."""


def os_error(exc):
    """The OSError behind a failed write: torch.save reports a failed write of its file object as a RuntimeError
    ("inline_container.cc ... unexpected pos") whose context is the OSError the file raised."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def save_error(directory, exc):
    cause = os_error(exc)
    if cause is None:
        return SaveError(f"cannot write a checkpoint to {directory} ({type(exc).__name__}: {exc})")
    code = errno.errorcode.get(cause.errno, "")
    what = f"{code}: {cause.strerror}" if code else str(cause)
    advice = "free space there or pick another --out_dir" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else \
        "check that the directory is writable"
    return SaveError(f"cannot write a checkpoint to {directory} ({what}); the previous checkpoint is kept and this "
                     f"save's temporary files are removed; {advice}, then --resume")


def write_atomically(path, write):
    """write(f) into PATH.tmp.PID, flushed to disk, then renamed into place; SaveError, and no temporary file
    left, if any of it fails."""
    directory = os.path.dirname(path) or "."
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())                     # on disk before it is renamed into place (a node crash too)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:             # RuntimeError: torch.save's report of a failed write
        if os.path.exists(tmp):
            os.remove(tmp)
        raise save_error(directory, e) from None


def write_directory_atomically(path, write):
    """The commit-last rule for a directory (python -m common.hf export): write(tmp) fills a fresh directory beside
    PATH (PATH.tmp.PID: the same filesystem), each file is flushed to disk, and then it takes PATH's place. A reader
    sees the old directory whole or the new one whole, never a mixture of the two. A write that fails or is
    interrupted leaves PATH untouched and removes its directory. A killed one leaves it behind, and the next write
    to PATH removes it. Replacing an older PATH takes two renames (PATH -> PATH.old.PID, then the new one in). A
    crash between them leaves that complete older copy as PATH.old.PID. Returns write's result."""
    remove_stale_directories(path)
    tmp, old = f"{path}.tmp.{os.getpid()}", f"{path}.old.{os.getpid()}"
    try:
        os.makedirs(tmp)
        result = write(tmp)
        for root, _, names in os.walk(tmp):
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
        if os.path.isdir(path) and os.listdir(path):
            os.rename(path, old)                     # (rename replaces an empty directory, not a full one)
        os.replace(tmp, path)
    except BaseException:                            # a full disk, a bad tokenizer file, Ctrl-C: PATH as it was
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(old) and not os.path.exists(path):
            os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return result


def remove_stale_directories(path):
    """Remove PATH.tmp.PID and PATH.old.PID left by a killed write_directory_atomically whose process is gone; an
    old copy that never got its successor (killed between the two renames) is put back as PATH instead."""
    parent, base = os.path.split(os.path.abspath(path))
    for name in sorted(os.listdir(parent)):
        match = re.fullmatch(re.escape(base) + r"\.(tmp|old)\.(\d+)", name)
        if match is None or process_alive(int(match.group(2))):
            continue
        if match.group(1) == "old" and not os.path.exists(path):
            os.rename(os.path.join(parent, name), path)
        else:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def kept_words(path, if_replaced, otherwise):
    """A function saying what a Ctrl-C leaves (errors.report_interrupts' `kept`): `if_replaced` once `path`, which
    only a rename into place replaces (the commit-last rule: a dataset's meta.json, an export's directory), has been
    replaced since this call, else `otherwise`. A new file or directory has another inode."""
    def identity():
        try:
            return os.stat(path).st_ino
        except OSError:                              # none there
            return None
    before = identity()
    return lambda: if_replaced if identity() != before else otherwise


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                                  # (another user's process: alive)
        return True
    return True


def write_file(path, state):
    write_atomically(path, lambda f: torch.save(state, f))


def publish(out_dir, step, keep):
    """Commit step `step` as the latest checkpoint, then remove the step directories that are not among the
    newest `keep` (and any newer than `step`: left by a run that crashed before publishing them)."""
    root = os.path.join(out_dir, CKPT_DIR)
    write_atomically(os.path.join(root, LATEST), lambda f: f.write(f"step_{step:08d}\n".encode()))
    steps = [int(m.group(1)) for m in map(STEP_DIR.fullmatch, os.listdir(root)) if m]
    kept = [s for s in complete_steps(out_dir) if s <= step][-keep:]     # never an interrupted save's directory
    for s in steps:
        if s not in kept:
            shutil.rmtree(step_dir(out_dir, s), ignore_errors=True)


def remove_step_dir(out_dir, step):
    """A failed save's step directory, unless `latest` names it (a fresh run saving a step an earlier run in this
    out_dir published): that checkpoint stays, whatever this save wrote into it."""
    latest = latest_checkpoint(out_dir)
    if latest is None or os.path.dirname(latest) != step_dir(out_dir, step):
        shutil.rmtree(step_dir(out_dir, step), ignore_errors=True)


def remove_stale_temp_files(out_dir):
    """Delete the temporary files of saves that were killed mid-write (the checkpoint they would have replaced
    is intact). Called before a run starts, by rank 0 only, once it holds the out_dir lock."""
    root = os.path.join(out_dir, CKPT_DIR)
    dirs = [out_dir, root] + [os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) else [])]
    stale = [os.path.join(d, n) for d in dirs if os.path.isdir(d) for n in os.listdir(d) if TEMP_FILE.fullmatch(n)]
    for path in stale:
        os.remove(path)
    if stale:
        print(f"removed {len(stale)} temporary file(s) of interrupted checkpoint saves from {out_dir}", flush=True)


# ----------------------------------------------------------------------------------------------------------
# reading

def read_file(path, device, mmap=False):
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except Exception as e:   # truncated, empty, missing, or not a checkpoint: torch raises several kinds
        raise ValueError(f"--resume: {path} is not a readable checkpoint ({type(e).__name__}: {e})") from e


def load_checkpoint(path, device="cpu", mmap=False):
    """The checkpoint in train_single's one-file form; a sharded save's parts are merged in (memory-mapped).
    mmap: ckpt.pt memory-mapped too (a one-process save holds every tensor there: an export reads one at a time)."""
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    state = read_file(path, device, mmap=mmap)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ValueError(f"--resume: {path} is not a nanoscale checkpoint (no model state in it)")
    for name in state.pop("parts", []):
        part = read_file(os.path.join(os.path.dirname(path), name), device, mmap=device == "cpu")
        state["model"].update(part["model"])
        state["optimizer"]["state"].update(part["optimizer"]["state"])
    return state


def load_latest(out_dir, device="cpu"):
    """(the checkpoint to resume from, its path); FileNotFoundError or ValueError carry one clear line."""
    path = latest_checkpoint(out_dir)
    if path is None:
        raise FileNotFoundError(missing_checkpoint_message(out_dir))
    return load_checkpoint(path, device), path


# ----------------------------------------------------------------------------------------------------------
# one writer per out_dir: an flock on OUT_DIR/run.lock, held while the process lives (the kernel releases it when
# the process dies, however it dies), the holder's pid and host written in it for the message a second run gets

HELD = {}        # realpath of a lock file -> its open file, for the rest of this process (several main() calls)


def path_problem(out_dir):
    """Whether the longest file a run writes under out_dir (a part of a sharded save, as its temporary file) fits
    this filesystem's limits on a path and on a name; None if it does, else the line to print, at start rather than
    at the first save."""
    longest = os.path.join(os.path.abspath(out_dir), step_dir("", 10 ** 8 - 1),
                           PART.format(99999) + ".tmp." + "9" * 7)
    existing = os.path.abspath(out_dir)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    limits = {name: os.pathconf(existing, name) for name in ("PC_PATH_MAX", "PC_NAME_MAX")}
    if len(longest.encode()) >= limits["PC_PATH_MAX"]:
        return (f"--out_dir {out_dir}: its checkpoint files would have paths of {len(longest.encode())} bytes, past "
                f"this filesystem's limit of {limits['PC_PATH_MAX']}: choose a shorter --out_dir")
    name = max(os.path.abspath(out_dir).split(os.sep), key=lambda part: len(part.encode()))
    if len(name.encode()) > limits["PC_NAME_MAX"]:
        return (f"--out_dir {out_dir}: the name {name[:40]}... has {len(name.encode())} bytes, past this "
                f"filesystem's limit of {limits['PC_NAME_MAX']} for one name: choose a shorter --out_dir")
    return None


def held_by_another_run(out_dir):
    """Whether another process holds out_dir's run.lock now (a look: taken and at once released)."""
    import fcntl
    path = os.path.realpath(os.path.join(out_dir, LOCK))
    if path in HELD or not os.path.isfile(path):
        return False
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def lock_out_dir(out_dir):
    """Take OUT_DIR/run.lock for this process, or return the one error line naming the run that holds it. A lock
    file naming a process that is gone (killed: its flock went with it) is taken over, with a note. A filesystem
    that refuses locks altogether is said as such, not as a run holding the lock."""
    import fcntl
    problem = path_problem(out_dir)
    if problem is not None:
        return problem
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.realpath(os.path.join(out_dir, LOCK))
    if path in HELD:
        return None
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):     # ENOLCK, EOPNOTSUPP...
            f.close()
            return (f"--out_dir {out_dir}: its filesystem refuses file locks (flock on {path}: {e.strerror}), which "
                    f"keep two runs from writing one out_dir; choose an --out_dir on a filesystem that supports "
                    f"them (a local disk; NFS v4)")
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return (f"--out_dir {out_dir} is in use by another run ({holder}, holding {path}); one run writes an "
                f"out_dir at a time: wait for it, stop it, or pick another --out_dir")
    f.seek(0)
    previous = f.read().strip()
    if previous:
        print(f"note: took over {path} from {previous}, which is no longer running", flush=True)
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    if not HELD:
        atexit.register(release_out_dir_locks)
    HELD[path] = f
    return None


def lock_holder(out_dir):
    """What OUT_DIR/run.lock says as this node sees it (the pid and host of the run holding it), or None."""
    try:
        with open(os.path.join(out_dir, LOCK)) as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def release_out_dir_locks():
    """Empty and unlock every lock file this process holds (at exit: an emptied file is a lock nobody holds)."""
    for f in HELD.values():
        f.seek(0)
        f.truncate()
        f.close()                                    # closing the last descriptor releases the flock
    HELD.clear()
