"""
startup.py: what a run checks and opens before its first step, on every rank alike: the out_dir lock, the corpus
(prepared once per node), the deterministic loader, whether the model can fit at all (one error line before any
work, not an allocator's crash) and whether the end-of-run sample can be decoded.
"""
import functools
import os
import shutil

import torch
import torch.distributed as dist

from common.checkpoint.files import kept_checkpoint, lock_holder, lock_out_dir, remove_stale_temp_files
from common.data import GlobalBatchLoader, ensure_dataset
from common.data_mix import MixtureLoader, parse_data_mix
from common.distributed import decision_group, fail_together
from common.errors import fail, report_interrupts
from common.evaluation import sample_problem
from common.run_identity import ranks_disagree
from common.precision import param_dtype, resolve_dtype

def prepares_data(env):
    """Who prepares the default corpus: local rank 0 of every node, as nodes need not share a filesystem."""
    return env.local_rank == 0


def prepare_data(cfg, env):
    """The out_dir lock, then the deterministic loader. Rank 0 takes the lock of --out_dir (one run writes there:
    a second one stops here naming the first) and then removes the temporary files of killed saves. Each node's
    local rank 0 prepares the default corpus on first use while the others wait; then every rank opens it. A rank
    that cannot (no dataset on its node) says so itself. From here on a Ctrl-C's line names the checkpoint the run
    keeps (a save cut short never replaces it)."""
    report_interrupts(kept=functools.partial(kept_checkpoint, cfg.out_dir), rank=env.rank)
    error = None
    if env.rank == 0:
        try:
            error = lock_out_dir(cfg.out_dir)
        except OSError as e:
            error = f"--out_dir {cfg.out_dir}: cannot create its lock file ({e})"
    if prepares_data(env) and error is None:
        try:
            for data_dir in data_dirs(cfg):
                ensure_dataset(data_dir)
        except (OSError, ValueError) as e:          # FileNotFoundError is an OSError
            error = str(e)
    fail_together(error, env)                       # also the barrier: the node's corpus is ready
    fail_together(not_rank0s_out_dir(cfg, env), env)
    if env.rank == 0:                               # this run holds the lock: no save of any run is under way
        remove_stale_temp_files(cfg.out_dir)
    loader = None
    try:
        loader = open_loader(cfg, env.device)
        error = memory_problem(cfg, env, loader.vocab_size) or sample_problem(cfg, loader) or \
            compiler_problem(cfg, env.device)
    except (OSError, ValueError) as e:
        error = str(e)
    fail_together(error, env)
    disagree = ranks_disagree(cfg, env)             # the same line on every rank: each says it and stops
    if disagree is not None:
        fail(disagree, rank_local=True)
    return loader


def compiler_problem(cfg, device):
    """--compile (or --kernels compile) where the compiler torch.compile calls is missing: inductor builds C++ with
    g++ (or $CXX) on a CPU, Triton a C launcher with cc, gcc or clang (or $CC) on a GPU. Named before the model is
    built, not by a traceback from the first step's compile."""
    if not (cfg.compile or cfg.kernels == "compile"):
        return None
    flag = "--compile" if cfg.compile else "--kernels compile"
    if device.type == "cpu":
        from torch._inductor import config as inductor
        candidates = [c for c in inductor.cpp.cxx if c] if isinstance(inductor.cpp.cxx, tuple) else [inductor.cpp.cxx]
        if not any(shutil.which(c) for c in candidates):
            return (f"{flag} on the CPU needs a C++ compiler: torch.compile's inductor runs {' or '.join(candidates)}, "
                    f"which is not on PATH (install g++, set CXX to one, or run without {flag})")
    elif not any(shutil.which(c) for c in (os.environ.get("CC", "cc"), "gcc", "clang")):
        return (f"{flag} on the GPU needs a C compiler: Triton compiles a launcher per kernel with $CC, cc, gcc or "
                f"clang, none of which is on PATH (install gcc, or run without {flag})")
    return None


