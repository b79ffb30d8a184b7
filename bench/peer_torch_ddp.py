"""
bench/peer_torch_ddp.py: the peer of train_ddp.py. The same model, data slices, optimizer and loop, with the
gradient averaging done by torch.nn.parallel.DistributedDataParallel instead of by hand; writes the same
metrics.jsonl, so bench/harness.py measures both alike.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/peer_torch_ddp.py --n_layer 4 --n_embd 256 \
        --max_steps 20 --out_dir OUT

torch DDP runs its default C++ reducer (buckets of --bucket_mb, overlap with backward, gradient_as_bucket_view,
`no_sync()` on all but the last micro-step). Its all-reduces bypass comm.py's counters, so comm_bytes is
what its reducer sends under docs/observability.md's convention: every gradient once per step, 2 (n-1)/n * P * bytes.
"""
import contextlib
import os
import sys
import time

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.distributed import init_distributed, destroy  # noqa: E402
from common.config import grad_accum_steps, parse_config                     # noqa: E402
from common.metrics import MetricsLogger                                     # noqa: E402
from model import GPT, flops_per_token                                # noqa: E402
from common.optim import clip_grad_norm, configure_optimizer, lr_at, set_lr  # noqa: E402
from train_ddp import mean_over_group, validate                       # noqa: E402
from common.model_setup import gpt_config
from common.precision import autocast_context, resolve_dtype
from common.startup import prepare_data  # noqa: E402


def main(argv=None):
    cfg = parse_config(argv, techniques=("bucket_mb",), description=__doc__.split("\n\n")[0], validate=validate)
    env = init_distributed(cfg)
    dp, grad_acc = env.world_size, grad_accum_steps(cfg, env.world_size)
    loader = prepare_data(cfg, env)
    dtype = resolve_dtype(cfg, env.device)
    model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed).to(env.device)
    ddp = DistributedDataParallel(model, device_ids=[env.device] if env.device.type == "cuda" else None,
                                  bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True)
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    amp = autocast_context(dtype, env.device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    comm_bytes = 2 * (dp - 1) / dp * grad_bytes
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=dp,
                           tokens_per_step=cfg.global_batch_size * cfg.block_size)
    for step in range(cfg.stop_step or cfg.max_steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        for micro in range(grad_acc):
            sync = micro == grad_acc - 1
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size, env.rank, dp)
            with (contextlib.nullcontext() if sync else ddp.no_sync()), amp:
                _, loss = ddp(x, y)
                (loss / grad_acc).backward()
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm([p.grad for p in model.parameters()], cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)     # keep the bucket views
        loss_value = mean_over_group(loss_sum / grad_acc, dist.group.WORLD)
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, comm_bytes)
    logger.close()
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    main()
    destroy()   # every rank leaves the group together (as the train_*.py scripts do)
