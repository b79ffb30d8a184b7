"""
train_cp.py: context parallelism over train_single.py. Every sequence of the batch is cut along its length
across --cp ranks; everything except attention (embeddings, LayerNorms, MLP, LM head, loss) runs on the
local chunk with no communication, RoPE using the chunk's *global* positions. Attention, where every token
needs the keys/values of all earlier tokens, is swapped for a distributed one:

    torchrun --nproc_per_node=4 train_cp.py --cp 4 --cp_layout zigzag --block_size 1024   # ring | allgather

Layouts at cp = 4 (T = sequence length; allgather uses the zigzag layout, as Llama 3 does):
    ring:      rank0 [0]       rank1 [1]       rank2 [2]       rank3 [3]           4 chunks of c = T/4
    zigzag:    rank0 [0 | 7]   rank1 [1 | 6]   rank2 [2 | 5]   rank3 [3 | 4]       8 chunks of c = T/8

ring / zigzag: at ring step s, rank r holds the K/V of rank r-s and sends them on to r+1 (async, overlapped
with this step's blocks). Each block gives a partial output and log-sum-exp, merged exactly in fp32:
    lse = log(e^lse_a + e^lse_b),   out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse)
Fully masked blocks are skipped: in ring, rank r computes 1/2 + r blocks of c x c (rank 0 idles while rank
cp-1 works); in zigzag every rank computes the causal diagonal plus cp-1 half blocks, exactly equal work.
Backward: dQ accumulates locally; dK/dV travel around the ring with K/V (in their dtype, summed in fp32 at
each rank) and take one last hop home. allgather (Llama 3): K/V all-gathered, local queries attend to what they
can see, dK/dV reduce-scattered in fp32. Bytes sent per layer and micro-batch (KV = this rank's K and V, in the
compute dtype, dKV = the same in fp32): ring and zigzag (cp-1)*KV forward, (cp-1)*KV + cp*KV backward;
allgather (cp-1)*(2*KV + dKV). Plus the all-reduce of every gradient over CP, 2(cp-1)/cp * 4N bytes.
Block attention: any (forward, backward) pair of PLAIN_TORCH's signatures (--kernels picks a fused one in
converters/cp_kernels.py). K/V may have fewer heads than Q (grouped-query attention): they travel with their own
heads. Any model (docs/copy_out.md): swap_modules puts the core in place of the modules named.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from common.comm import COMM, all_gather, all_reduce, batch_isend_irecv, clip_grad_norm, label, p2p_op, reduce_scatter
from common.cp_layout import allgather_blocks, global_order, local_positions, ring_step_blocks, score_elements


# ----------------------------------------------------------------------------------------------------------
# block attention: queries against one block of keys, returning the output and the log-sum-exp

def block_scores(q, k, causal):
    """q k^T / sqrt(D). causal: the diagonal block, q and k at the same positions (Tq == Tk), so query i sees
    keys j <= i (top-left and bottom-right alignment agree: any flash kernel's causal mode fits)."""
    s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def attention_forward(q, k, v, causal):
    """q [B, H, Tq, D], k/v [B, H, Tk, D] -> out [B, H, Tq, D] (q's dtype), lse [B, H, Tq] (fp32 or fp64)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = block_scores(q.to(acc), k.to(acc), causal)
    lse = torch.logsumexp(s, dim=-1)           # log of the softmax denominator: all a merge needs
    return torch.matmul(torch.exp(s - lse[..., None]), v.to(acc)).to(q.dtype), lse


def attention_backward(dout, q, k, v, out, lse, causal):
    """Gradients of one block given the *final* out and lse of these queries (over all blocks): with
    P = exp(S - lse) the block's exact share of softmax, dS = P * (dO V^T - rowsum(dO * O))."""
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, v, dout, out = (t.to(acc) for t in (q, k, v, dout, out))
    p = torch.exp(block_scores(q, k, causal) - lse[..., None])   # final probabilities, not block-local ones
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - (dout * out).sum(-1, keepdim=True))
    scale = q.shape[-1] ** -0.5
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


PLAIN_TORCH = (attention_forward, attention_backward)   # the seam: any pair of these signatures can run instead


