"""
bench/peer_fsdp2.py: the peer of train_zero.py --zero_stage 3. The same model, data slices, AdamW settings and
loop, sharded by PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard` on every block, then on the root);
writes the same metrics.jsonl, so bench/harness.py measures both alike.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/peer_fsdp2.py --n_layer 4 --n_embd 256 \
        --max_steps 20 --out_dir OUT

Parameters are created on the meta device and each rank fills only its shard, one parameter at a time, from
model.init_parameter (as train_zero.py does), so neither side ever materializes the whole model. FSDP2
reduce-scatters after every micro-batch (like our stage 3). --dtype bfloat16 uses its MixedPrecisionPolicy
(bf16 compute and reduction, fp32 sharded parameters). Its collectives bypass comm.py's counters, so
comm_bytes is its schedule's volume under docs/observability.md's convention, unpadded: blocks are all-gathered twice
(forward, backward) and reduce-scattered once per micro-batch; the root is not resharded after forward
(FSDP2's default for the root), so it is gathered once.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.distributed import init_distributed, destroy  # noqa: E402
from common.config import grad_accum_steps, parse_config                     # noqa: E402
from common.metrics import MetricsLogger                                     # noqa: E402
from model import GPT, flops_per_token, init_parameter                # noqa: E402
from common.optim import configure_optimizer, lr_at, set_lr                  # noqa: E402
from train_ddp import mean_over_group                                 # noqa: E402
from common.model_setup import gpt_config
from common.precision import resolve_dtype
from common.startup import prepare_data  # noqa: E402
from train_zero import validate                                       # noqa: E402


def main(argv=None):
    cfg = parse_config(argv, techniques=("zero_stage", "bucket_mb"), description=__doc__.split("\n\n")[0],
                       validate=validate)
    env = init_distributed(cfg)
    dp, grad_acc = env.world_size, grad_accum_steps(cfg, env.world_size)
    loader = prepare_data(cfg, env)
    dtype = resolve_dtype(cfg, env.device)
    with torch.device("meta"):
        model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=env.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = init_parameter(name, p.shape, cfg.n_layer, cfg.seed).to(env.device)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    b = torch.tensor([], dtype=dtype).element_size()
    block_params = sum(p.numel() for p in model.transformer.h.parameters())
    root_params = sum(p.numel() for p in model.parameters()) - block_params
    comm_bytes = (dp - 1) / dp * b * grad_acc * (3 * block_params + 2 * root_params)
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=dp,
                           tokens_per_step=cfg.global_batch_size * cfg.block_size)
    for step in range(cfg.stop_step or cfg.max_steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        for micro in range(grad_acc):
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size, env.rank, dp)
            _, loss = model(x, y)
            (loss / grad_acc).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = mean_over_group(loss_sum / grad_acc, dist.group.WORLD)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, comm_bytes)
    logger.close()
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    main()
    destroy()   # every rank leaves the group together (as the train_*.py scripts do)
