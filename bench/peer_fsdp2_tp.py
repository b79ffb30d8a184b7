"""
bench/peer_fsdp2_tp.py: the peer of train_5d.py --dp D --tp T. The same model, data slices, AdamW settings and
loop, parallelized by PyTorch's own 2-D composition: DTensor `parallelize_module` over the tp dimension (the
plan of bench/peer_tp_dtensor.py) and FSDP2 `fully_shard` over the dp dimension of one 2-D DeviceMesh;
writes the same metrics.jsonl, so bench/harness.py measures both alike.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 bench/peer_fsdp2_tp.py --dp 2 --tp 2 --max_steps 20 \
        --out_dir OUT

The mesh is (dp, tp) with tp varying fastest, so its groups are train_5d's: tp ranks [0 1] [2 3], dp ranks
[0 2] [1 3]. Where it differs from train_5d, and why:
- FSDP2 shards parameters, gradients and AdamW moments over dp (ZeRO-3 style: blocks gathered for forward and
  again for backward, gradients reduce-scattered after every micro-batch); train_5d's dp axis keeps whole
  replicas and all-reduces gradients once per step (DDP style), so it holds dp times more model state;
- the tied embedding / LM head stays tp-replicated, and c_attn's rows are reordered once at init, as in
  bench/peer_tp_dtensor.py (see its docstring);
- gradient clipping uses the global norm over both mesh dimensions: parameters the TP plan does not touch
  live on the 1-D dp mesh, the others on the 2-D mesh, so the norm is taken per mesh and combined;
- no --sp: with fully_shard hooks on the blocks, the SP plan's input re-layout of the first block raised
  ("module inputs and input_layouts should have same length", torch 2.13), so only plain TP is compared;
- its collectives bypass comm.py's counters: comm_bytes is the theory of both axes, per rank: FSDP2's
  (dp-1)/dp x bytes x micro-batches x (3 x block + 2 x root parameters of this tp rank), as in
  bench/peer_fsdp2.py, plus the TP plan's bytes, as in bench/peer_tp_dtensor.py.
"""
import math
import os
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.distributed import world_size_from_env, destroy, init_distributed  # noqa: E402
from common.config import check, grad_accum_steps, parse_config              # noqa: E402
from common.metrics import MetricsLogger                                     # noqa: E402
from model import GPT, flops_per_token, init_parameter                # noqa: E402
from common.optim import configure_optimizer, lr_at, set_lr                  # noqa: E402
from train_ddp import mean_over_group                                 # noqa: E402
from common.model_setup import gpt_config
from common.precision import resolve_dtype
from common.startup import prepare_data  # noqa: E402
from common.module_io import shard_of                                       # noqa: E402
from peer_tp_dtensor import apply_dtensor_tp, plan_comm_bytes         # noqa: E402


def validate(cfg):
    world = world_size_from_env()
    check(cfg.tp >= 1 and world % cfg.tp == 0, f"--tp {cfg.tp} does not divide the number of processes ({world})")
    cfg.dp = cfg.dp or world // cfg.tp
    check(cfg.dp * cfg.tp == world, f"dp*tp = {cfg.dp}*{cfg.tp} != number of processes ({world})")
    check(cfg.n_head % cfg.tp == 0, f"n_head={cfg.n_head} is not divisible by tp={cfg.tp}")
    check(cfg.dtype != "float16", "this peer supports float32, bfloat16 and float64 (no fp16 loss scaling)")
    grad_accum_steps(cfg, cfg.dp)


def full_initial_value(name, shape, cfg):
    """model.init_parameter's value, with c_attn's rows in the order the TP plan expects (whole heads per rank)."""
    full = init_parameter(name, shape, cfg.n_layer, cfg.seed)
    if ".attn.c_attn." in name:
        full = torch.cat([shard_of(full, 0, 3, r, cfg.tp) for r in range(cfg.tp)])
    return full


def build_model(cfg, vocab_size, mesh, device, dtype):
    """GPT on the meta device -> TP plan over mesh["tp"] -> this rank's TP slices filled from the full initial
    values -> FSDP2 over mesh["dp"] (each block, then the root), which keeps 1/dp of every slice."""
    with torch.device("meta"):
        model = GPT(gpt_config(cfg, vocab_size), seed=cfg.seed)
    apply_dtensor_tp(model, mesh["tp"], sp=False)
    model.to_empty(device=device)
    model.lm_head.weight = model.transformer.wte.weight     # to_empty gives each module its own tensor: re-tie
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = full_initial_value(name, p.shape, cfg).to(device)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    return model


def local_numel(params):
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)


def clip_by_global_norm(params, max_norm):
    """Global gradient norm over the 2-D grid, every shard counted once: torch's norm per mesh (a DTensor norm
    reduces over its own mesh), combined across meshes; then every gradient scaled by the clip."""
    by_mesh = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    total = math.sqrt(sum(float(n.full_tensor()) ** 2 for n in norms))
    if max_norm > 0:
        for group in by_mesh.values():      # one foreach scale per mesh (DTensor ops do not mix meshes)
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, torch.tensor(total))
    return total


def main(argv=None):
    cfg = parse_config(argv, techniques=("dp", "tp"), description=__doc__.split("\n\n")[0], validate=validate)
    env = init_distributed(cfg)
    mesh = init_device_mesh(env.device.type, (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    dp, dp_rank = cfg.dp, mesh["dp"].get_local_rank()
    grad_acc = grad_accum_steps(cfg, dp)
    loader = prepare_data(cfg, env)
    dtype = resolve_dtype(cfg, env.device)
    model = build_model(cfg, loader.vocab_size, mesh, env.device, dtype)
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)

    b = torch.tensor([], dtype=dtype).element_size()
    block_params = local_numel(model.transformer.h.parameters()) * dp      # this tp rank's slices, before FSDP
    root_params = local_numel(model.parameters()) * dp - block_params
    comm_bytes = (dp - 1) / dp * b * grad_acc * (3 * block_params + 2 * root_params) + plan_comm_bytes(cfg, grad_acc)
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=env.world_size,
                           tokens_per_step=cfg.global_batch_size * cfg.block_size)
    params = list(model.parameters())
    for step in range(cfg.stop_step or cfg.max_steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        for micro in range(grad_acc):
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size, dp_rank, dp)
            _, loss = model(x, y)
            (loss / grad_acc).backward()
            loss_sum += loss.detach()
        grad_norm = clip_by_global_norm(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = mean_over_group(loss_sum / grad_acc, mesh["dp"].get_group())
        logger.log_step(step, loss_value, lr, grad_norm, time.perf_counter() - t0, comm_bytes)
    logger.close()
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    main()
    destroy()   # every rank leaves the group together (as the train_*.py scripts do)
