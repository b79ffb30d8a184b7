"""
Run a function on N gloo worker processes on CPU and collect what each rank returns.

    results = run_workers(fn, world_size=2, args=(...))   # fn(rank, world_size, *args), a module-level function

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and one
thread, so `distributed.init_distributed` and the train scripts' main() work inside it unchanged. A worker's exception
comes back with its traceback; a worker that hangs is killed after `timeout` seconds and the test fails.
"""
import contextlib
import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, environ):
    os.environ.clear()
    os.environ.update(environ)      # the test's environment now, not the fork server's from when it started
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # SystemExit too: a config error inside a worker must surface
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT = []


# What the fork server imports once for every worker: torch, and the train scripts with all they import (train_5d
# brings every rung, common/, kernels/ and torch._dynamo): ~3.5 s of CPU per worker otherwise, 12-20 s of wall
# time for a 4-rank launch on two loaded cores, paid again by every run_workers call. Python 3.11's fork server
# imports these from its working directory (pytest's, the repo root); one it cannot import is skipped, and each
# worker imports it itself as before. No import here reads the environment or starts a thread.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "triton_interpreter", "model", "train_single", "train_5d"]


def context():
    """Workers are forked from one server process that imported torch and the train scripts once
    (multiprocessing's forkserver): a worker starts in a fraction of a second instead of importing them again, as
    a spawned one would. The server runs nothing else, so no thread of a test's torch is forked with it."""
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def run_workers(fn, world_size, args=(), timeout=300):
    """fn(rank, world_size, *args) on world_size processes; returns [result of rank 0, rank 1, ...]."""
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, dict(os.environ)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} failed ---\n{payload}")
                break   # the other ranks may now be stuck in a collective: stop waiting
    except Exception as e:  # queue.Empty: a hang
        errors.append(f"workers did not finish within {timeout}s ({type(e).__name__}); "
                      f"finished ranks: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def recorded_runs(rank, world_size, script, argvs):
    """`script`.main(argv) for each argv (a worker for run_workers), with comm.py recording every launch
    (p2p batches and collectives) and recording_direct_calls the rest: one launch log per run, for nccl_check.check."""
    import importlib
    from common import comm
    main, logs = importlib.import_module(script).main, []
    with recording_direct_calls():
        for argv in argvs:
            comm.LAUNCH_LOG = []
            main(argv)
            logs.append(comm.LAUNCH_LOG)
            comm.LAUNCH_LOG = None
    return logs


DIRECT = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "gather", "scatter", "barrier",
          "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


@contextlib.contextmanager
def recording_direct_calls():
    """Collectives called on torch.distributed directly, not through comm.py (barriers, the *_object helpers, a
    loss's broadcast), recorded into comm.LAUNCH_LOG as comm.py records its own: one collective each, on its group's
    communicator (an *_object helper runs its collectives on every member alike). Left out: comm.py's own calls
    (recorded there) and the gloo group decisions run on (distributed.decision_group: not an NCCL communicator)."""
    import inspect
    import sys
    import torch.distributed as dist
    from common import comm, distributed
    originals = {name: getattr(dist, name) for name in DIRECT if hasattr(dist, name)}

    def recorded(fn):
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__")
            if comm.LAUNCH_LOG is not None and caller != "common.comm":
                group = signature.bind(*args, **kwargs).arguments.get("group")
                if not any(group is side for _, side in distributed.DECISIONS):
                    comm.LAUNCH_LOG.append([("coll", None, 0, comm._ranks(group))])
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, recorded(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def exit_code_and_stderr(rank, world_size, script, argv):
    """A worker: script.main(argv) on one rank; returns (its exit code, 0 if it returned; this rank's stderr)."""
    import contextlib
    import importlib
    import io
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            importlib.import_module(script).main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()
