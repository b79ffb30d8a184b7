"""
errors.py: how every entry point reports a bad input or a failed run: one `error:` line and exit code 2, never a
traceback. Imports only the stdlib (config, checkpoint and the process-group setup all use it).
"""
import os
import sys


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
