"""
optim.py: AdamW parameter groups, the learning-rate schedule (and a warning where it or AdamW's decay would train
degenerately), and the guard that skips a step whose loss or gradients are not finite. Gradient-norm clipping that
also works when gradients are sharded across ranks is comm.clip_grad_norm (imported here too): the rungs' building
blocks use it, and comm.py is what they take along.
"""
import math
import sys

import torch

from common.comm import clip_grad_norm  # noqa: F401 (lives in comm.py so copied-out blocks have it; scripts import it here)
from common.errors import fail, launch_rank


BETAS, EPS = (0.9, 0.95), 1e-8      # AdamW hyperparameters of every script (GPT-3 paper, as nanoGPT)


def configure_optimizer(named_params, cfg, device_type="cpu"):
    """AdamW with weight decay on >= 2-D parameters (matmul weights, embeddings) only, not biases/LayerNorms."""
    groups = {}     # (no decay, tensor kind) -> group: a fused step takes one kind (a partly DTensor model has two)
    for _, p in named_params:
        if p.requires_grad:
            key = (p.dim() < 2, type(p.data).__name__)
            group = groups.setdefault(key, dict(params=[], weight_decay=0.0 if key[0] else cfg.weight_decay))
            group["params"].append(p)
    # fused: one kernel over all parameters. On CPU (torch >= 2.4) it is ~5x faster than the default
    # per-tensor loop: 17 vs 93 ms per step for the 11M-parameter L6 h384 model on one thread
    return torch.optim.AdamW([groups[k] for k in sorted(groups)], lr=cfg.lr, betas=BETAS, eps=EPS,
                             fused=device_type in ("cuda", "cpu") or None)


def lr_at(step, cfg):
    """Linear warmup to lr over warmup_steps, then cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def warn_degenerate(cfg):
    """Hyperparameters that train, but not as meant: one warning line each, with the reason, at the top of the run's
    log on stdout (the run goes on; stderr is for what stops it). Rank 0 alone: every rank has the same flags."""
    if launch_rank() != 0:
        return
    decay = cfg.lr * cfg.weight_decay
    if decay >= 1:
        print(f"warning: --lr {cfg.lr:g} x --weight_decay {cfg.weight_decay:g} = {decay:g} >= 1: AdamW multiplies each "
              f"decayed weight by 1 - lr x weight_decay = {1 - decay:g} every step, zeroing it or flipping its sign",
              flush=True)
    if cfg.warmup_steps > cfg.max_steps:
        print(f"warning: --warmup_steps {cfg.warmup_steps} is longer than the run (--max_steps {cfg.max_steps}): the "
              f"learning rate never reaches --lr {cfg.lr:g} (it ends at {cfg.lr * cfg.max_steps / cfg.warmup_steps:g}) "
              f"and never decays", flush=True)


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


class NonFiniteGuard:
    """Decides whether to take an optimizer step: not when the step's loss or gradient norm is inf or NaN (a
    diverged run, a bad batch). The caller then skips the step, so weights and optimizer state stay as they were,
    and zeroes the gradients as usual. After --max_bad_steps such steps in a row the run stops with one error
    line, before anything non-finite could be saved over a good checkpoint.

    Pass the global loss and gradient norm (reduced over the ranks that split the step): every rank then makes
    the same decision, and no rank steps while another skips. With an fp16 GradScaler, inf gradients are its
    overflow signal and not a bad step: the scaler skips that step itself and lowers the scale."""

    def __init__(self, cfg, is_main=True, scaler=None):
        self.max_bad, self.is_main, self.in_a_row = cfg.max_bad_steps, is_main, 0
        self.scaled = scaler is not None and scaler.is_enabled()

    def step(self, optimizer, scaler, loss, grad_norm):
        """scaler.step(optimizer), skipped on the device when this step's loss or gradient norm is not finite: a
        fused AdamW skips its whole update, step count included, while its `found_inf` is 1 (as a GradScaler skips
        an overflow), so nothing is read on the host. Pass the values to step_ok later, in step order, for the
        warning, the count of bad steps in a row and the stop. Under an fp16 GradScaler its own found_inf decides
        (a non-finite loss leaves non-finite gradients); an optimizer that is not fused is decided on the host."""
        if self.scaled:
            scaler.step(optimizer)
            return
        ok = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if not optimizer.defaults.get("fused"):
            if bool(ok):
                optimizer.step()
            return
        optimizer.found_inf = (~ok).to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf

    def step_ok(self, step, loss, grad_norm):
        grad_norm = float(grad_norm)
        if math.isfinite(loss) and (math.isfinite(grad_norm) or self.scaled):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        what = f"step {step}: loss {loss:.4g}, grad norm {grad_norm:.4g}"
        if self.in_a_row >= self.max_bad:
            fail(f"{what}: {self.in_a_row} steps in a row with a non-finite loss or gradient norm (--max_bad_steps "
                 f"{self.max_bad}); stopped without saving, the last checkpoint is kept. Lower --lr, or check the data")
        if self.is_main:
            print(f"warning: {what}: not finite, optimizer step skipped ({self.in_a_row} in a row; the run stops at "
                  f"--max_bad_steps {self.max_bad})", file=sys.stderr, flush=True)
        return False