def not_rank0s_out_dir(cfg, env):
    """Why this rank does not see the out_dir rank 0 writes (rank 0's lock file, naming its pid and host), or None.
    On a node-local disk every rank would write its part of each checkpoint and the commit would pass, but only rank
    0's node would get ckpt.pt, `latest` and the pruning: the other nodes' disks fill up, and a resume fails only at
    the restart. Checked once, at start, by rank 0 sending what its lock file says (on the gloo decision group)."""
    if env.world_size == 1:
        return None
    said = [lock_holder(cfg.out_dir) if env.rank == 0 else None]
    dist.broadcast_object_list(said, src=0, group=decision_group())
    mine = lock_holder(cfg.out_dir)
    if mine == said[0]:
        return None
    here = "no run.lock" if mine is None else f"a run.lock saying {mine!r}"
    return (f"--out_dir {cfg.out_dir} is not the directory rank 0 writes: this node sees {here} there, where rank "
            f"0's says {said[0]!r}; every rank writes its part of each checkpoint into it and rank 0 commits them, so "
            f"all ranks need the same directory: put --out_dir on a filesystem every node shares")


def data_dirs(cfg):
    """The prepared corpora a run reads: --data_dir, or each source of --data_mix."""
    return [d for d, _ in parse_data_mix(cfg.data_mix)] if cfg.data_mix else [cfg.data_dir]


def open_loader(cfg, device):
    """The deterministic loader of one corpus, or of a weighted mixture of several (data_mix.py)."""
    for data_dir in data_dirs(cfg):
        ensure_dataset(data_dir)
    if cfg.data_mix:
        return MixtureLoader(parse_data_mix(cfg.data_mix), cfg.block_size, cfg.global_batch_size, cfg.seed, device)
    return GlobalBatchLoader(cfg.data_dir, cfg.block_size, cfg.global_batch_size, cfg.seed, device)


GiB = 2 ** 30


def least_memory(cfg, vocab_size, dtype):
    """(bytes, what): a lower bound of one run's memory, whatever its layout: weights, gradients and AdamW's two
    moments of every matrix (norms and biases left out), the offsets of a global batch, and of one micro-batch the
    logits and the activations a block keeps for its backward (at least 14 h per token without recomputation: the
    inputs of both norms, q k v, the attention output, the MLP's 4h input and 4h GeLU output; h with it)."""
    h, layers, size = cfg.n_embd, cfg.n_layer, param_dtype(dtype).itemsize
    moe = layers // cfg.moe_every if cfg.n_experts > 0 else 0      # blocks moe_every-1, 2*moe_every-1, ...
    params = vocab_size * h + layers * 4 * h * h + (layers - moe + moe * cfg.n_experts) * 8 * h * h
    tokens = cfg.micro_batch_size * cfg.block_size
    kept = h * (layers if cfg.recompute != "none" else 14 * layers)
    act = tokens * (kept + 2 * vocab_size) * min(size, dtype.itemsize)
    total = 4 * params * size + act + 8 * cfg.global_batch_size
    return total, (f"{params:,} parameters: {4 * params * size / GiB:,.1f} GiB of weights, gradients and AdamW's "
                   f"moments in {size}-byte floats; activations of --micro_batch_size {cfg.micro_batch_size} x "
                   f"--block_size {cfg.block_size}: {act / GiB:,.1f} GiB")


def memory_problem(cfg, env, vocab_size):
    """A run that cannot fit, said before the model is built (not an allocator's crash, an OOM kill or swapping):
    its least memory, split over every rank (the most any layout shares it), against this rank's device (free
    memory) or this host (MemAvailable, shared by its ranks). None if it may fit."""
    need, what = least_memory(cfg, vocab_size, resolve_dtype(cfg, env.device))
    per_rank = need // env.world_size
    if env.device.type == "cuda":
        have, where = torch.cuda.mem_get_info(env.device)[0], f"{env.device} has"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.world_size > 1 else 1
        have, where = host_available(), f"this host has available (MemAvailable, for {local} rank(s))"
        per_rank *= local
    if have is None or per_rank <= have:
        return None
    return (f"the model and one micro-batch need at least {need / GiB:,.1f} GiB ({what}); split over "
            f"{env.world_size} rank(s), {per_rank / GiB:,.1f} GiB here, but {where} {have / GiB:,.1f} GiB: use a "
            f"smaller --n_layer / --n_embd / --micro_batch_size / --block_size, or more devices")


def host_available():
    """MemAvailable of /proc/meminfo in bytes (Linux), else None (not checked)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def fits_on_device(n_bytes, device):
    """Whether n_bytes more fit on `device` now: on CUDA, the driver's free memory plus what torch's allocator holds
    unused (torch.cuda.mem_get_info; memory_reserved - memory_allocated). Host memory is not checked (True)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return n_bytes <= free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
