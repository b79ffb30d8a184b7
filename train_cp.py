"""
train_cp.py: context parallelism over train_single.py. Every sequence of the batch is cut along its length
across --cp ranks; everything except attention (embeddings, LayerNorms, MLP, LM head, loss) runs on the
local chunk with no communication, RoPE using the chunk's *global* positions. Attention, where every token
needs the keys/values of all earlier tokens, is swapped for a distributed one:

    torchrun --nproc_per_node=4 train_cp.py --cp 4 --cp_layout zigzag --block_size 1024
    torchrun --nproc_per_node=2 train_cp.py --cp 2 --cp_layout ring           # or allgather

Layouts (T = sequence length, c = T/cp for ring, T/(2cp) for zigzag and allgather), cp = 4:

    ring:      rank0 [0]       rank1 [1]       rank2 [2]       rank3 [3]           4 chunks of T/4
    zigzag:    rank0 [0 | 7]   rank1 [1 | 6]   rank2 [2 | 5]   rank3 [3 | 4]       8 chunks of T/8

ring / zigzag: at ring step s, rank r holds the K/V of rank r-s and sends them on to r+1 (async, overlapped
with this step's block). Each block gives a partial output and log-sum-exp, merged exactly in fp32:
    lse = log(e^lse_a + e^lse_b),   out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse)
Causal blocks that are fully masked are skipped. In plain ring, rank r computes 1/2 + r blocks of c x c, so
rank 0 idles while rank cp-1 works; in zigzag every rank does the causal diagonal plus cp-1 half blocks:
exactly equal work. Backward: dQ accumulates locally; dK/dV travel around the ring with K/V and take one
last hop home. allgather (Llama 3): K/V all-gathered, local queries attend to the prefix they need; dK/dV
reduce-scattered back. Bytes sent per layer and micro-batch (KV = this rank's K and V, dKV = the same in
fp32): ring/zigzag (cp-1)*KV forward, (cp-1)*KV + cp*dKV backward; allgather (cp-1)*(2*KV + dKV).
Plus the CP all-reduce of all gradients, 2(cp-1)/cp * 4 bytes * N: every rank holds the full model.

The block attention (attention_forward / attention_backward below) is plain torch and the reference; a
fused kernel with the same signatures can be passed as `kernel=(forward, backward)`.
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from comm import COMM, all_gather, all_reduce, batch_isend_irecv, init_distributed, p2p_op, reduce_scatter, \
    world_size_from_env
from config import check, grad_accum_steps, parse_config
from metrics import MetricsLogger
from model import GPT, flops_per_token
from optim import clip_grad_norm, configure_optimizer, lr_at, set_lr
from train_single import autocast_context, evaluate, gpt_config, load_training_state, prepare_data, \
    print_sample, resolve_dtype, save_training_state, should_save


# ----------------------------------------------------------------------------------------------------------
# block attention: queries against one block of keys, returning the output and the log-sum-exp

def causal_mask(q_len, k_len, device):
    """True where query i may see key j. Bottom-right aligned (as flash-attn): the queries are the last q_len
    positions of the keys, so q_len == k_len is the usual causal mask."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    return j <= i + (k_len - q_len)


