"""
train_single.py: the first rung. Train model.py's GPT on one device; every other script must reproduce
this one's loss curve for the same seed and global batch (docs/parity.md).

    python train_single.py                                  # default corpus, CPU-sized model
    python train_single.py --n_layer 4 --n_head 4 --n_embd 128 --block_size 64 --global_batch_size 12 \
        --micro_batch_size 12 --max_steps 500 --eval_interval 100       # a few minutes on a laptop CPU
    python train_single.py --device cuda --compile                       # bf16 autocast on a GPU
    python train_single.py --n_experts 8 --top_k 2                       # mixture-of-experts MLPs (model.py)

What a step does (the loop at the bottom of main reads top to bottom):

    for micro in range(grad_acc):            global_batch = micro_batch_size * grad_acc
        loss = model(x_micro, y_micro) / grad_acc ; loss.backward()      grads accumulate in .grad
    clip the global grad norm ; AdamW step with lr_at(step) ; zero grads

Memory levers here: gradient accumulation (activations of one micro-batch at a time) and activation
recomputation (--recompute selective: recompute the T x T attention scores; full: recompute every block from
its input). Precision: bf16 autocast on GPU, fp16 autocast with a GradScaler, fp32 on CPU.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import time

import torch

from common import checkpoint
from common.checkpoint import ModuleState, replicated
from common.comm import COMM
from common.config import check, grad_accum_steps, parse_config
from common.distributed import init_distributed
from common.metrics import MetricsLogger
from common.optim import NonFiniteGuard, clip_grad_norm, configure_optimizer, lr_at, set_lr
from common.routing import end_moe_step, router_metrics, start_moe_training
from common.evaluation import evaluate, print_sample
from common.model_setup import MOE_FLAGS, check_moe, gpt_config
from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
from common.startup import prepare_data
from common.sdpa import SdpaKernels, add_sdpa_flag
from converters.apply import apply_kernels_and_fp8, compiled
from model import GPT, flops_per_token


def main(argv=None):
    cfg = parse_config(argv, techniques=MOE_FLAGS + ("fp8",), description=__doc__.split("\n\n")[0],
                       extra_args=add_sdpa_flag,
                       validate=lambda c: (check_moe(c), check(grad_accum_steps(c, 1) > 0, "empty batch")))
    env = init_distributed(cfg, need_group=False)
    attention = SdpaKernels(cfg.sdpa, env.device)      # SDPA's kernels, in the order to try (common/sdpa.py)
    grad_acc = grad_accum_steps(cfg, 1)
    loader = prepare_data(cfg, env)
    enable_tf32(env.device)
    dtype = resolve_dtype(cfg, env.device)

    model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed).to(env.device, param_dtype(dtype))
    apply_kernels_and_fp8(model, cfg, env.device)    # fused modules, FP8 GEMMs in the blocks: same parameters
    start_moe_training(model, cfg.global_batch_size * cfg.block_size)   # MoE balancing: the step's tokens
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(cfg, scaler=scaler)
    torch.manual_seed(cfg.seed)                      # dropout stream, identical in every run with this seed
    held = ModuleState([model], optimizer, replicated, scaler=scaler)   # what this rank holds, for checkpoints
    start = checkpoint.start_from(cfg, env, model.cfg, held)
    train_model = compiled(model, cfg)
    amp = autocast_context(dtype, env.device)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=1, on_read=guard.step_ok, resume=cfg.resume)
    print(f"train_single: {sum(p.numel() for p in model.parameters()):,} parameters, grad_acc {grad_acc}, "
          f"{dtype}, {env.device}, steps {start}..{last_step - 1}", flush=True)

    for step in range(start, last_step):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        with attention:                                # backward too: a recomputed attention core runs the same kernel
            for micro in range(grad_acc):
                x, y = loader.micro_batch(step, micro, cfg.micro_batch_size)
                with amp:
                    _, loss = train_model(x, y)
                scaler.scale(loss / grad_acc).backward()   # mean over the global batch = mean of micro means
                loss_sum += loss.detach()
        step_loss = loss_sum / grad_acc
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm([p.grad for p in model.parameters()], cfg.grad_clip)
        guard.step(optimizer, scaler, step_loss, grad_norm)   # inf/NaN: skipped on the device
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        # loss and grad norm stay on the device: the logger reads them once per log interval (no wait per step)
        logger.log_step(step, step_loss, lr, grad_norm, time.perf_counter() - t0, COMM.bytes_sent,
                        **router_metrics(end_moe_step(model), cfg.top_k))

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            logger.read()                                # this step's row (and the guard's count) first
            model.eval()
            with amp, attention:
                val = evaluate(lambda x, y: train_model(x, y)[1], loader, cfg)
            model.train()
            logger.log_eval(step, val)
        if checkpoint.should_save(cfg, step, last_step):
            logger.read()                                # a diverged run stops here, before saving
            checkpoint.save(cfg, model.cfg, step + 1, held)
    logger.close()
    print_sample(model, loader, cfg, env)
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    main()