def merge_partial(out, lse, block_out, block_lse):
    """Fold one block's (out, lse) into the running fp32 accumulators, in place (stable log-sum-exp)."""
    new_lse = torch.logaddexp(lse, block_lse)              # never exponentiates a large number
    out.mul_(torch.exp(lse - new_lse)[..., None])          # each part re-weighted by its share of the total
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


def repeat_heads(t, q):
    """Grouped-query attention: K/V [B, H_kv, T, D] repeated to q's H heads (each K/V head serves H/H_kv query
    heads, adjacent). K/V travel between ranks with their own H_kv heads; only the local blocks repeat them."""
    rep = q.shape[1] // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def sum_heads(grad, kv):
    """The backward of repeat_heads: the repeated heads' gradients summed back onto kv's H_kv heads."""
    rep = grad.shape[1] // kv.shape[1]
    return grad if rep == 1 else grad.unflatten(1, (kv.shape[1], rep)).sum(2)


def attend(q, k, v, blocks, out, lse, kernel):
    """Queries q[rows] against k/v[cols] for each (rows, cols, causal) block, merged into out/lse."""
    for rows, cols, causal in blocks:
        o, l = kernel[0](q[..., rows, :], repeat_heads(k[..., cols, :], q), repeat_heads(v[..., cols, :], q), causal)
        merge_partial(out[..., rows, :], lse[..., rows], o, l)


def attend_backward(dout, q, k, v, out, lse, blocks, kernel, dq):
    """Backward of `attend`: adds into dq, returns [(cols, dk, dv)] for the caller to place."""
    grads = []
    for rows, cols, causal in blocks:
        kb, vb = k[..., cols, :], v[..., cols, :]
        dq_b, dk_b, dv_b = kernel[1](dout[..., rows, :], q[..., rows, :], repeat_heads(kb, q), repeat_heads(vb, q),
                                     out[..., rows, :], lse[..., rows], causal)
        dq[..., rows, :] += dq_b
        grads.append((cols, sum_heads(dk_b, kb), sum_heads(dv_b, vb)))
    return grads


def add_kv_grads(dkv, grads):
    for cols, dk, dv in grads:
        dkv[:, ..., cols, :] += torch.stack([dk, dv])


# ----------------------------------------------------------------------------------------------------------
# ring attention (ring and zigzag layouts)

