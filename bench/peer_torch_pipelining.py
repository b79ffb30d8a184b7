"""
bench/peer_torch_pipelining.py: the peer of train_pp.py. The same stages (pipeline/gpt_stages.build_stages: same split,
same initial weights, same tied-embedding gradient sync), data, optimizer and loop, with the schedule run by
torch.distributed.pipelining (ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble /
ScheduleDualPipeV, the last two on train_pp's V placement) instead of by our action-list interpreter; writes
the same metrics.jsonl, so bench/harness.py measures both alike.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/peer_torch_pipelining.py --pp 2 --pp_schedule 1f1b \
        --n_microbatches 4 --max_steps 20 --out_dir OUT

torch's stages talk through their own send/recv, bypassing comm.py's counters, so comm_bytes adds what they
send under docs/observability.md's convention (m activations / gradients per boundary, as train_pp.py) to what is counted.
There is no zb1 here: torch's ScheduleInterleavedZeroBubble is a different schedule.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining import schedules as torch_schedules

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import comm                                                        # noqa: E402
from common.comm import COMM  # noqa: E402
from common.distributed import init_distributed, destroy  # noqa: E402
from common.config import check, parse_config                                # noqa: E402
from common.metrics import MetricsLogger                                     # noqa: E402
from model import flops_per_token                                     # noqa: E402
from common.optim import configure_optimizer, lr_at, set_lr                  # noqa: E402
from pipeline.schedules import V_SHAPED, placement_of, rank_of, stage_of   # noqa: E402
from pipeline.tied import clip_stage_grads, tied_grads_sync, tied_pair_group  # noqa: E402
from pipeline.gpt_stages import build_stages                                   # noqa: E402
from train_pp import extra_args, n_microbatches, validate                      # noqa: E402
from common.model_setup import gpt_config
from common.precision import autocast_context, resolve_dtype
from common.startup import prepare_data  # noqa: E402

SCHEDULES = {"afab": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zbv": getattr(torch_schedules, "ScheduleZBVZeroBubble", None),    # older torch: not there
             "dualpipev": getattr(torch_schedules, "ScheduleDualPipeV", None)}


class LogitsStage(nn.Module):
    """torch's schedules want the last stage to return logits and apply loss_fn themselves."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        h = self.stage.body(x)
        return self.stage.lm_head(self.stage.transformer["ln_f"](h))[0] if self.stage.last else h


def main(argv=None):
    cfg = parse_config(argv, techniques=("pp", "pp_schedule", "pp_virtual", "n_microbatches"),
                       description=__doc__.split("\n\n")[0], extra_args=extra_args,
                       validate=lambda c: (validate(c), check(SCHEDULES.get(c.pp_schedule) is not None,
                                                              f"no {c.pp_schedule} peer in this torch")))
    env = init_distributed(cfg)
    p, v, rank = cfg.pp, cfg.pp_virtual, env.rank
    m, micro = n_microbatches(cfg)
    loader = prepare_data(cfg, env)
    dtype = resolve_dtype(cfg, env.device)
    gcfg = gpt_config(cfg, loader.vocab_size)
    placement = placement_of(cfg.pp_schedule)
    chunks = build_stages(gcfg, rank, p, v, cfg.seed, env.device, placement=placement)
    stages = [PipelineStage(LogitsStage(c), stage_of(rank, i, p, placement), p * v, env.device)
              for i, c in enumerate(chunks)]
    first, last = any(c.first for c in chunks), any(c.last for c in chunks)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    multi = cfg.pp_schedule == "interleaved" or cfg.pp_schedule in V_SHAPED
    schedule = SCHEDULES[cfg.pp_schedule](stages if multi else stages[0], m,
                                          loss_fn=loss_fn)      # scale_grads: each micro-batch's loss / m
    tied_group = tied_pair_group(p, v, placement)
    optimizer = configure_optimizer(chunks.named_parameters(), cfg, env.device.type)
    amp = autocast_context(dtype, env.device)
    act_bytes = micro * cfg.block_size * cfg.n_embd * 4
    p2p_bytes = m * act_bytes * (2 * v - (rank == 0) - (rank == p - 1))
    if placement == "v":                         # rank 0 holds both ends; p-1 -> p stays on rank p-1
        p2p_bytes = m * act_bytes * (0 if p == 1 else 2 if rank in (0, p - 1) else 4)
    logger = MetricsLogger(cfg, env, flops_per_token(gcfg), n_devices=p,
                           tokens_per_step=cfg.global_batch_size * cfg.block_size)
    for step in range(cfg.stop_step or cfg.max_steps):
        COMM.reset()
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        x, y = loader.micro_batch(step, 0, cfg.global_batch_size)   # the whole global batch; torch splits it
        losses = []
        with amp:
            schedule.step(*([x] if first else []), target=y if last else None, losses=losses if last else None)
        tied_grads_sync(chunks, tied_group)
        grad_norm = clip_stage_grads(chunks, cfg.grad_clip, dist.group.WORLD, env.device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).detach().float().mean() if losses else torch.zeros((), device=env.device)
        comm.broadcast(loss, rank_of(p * v - 1, p, placement))     # the last stage's rank has it
        logger.log_step(step, float(loss), lr, float(grad_norm), time.perf_counter() - t0,
                        COMM.bytes_sent + p2p_bytes)
    logger.close()


if __name__ == "__main__":
    main()
    destroy()   # every rank leaves the group together (as the train_*.py scripts do)
