"""
tp_grads.py: the loss and the gradients of a tensor-parallel model outside its layers (train_tp.py's building
blocks, split out so the rung reads as its layers; docs/copy_out.md). The cross-entropy of vocabulary-split logits
all-reduces three numbers per token (train_tp.py's docstring) and writes its gradient by hand: softmax - onehot,
each rank its own columns. Under sequence parallelism a replicated parameter inside the SP region (a norm, a row
bias) saw only this rank's sequence chunk: its gradient is a partial sum, summed over tp. In the global gradient
norm every value counts once: each rank its shards (tagged `tp_split` by train_tp's layers), TP rank 0 the
replicated parameters.

    vocab_parallel_loss(logits, targets, group)      # logits [..., V/tp]: rank r holds vocabulary rows r*V/tp...
                                                     # (ignore_index= as F.cross_entropy's: -100, nanoGPT's -1)
    mark_sequence_parallel(model, norms)             # tensor_parallel does it under SP; refuses a norm left out
    mark_tp_params(model, group, sp)                 # tensor_parallel's last step: that, and torch's clip refused
    all_reduce_sequence_parallel_grads(model, group)
    clip_tp_grads(model, max_norm, group)            # the global norm, every gradient scaled to at most max_norm
"""
import torch
import torch.distributed as dist

from common.comm import all_reduce, clip_grad_norm, refuse_torch_clip


def is_norm(module):
    """LayerNorm, RMSNorm, GroupNorm, a fused or a user's own norm: by class name, with parameters of its own."""
    return "Norm" in type(module).__name__ and any(True for _ in module.parameters(recurse=False))


def mark_tp_params(model, group, sp, sequence_parallel=(), replicated=()):
    """What tensor_parallel marks once its layers are in: under SP the sequence-parallel parameters
    (mark_sequence_parallel); on more than one rank every parameter, so that torch's clip_grad_norm_ over any of them
    (each rank its own shards' norm, the replicas scaled apart) raises a ValueError naming clip_tp_grads."""
    if sp:
        mark_sequence_parallel(model, sequence_parallel, replicated)
    if dist.get_world_size(group) > 1:
        refuse_torch_clip(model.parameters(), "clip_tp_grads(model, max_norm, group)")


def mark_sequence_parallel(model, names, replicated=()):
    """Tag every parameter of the named modules `sequence_parallel` (its gradient is summed over tp after
    backward); refuse a norm with parameters that is named in neither list."""
    for name in names:
        for p in model.get_submodule(name).parameters():
            p.sequence_parallel = True
    covered = tuple(names) + tuple(replicated)
    missed = [n for n, m in model.named_modules() if is_norm(m)
              and not any(n == c or n.startswith(c + ".") for c in covered)]
    if missed:
        raise ValueError(f"sequence parallelism: the norms {missed} have parameters but are not named in "
                         f"sequence_parallel: under SP a norm sees this rank's sequence chunk, so its gradient must "
                         f"be summed over tp (name it in sequence_parallel), or, if it runs on the whole sequence "
                         f"outside the SP region, name it in replicated")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-split logits [N, V/tp]: loss = log(sum_v e^(z_v - m)) - (z_target - m),
    averaged over the targets that are not ignore_index (F.cross_entropy's mean)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        m = logits.max(dim=-1).values                            # max for a stable exp
        all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = logits - m[:, None]
        local = targets - vocab_start
        counted = targets != ignore_index                        # (nanoGPT's -1, torch's default -100)
        mine = (local >= 0) & (local < z.shape[-1]) & counted    # the target id is in my rows
        local = local.clamp(0, z.shape[-1] - 1)
        target_z = torch.where(mine, z.gather(1, local[:, None]).squeeze(1), 0.0)   # only the owner's counts
        all_reduce(target_z, group=group)
        exp = z.exp()                                            # (out of place: torch.compile traces this)
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp / sum_exp[:, None], local, mine, counted)   # my slice of the softmax
        return torch.where(counted, sum_exp.log() - target_z, 0.0).sum() / counted.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, counted = ctx.saved_tensors        # dL/dz = (softmax - onehot(target)) / N counted
        grad_z = softmax.scatter_add(1, local[:, None], -mine[:, None].to(softmax.dtype))
        return grad_z * (counted[:, None] * (grad / counted.sum())), None, None, None, None


def vocab_parallel_loss(logits, targets, group, ignore_index=-100):
    """Mean cross-entropy from a vocabulary-parallel head's logits [..., V/tp] (a "column" head tied to an
    "embedding" in tensor_parallel's plan, or VocabParallelLMHead): rank r holds rows [r*V/tp, (r+1)*V/tp).
    Targets equal to ignore_index count for nothing, as in F.cross_entropy (nanoGPT's padding: -1)."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))     # fp32 at least, float64 stays
    return VocabParallelCrossEntropy.apply(wide.flatten(0, -2), targets.reshape(-1),
                                           dist.get_rank(group) * logits.shape[-1], group, ignore_index)


def all_reduce_sequence_parallel_grads(model, group):
    """Under SP each rank's norms and row biases saw only its sequence chunk: sum their grads (one bucket)."""
    sum_sequence_parallel_grads(model.parameters(), group)


def sum_sequence_parallel_grads(params, group):
    """all_reduce_sequence_parallel_grads of the parameters `params` only (train_5d: those whose gradients a
    pipeline schedule has just finished, summed before their data-parallel reduction starts)."""
    sum_in_place([p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None], group)


def sum_in_place(tensors, group):
    """Sum `tensors` over `group` in place with one all-reduce of their concatenation (one message, not many)."""
    if tensors:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        all_reduce(flat, group=group)
        torch._foreach_copy_(tensors, [v.view_as(t) for t, v in zip(tensors, flat.split([t.numel() for t in tensors]))])


def tp_counts(p, group):
    """Whether this TP rank counts p in a global norm: every rank its shards, TP rank 0 the replicated
    parameters (norms, row biases), so each value is counted once."""
    return hasattr(p, "tp_split") or dist.get_rank(group) == 0


def tp_owned(params, group):
    """(gradients this rank counts in the global norm, the replicas another TP rank counts)."""
    grads = [(p.grad, tp_counts(p, group)) for p in params if p.grad is not None]
    return [g for g, mine in grads if mine], [g for g, mine in grads if not mine]


def clip_tp_grads(model, max_norm, group):
    """The global grad norm over the TP ranks, and every gradient (replicas too) scaled to at most max_norm."""
    owned, replicas = tp_owned(model.parameters(), group)
    return clip_grad_norm(owned, max_norm, group, device=owned[0].device, dtype=owned[0].dtype, replicas=replicas)
