"""
comm.py: process-group setup and every collective nanoscale uses, each one counted.

    env = init_distributed(cfg)      # reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK; gloo on CPU, nccl on GPU
    all_reduce(grad, group=dp_group) # the same call as torch.distributed, plus bytes accounting
    COMM.bytes_sent                  # bytes this rank sent since the last COMM.reset()
    comm.LAUNCH_LOG = []             # record every launch in NCCL's groups, for nccl_check.py (default off)

Under a torch profiler (--profile, profiling.py) each call is also a range "comm:<op> [group's global ranks]", and
an async call's wait() a range "comm:wait <op> ...": traces show communication (bench/timeline.py colours it).

Bytes are counted under the standard ring algorithms (README, "Metrics"), S = the full tensor's bytes,
n = group size, counting what *this rank sends*:
    all_reduce 2(n-1)/n * S     reduce_scatter (n-1)/n * S of its input    all_gather (n-1)/n * S of its output
    all_to_all: the bytes of its input that go to other ranks (= (n-1)/n * S for even splits)
    send S (recv 0)             broadcast (n-1)/n * S (pipelined chain)
So one convention holds everywhere and DP, ZeRO-1/2 and ZeRO-3 come out at 2P, 2P and 3P times (n-1)/n.

Every process group is created with a timeout (--dist_timeout), so a dead or diverged rank raises an error
instead of hanging forever.
"""
import atexit
import contextlib
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from config import FAILED, fail

# torch >= 2.13 renamed the flat-tensor collectives and warns on the old names; older torch only has those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounter:
    """Bytes sent by this rank, in total, per operation and per process group, since the last reset()
    (train_5d.py names its groups' bytes by grid axis)."""

    def __init__(self):
        self.paused = False
        self.reset()

    def reset(self):
        self.bytes_sent = 0.0
        self.by_op = defaultdict(float)
        self.calls = defaultdict(int)
        self.by_group = defaultdict(float)      # key: the group passed (None: the default group)

    def add(self, op, nbytes, group=None):
        if self.paused:
            return
        self.bytes_sent += nbytes
        self.by_op[op] += nbytes
        self.calls[op] += 1
        self.by_group[group] += nbytes

    @contextlib.contextmanager
    def uncounted(self):
        """Collectives inside are left out of the counts: reducing the loss for the log (and for optim's
        NonFiniteGuard, before the optimizer step) is not the technique's traffic."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


COMM = CommCounter()

# Off (None) by default. Set to a list to record every launch of this process, in order, as NCCL would run it:
# one entry per group (a batch_isend_irecv, a lone send or recv, a collective), each a list of
# (kind, peer global rank, nbytes, the group's global ranks) with kind "send", "recv" or "coll" (peer None).
# nccl_check.py replays such records under NCCL's rules; gloo alone cannot show an ordering NCCL deadlocks on.
LAUNCH_LOG = None


def _log(ops):
    """Append one group of (kind, peer, tensor, group) to LAUNCH_LOG; free when not recording."""
    if LAUNCH_LOG is not None:
        LAUNCH_LOG.append([(kind, peer, _nbytes(t), _ranks(group)) for kind, peer, t, group in ops])


PROFILE_PREFIX = "comm:"


class LabelledWork:
    """An async call's work whose wait() is a profiler range: time spent waiting for communication shows as such."""

    def __init__(self, work, name):
        self.work, self.name = work, name

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(self.name):
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, attr):                 # is_completed, get_future, ...: the work's own
        return getattr(self.work, attr)


def _launch(op, group, fn, /, *args, peer=None, **kwargs):
    """fn(*args, **kwargs), the torch.distributed call; labelled (module docstring) only while a torch profiler
    records, so nothing is added when profiling is off."""
    if not torch.autograd._profiler_enabled():
        return fn(*args, **kwargs)
    name = f"{op} {list(_ranks(group))}" + ("" if peer is None else f" -> {peer}")
    with torch.profiler.record_function(PROFILE_PREFIX + name):
        works = fn(*args, **kwargs)
    if isinstance(works, list):                  # batch_isend_irecv
        return [LabelledWork(w, f"{PROFILE_PREFIX}wait {name}") for w in works]
    return None if works is None else LabelledWork(works, f"{PROFILE_PREFIX}wait {name}")