def ring_shift(t, group):
    """Start sending t to the next rank of the ring and receiving the previous rank's; returns a function
    that waits for both and gives the received tensor."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(t)
    works = batch_isend_irecv([p2p_op("send", t, dist.get_global_rank(group, (r + 1) % n), group),
                               p2p_op("recv", recv, dist.get_global_rank(group, (r - 1) % n), group)])

    def arrived():
        for w in works:
            w.wait()
        return recv
    return arrived


def new_accumulators(q):
    """(out, lse) in fp32 or wider, out shaped like q [B, H, T, D] but laid out [B, T, H, D] in memory, as torch's
    SDPA lays its output: the model's transpose-reshape to [B, T, C] is then a view, not a copy that c_proj would
    keep for backward beside the `out` this core keeps."""
    acc = torch.promote_types(q.dtype, torch.float32)
    B, H, T, D = q.shape
    return (torch.zeros(B, T, H, D, dtype=acc, device=q.device).transpose(1, 2),
            torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device))


def keep_for_backward(ctx, q, k, v, out, lse, group, layout, kernel):
    """Keep the local q, k, v and the merged out, lse (never the other ranks' K/V: they travel again)."""
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.group, ctx.layout, ctx.kernel = group, layout, kernel
    ctx.mark_non_differentiable(lse)           # lse is returned for tests and merging, not differentiated
    return out, lse


class RingAttention(torch.autograd.Function):
    """Causal attention over a sequence split across `group` by `layout`; returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, kernel):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        with torch.autocast(q.device.type, enabled=False):
            out, lse = new_accumulators(q)
            kv = torch.stack([k, v])           # one message per hop
            for s in range(n):
                if s + 1 < n:
                    next_kv = ring_shift(kv, group)   # in flight while this step's blocks compute
                with label(f"cp:ring step {s}"):       # a range in --profile's trace
                    attend(q, kv[0], kv[1], ring_step_blocks(layout, r, (r - s) % n, q.shape[-2]), out, lse, kernel)
                if s + 1 < n:
                    kv = next_kv()
        return keep_for_backward(ctx, q, k, v, out, lse, group, layout, kernel)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, n, r = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        with torch.autocast(q.device.type, enabled=False):
            dq = new_accumulators(q)[0]
            kv = torch.stack([k, v])
            dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=q.device)   # dK/dV of the block held now
            for s in range(n):
                if s + 1 < n:
                    next_kv = ring_shift(kv, group)
                blocks = ring_step_blocks(ctx.layout, r, (r - s) % n, q.shape[-2])
                with label(f"cp:ring step {s} backward"):
                    grads = attend_backward(dout, q, kv[0], kv[1], out, lse, blocks, ctx.kernel, dq)
                if s > 0:                      # this block's dK/dV, summed by the ranks before us: widened
                    dkv = next_dkv().to(dq.dtype)
                add_kv_grads(dkv, grads)
                if n > 1:                      # passed on in K/V's dtype; after the last step this is the hop home
                    next_dkv = ring_shift(dkv.to(k.dtype), group)
                if s + 1 < n:
                    kv = next_kv()
            if n > 1:
                dkv = next_dkv()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# ----------------------------------------------------------------------------------------------------------
# all-gather KV attention (Llama 3), on the zigzag layout so that the work is balanced

def gather_sequence(local, group, layout, seq_len):
    """[..., T_local, D] of every rank -> [..., T, D] in global position order."""
    n = dist.get_world_size(group)
    parts = torch.empty(n * local.numel(), dtype=local.dtype, device=local.device)   # flat: gloo wants 1-D
    all_gather(parts, local.contiguous().view(-1), group=group)
    parts = parts.view(n, *local.shape)        # rank-major: rank i's chunks, then rank i+1's
    return torch.cat([parts[i] for i in range(n)], dim=-2)[..., global_order(layout, seq_len, n, local.device), :]


def scatter_sequence_grad(full, group, layout, seq_len):
    """Inverse of gather_sequence for gradients: sum over ranks, each keeps its own positions."""
    n = dist.get_world_size(group)
    rank_major = torch.empty_like(full)
    rank_major[..., global_order(layout, seq_len, n, full.device), :] = full
    parts = torch.stack(rank_major.chunk(n, dim=-2))           # [n, ..., T_local, D]: rank i's part first
    local = torch.empty(parts.shape[1:], dtype=full.dtype, device=full.device)
    reduce_scatter(local.view(-1), parts.reshape(-1), group=group)
    return local


class AllGatherKVAttention(torch.autograd.Function):
    """Local queries against the all-gathered K/V (only the blocks they can see); returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, kernel):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        seq_len = q.shape[-2] * n
        with torch.autocast(q.device.type, enabled=False):
            kv = gather_sequence(torch.stack([k, v]), group, layout, seq_len)
            out, lse = new_accumulators(q)
            attend(q, kv[0], kv[1], allgather_blocks(layout, seq_len, n, r), out, lse, kernel)
        return keep_for_backward(ctx, q, k, v, out, lse, group, layout, kernel)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        seq_len = q.shape[-2] * n
        with torch.autocast(q.device.type, enabled=False):
            kv = gather_sequence(torch.stack([k, v]), ctx.group, ctx.layout, seq_len)
            dq = new_accumulators(q)[0]
            dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=q.device)
            blocks = allgather_blocks(ctx.layout, seq_len, n, r)
            add_kv_grads(dkv, attend_backward(dout, q, kv[0], kv[1], out, lse, blocks, ctx.kernel, dq))
            dkv = scatter_sequence_grad(dkv, ctx.group, ctx.layout, seq_len)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def context_parallel_attention(q, k, v, group, layout, kernel=PLAIN_TORCH):
    """(out, lse) of causal attention for this rank's chunk q [B, H, T_local, D], k/v [B, H_kv, T_local, D]
    (H_kv divides H: grouped-query attention) of a sequence laid out across `group` by `layout` (ring | zigzag |
    allgather)."""
    fn = AllGatherKVAttention if layout == "allgather" else RingAttention
    return fn.apply(q, k, v, group, layout, kernel)


