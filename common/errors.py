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


def fail(message, rank_local=False):
    """Print one clear error line and exit with code 2. A configuration error is the same on every rank and
    prints once (rank 0); a rank-local one (this node's files, this rank's checkpoint) prints on the rank that
    hit it, named, since rank 0 may not have seen it."""
    text = os.environ.get("RANK", "0").strip()
    world = os.environ.get("WORLD_SIZE", "1").strip()
    rank = int(text) if text.isdigit() else 0       # (a malformed RANK is itself reported through here)
    if world.isdigit() and rank >= int(world):      # a rank outside its world: no rank 0 will say it
        rank = 0
    if rank_local and "RANK" in os.environ:
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
    elif rank == 0 or rank_local:
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