def attention_forward(q, k, v, causal, scale=None):
    """q [B, H, Tq, D], k/v [B, H, Tk, D] -> out [B, H, Tq, D] (q's dtype), lse [B, H, Tq] (fp32 or fp64)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.to(acc))
    return out.to(q.dtype), lse


def attention_backward(dout, q, k, v, out, lse, causal, scale=None):
    """Gradients of one block given the *final* out and lse of these queries (over all blocks): with
    P = exp(S - lse) the block's exact share of softmax, dS = P * (dO V^T - rowsum(dO * O))."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, dout, out = (t.to(acc) for t in (q, k, v, dout, out))
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - (dout * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


PLAIN_TORCH = (attention_forward, attention_backward)


def merge_partial(out, lse, block_out, block_lse):
    """Fold one block's (out, lse) into the running fp32 accumulators, in place (stable log-sum-exp)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out.to(out.dtype) * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


class WorkCounter:
    """Attention score elements this rank computes (unmasked (query, key) pairs x B x H, forward)."""

    def __init__(self):
        self.score_elements = 0

    def add(self, q, k_len, causal):
        B, H, q_len, _ = q.shape
        pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) // 2 if causal else q_len * k_len
        self.score_elements += B * H * pairs


WORK = WorkCounter()


# ----------------------------------------------------------------------------------------------------------
# sequence layouts

def chunk_runs(layout, seq_len, cp, rank):
    """(global start, length) of each contiguous run of positions `rank` holds, in local order."""
    if layout == "ring":
        c = seq_len // cp
        return [(rank * c, c)]
    c = seq_len // (2 * cp)                    # zigzag and allgather: chunks rank and 2cp-1-rank
    return [(rank * c, c), ((2 * cp - 1 - rank) * c, c)]


def local_positions(layout, seq_len, cp, rank, device="cpu"):
    return torch.cat([torch.arange(s, s + n) for s, n in chunk_runs(layout, seq_len, cp, rank)]).to(device)


def ring_step_blocks(layout, rank, src, local_len):
    """[(query rows, key rows, causal)] of this rank's queries against rank src's K/V that are not fully
    masked. Local positions increase with the local index in both layouts, so the diagonal is plain causal."""
    full, half = slice(0, local_len), local_len // 2
    if src == rank:
        return [(full, full, True)]
    if layout == "ring":
        return [(full, full, False)] if src < rank else []     # later chunks are entirely in the future
    if src < rank:           # zigzag: both my chunks come after src's early chunk, before its late one
        return [(full, slice(0, half), False)]
    return [(slice(half, local_len), full, False)]             # only my late chunk sees src's two chunks


# ----------------------------------------------------------------------------------------------------------
# ring attention (ring and zigzag layouts)

def ring_shift(t, group):
    """Send t to the next rank of the ring and receive the previous rank's into a new buffer (async)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(t)
    ops = [p2p_op("send", t, dist.get_global_rank(group, (r + 1) % n), group),
           p2p_op("recv", recv, dist.get_global_rank(group, (r - 1) % n), group)]
    return recv, batch_isend_irecv(ops)


def wait(works):
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention over a sequence split across `group` by `layout`; returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, kernel):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            out = torch.zeros(q.shape, dtype=acc, device=q.device)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
            kv = torch.stack([k, v])           # one message per hop
            for s in range(n):
                if s + 1 < n:
                    next_kv, works = ring_shift(kv, group)   # in flight while this block computes
                for qs, ks, causal in ring_step_blocks(layout, r, (r - s) % n, q.shape[-2]):
                    WORK.add(q[..., qs, :], ks.stop - ks.start, causal)
                    o, l = kernel[0](q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], causal)
                    merge_partial(out[..., qs, :], lse[..., qs], o, l)
                if s + 1 < n:
                    wait(works)
                    kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.kernel = group, layout, kernel
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, n, r = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            kv = torch.stack([k, v])
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)   # dK/dV of the block held now
            for s in range(n):
                if s + 1 < n:
                    next_kv, kv_works = ring_shift(kv, group)
                grads = []
                for qs, ks, causal in ring_step_blocks(ctx.layout, r, (r - s) % n, q.shape[-2]):
                    dq_b, dk_b, dv_b = ctx.kernel[1](dout[..., qs, :], q[..., qs, :], kv[0][..., ks, :],
                                                     kv[1][..., ks, :], out[..., qs, :], lse[..., qs], causal)
                    dq[..., qs, :] += dq_b
                    grads.append((ks, dk_b, dv_b))
                if s > 0:
                    wait(dkv_works)            # this block's dK/dV, accumulated by the ranks before us
                    dkv = next_dkv
                for ks, dk_b, dv_b in grads:
                    dkv[0][..., ks, :] += dk_b
                    dkv[1][..., ks, :] += dv_b
                if n > 1:                      # pass it on; after the last step this is the hop home
                    next_dkv, dkv_works = ring_shift(dkv, group)
                if s + 1 < n:
                    wait(kv_works)
                    kv = next_kv
            if n > 1:
                wait(dkv_works)
                dkv = next_dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# ----------------------------------------------------------------------------------------------------------