class ContextParallelAttentionCore(nn.Module):
    """Drop-in for a model's causal attention core (model.AttentionCore, F.scaled_dot_product_attention(q, k, v,
    is_causal=True) in a module of its own): forward(q, k, v) on the local chunk -> local attention output; SDPA's
    scale= too, and a ValueError for what it cannot apply (attn_mask, dropout_p, is_causal=False), never ignored."""

    def __init__(self, group, layout, kernel=PLAIN_TORCH):
        super().__init__()
        self.group, self.layout, self.kernel = group, layout, kernel

    def forward(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None):
        if attn_mask is not None or dropout_p or not is_causal:
            mask = None if attn_mask is None else tuple(attn_mask.shape)
            raise ValueError(f"context-parallel attention is causal, without a mask or dropout: got attn_mask={mask}, "
                             f"dropout_p={dropout_p}, is_causal={is_causal}")
        if scale is not None and scale != q.shape[-1] ** -0.5:    # the kernels scale by 1/sqrt(D): fold the rest
            q = q * (scale * q.shape[-1] ** 0.5)                  # into q (autograd takes it back to q's grad)
        return context_parallel_attention(q, k, v, self.group, self.layout, self.kernel)[0]


def swap_modules(model, names, make):
    """Replace each named module of `model` by make(); returns the old ones, in order (to swap back)."""
    old = [model.get_submodule(name) for name in names]
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, make())
    return old


def swap_attention_cores(model, make_core):
    """swap_modules for model.py's GPT (or a pipeline stage of it): every block's attn.core."""
    return swap_modules(model, [n for n, _ in model.named_modules() if n.endswith("attn.core")], make_core)


# ----------------------------------------------------------------------------------------------------------
# the rest of a CP step: gradients summed over the CP group (the loss is local: the script divides it by cp)