def _ranks(group):
    """The group's global ranks: the same name for its communicator on every member."""
    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def _nbytes(t):
    return t.numel() * t.element_size()


def _group_size(group):
    return dist.get_world_size(group)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    n = _group_size(group)
    COMM.add("all_reduce", 2 * (n - 1) / n * _nbytes(tensor), group)
    _log([("coll", None, tensor, group)])
    return _launch("all_reduce", group, dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def all_gather(output, input, group=None, async_op=False):
    """Gather equal-sized flat shards into `output` (n * input.numel() elements)."""
    n = _group_size(group)
    COMM.add("all_gather", (n - 1) / n * _nbytes(output), group)
    _log([("coll", None, output, group)])
    return _launch("all_gather", group, _all_gather_flat, output, input, group=group, async_op=async_op)


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Sum `input` across the group and keep this rank's 1/n slice in `output`."""
    n = _group_size(group)
    COMM.add("reduce_scatter", (n - 1) / n * _nbytes(input), group)
    _log([("coll", None, input, group)])
    return _launch("reduce_scatter", group, _reduce_scatter_flat, output, input, op=op, group=group,
                   async_op=async_op)


def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """all_to_all_single along dim 0; counts the rows of `input` that leave this rank."""
    n, rank = _group_size(group), dist.get_rank(group)
    row_bytes = _nbytes(input) / max(input.shape[0], 1)
    if input_split_sizes is None:
        sent = (n - 1) / n * _nbytes(input)
    else:
        sent = (sum(input_split_sizes) - input_split_sizes[rank]) * row_bytes
    COMM.add("all_to_all", sent, group)
    _log([("coll", None, input, group)])
    return _launch("all_to_all", group, dist.all_to_all_single, output, input, output_split_sizes,
                   input_split_sizes, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    n = _group_size(group)
    COMM.add("broadcast", (n - 1) / n * _nbytes(tensor), group)
    _log([("coll", None, tensor, group)])
    return _launch("broadcast", group, dist.broadcast, tensor, src=src, group=group, async_op=async_op)


def send(tensor, dst, group=None):
    COMM.add("send", _nbytes(tensor), group)
    _log([("send", dst, tensor, group)])
    return _launch("send", group, dist.send, tensor, dst=dst, group=group, peer=dst)


def recv(tensor, src, group=None):
    _log([("recv", src, tensor, group)])
    return _launch("recv", group, dist.recv, tensor, src=src, group=group, peer=src)


def p2p_op(kind, tensor, peer, group=None):
    """A P2POp for batch_isend_irecv: kind is 'send' or 'recv'; peer is a global rank."""
    fn = dist.isend if kind == "send" else dist.irecv
    return dist.P2POp(fn, tensor, peer, group=group)


def batch_isend_irecv(ops):
    """Launch a batch of P2POps at once (sends and receives paired without deadlock); returns the works."""
    for op in ops:
        if op.op is dist.isend:
            COMM.add("send", _nbytes(op.tensor), op.group)
    if not ops:
        return []
    _log([("send" if op.op is dist.isend else "recv", op.peer, op.tensor, op.group) for op in ops])
    return _launch("batch_isend_irecv", ops[0].group, dist.batch_isend_irecv, ops,
                   peer=sorted({op.peer for op in ops}))


# ----------------------------------------------------------------------------------------------------------
# process-group setup

@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self):
        return self.rank == 0


def world_size_from_env():
    """WORLD_SIZE as torchrun sets it (1 when launched with plain python); usable before init."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested, local_rank):
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        requested = f"cuda:{local_rank}"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {requested} requested but CUDA is not available")
        torch.cuda.set_device(device)
    return device


GROUP_TIMEOUT = dict(s=None)     # --dist_timeout, set by init_distributed for every group created after it


def restart_store(rank, world_size, timeout):
    """Under torchrun with --max-restarts, its agent's store with a prefix per attempt (None otherwise: env://).
    The agent keeps one store across restarts, so the keys a crashed attempt left (its ranks' gloo addresses, an
    NCCL unique id) would otherwise be read by the restarted ranks, which then connect to dead peers and time out."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(cfg, need_group=True):
    """Device and (optionally) the default process group, from torchrun's environment variables.

    Launched with plain `python` (no RANK in the environment), a script that needs a group gets a
    one-process group on an in-memory store, so every script also runs on a single device."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        device = pick_device(cfg.device, local_rank)
    except ValueError as e:                      # --device cuda on a machine without one: one line, not a trace
        fail(str(e))
    backend = "nccl" if device.type == "cuda" else "gloo"
    GROUP_TIMEOUT["s"] = cfg.dist_timeout        # every subgroup gets it too (new_group), not torch's 30 min
    if need_group and not dist.is_initialized():
        timeout = timedelta(seconds=cfg.dist_timeout)
        if "RANK" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None,
                                    store=restart_store(rank, world_size, timeout))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        report_collective_failures(rank, cfg.dist_timeout)
        atexit.unregister(destroy_at_exit)       # registered once, however often main() runs in one process
        atexit.register(destroy_at_exit)
    return DistEnv(rank, world_size, local_rank, device, backend)


# what gloo's transport says when a peer is gone or too slow (its RuntimeErrors mostly also name their source file,
# third_party/gloo/..., but "Application timeout caused pair closure", on a pair an earlier timeout closed, does not)
GLOO_FAILURES = ("/gloo/", "Application timeout caused pair closure", "Connection closed by peer", "Socket closed",
                 "Read error", "Timed out waiting")


def collective_failure(exc):
    """The reason of a failed collective or p2p transfer, in one line, or None for any other exception. NCCL and
    the store raise DistError; gloo a RuntimeError with one of GLOO_FAILURES in its first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    gloo = isinstance(exc, RuntimeError) and any(sign in text for sign in GLOO_FAILURES)
    if not isinstance(exc, dist.DistError) and not gloo:
        return None
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)            # gloo's "[.../pair.cc:537] " source position
    return text.split(". This is typically")[0].rstrip(".")