# all-gather KV attention (Llama 3), on the zigzag layout so that the work is balanced

def gather_sequence(local, group, layout, seq_len):
    """[..., T_local, D] of every rank -> [..., T, D] in global position order."""
    n = dist.get_world_size(group)
    parts = torch.empty(n * local.numel(), dtype=local.dtype, device=local.device)   # flat: gloo wants 1-D
    all_gather(parts, local.contiguous().view(-1), group=group)
    parts = parts.view(n, *local.shape)
    return torch.cat([parts[i] for i in range(n)], dim=-2)[..., global_order(layout, seq_len, n, local.device), :]


def global_order(layout, seq_len, cp, device):
    """Index that sorts the rank-major concatenation of all local chunks into global position order."""
    return torch.cat([local_positions(layout, seq_len, cp, i) for i in range(cp)]).argsort().to(device)


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
    """Each run of local queries attends to the gathered keys up to its last position; returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, kernel):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        seq_len = q.shape[-2] * n
        with torch.autocast(q.device.type, enabled=False):
            kv = gather_sequence(torch.stack([k, v]), group, layout, seq_len)
            outs, lses, local = [], [], 0
            for start, length in chunk_runs(layout, seq_len, n, r):
                qr = q[..., local:local + length, :]
                WORK.add(qr, start + length, True)
                o, l = kernel[0](qr, kv[0][..., :start + length, :], kv[1][..., :start + length, :], True)
                outs.append(o)
                lses.append(l)
                local += length
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)   # not the gathered K/V: re-gathered in backward
        ctx.group, ctx.layout, ctx.kernel = group, layout, kernel
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        seq_len = q.shape[-2] * n
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            kv = gather_sequence(torch.stack([k, v]), ctx.group, ctx.layout, seq_len)
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            dqs, local = [], 0
            for start, length in chunk_runs(ctx.layout, seq_len, n, r):
                rows, end = slice(local, local + length), start + length
                dq, dk, dv = ctx.kernel[1](dout[..., rows, :], q[..., rows, :], kv[0][..., :end, :],
                                           kv[1][..., :end, :], out[..., rows, :], lse[..., rows], True)
                dqs.append(dq)
                dkv[0][..., :end, :] += dk
                dkv[1][..., :end, :] += dv
                local += length
            dkv = scatter_sequence_grad(dkv, ctx.group, ctx.layout, seq_len)
        return torch.cat(dqs, dim=-2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def context_parallel_attention(q, k, v, group, layout, kernel=PLAIN_TORCH):
    """(out, lse) of causal attention for this rank's chunk q/k/v [B, H, T_local, D] of a sequence laid out
    across `group` by `layout` (ring | zigzag | allgather)."""
    fn = AllGatherKVAttention if layout == "allgather" else RingAttention
    return fn.apply(q, k, v, group, layout, kernel)


class ContextParallelAttentionCore(nn.Module):
    """Drop-in for model.AttentionCore: forward(q, k, v) on the local chunk -> local attention output."""

    def __init__(self, group, layout, kernel=PLAIN_TORCH):
        super().__init__()
        self.group, self.layout, self.kernel = group, layout, kernel

    def forward(self, q, k, v):
        return context_parallel_attention(q, k, v, self.group, self.layout, self.kernel)[0]


def swap_attention_cores(model, make_core):
    """Replace every block's attention core; returns the old ones (to restore for single-device sampling)."""
    old = [block.attn.core for block in model.transformer.h]
    for block in model.transformer.h:
        block.attn.core = make_core()
    return old


# ----------------------------------------------------------------------------------------------------------
# the rest of a CP step: local loss, gradients summed over the CP group, activation bytes