def allreduce_grads(params, group):
    """Sum gradients over `group` in one flat all-reduce: each CP rank's gradient covers only the paths
    through its own chunk (K/V gradients from other ranks' queries already came home in backward)."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)       # one collective instead of one per parameter
    all_reduce(flat, group=group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


# ----------------------------------------------------------------------------------------------------------
# the script

def block_attention_kernel(kernels, device, dtype, head_dim):
    """The (forward, backward) pair the block attention runs for --kernels `kernels` (this script and train_5d.py):
    the fused pair converters/cp_kernels.py picks, else the plain-torch reference."""
    from converters.cp_kernels import fused_block_kernel
    return fused_block_kernel(kernels, device, dtype, head_dim) or PLAIN_TORCH


def validate(cfg):
    from common.config import check, grad_accum_steps
    from common.distributed import world_size_from_env
    world = world_size_from_env()
    check(cfg.cp == world, f"--cp {cfg.cp} must equal the number of processes ({world}): train_cp.py is "
          f"context parallel only (combine with data parallelism in train_5d.py)")
    check_cp(cfg, cfg.cp)
    grad_accum_steps(cfg, 1)


def check_cp(cfg, cp):
    """What context parallelism asks of the run, for train_cp and train_5d alike: equal chunks of every sequence
    (cp of them for ring, 2cp for zigzag and allgather) and no attention dropout."""
    from common.config import check
    multiple = cp if cfg.cp_layout == "ring" else 2 * cp
    check(cp == 1 or cfg.block_size % multiple == 0, f"--block_size {cfg.block_size} must be a multiple of "
          f"{multiple} (--cp_layout {cfg.cp_layout} cuts every sequence into {multiple} equal chunks at cp={cp})")
    check(cp == 1 or cfg.dropout == 0.0, "--dropout must be 0 with --cp > 1: the distributed attention has no "
                                         "attention dropout")


def main(argv=None):
    # the script's plumbing, imported here: the building blocks above need only torch and comm.py
    from common import checkpoint
    from common.checkpoint import ModuleState, replicated
    from common.config import grad_accum_steps, parse_config
    from common.distributed import init_distributed
    from common.metrics import MetricsLogger, SavedActivationBytes
    from common.optim import NonFiniteGuard, configure_optimizer, lr_at, set_lr
    from common.evaluation import evaluate, print_sample
    from common.model_setup import gpt_config
    from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
    from common.startup import prepare_data
    from converters.apply import apply_kernels_and_fp8
    from model import GPT, flops_per_token
    cfg = parse_config(argv, techniques=("cp", "cp_layout", "fp8"), description=__doc__.split("\n\n")[0],
                       validate=validate)
    env = init_distributed(cfg)
    group, cp = dist.group.WORLD, cfg.cp
    grad_acc = grad_accum_steps(cfg, 1)        # every CP rank sees every sequence: dp = 1
    loader = prepare_data(cfg, env)
    enable_tf32(env.device)
    dtype = resolve_dtype(cfg, env.device)
    wide = param_dtype(dtype)                  # losses summed over ranks in fp32 (float64 in a float64 run)

    model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed).to(env.device, param_dtype(dtype))
    mode = apply_kernels_and_fp8(model, cfg, env.device)   # fused modules, FP8 GEMMs: same parameters
    kernel = block_attention_kernel(cfg.kernels, env.device, dtype, cfg.n_embd // cfg.n_head)
    local_cores = swap_attention_cores(model, lambda: ContextParallelAttentionCore(group, cfg.cp_layout, kernel))
    pos = local_positions(cfg.cp_layout, cfg.block_size, cp, dist.get_rank(group), env.device)  # for RoPE, too
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(cfg, env.is_main, scaler)
    torch.manual_seed(cfg.seed)                # same stream as train_single (no dropout here, though)
    held = ModuleState([model], optimizer, replicated, scaler=scaler)   # what this rank holds, for checkpoints
    start = checkpoint.start_from(cfg, env, model.cfg, held)
    train_model = torch.compile(model) if cfg.compile else model
    amp = autocast_context(dtype, env.device)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=cp, resume=cfg.resume)
    activations = SavedActivationBytes(model)
    # attention score elements this rank computes per step: every layer of every micro-batch, twice when
    # recomputed in backward (--recompute selective or full runs the attention forward again)
    score_work = (score_elements(cfg.cp_layout, cfg.block_size, cp, dist.get_rank(group)) * cfg.micro_batch_size
                  * cfg.n_head * cfg.n_layer * grad_acc * (1 if cfg.recompute == "none" else 2))
    if env.is_main:
        print(f"train_cp: {sum(p.numel() for p in model.parameters()):,} parameters, cp {cp} ({cfg.cp_layout}), "
              f"{len(pos)} of {cfg.block_size} positions per rank, grad_acc {grad_acc}, {dtype}, {env.device}, "
              f"kernels {mode}, steps {start}..{last_step - 1}", flush=True)

    def local_loss(x, y):                      # this rank's chunk of every sequence, at its global positions
        return train_model(x[:, pos], y[:, pos], pos=pos)[1]

    def eval_loss(x, y):                       # the mean over the whole sequence, on every rank
        loss = local_loss(x, y).to(wide)
        all_reduce(loss, group=group)
        return loss / cp

    for step in range(start, last_step):
        t0 = time.perf_counter()
        COMM.reset()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = torch.zeros((), device=env.device, dtype=wide)
        for micro in range(grad_acc):
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size)
            with amp, activations.during(micro == 0):
                loss = local_loss(x, y)        # mean over local tokens; every rank holds B*T/cp of them
            if micro == 0:
                act_bytes = activations.bytes        # saved for backward by one micro-batch (all are alike)
            scaler.scale(loss / (grad_acc * cp)).backward()   # global mean = mean of the cp local means
            loss_sum += loss.detach().to(wide)
        allreduce_grads(model.parameters(), group)   # sum of partial grads: the replicas stay identical
        all_reduce(loss_sum, group=group)      # the logged loss covers every token of the global batch
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm([p.grad for p in model.parameters()], cfg.grad_clip)  # grads replicated
        loss_value = float(loss_sum) / (grad_acc * cp)
        if guard.step_ok(step, loss_value, grad_norm):   # global loss and norm: every rank decides alike
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, COMM.bytes_sent,
                        act_bytes=act_bytes, attn_score_elements=score_work)

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            model.eval()
            with amp:
                val = evaluate(eval_loss, loader, cfg)
            model.train()
            logger.log_eval(step, val)
        if checkpoint.should_save(cfg, step, last_step):           # the CP ranks hold the same weights: rank 0 saves
            checkpoint.save(cfg, model.cfg, step + 1, held)
    logger.close()
    cores = iter(local_cores)                  # sample on one device with the plain cores
    swap_attention_cores(model, lambda: next(cores))
    print_sample(model, loader, cfg, env)
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    from common.distributed import destroy
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
