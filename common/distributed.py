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
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common import comm
from common.errors import FAILED, fail


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
    comm.GROUP_TIMEOUT["s"] = cfg.dist_timeout        # every subgroup gets it too (new_group), not torch's 30 min
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


def fail_together(error, env):
    """Every rank passes its own error message (or None). If any rank has one, each failing rank prints its
    own and every rank exits with code 2: no rank is left waiting in a collective for one that has exited."""
    if dist.is_initialized():
        flag = torch.tensor([error is not None], dtype=torch.int32, device=env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    else:
        failed = error is not None
    if error is not None:
        fail(error, rank_local=True)
    if failed:
        fail("another rank failed (its error line names it)")


def wait_for_main_rank(group, cfg, what):
    """After work that only rank 0 does (a checkpoint save, an evaluation): the other ranks wait for it here,
    bounded by --dist_timeout, instead of inside the next step's collective; a too-slow save or evaluation
    is then reported as what it is."""
    try:
        dist.barrier(group=group)
    except RuntimeError as e:                        # DistBackendError: a timeout (or a rank gone)
        fail(f"waited longer than --dist_timeout {cfg.dist_timeout:g} s for rank 0's {what} "
             f"({type(e).__name__}); raise --dist_timeout", rank_local=True)