def allreduce_grads(params, group):
    """Sum gradients over `group` in one flat all-reduce: each CP rank's gradient covers only the paths
    through its own chunk (K/V gradients from other ranks' queries already came home in backward)."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    all_reduce(flat, group=group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


class SavedActivationBytes:
    """Bytes of the tensors autograd keeps for backward during a forward, parameters excluded (each storage
    counted once): the activation memory of one micro-batch, exact on any device."""

    def __init__(self, model):
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes = 0

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.param_storages and storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t

    def __enter__(self):
        self.seen, self.bytes = set(), 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.seen = set()


def validate(cfg):
    world = world_size_from_env()
    check(cfg.cp == world, f"--cp {cfg.cp} must equal the number of processes ({world}): train_cp.py is "
          f"context parallel only (combine with data parallelism in train_5d.py)")
    multiple = cfg.cp if cfg.cp_layout == "ring" else 2 * cfg.cp
    check(cfg.block_size % multiple == 0,
          f"--block_size {cfg.block_size} must be a multiple of {multiple} for --cp_layout {cfg.cp_layout} "
          f"at cp={cfg.cp} (" + ("cp chunks" if cfg.cp_layout == "ring" else "2*cp chunks") + ")")
    check(cfg.dropout == 0.0, "--dropout must be 0: the distributed attention has no attention dropout")
    grad_accum_steps(cfg, 1)


def main(argv=None):
    cfg = parse_config(argv, techniques=("cp", "cp_layout"), description=__doc__.split("\n\n")[0],
                       validate=validate)
    env = init_distributed(cfg)
    group, cp = dist.group.WORLD, cfg.cp
    grad_acc = grad_accum_steps(cfg, 1)        # every CP rank sees every sequence: dp = 1
    loader = prepare_data(cfg, env)
    if env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = resolve_dtype(cfg, env.device)

    model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed).to(env.device)
    local_cores = swap_attention_cores(model, lambda: ContextParallelAttentionCore(group, cfg.cp_layout))
    pos = local_positions(cfg.cp_layout, cfg.block_size, cp, dist.get_rank(group), env.device)
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)
    torch.manual_seed(cfg.seed)
    start = load_training_state(cfg, model, optimizer) if cfg.resume else 0
    train_model = torch.compile(model) if cfg.compile else model
    amp = autocast_context(dtype, env.device)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=cp,
                           tokens_per_step=cfg.global_batch_size * cfg.block_size, resume=cfg.resume)
    activations = SavedActivationBytes(model)
    if env.is_main:
        print(f"train_cp: {sum(p.numel() for p in model.parameters()):,} parameters, cp {cp} "
              f"({cfg.cp_layout}), {len(pos)} of {cfg.block_size} positions per rank, grad_acc {grad_acc}, "
              f"{dtype}, {env.device}, steps {start}..{last_step - 1}", flush=True)

    def local_loss(x, y):                      # this rank's chunk of every sequence, at its global positions
        return train_model(x[:, pos], y[:, pos], pos=pos)[1]

    def eval_loss(x, y):                       # the mean over the whole sequence, on every rank
        loss = local_loss(x, y).float()
        all_reduce(loss, group=group)
        return loss / cp

    for step in range(start, last_step):
        t0 = time.perf_counter()
        COMM.reset()
        WORK.score_elements = 0
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = torch.zeros((), device=env.device)
        for micro in range(grad_acc):
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size)
            with amp, activations:
                loss = local_loss(x, y)        # mean over local tokens; every rank holds B*T/cp of them
            act_bytes = activations.bytes if micro == 0 else act_bytes
            scaler.scale(loss / (grad_acc * cp)).backward()   # global mean = mean of the cp local means
            loss_sum += loss.detach().float()
        allreduce_grads(model.parameters(), group)
        all_reduce(loss_sum, group=group)
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm([p.grad for p in model.parameters()], cfg.grad_clip)  # grads replicated
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss_sum) / (grad_acc * cp)
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, COMM.bytes_sent,
                        act_bytes=act_bytes, attn_score_elements=WORK.score_elements)

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            model.eval()
            with amp:
                val = evaluate(eval_loss, loader, cfg)
            model.train()
            logger.log_eval(step, val)
        if should_save(cfg, step, last_step) and env.is_main:
            save_training_state(cfg, model, optimizer, step + 1)
    logger.close()
    for block, core in zip(model.transformer.h, local_cores):   # sample on one device with the plain core
        block.attn.core = core
    print_sample(model, loader, cfg, env)
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    main()