def report_collective_failures(rank, timeout_s):
    """A collective that fails mid-run (a peer was killed, or stalled past --dist_timeout) ends this rank with
    one error line instead of a traceback through the training loop. Other exceptions keep their traceback."""
    previous = sys.excepthook

    def hook(kind, exc, tb):
        reason = collective_failure(exc)
        if reason is None:
            return previous(kind, exc, tb)
        print(f"error: rank {rank}: a collective failed ({reason}): another rank exited, or stalled longer than "
              f"--dist_timeout {timeout_s:g} s; its own output says which", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)     # not the normal teardown: it would wait on (or abort in) the dead peer's connections
    sys.excepthook = hook


def new_group(ranks, timeout_s=None):
    """A subgroup (every rank of the world must call this with the same ranks, in the same order), with the
    run's --dist_timeout unless timeout_s says otherwise: a stuck collective on it raises, never hangs."""
    timeout_s = GROUP_TIMEOUT["s"] if timeout_s is None else timeout_s
    kwargs = {} if timeout_s is None else dict(timeout=timedelta(seconds=timeout_s))
    return dist.new_group(ranks, **kwargs)


def destroy_at_exit():
    """Leave the process group before the interpreter tears down its modules. A run that ended by config.fail
    (its error line printed) on several processes then exits at once, skipping that teardown: objects built on the
    group can outlive it (gradient hooks keep their owners alive where the garbage collector cannot see them), and
    gloo's threads, still running while the interpreter and C++ runtime shut down, abort the process now and then
    ("terminate called without an active exception", exit -6 after the clean error line: 3 of 30 two-rank runs
    here). Whatever the run wrote is on disk by then (metrics rows and checkpoints are flushed as written)."""
    if not dist.is_initialized():
        return
    several = dist.get_world_size() > 1
    dist.destroy_process_group()
    if several and FAILED["code"] is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAILED["code"])


def destroy():
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
