"""
train_5d.py: the rungs composed. Data, tensor, context, pipeline and expert parallelism on one grid of ranks,
each axis the building block of its own rung (imported, not rewritten), checked to train exactly like
train_single.

    torchrun --nproc_per_node=8 train_5d.py                                   # default grid: dp 2 x tp 2 x pp 2
    torchrun --nproc_per_node=8 train_5d.py --tp 2 --sp --cp 2 --pp 2         # tp, cp, pp (dp = 8 / 8 = 1)
    torchrun --nproc_per_node=8 train_5d.py --dp 4 --tp 2 --zero_stage 2      # ZeRO-2 over dp x cp
    torchrun --nproc_per_node=8 train_5d.py --dp 2 --tp 2 --sp --pp 2 --zero_stage 3   # ZeRO-3 (FSDP) in the grid
    torchrun --nproc_per_node=8 train_5d.py --dp 2 --pp 4 --pp_schedule interleaved --pp_virtual 2 --n_layer 8
    torchrun --nproc_per_node=8 train_5d.py --dp 4 --tp 2 --sp --ep 4 --n_experts 8   # MoE, experts over 4 ranks
    torchrun --nproc_per_node=8 train_5d.py --layout auto     # plan.py's best layout for this model and GPU
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 train_5d.py \\
        --tp 8 --pp 2                                     # two nodes: tp inside a node, pp across the two

The grid (grid.py; Megatron's rank order: tp innermost so a TP group shares a node's NVLink, then cp, dp, pp):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i          e.g. dp 2 x tp 2 x pp 2 on 8 ranks:
                                                                     stage 0: [0 1] [2 3]   stage 1: [4 5] [6 7]
                                                                               dp0   dp1             dp0   dp1
What each axis does in one optimizer step (each from its rung):
    tp  train_tp: heads / MLP columns / vocabulary rows split; 2 all-reduces per block forward and backward
        (--sp: reduce-scatter + all-gather, activations sequence-split outside the TP regions; without SP,
        --partition_activations: train_tp's ZeRO-R Pa, each recomputed block's input kept as 1/tp and gathered back)
    cp  train_cp: the sequence cut into cp chunks (zigzag by default); attention's K/V travel around a ring
    pp  train_pp: blocks cut into pp*pp_virtual stages; micro-batches flow through a schedule (afab, 1f1b,
        interleaved, zb1, and zbv / dualpipev with their stages in a V), activations and their gradients sent
        point to point
    dp  train_ddp: each (dp, cp) pair of coordinates holds its slice of the batch / sequence; gradients are
        averaged over the dp x cp group in flat buckets, each launched once the schedule's last backward writing
        it ends (compose/grad_ready.py), or train_zero's ZeRO-1/2 shards over it, or ZeRO-3's units: each
        chunk's blocks gathered block by block in every F and B action, reduce-scattered as each block's
        backward ends (experts, with ep > 1, sharded over their edp group instead; ZeRO-3: a unit per MoE block)
    ep  train_ep: with --n_experts, each MoE block's experts are shared out over ep consecutive ranks of the
        dp x cp group (ep | dp*cp); tokens go to their experts' ranks and back by all_to_all. Expert gradients
        are averaged over the ranks holding the same experts (edp), dense ones over dp x cp. Under --sp each TP
        rank routes its own sequence chunk, so no expert work repeats across tp; MoE blocks sit in stages like
        dense ones. Load balancing is global-batch (routing.py): the same objective in every layout.
A stage's blocks are tensor-parallel and their attention context-parallel (on the heads this TP rank holds).
Loss: each rank's last stage gives the mean over its tokens; the global-batch mean is the average over dp x cp
and micro-batches, exactly train_single's. Global grad norm: every shard counted once (TP replicas by TP rank 0,
the tied weight by the first stage), reduced over tp x pp (the dp x cp replicas agree after averaging).

Bytes per step (metrics.jsonl `comm_bytes_by_axis`, this rank, comm.py's ring convention) are each rung's own
formula with the sizes of the composed step: tp its block all-reduces on [b, T/cp, h], cp its ring on this TP
rank's heads, pp its p2p of [b, T/cp (/tp under SP), h], dp the all-reduce (ZeRO: reduce-scatters, one per
micro-batch for ZeRO-2, + all-gather) of this rank's gradients, ep train_ep's all_to_all rows that leave this
rank (and the all_gather of the row counts); ZeRO-3's dp is (gathers + m) (N-1)/N of each unit's padded bytes
(N: dp x cp, or edp for an experts unit; gathers: 2m when resharding after forward, none for a W action).
Checkpoints are one file in train_single's layout: any layout, or train_single, resumes any other. --kernels and
--fp8 apply inside the stages as in train_single, inside the parallel layers with tp > 1 (FP8 adds tp's amax
all-reduces: converters/fp8_tp.py), gathered by ZeRO-3 in fp32 or with --fp8_all_gather in FP8 (fp8_gather.py);
zb1, zbv and dualpipev defer the dW of nn.Linear, FP8, train_tp's layers and the fused LM head (docs/pipelines.md).

What exists only because two axes meet is in compose/: the dp x cp axis as one object in its three modes
(dp_axis.py: replicas; zero_pipeline.py: ZeRO-1/2 shards and ZeRO-3 units inside the pipeline), experts on the
grid (ep_grid.py: router metrics, checkpoint writers), the whole model gathered for the sample (whole_model.py).
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import argparse
import functools
import time

import torch
import torch.distributed as dist

from common import comm
from common import checkpoint
from common.comm import COMM
from common.distributed import destroy, init_distributed, world_size_from_env
from common.config import ConfigError, check, fail, parse_config
from common.grid import build_grid, bytes_by_axis, print_grid
from plan import apply_auto_layout
from planner.inputs import HARDWARE
from common.metrics import MetricsLogger
from model import GPT, flops_per_token
from converters.partition_activations import add_partition_args, apply_partition_flags, check_partition_args
from common.optim import NonFiniteGuard, lr_at
from pipeline.gpt_stages import stage_views
from pipeline.schedules import SPLIT_BACKWARD, V_SHAPED, placement_of, simulate
from train_cp import (ContextParallelAttentionCore, block_attention_kernel, check_cp, local_positions,
                      swap_attention_cores)
from train_pp import PipelineRunner, check_pp, make_schedule
from converters.tp_gemms import with_gemm_slots
from pipeline.weight_grads import WeightGradStore, defer_weight_grads
from common.routing import start_moe_training
from train_ep import swap_in_expert_parallel
from common.evaluation import evaluate
from common.model_setup import MOE_FLAGS, check_moe, gpt_config, materialize
from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
from common.startup import prepare_data
from converters.apply import apply_kernels_and_fp8, check_fp8_all_gather, compiled
from common.tp_shards import init_tp_weights
from common.tp_setup import check_tp
from train_tp import apply_tp
from compose.dp_axis import Replicas
from compose.zero_pipeline import ZeroShards, ZeroUnits
from compose.ep_grid import checkpoint_holder, moe_metrics
from compose.whole_model import sample_on_rank0

# ----------------------------------------------------------------------------------------------------------
# the model: model.py's GPT on the meta device, TP layers swapped in, CP attention, cut into this rank's
# stages; only then does anything get memory, and each parameter is filled from model.init_parameter

def build_chunks(cfg, vocab_size, grid, device, dtype):
    gcfg = gpt_config(cfg, vocab_size)
    with torch.device("meta"):
        gpt = GPT(gcfg, seed=cfg.seed)
        if grid.ep > 1:                        # train_ep's MoE: my experts only, tokens exchanged over ep
            swap_in_expert_parallel(gpt, grid.groups.ep)
    if grid.sizes["tp"] > 1:
        apply_tp(gpt, grid.groups.tp, cfg.sp, device="meta")
    if grid.sizes["cp"] > 1:
        # the compute dtype (bf16 under autocast, not the parameters' fp32) decides between the fused kernels
        kernel = block_attention_kernel(cfg.kernels, device, resolve_dtype(cfg, device), cfg.n_embd // cfg.n_head)
        swap_attention_cores(gpt, lambda: ContextParallelAttentionCore(grid.groups.cp, cfg.cp_layout, kernel))
    mine = stage_views(gpt, grid.coords["pp"], grid.sizes["pp"], cfg.pp_virtual, placement_of(cfg.pp_schedule))
    chunks = materialize(mine, device, dtype)
    pos = local_positions(cfg.cp_layout, cfg.block_size, grid.sizes["cp"], grid.coords["cp"], device)
    for chunk in chunks:
        init_tp_weights(chunk, cfg.seed, grid.groups.tp)    # my TP slice of each full initial value
        chunk.pos = pos                                        # RoPE at this CP rank's global positions
    return chunks, gcfg, pos


# ----------------------------------------------------------------------------------------------------------
# the dp x cp axis: one object whatever its mode (compose/dp_axis.py), so the step below has no branch on it

def data_parallel_axis(chunks, cfg, grid, dtype, device):
    """The mode --zero_stage names: train_ddp's replicas, or ZeRO inside the pipeline (compose/zero_pipeline.py):
    ZeRO-1/2 shards or ZeRO-3 units. Each whole tensor is checkpointed by one of its holders (compose/ep_grid.py)."""
    holder = functools.partial(checkpoint_holder, grid=grid)
    if not cfg.zero_stage:
        return Replicas(chunks, cfg, grid, device, holder)
    return (ZeroUnits if cfg.zero_stage == 3 else ZeroShards)(chunks, cfg, grid, dtype, device, holder)


# ----------------------------------------------------------------------------------------------------------
# the command line

def extra_args(parser):
    parser.set_defaults(tp=0, cp=0, pp=0)      # 0: chosen by default_layout when no degree is given
    add_partition_args(parser)                 # ZeRO-R's Pa on the tp axis (converters/partition_activations.py)
    parser.add_argument("--layout", default="", choices=["", "auto"],
                        help="auto: the layout plan.py ranks best for this model, world and GPU (plan.py); "
                             "it replaces the degree, schedule, micro-batch, ZeRO and recompute flags")
    parser.add_argument("--plan_gpu", default="", help="with --layout auto: plan as if on this GPU (a100, h100, "
                                                       "h200, b200; default: the GPU found)")
    parser.add_argument("--pp_uneven", action="store_true",
                        help="allow n_layer not divisible by pp*pp_virtual: the first n_layer %% (pp*pp_virtual) "
                             "stages take one block more (train_pp's split, plan.py's default)")
    parser.add_argument("--reshard_after_forward", action=argparse.BooleanOptionalAction, default=True,
                        help="ZeRO-3: free each block's gathered weights after its forward and gather them again for "
                             "its backward (--no-reshard_after_forward: keep them until its backward is over)")


def default_layout(cfg, world):
    """With no degree flag: tp 2 and pp 2 where they divide (the world, the heads, the layers), dp the rest."""
    if cfg.tp or cfg.cp or cfg.pp or cfg.dp:
        cfg.tp, cfg.cp, cfg.pp = cfg.tp or 1, cfg.cp or 1, cfg.pp or 1
        return
    cfg.tp = 2 if world % 2 == 0 and cfg.n_head % 2 == 0 else 1
    cfg.pp = 2 if world % (2 * cfg.tp) == 0 and cfg.n_layer % 2 == 0 else 1
    cfg.cp = 1


def validate(cfg):
    world = world_size_from_env()
    if cfg.layout == "auto":                   # chosen once the vocabulary is known (main), then validated
        check(not (cfg.tp or cfg.cp or cfg.pp or cfg.dp or cfg.ep > 1), "--layout auto chooses the degrees: "
              "leave out --dp --tp --cp --pp --ep")
        check(cfg.plan_gpu in ("",) + tuple(HARDWARE),
              f"--plan_gpu {cfg.plan_gpu}: plan.py knows {', '.join(HARDWARE)}")
        check(cfg.plan_gpu or (cfg.device != "cpu" and torch.cuda.is_available()), "--layout auto plans for a GPU: "
              "none here; give the degrees (--dp --tp --cp --pp --ep), or --plan_gpu h100 to plan as if on one")
        return
    default_layout(cfg, world)
    tp, cp, pp = cfg.tp, cfg.cp, cfg.pp
    for name in ("tp", "cp", "pp", "pp_virtual"):
        check(getattr(cfg, name) >= 1, f"--{name} must be >= 1, got {getattr(cfg, name)}")
    check(world % (tp * cp * pp) == 0, f"tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp} does not divide the world "
                                       f"size {world}")
    cfg.dp = cfg.dp or world // (tp * cp * pp)
    check(cfg.dp * tp * cp * pp == world, f"dp*tp*cp*pp = {cfg.dp}*{tp}*{cp}*{pp} = {cfg.dp * tp * cp * pp} "
                                          f"!= world size {world}")
    check_cp(cfg, cp)
    check(not cfg.sp or tp > 1, "--sp needs --tp > 1")
    check_tp(cfg, tp, cfg.block_size // cp, what="block_size/cp")
    check_partition_args(cfg, tp)
    check(cfg.global_batch_size % (cfg.micro_batch_size * cfg.dp) == 0,
          f"global_batch_size={cfg.global_batch_size} is not divisible by micro_batch_size * dp = "
          f"{cfg.micro_batch_size} * {cfg.dp}")
    m = cfg.global_batch_size // (cfg.micro_batch_size * cfg.dp)
    check_pp(cfg, pp, m)
    check(cfg.dtype != "float16", "train_5d supports float32, bfloat16 and float64 (no fp16 loss scaling)")
    check(cfg.zero_stage in (0, 1, 2, 3), f"--zero_stage {cfg.zero_stage}: 0 (replicas), 1, 2 or 3")
    check_fp8_all_gather(cfg)
    check(cfg.zero_stage < 3 or cfg.dp * cp > 1, "--zero_stage 3 shards over dp x cp: with dp*cp = 1 there is "
                                                 "nothing to shard")
    check(cfg.zero_stage < 3 or cfg.pp_schedule != "interleaved" or pp > 1, "--zero_stage 3 with interleaved "
          "needs --pp > 1 (with pp 1 two chunks of one rank would both write the tied weight's gradient unit)")
    check_moe(cfg)
    check(cfg.ep >= 1 and (cfg.dp * cp) % cfg.ep == 0, f"--ep {cfg.ep} must divide dp*cp = {cfg.dp * cp} (experts "
                                                        f"are shared out over ranks holding different tokens)")
    check(cfg.ep == 1 or (cfg.n_experts > 0 and cfg.n_experts % cfg.ep == 0),
          f"--ep {cfg.ep} needs --n_experts > 0 and divisible by it, got {cfg.n_experts}")
    check(cfg.n_experts == 0 or cfg.moe_every <= cfg.n_layer, f"--moe_every {cfg.moe_every} > --n_layer: no MoE block")


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_config(argv, techniques=("dp", "tp", "sp", "cp", "cp_layout", "pp", "pp_schedule", "pp_virtual",
                                         "zero_stage", "bucket_mb", "fp8", "fp8_all_gather", "ep") + MOE_FLAGS,
                       description=__doc__.split("\n\n")[0], extra_args=extra_args, validate=validate)
    env = init_distributed(cfg)
    loader = prepare_data(cfg, env)
    if cfg.layout == "auto":                   # once the vocabulary is known; a refusal is still one line
        try:
            apply_auto_layout(cfg, loader.vocab_size, env.device, env.world_size, env.is_main, validate)
        except ConfigError as e:
            fail(str(e))
    sizes = dict(tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, pp=cfg.pp)
    grid = build_grid(sizes, env.rank, cfg.dist_timeout, cfg.ep, v_shaped=cfg.pp_schedule in V_SHAPED)
    dp_rank, dp = grid.coords["dp"], cfg.dp
    micro = cfg.micro_batch_size
    m = cfg.global_batch_size // (micro * dp)                  # micro-batches per step on each dp rank
    dtype = resolve_dtype(cfg, env.device)
    enable_tf32(env.device)

    # the techniques in the order they apply, one call each: the model (EP's experts, TP, CP attention, stages),
    # ZeRO-R's Pa, MoE's balancing, kernels and FP8, zero-bubble's deferred dW, compile, the pipeline, the dp x cp axis
    chunks, gcfg, pos = build_chunks(cfg, loader.vocab_size, grid, env.device, param_dtype(dtype))
    apply_partition_flags(cfg, gcfg, [b for c in chunks for b in c.transformer["h"]], grid.groups.tp)   # ZeRO-R's Pa
    start_moe_training(chunks, cfg.global_batch_size * cfg.block_size // (dp * cfg.cp))   # my step's tokens
    for chunk in chunks:              # fused modules, FP8 GEMMs; under TP inside the parallel layers (kernels/apply.py)
        apply_kernels_and_fp8(chunk, cfg, env.device)
    store = WeightGradStore() if cfg.pp_schedule in SPLIT_BACKWARD else None
    if store is not None:
        with_gemm_slots(chunks)       # train_tp's layers take the store too (converters/tp_gemms.py)
        defer_weight_grads(chunks, store)
    compiled(chunks, cfg, [b for chunk in chunks for b in chunk.transformer["h"]])   # by block, in ZeRO-3's hooks
    act_shape = (micro, len(pos) // (cfg.tp if cfg.sp else 1), cfg.n_embd)
    schedules = make_schedule(cfg.pp_schedule, cfg.pp, m, cfg.pp_virtual)
    sim = simulate(schedules, cfg.pp, cfg.pp_virtual)
    runner = PipelineRunner(chunks, grid.groups.pp, schedules, m, act_shape, env.device, store,
                            autocast_context(dtype, env.device), param_dtype(dtype))
    dp_axis = data_parallel_axis(chunks, cfg, grid, param_dtype(dtype), env.device)     # replicas or ZeRO-1/2/3
    dp_axis.follow(runner, store, schedules[grid.coords["pp"]])

    guard = NonFiniteGuard(cfg, env.is_main)
    torch.manual_seed(cfg.seed + grid.coords["pp"] * dp + dp_rank)   # dropout: own stream per stage and batch slice
    start = checkpoint.start_from(cfg, env, gcfg, dp_axis.held)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(gcfg), n_devices=env.world_size, resume=cfg.resume)
    if env.is_main:
        print_grid(grid, cfg, act_shape, sum(p.numel() for p in chunks.parameters()))
        print(f"  schedule {cfg.pp_schedule}, {m} micro-batches of {micro} per dp rank, simulated bubble "
              f"{sim['idle'][0] / sim['makespan']:.3f}, {dtype}, {env.device}, steps {start}..{last_step - 1}",
              flush=True)

    for group in (grid.groups.pp, grid.groups.cp):   # a collective before the first send/recv of a group (NCCL
        dist.barrier(group=group)              # connects a pair at its first p2p; torch wants the group up first)

    def batch(step, mb, split="train"):
        """This rank's micro-batch: its dp slice of the global batch, its cp positions of every sequence."""
        x, y = loader.micro_batch(step, mb, micro, dp_rank, dp, split)
        return x[:, pos], y[:, pos]

    def eval_loss(x, y):                       # every rank: the full loss of one validation micro-batch
        loss = runner.forward_only_loss(x[:, pos], y[:, pos])
        comm.all_reduce(loss, group=grid.groups.cp)
        return loss / cfg.cp

    for step in range(start, last_step):
        t0 = time.perf_counter()
        COMM.reset()
        lr = lr_at(step, cfg)
        dp_axis.start()
        loss_sum = runner.step(schedules[grid.coords["pp"]], lambda mb: batch(step, mb))
        dp_axis.finish()
        grad_norm = dp_axis.clip(cfg.grad_clip)
        with COMM.uncounted():                   # the logged loss, on every rank for the guard: not step traffic
            comm.all_reduce(loss_sum, group=grid.groups.dp_cp)      # the last stage's mean over dp x cp
            last = dist.get_global_rank(grid.groups.pp, runner.last_stage_rank)   # rank 0 in a V
            comm.broadcast(loss_sum, last, group=grid.groups.pp)
        loss_value = float(loss_sum) / (m * dp * cfg.cp)
        if guard.step_ok(step, loss_value, grad_norm):   # global loss and norm: every rank decides alike
            dp_axis.step(lr)
        dp_axis.zero_grad()
        comm_bytes, by_axis = COMM.bytes_sent, bytes_by_axis(grid)     # this step's traffic, before logging
        router = moe_metrics(chunks, grid, cfg) if cfg.n_experts else {}
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, comm_bytes,
                        comm_bytes_by_axis=by_axis, bubble_sim=sim["idle"][grid.coords["pp"]] / sim["makespan"],
                        **router)

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            chunks.eval()
            val = evaluate(eval_loss, loader, cfg)
            chunks.train()
            logger.log_eval(step, val)
        if checkpoint.should_save(cfg, step, last_step):
            checkpoint.save(cfg, gcfg, step + 1, dp_axis.held)
    logger.close()
    if cfg.sample_tokens > 0 and last_step > start:     # (AdamW's state exists once a step has run)
        sample_on_rank0(cfg, dp_axis.held, grid, gcfg, loader, env)
    return dict(chunks=chunks, cfg=cfg, gcfg=gcfg, grid=grid, dp_axis=dp_axis)


if __name__ == "__main__":
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
