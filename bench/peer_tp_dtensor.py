"""
bench/peer_tp_dtensor.py: the peer of train_tp.py. The same model, data, optimizer and loop, with tensor (and
sequence) parallelism applied by PyTorch's DTensor `parallelize_module` (ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput) instead of by hand; writes the same metrics.jsonl, so bench/harness.py
measures both alike.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/peer_tp_dtensor.py --tp 2 [--sp] --max_steps 20 --out_dir OUT

Where it differs from train_tp.py, and why:
- c_attn's rows are reordered once at init, [q|k|v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so that DTensor's
  contiguous row split hands each rank whole heads (the same function: the heads are only relabelled);
- the tied embedding / LM head stays replicated (a plan cannot shard one weight shared by an Embedding and a
  functional head), so every rank computes the full [tokens, vocab] logits and cross-entropy;
- the loss and gradients are the same as train_single's; the gradient norm is that of the local gradients
  (DTensor grads are reduced to their local shards), so the peer takes --grad_clip 0 only (and so should ours);
- DTensor's collectives bypass comm.py's counters: comm_bytes is what the plan sends in theory (ring convention,
  S = micro*T*h*4): per block and micro-batch 2 all-reduces of S forward and 2 backward; with SP 4 all-gathers /
  reduce-scatters forward and 4 backward (the gathered inputs are kept, not gathered again), plus the
  embedding-output gather, the head-input gather and the LayerNorm-grad all-reduces.
"""
import os
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.distributed import init_distributed, destroy  # noqa: E402
from common.config import check, grad_accum_steps, parse_config              # noqa: E402
from common.metrics import MetricsLogger                                     # noqa: E402
from model import GPT, flops_per_token                                # noqa: E402
from common.optim import configure_optimizer, lr_at, set_lr                  # noqa: E402
from common.model_setup import gpt_config
from common.precision import autocast_context, resolve_dtype
from common.startup import prepare_data  # noqa: E402
from common.module_io import shard_of                                       # noqa: E402
from train_tp import extra_args, validate as validate_tp              # noqa: E402


def apply_dtensor_tp(model, mesh, sp):
    """torchtitan-style plan on model.py's GPT: attention and MLP column-then-row, LayerNorms sequence-parallel."""
    n = mesh.size()
    out_layout = Shard(1) if sp else Replicate()
    for block in model.transformer.h:
        with torch.no_grad():                  # whole heads per contiguous 1/n row block (see the docstring)
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                p.copy_(torch.cat([shard_of(p, 0, 3, r, n) for r in range(n)]))
        plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=out_layout),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=out_layout)}
        if sp:   # the residual stream holds this rank's sequence chunk; attention / MLP inputs are gathered
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1), None),        # (x, rope)
                                                    desired_input_layouts=(Replicate(), None)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    if sp:       # replicated embedding output -> my chunk; ln_f on my chunk -> gathered for the replicated head
        parallelize_module(model, mesh, {
            "transformer.h.0": PrepareModuleInput(input_layouts=(Replicate(), None),   # (x, rope): rope stays whole
                                                  desired_input_layouts=(Shard(1), None), use_local_output=True),
            "transformer.ln_f": SequenceParallel(),
            "lm_head": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                          use_local_output=True)})
    return model


def plan_comm_bytes(cfg, grad_acc):
    n, L, h = cfg.tp, cfg.n_layer, cfg.n_embd
    S = cfg.micro_batch_size * cfg.block_size * h * 4
    ar, part = 2 * (n - 1) / n, (n - 1) / n
    if not cfg.sp:
        return grad_acc * 4 * L * ar * S
    return grad_acc * ((8 * L + 2) * part * S + ar * 4 * (2 * L + 1) * 2 * h)


def validate(cfg):
    validate_tp(cfg)
    check(cfg.grad_clip == 0, f"--grad_clip {cfg.grad_clip}: this peer has no global norm over DTensor shards; "
                              "pass --grad_clip 0 (to both scripts, for a like-for-like step)")


def main(argv=None):
    cfg = parse_config(argv, techniques=("tp", "sp"), description=__doc__.split("\n\n")[0],
                       extra_args=extra_args, validate=validate)
    env = init_distributed(cfg)
    mesh = init_device_mesh(env.device.type, (cfg.tp,))
    grad_acc = grad_accum_steps(cfg, 1)
    loader = prepare_data(cfg, env)
    dtype = resolve_dtype(cfg, env.device)
    model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed).to(env.device)
    apply_dtensor_tp(model, mesh, cfg.sp)
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    torch.manual_seed(cfg.seed)
    amp = autocast_context(dtype, env.device)
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=cfg.tp,
                           tokens_per_step=cfg.global_batch_size * cfg.block_size)
    for step in range(cfg.stop_step or cfg.max_steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        for micro in range(grad_acc):
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size)
            with amp:
                _, loss = model(x, y)
            (loss / grad_acc).backward()
            loss_sum += loss.detach()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
        grad_norm = torch.nn.utils.get_total_norm(grads)        # of the local shards: logged only (validate)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logger.log_step(step, float(loss_sum) / grad_acc, lr, float(grad_norm), time.perf_counter() - t0,
                        plan_comm_bytes(cfg, grad_acc))
    logger.close()
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    main()
    destroy()   # every rank leaves the group together (as the train_*.py scripts do)
