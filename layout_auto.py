"""
layout_auto.py: `train_5d.py --layout auto`, the layout plan.py ranks best for this run, applied and explained.

    torchrun --nproc_per_node=8 train_5d.py --layout auto --n_layer 24 --n_embd 2048 --n_head 16
    python -m torch.distributed.run --nproc_per_node 4 train_5d.py --layout auto --plan_gpu h100   # CPU: plan as if

The job plan.py is asked about is this run's: the model (train_5d's flags, the dataset's vocabulary), the world
size, the GPUs per node (torchrun's LOCAL_WORLD_SIZE) and the GPU found (its memory too), with the global batch
and precision of the flags. plan.py ranks every layout of dp x tp x cp x pp x ep, schedule, micro-batch size,
ZeRO stage and recompute by predicted tokens/s among those that fit; the first one that train_5d.py's own
validate accepts (it refuses ZeRO-3, ZeRO-2 with interleaved / zb1, zb1 / zbv / dualpipev with tp > 1, ...) and that
fits the memory found is taken. Its degrees, schedule, micro-batch size, ZeRO stage and recompute replace the
flags'; rank 0 prints why.
"""
import copy
import os

import torch

from config import ConfigError, check
from metrics import gpu_chip_and_board
from model import GPTConfig
from plan import HEADER, format_row, rank_layouts
from plan_inputs import GIB, HARDWARE, USABLE, Job


def gpu_kind(device_name):
    """plan_inputs.HARDWARE's key for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100'), or None."""
    chip = gpu_chip_and_board(device_name)[0].lower()
    return chip if chip in HARDWARE else None


def set_layout(cfg, row):
    """cfg with the layout of a plan.py row (degrees, schedule, micro-batch size, ZeRO stage, recompute)."""
    for key in ("dp", "tp", "cp", "pp", "ep", "sp", "zero_stage", "micro_batch_size", "recompute"):
        setattr(cfg, key, row[key])
    cfg.pp_schedule, cfg.pp_virtual, cfg.layout = row["schedule"], row["v"], ""
    return cfg


def accepted_by(validate, cfg):
    """row -> whether `validate` (train_5d's own, raising ConfigError) accepts cfg with the row's layout."""
    def accepts(row):
        try:
            validate(set_layout(copy.copy(cfg), row))
        except ConfigError:
            return False
        return True
    return accepts


def plan_job(cfg, vocab_size, world, gpus_per_node, gpu, precision):
    """plan.py's Job for this run."""
    model = GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                      n_embd=cfg.n_embd, n_experts=cfg.n_experts, top_k=cfg.top_k, moe_every=cfg.moe_every)
    return Job(model, world, gpus_per_node, gpu, cfg.global_batch_size, precision, "flash", cfg.bucket_mb)


def choose_layout(job, memory_bytes, accepts):
    """(best row that `accepts` takes and that fits memory_bytes, the ranked rows it was chosen from)."""
    rows = [r for r in rank_layouts(job) if accepts(r)]
    fits = [r for r in rows if not r["oom"] and r["mem_bytes"]["total"] <= USABLE * memory_bytes]
    check(fits, f"--layout auto: no layout train_5d.py runs fits {memory_bytes / GIB:.1f} GiB per GPU for this "
                f"model and batch (plan.py ranks {len(rows)}); try a smaller --micro_batch_size or model")
    return fits[0], fits


def apply_auto_layout(cfg, vocab_size, device, world, is_main, validate):
    """Replace cfg's layout flags by plan.py's choice for this run among those `validate` (train_5d's) accepts."""
    name = cfg.plan_gpu or (torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    gpu = name if name in HARDWARE else gpu_kind(name)
    check(gpu is not None, f"--layout auto plans for a GPU plan.py knows ({', '.join(HARDWARE)}), found "
                           f"{name or device.type!r}: give the degrees (--dp --tp --cp --pp --ep), or --plan_gpu")
    memory = HARDWARE[gpu]["mem"]
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    precision = "fp32" if cfg.dtype in ("float32", "float64") or device.type == "cpu" else "amp"
    job = plan_job(cfg, vocab_size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), gpu, precision)
    best, fits = choose_layout(job, memory, accepted_by(validate, cfg))
    set_layout(cfg, best)
    if is_main:
        print(f"--layout auto: plan.py for {world} x {gpu} ({memory / GIB:.0f} GiB, {job.gpus_per_node} per node), "
              f"{precision}; {len(fits)} layouts train_5d runs fit, ranked by predicted tokens/s; the first is "
              f"taken:\n{HEADER}\n" + "\n".join(format_row(i + 1, r) for i, r in enumerate(fits[:3])), flush=True)
    return best
