"""
converters/apply.py: what a script's main applies to its model before training, in one call: the fused kernels
(--kernels), FP8 GEMMs (--fp8) in model.py's Linear layers and, through the wing, inside train_tp's layers
(converters/fp8_tp.py), ZeRO-3's units gathering FP8 weights (converters/fp8_gather.py), and --compile (whole, or block by
block inside hooks). It lives in the wing because it reaches the techniques' layers; no rung's building blocks use it.
"""
import re

import torch
import torch.nn as nn

from common.errors import check, fail
from converters.fp8_gather import attach_fp8_gathers
from converters.fp8_tp import convert_parallel_to_float8
from kernels import apply_kernels, convert_to_float8
from kernels.apply import compile_block
from kernels.fp8 import check_fp8_support

def apply_kernels_and_fp8(model, cfg, device, units=None):
    """--kernels (fused modules) and --fp8 (Float8Linear GEMMs; FP8 GEMMs inside tensor-parallel layers) swapped
    into a model or a pipeline stage in place, parameters unchanged; one clear error line when the device cannot
    run them. units: ZeRO-3's (train_zero's Shards) of this model, whose FP8 weights are then gathered as
    converters/fp8_gather.py says (in fp32, or with --fp8_all_gather quantized). Returns the kernel mode."""
    try:
        mode = apply_kernels(model, cfg.kernels)
        if getattr(cfg, "fp8", "none") != "none":
            check_fp8_support(device)
            report_fp8_layers(model, convert_to_float8(model, recipe=cfg.fp8, size_filter=True), cfg.fp8)
            convert_parallel_to_float8(model, recipe=cfg.fp8)
    except (ValueError, RuntimeError) as e:
        fail(str(e))
    gather_fp8_units(model, units or [], cfg)
    return mode


def report_fp8_layers(model, swapped, recipe):
    """One line at start (rank 0): which Linear layers run their GEMMs in FP8 and which stay in high precision
    (the LM head and embedding by name; on a GPU those too small to gain, kernels/fp8.py's too_small_for_fp8).
    Block indices are folded: h.0.mlp.c_fc ... h.11.mlp.c_fc print as 12 x h.*.mlp.c_fc."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    kept = [name for name, m in model.named_modules() if type(m) is nn.Linear and name not in swapped]
    print(f"fp8 {recipe}: FP8 GEMMs in {len(swapped)} Linear layers ({_folded(swapped)}); "
          f"high precision in {len(kept)} ({_folded(kept)})")


def _folded(names):
    counts = {}
    for name in names:
        key = re.sub(r"\.\d+\.", ".*.", name)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {key}" if n > 1 else key for key, n in counts.items()) or "none"


def compiled(model, cfg, blocks=()):
    """The model a step calls: itself, or with --compile compiled whole; given `blocks` (where hooks sit on them:
    ZeRO-3's gather, free and reduce-scatter; train_5d's stages always), each block's forward compiled inside the
    hooks instead (kernels/apply.py's compile_block) and the rest (embedding, final norm, head) eager, because
    compiling the whole model would trace the hooks themselves into its graphs (docs/kernels.md).

    Settings, the same on a GPU and a CPU: inductor's default mode and dynamic=False: every step has the same
    shapes, so kernels specialised to them, and a new shape recompiles rather than turning sizes symbolic; no
    CUDA graphs (mode reduce-overhead): gradient accumulation keeps each backward's outputs alive in
    .grad across replays, which graph replays would overwrite, and the clipping, optimizer and guard run outside
    the graph anyway; no max-autotune: minutes of GEMM tuning for cuBLAS shapes a GPT already runs well."""
    if not cfg.compile:
        return model
    if not blocks:
        return torch.compile(model, dynamic=False)
    for block in blocks:
        compile_block(block)
    return model


def gather_fp8_units(model, units, cfg):
    """ZeRO-3's units of `model` (train_zero's Shards) holding FP8 GEMMs' weights gather them as
    converters/fp8_gather.py says: in fp32, or with --fp8_all_gather quantized; one clear error line where the
    recipe or the device's GEMM cannot take a gathered FP8 weight."""
    try:
        attach_fp8_gathers(model, units, getattr(cfg, "fp8_all_gather", False))
    except ValueError as e:
        fail(str(e))


def check_fp8_all_gather(cfg):
    """ZeRO-3's one rule left (its hooks compose with the fused modules, --compile, every FP8 recipe and every
    pipeline schedule: docs/kernels.md). --fp8_all_gather: its gather of FP8 weights already quantized
    (converters/fp8_gather.py), for the recipes whose weight scales are maxes of its shards' amaxes (per tensor or per
    128 x 128 block) and that quantize W once for both its GEMMs."""
    if not getattr(cfg, "fp8_all_gather", False):
        return
    check(cfg.zero_stage == 3 and cfg.fp8 != "none", "--fp8_all_gather needs --zero_stage 3 and --fp8 (it gathers "
          "the blocks' FP8 weights instead of their high-precision values)")
    check(cfg.fp8 != "rowwise", "--fp8_all_gather with --fp8 rowwise: W's forward GEMM scales it per row and its "
          "dgrad GEMM per column, two FP8 encodings of W (2 bytes a value, bf16's): use tensorwise, delayed or "
          "blockwise")
    check(getattr(cfg, "tp", 1) == 1, "--fp8_all_gather with --tp > 1: the tensor-parallel layers quantize their "
          "weight shard inside each GEMM (converters/fp8_tp.py), not from a gathered FP8 weight")
