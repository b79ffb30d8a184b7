"""
distributed.py: the process group of a training run, from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK):
gloo on CPU, NCCL on GPU, every group with --dist_timeout, and the exits that turn a failed collective or a failed
run into one error line instead of a traceback or a hang.

    env = init_distributed(cfg)      # env.rank, env.world_size, env.device, env.backend
    ...
    destroy()
"""
import atexit
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common import comm
from common.errors import FAILED, ConfigError, check, fail, fail_after_another_rank, report_interrupts


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


def warn_single_rank(env, why):
    """A data-parallel rung launched on one rank: one warning line (rank 0, stderr) saying `why` it is pointless."""
    if env.world_size == 1 and env.is_main:
        print(f"warning: world size 1: {why}", file=sys.stderr, flush=True)


def world_size_from_env():
    """WORLD_SIZE as torchrun sets it (1 when launched with plain python); usable before init, to validate a
    layout (init_distributed refuses a WORLD_SIZE that came without RANK, i.e. not from a launcher)."""
    return launch_env()[1]


def launch_env():
    """(rank, world size, local rank) from torchrun's environment; ConfigError for values no launcher sets."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    values = []
    for name, default in zip(names, ("0", "1", "0")):
        text = os.environ.get(name, default)
        check(re.fullmatch(r"\d+", text.strip()) is not None,
              f"environment variable {name}={text!r} is not a non-negative integer (torchrun sets it)")
        values.append(int(text))
    rank, world, local = values
    check(world >= 1 and rank < world, f"RANK={rank} is not below WORLD_SIZE={world} (torchrun sets both)")
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    check("LOCAL_RANK" not in os.environ or not local_world.isdigit() or local < int(local_world) <= world,
          f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={local_world} and WORLD_SIZE={world}: a node's ranks are "
          f"0..LOCAL_WORLD_SIZE-1, at most WORLD_SIZE of them (torchrun sets all three)")
    threads = os.environ.get("OMP_NUM_THREADS")      # libgomp warns about a bad one and guesses a thread count
    check(not (threads or "").strip() or re.fullmatch(r"\s*[1-9][0-9]*(,[1-9][0-9]*)*\s*", threads) is not None,
          f"environment variable OMP_NUM_THREADS={threads!r} is not a positive integer (threads per process)")
    return rank, world, local


def pick_device(requested, local_rank, world_size=1):
    """The torch.device of this rank: --device auto | cpu | cuda (this rank's GPU) | cuda:N (that one). A rank's
    GPU is cuda:LOCAL_RANK of the GPUs it sees; a launcher that gives each rank its own CUDA_VISIBLE_DEVICES
    (SLURM's --gpus-per-task) shows it one GPU, which is then its cuda:0. ValueError, with what to do, for a GPU
    the rank cannot see, and for cuda:N pinning several ranks that see the same GPUs to one of them (NCCL
    refuses two ranks on one GPU, at init, with an error that reads like a wrong MASTER_ADDR)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"--device {requested} requested but CUDA is not available")
    count, visible = torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    if device.index is None:      # one GPU seen, by a rank that torchrun (which shares a node's GPUs) did not start
        own_gpu = count == 1 and visible is not None and "TORCHELASTIC_RUN_ID" not in os.environ
        device = torch.device("cuda", 0 if own_gpu else local_rank)
        requested = str(device)
    elif world_size > 1 and count > 1 and int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) > 1:
        raise ValueError(f"--device {requested} puts every rank of this node on GPU {device.index}, but NCCL needs "
                         f"one GPU per rank: use --device cuda (each rank takes cuda:LOCAL_RANK) or auto")
    if device.index >= count:
        seen = f"CUDA_VISIBLE_DEVICES={visible} shows this rank" if visible is not None else "this node has"
        raise ValueError(f"--device {requested} (local rank {local_rank}): {seen} {count} GPU(s), cuda:0..cuda:"
                         f"{count - 1}; launch at most {count} ranks per node, or give each rank its own GPU")
    torch.cuda.set_device(device)
    return device


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
    one-process group on an in-memory store, so every script also runs on a single device. A script that needs
    no group (train_single) refuses a world of several ranks: each would train alone, racing on one out_dir."""
    try:
        rank, world_size, local_rank = launch_env()
        launch_order_defaults(cfg, rank)           # before pick_device creates this process's CUDA context
        if "RANK" not in os.environ and world_size > 1:     # a WORLD_SIZE left in the shell, not a launch
            check(not need_group, f"WORLD_SIZE={world_size} is set but RANK is not: this is not a launch by "
                                  f"torchrun, and one process would split the batch for {world_size - 1} rank(s) "
                                  f"that do not exist; launch with torchrun --nproc_per_node {world_size}, or unset "
                                  f"WORLD_SIZE")
            print(f"warning: WORLD_SIZE={world_size} without RANK is not a launch by torchrun: running as one "
                  f"process", flush=True)
            world_size = 1
        check(need_group or world_size == 1,
              f"{os.path.basename(sys.argv[0]) or 'this script'} trains on one device, but it was launched as "
              f"{world_size} ranks (WORLD_SIZE={world_size}); run it with plain python, or use a parallel script "
              f"(train_ddp.py, ...) under torchrun")
        device = pick_device(cfg.device, local_rank, world_size)
    except ValueError as e:                      # --device cuda on a machine without one: one line, not a trace
        fail(str(e))
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm.GROUP_TIMEOUT["s"] = cfg.dist_timeout        # every subgroup gets it too (new_group), not torch's 30 min
    if need_group and not dist.is_initialized():
        if backend == "nccl":
            nccl_error_defaults()
        timeout = timedelta(seconds=cfg.dist_timeout)
        try:
            if "RANK" in os.environ:
                rendezvous_problem(rank, cfg.dist_timeout)
                dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                        device_id=device if device.type == "cuda" else None,
                                        store=restart_store(rank, world_size, timeout))
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        except ConfigError as e:                # the launch's environment, or a rendezvous that never answered
            fail(str(e), rank_local=True)
        except (RuntimeError, ValueError, TimeoutError, OSError) as e:    # DistError is a RuntimeError
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            fail(f"could not join the process group of {world_size} rank(s) at {where} within --dist_timeout "
                 f"{cfg.dist_timeout:g} s ({first_line(e)}): a rank did not start or exited early, or "
                 f"MASTER_ADDR/MASTER_PORT are wrong; launch every rank with torchrun", rank_local=True)
        report_collective_failures(rank)         # over torch's own hook (installed by init: it buffers output)
        report_interrupts(rank=rank)             # outermost of all: a Ctrl-C's line, then a peer's closed link
        atexit.unregister(destroy_at_exit)       # registered once, however often main() runs in one process
        atexit.register(destroy_at_exit)
    return DistEnv(rank, world_size, local_rank, device, backend)


def rendezvous_problem(rank, timeout_s):
    """Under a launch (RANK set): ConfigError for a RANK no launcher set (MASTER_ADDR or MASTER_PORT missing, a
    port that is not one), and, on a rank other than 0, for a rendezvous that does not answer within --dist_timeout.
    (torch's store client waits as long but prints C++ stack frames at every retry, so the address is probed here.)"""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name, "").strip()]
    check(not missing, f"RANK={os.environ['RANK']} is set but not {' or '.join(missing)}: a RANK left in the "
                       f"shell, not a launch by torchrun (which sets them all); unset RANK, or launch with torchrun")
    address, port = os.environ["MASTER_ADDR"].strip(), os.environ["MASTER_PORT"].strip()
    check(port.isascii() and port.isdigit() and 1 <= int(port) <= 65535,
          f"MASTER_PORT={port!r} is not a port number (1..65535)")
    deadline = time.monotonic() + timeout_s
    while rank != 0:
        try:
            socket.create_connection((address, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
                                     ).close()
            return
        except OSError as e:
            check(time.monotonic() < deadline, f"nothing answers at MASTER_ADDR:MASTER_PORT = {address}:{port} "
                                               f"within --dist_timeout {timeout_s:g} s ({e.strerror or e}): rank 0 "
                                               f"did not start, or MASTER_ADDR/MASTER_PORT are wrong")
            time.sleep(0.2)


def launch_order_defaults(cfg, rank):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 under --tp_overlap, unless the user chose a value (a warning if it is not 1).

    A GPU takes kernels from several hardware queues (8 by default); streams map onto them. --tp_overlap launches
    the input gradient's all-reduce on NCCL's stream and then the weight-gradient matmul on the compute stream,
    expecting the all-reduce to run beside the matmul. From separate queues the matmul may take every SM first, and
    the all-reduce waits until it is done: no overlap. With one queue kernels are dispatched in the order the host
    launched them, so the all-reduce gets its SMs first and the matmul fills the rest (Megatron-LM sets the same for
    its TP overlap). No other overlap here needs an order between streams (DDP's buckets and ZeRO's reduce-scatters
    and prefetches only need their inputs made first, which stream order gives), so other runs keep the default:
    one queue would also hold their collectives behind every kernel queued before them. The driver reads the
    variable when the CUDA context is made: this runs before pick_device."""
    if not getattr(cfg, "tp_overlap", False):
        return
    chosen = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if chosen is None:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    elif chosen.strip() != "1" and rank == 0:
        print(f"warning: CUDA_DEVICE_MAX_CONNECTIONS={chosen}: --tp_overlap's all-reduce may wait for the matmul it "
              f"should overlap (1 dispatches kernels in launch order)", file=sys.stderr, flush=True)


def nccl_error_defaults():
    """How an NCCL rank learns of a dead or stuck peer without blocking the host on every collective.

    Collectives stay asynchronous (no TORCH_NCCL_BLOCKING_WAIT: with it, every wait() polls until the collective is
    done, so the host can never queue work ahead of the GPU). torch's watchdog thread watches each collective
    against the group's timeout (--dist_timeout) and NCCL's own errors (a peer's closed connection is
    ncclRemoteError). With TORCH_NCCL_ASYNC_ERROR_HANDLING=2 it then aborts the communicators and leaves the
    process alive: the aborted kernels return, and the training thread's next collective raises
    "NCCL communicator was aborted ... Original reason for failure was: <the watchdog's reason>", which
    report_collective_failures turns into one error line (failure_kind reads the original reason: a timeout or a
    gone peer). torch's default, 3, tears the process down from the watchdog instead (a C++ log and SIGABRT).
    torchrun passes 1 (tear down) to every worker when its own environment has none, so 1 under torchrun counts
    as unset; any other value the user set is kept (docs/failures.md: what each does). Set before init:
    ProcessGroupNCCL reads it when it is built."""
    chosen = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    torchrun_default = chosen == "1" and "TORCHELASTIC_RUN_ID" in os.environ
    if chosen is None or torchrun_default:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"


# what a failed collective says, by cause. gloo: its RuntimeErrors mostly name their source file, third_party/gloo/...,
# but "Application timeout caused pair closure", on a pair an earlier timeout closed, does not. NCCL and the store
# raise DistError. A peer that is gone shows as a closed or reset connection; a stuck one as a timeout. An NCCL
# communicator that torch's watchdog aborted says so, then why (ABORTED_BECAUSE): the kind is read from the why.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Socket closed", "Broken pipe", "Read error",
             "Write error", "remote process exited", "communicator was aborted", "ncclRemoteError")
TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure", "timed out", "timeout", "Timeout")
ABORTED_BECAUSE = "Original reason for failure was:"
GLOO_FAILURES = ("/gloo/", "Application timeout caused pair closure", "Connection closed by peer",
                 "Connection reset by peer", "Socket closed", "Read error", "Timed out waiting")


def first_line(exc):
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)            # gloo's "[.../pair.cc:537] " source position
    return text.split(". This is typically")[0].rstrip(".")


def collective_failure(exc):
    """The reason of a failed collective or p2p transfer, in one line, or None for any other exception. NCCL and
    the store raise DistError; gloo a RuntimeError with one of GLOO_FAILURES in its first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    gloo = isinstance(exc, RuntimeError) and any(sign in text for sign in GLOO_FAILURES)
    if not isinstance(exc, dist.DistError) and not gloo:
        return None
    cause = exc.__cause__                            # comm.py's launch names the usual cause of a failed call, a
    if cause is not None and failure_kind(first_line(cause)) == "peer gone":   # forward on some ranks only: not
        return first_line(cause)                     # the cause where a peer is plainly gone
    return first_line(exc)


def failure_kind(reason):
    """"peer gone" (its connection closed or reset: it exited or was killed), "timed out" (no answer within
    --dist_timeout: stuck or slow), or "failed" (anything else the backend said)."""
    reason = reason.split(ABORTED_BECAUSE)[-1]     # the watchdog's reason for an abort, where it gives one
    if any(sign in reason for sign in PEER_GONE):
        return "peer gone"
    if any(sign in reason for sign in TIMED_OUT):
        return "timed out"
    return "failed"


def describe_failure(reason, what, timeout_s):
    """One line saying what happened to `what` (a collective, a checkpoint save's barrier...) and what to do."""
    kind = failure_kind(reason)
    if kind == "peer gone":
        return (f"{what} failed: another rank exited or lost its connection ({reason}); its own output says why, "
                f"then restart (--resume auto continues from the last checkpoint)")
    if kind == "timed out":
        return (f"waited longer than --dist_timeout {timeout_s:g} s for {what} ({reason}): another rank is stuck "
                f"or much slower; its own output says which; raise --dist_timeout if it was only slow")
    return f"{what} failed ({reason}); the other ranks' output may say why"


def report_collective_failures(rank):
    """A collective that fails mid-run (a peer was killed, or stalled past --dist_timeout) ends this rank with
    one error line instead of a traceback through the training loop. Other exceptions keep their traceback."""
    previous = sys.excepthook

    def hook(kind, exc, tb):
        reason = collective_failure(exc)
        if reason is None:
            return previous(kind, exc, tb)
        what = describe_failure(reason, "a collective", comm.GROUP_TIMEOUT["s"])
        print(f"error: rank {rank}: {what}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)     # not the normal teardown: it would wait on (or abort in) the dead peer's connections
    hook.nanoscale = True
    if not getattr(previous, "nanoscale", False):     # once per process, however often main() runs
        sys.excepthook = hook                         # (outermost: torch's hook would buffer our line away)


def barrier(group, timeout_s, what):
    """dist.barrier bounded by --dist_timeout; a failure is one line saying whether a peer is gone or timed out."""
    try:
        dist.barrier(group=group)
    except RuntimeError as e:                        # DistBackendError (a RuntimeError), or gloo's RuntimeError
        reason = collective_failure(e) or first_line(e)
        fail(describe_failure(reason, what, timeout_s), rank_local=True)


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
    """The end of a run of several ranks: leave the group together (a barrier, then destroy it), then end the
    process without the interpreter's teardown, for the reason destroy_at_exit gives: gloo's threads, still
    running while the interpreter and C++ runtime shut down, abort a good run now and then ("terminate called
    without an active exception": collectives.py on 4 ranks, about one run in four). Call it last: whatever the
    run wrote is on disk by then (metrics rows and checkpoints are flushed as written); the out_dir lock is
    released first."""
    if not dist.is_initialized():
        return
    several = dist.get_world_size() > 1
    dist.barrier()
    dist.destroy_process_group()
    if several:
        from common.checkpoint.files import release_out_dir_locks
        release_out_dir_locks()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def fail_together(error, env):
    """Every rank passes its own error message (or None). If any rank has one, each failing rank prints its
    own and every rank exits with code 2: no rank is left waiting in a collective for one that has exited."""
    failed = error is not None
    if dist.is_initialized() and env.world_size > 1:
        failed = not agree(error, comm.GROUP_TIMEOUT["s"] or DEFAULT_TIMEOUT_S, "the other ranks' checks")
    if error is not None:
        fail(error, rank_local=True)
    if failed:
        fail_after_another_rank("another rank failed (its error line names it)")


# Decisions every rank takes together (commit a checkpoint, stop together) run on a gloo group of the whole world,
# whatever the training backend, because only a failure that raises can stop a commit. Under NCCL with
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (nccl_error_defaults) a collective that times out or loses a peer is aborted by
# torch's watchdog thread and does *not* raise where it was called: the kernel returns, the tensor keeps this rank's
# own value, and a flag all-reduced there would read "no rank failed" on every rank that had none. gloo raises
# inside the call, and its CPU flag needs no device sync either. One group, made the first time the world decides
# (every rank reaches its decisions in the same order, so every rank makes it at the same point).
DECISIONS = []        # [(the default group, its gloo twin)]
DEFAULT_TIMEOUT_S = 1800       # torch's own group timeout, where a caller started the group without --dist_timeout


def decision_group():
    """The gloo group of the whole world that agree() all-reduces on (see above)."""
    world = dist.group.WORLD
    if not DECISIONS or DECISIONS[0][0] is not world:
        DECISIONS[:] = [(world, comm.new_group(None, backend="gloo"))]
    return DECISIONS[0][1]


def agree(error, timeout_s, what):
    """True if no rank has an error (each passes its own, or None). An all-reduce on decision_group() that is also
    the barrier of `what`, bounded by --dist_timeout; if it fails (it raises: gloo), one line says whether a peer is
    gone or timed out, and this rank stops there."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error is None
    flag = torch.tensor([error is not None], dtype=torch.int32)
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=decision_group())
    except RuntimeError as e:                        # DistError (a RuntimeError), or gloo's RuntimeError
        reason = collective_failure(e) or first_line(e)
        fail(describe_failure(reason, what, timeout_s), rank_local=True)
    return not bool(flag.item())


def wait_for_main_rank(group, cfg, what):
    """After work that only rank 0 does (a checkpoint save, an evaluation): the other ranks wait for it here,
    bounded by --dist_timeout, instead of inside the next step's collective; a too-slow save or evaluation
    is then reported as what it is."""
    barrier(group, cfg.dist_timeout, f"rank 0's {what}")
