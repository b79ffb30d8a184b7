"""
errors.py: how every entry point reports a bad input or a failed run: one `error:` line and exit code 2, never a
traceback; and a Ctrl-C: one `interrupted:` line saying what was kept. Imports only the stdlib (config, checkpoint,
the process-group setup and every entry point's first lines use it).
"""
import functools
import os
import signal
import sys
import threading


class ConfigError(ValueError):
    """An invalid configuration, reported as one line before any work starts."""


def check(condition, message):
    if not condition:
        raise ConfigError(message)


FAILED = dict(code=None)     # set by fail(); distributed.destroy_at_exit ends a failed multi-process run with it


def launch_rank():
    """This process's rank as the launcher set it (RANK), 0 where none did, or where RANK is malformed or outside
    WORLD_SIZE (a malformed RANK is itself reported through fail)."""
    text = os.environ.get("RANK", "0").strip()
    world = os.environ.get("WORLD_SIZE", "1").strip()
    rank = int(text) if text.isdigit() else 0
    return 0 if world.isdigit() and rank >= int(world) else rank


def fail(message, rank_local=False):
    """Print one clear error line and exit with code 2. A configuration error is the same on every rank, and every
    rank prints it: under torchrun the first rank to exit gets the others killed, maybe before they print, so a
    line only rank 0 printed could be lost (N ranks show it N times: a duplicated line rather than none). A
    rank-local one (this node's files, this rank's checkpoint) is named by the rank that hit it, since no other
    may have seen it."""
    if rank_local and "RANK" in os.environ:
        print(f"error: rank {launch_rank()}: {message}", file=sys.stderr, flush=True)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)
    FAILED["code"] = 2
    sys.exit(2)


def fail_after_another_rank(message):
    """Exit with code 2 because another rank failed, whose own line (printed before it exited) says why: rank 0
    says so in one line, the others exit quietly."""
    if launch_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    FAILED["code"] = 2
    sys.exit(2)


def require(package, purpose, pin=None):
    """The module `package`, or a ConfigError naming what needs it and how to install it (an optional dependency
    reported in one line before any work, not as an ImportError's traceback in the middle of it)."""
    import importlib
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"{purpose} needs the {package} package, which is not installed here: "
                          f"pip install {pin or package}") from None


# ----------------------------------------------------------------------------------------------------------
# Ctrl-C

INTERRUPT = dict(kept=None, rank=None, interrupted=False)    # what a Ctrl-C reports (report_interrupts)


def report_interrupts(kept=None, rank=None):
    """From here on, a Ctrl-C ends this process with one line on rank 0, `interrupted: ` and what was kept (kept(),
    a phrase: the checkpoint a run keeps, a corpus left as it was; until one is given, nothing was written), never a
    traceback. Every entry point calls it first, before torch's import; a run again once it knows what it keeps
    (`kept`, its `rank`), and init_distributed after torch's process-group init, whose own excepthook would
    otherwise buffer and prefix the line. SIGINT still raises KeyboardInterrupt where it lands (`finally` blocks and
    the cleanup of temporary files run), and the process still ends as Python ends on one, by SIGINT (a shell says
    130, and a loop over runs stops too). It is remembered: what reaches the top after it (a collective closed by
    a peer's own Ctrl-C, which then ends the process with status 1) is reported as the same interrupt."""
    if kept is not None:
        INTERRUPT["kept"] = kept
    INTERRUPT["rank"] = launch_rank() if rank is None else rank
    if not getattr(sys.excepthook, "reports_interrupts", False):    # outermost: wraps whatever hook is there now
        hook = functools.partial(on_exit_exception, sys.excepthook)
        hook.reports_interrupts = True
        sys.excepthook = hook
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:    # (not where SIGINT is ignored)
        signal.signal(signal.SIGINT, on_sigint)


def on_sigint(signum, frame):
    INTERRUPT["interrupted"] = True
    while frame is not None:                        # arrived while the exit is being reported: that says it
        if frame.f_code is on_exit_exception.__code__:
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def on_exit_exception(previous, kind, value, traceback):
    """sys.excepthook: the `interrupted:` line for a Ctrl-C (or what followed one); anything else to `previous`."""
    if not (INTERRUPT["interrupted"] or issubclass(kind, KeyboardInterrupt)):
        return previous(kind, value, traceback)
    if INTERRUPT["rank"] == 0:
        kept = INTERRUPT["kept"]() if INTERRUPT["kept"] is not None else "nothing was written"
        print(f"interrupted: {kept}", file=sys.stderr, flush=True)
