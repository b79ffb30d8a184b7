"""
A process-group stand-in that fails as NCCL does, on CPU and gloo (DESIGN.md, "Tests"):

    install()                                      # in a worker, before its first collective
    python tests/nccl_abort.py train_ddp.py ...    # a script under it (bench/failure_battery.py's "NCCL aborts")

gloo raises inside a collective that fails (a peer gone, --dist_timeout passed). NCCL, under
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (what common/distributed.py sets), does not: torch's watchdog thread aborts the
communicator, the aborted kernel returns, and the call returns as if it had worked, its tensor holding this rank's
own value (or garbage); only the *next* collective raises "NCCL communicator was aborted ... Original reason for
failure was: ...". Under install(), every collective of the torch.distributed API behaves so, the *_object helpers
and barrier included, and so do send, recv and batch_isend_irecv (a receive whose sender never comes returns, its
buffer as it was), except on a group made with an explicit backend="gloo" (a gloo side group stays gloo beside
NCCL). The stand-in changes nothing while every collective works.
"""
import functools
import inspect
import os
import runpy
import sys

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "reduce_scatter", "all_to_all_single", "all_to_all", "broadcast", "reduce",
               "gather", "scatter", "barrier")
P2P = ("send", "recv", "batch_isend_irecv")     # (isend and irecv stay: batch_isend_irecv's works are wrapped)
ABORTED = dict(reason=None)     # why this process's NCCL-like communicators were aborted, once one was
GLOO_GROUPS = []                # groups made with backend="gloo": they raise, as gloo does


def aborted_error():
    return dist.DistBackendError(f"NCCL communicator was aborted on rank {dist.get_rank()}. Original reason for "
                                 f"failure was: {ABORTED['reason']}")


def abort(exc):
    """What the watchdog does with a failed collective: remember why, raise nothing here."""
    text = str(exc).strip().splitlines()
    ABORTED["reason"] = ABORTED["reason"] or (text[0] if text else type(exc).__name__)


class AbortedLater:
    """An async collective's work: wait() returns even when the collective failed (the abort is remembered)."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        try:
            if self.work is not None:                # (None: the launch itself failed)
                self.work.wait(*args, **kwargs)
        except RuntimeError as e:
            abort(e)
        return True

    def __getattr__(self, name):
        return getattr(self.work, name)


def nccl_like(fn):
    """fn (a torch.distributed collective) as NCCL's communicator runs it under asynchronous error handling."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if group is not None and any(group is g for g in GLOO_GROUPS):
            return fn(*args, **kwargs)
        if ABORTED["reason"] is not None:
            raise aborted_error()
        asked_async = bound.arguments.get("async_op", False)
        bound.arguments["async_op"] = True
        try:
            work = AbortedLater(fn(*bound.args, **bound.kwargs))
        except RuntimeError as e:
            abort(e)
            work = AbortedLater(None)
        if asked_async:
            return work
        work.wait()
        return None
    return call


def nccl_like_p2p(fn):
    """fn (send, recv or batch_isend_irecv) as NCCL runs point-to-point under asynchronous error handling: the call
    and its works' wait() return even when the peer never comes (a recv's buffer keeps what it held), and the abort
    surfaces at the next call, as for a collective."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        ops = args[0] if args and isinstance(args[0], list) else None
        group = ops[0].group if ops else kwargs.get("group")
        if group is not None and any(group is g for g in GLOO_GROUPS):
            return fn(*args, **kwargs)
        if ABORTED["reason"] is not None:
            raise aborted_error()
        try:
            works = fn(*args, **kwargs)
        except RuntimeError as e:
            abort(e)
            return [AbortedLater(None) for _ in ops] if ops is not None else None
        return [AbortedLater(w) for w in works] if ops is not None else works
    return call


def install():
    """Every collective and p2p call of torch.distributed (and common.comm's aliases of two) NCCL-like from now on."""
    new_group = c10d.new_group

    @functools.wraps(new_group)
    def remembering_gloo(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if inspect.signature(new_group).bind(*args, **kwargs).arguments.get("backend") == "gloo":
            GLOO_GROUPS.append(group)
        return group

    dist.new_group = c10d.new_group = remembering_gloo
    for name in COLLECTIVES:
        if hasattr(c10d, name):
            wrapped = nccl_like(getattr(c10d, name))
            setattr(c10d, name, wrapped)         # the *_object helpers call these through c10d's globals
            setattr(dist, name, wrapped)
    for name in P2P:
        wrapped = nccl_like_p2p(getattr(c10d, name))
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    comm = sys.modules.get("common.comm")        # bound when comm was imported: rebind them too
    if comm is not None:
        comm._all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        comm._reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


if __name__ == "__main__":        # python tests/nccl_abort.py SCRIPT ARGS...: SCRIPT's main under the stand-in
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
