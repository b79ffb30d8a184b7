"""
train_tp.py: tensor parallelism (Megatron-LM) and sequence parallelism, over train_single.py.

    torchrun --nproc_per_node 2 train_tp.py --tp 2                  # heads and MLP columns split over 2 ranks
    torchrun --nproc_per_node 4 train_tp.py --tp 4 --sp             # + LayerNorm/dropout regions split by sequence
    torchrun --nproc_per_node 2 train_tp.py --tp 2 --tp_overlap     # grad all-reduce overlaps the grad-weight matmul

Every weight matrix is split over the tp ranks so that one block needs two all-reduces forward, two backward:

    x --f--> [c_attn: my heads' rows of q|k|v] -> attention on my heads --> [c_proj: my columns] --g--> + x
    x --f--> [c_fc:   my 4h/tp rows]           -> GeLU, no communication --> [c_proj: my columns] --g--> + x
    f: identity forward, all-reduce backward          g: all-reduce forward, identity backward

The tied embedding / LM head weight is split by vocabulary rows (zero rows pad it to a multiple of tp). The
lookup zeroes ids outside my rows, then g sums; the cross-entropy (common/tp_grads.py) all-reduces the max, the
target logit and the sum of exponentials (a number per token each): no rank holds [tokens, vocab] logits, the
backward sends nothing.

--sp (Korthikanti et al. 2022): outside the TP regions (LayerNorm, dropout, the residual stream) each rank keeps
T/tp of the sequence. f becomes an all-gather along the sequence and g a reduce-scatter: an all-reduce *is* a
reduce-scatter then an all-gather, so the forward moves the same bytes. The column layers keep only their input
shard for backward and gather it again there (2 extra all-gathers per block). Activations per layer, 16-bit:
    single: sbh(34 + 5as/h)        TP: sbh(10 + 24/t + 5as/(ht))        TP+SP: sbh(34 + 5as/h) / t
Any model (docs/copy_out.md): tensor_parallel(model, plan, group, sp) swaps the layers a plan names; apply_tp is
that plan for model.py's GPT. Later chapters extend these layers from their own files (kernels/apply.py,
converters/), and main() applies them where their flags ask.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.comm import COMM, all_reduce, gather_seq, in_compute_dtype, reduce_scatter_seq
from common.module_io import EDGES, check_tp_plan, sequence_parallel_edge, swap_keeping_ties, tp_slice
from common.tp_grads import (all_reduce_sequence_parallel_grads, clip_tp_grads, mark_tp_params,
                             vocab_parallel_loss)


# ----------------------------------------------------------------------------------------------------------
# the conjugate pairs: what one does forward, the other does backward

class CopyToTP(torch.autograd.Function):
    """f: enter a TP region. Forward: every rank already holds x. Backward: each rank's input gradient covers
    only its own columns' contribution, so the gradients are summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: leave a TP region. Forward: sum the partial outputs. Backward: the sum's gradient goes to every part."""

    @staticmethod
    def forward(ctx, x, group):                # x: a fresh matmul / lookup output, summed in place
        all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceScatterToSP(torch.autograd.Function):
    """g under SP: sum the partial outputs and keep my sequence chunk. Backward: all-gather the chunks' grads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group)[0], None


class ColumnLinearFn(torch.autograd.Function):
    """f fused with the column-parallel matmul, for what autograd's composition cannot do. SP: keep only the
    input's sequence shard for backward and all-gather it again there, so every activation is 1/tp-sized.
    Overlap: launch the input-gradient all-reduce (or reduce-scatter) async, compute dW while it travels."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sp, overlap):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sp, ctx.overlap, ctx.has_bias = group, sp, overlap, bias is not None
        return F.linear(gather_seq(x, group)[0] if sp else x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        x = gather_seq(x, ctx.group)[0] if ctx.sp else x      # SP: the full sequence again
        grad_in = grad_out @ weight.to(grad_out.dtype)          # my columns' share of dL/dx
        if ctx.sp:
            grad_in, work = reduce_scatter_seq(grad_in, ctx.group, async_op=ctx.overlap)
        else:
            work = all_reduce(grad_in, group=ctx.group, async_op=ctx.overlap)
        g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])   # (overlap: runs while
        grad_w = (g2.t() @ x2.to(g2.dtype)).to(weight.dtype)                            # the sum travels)
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return grad_in, grad_w, grad_b, None, None, None


@torch.compiler.disable      # collectives (and comm.py's byte counters) run eagerly: a graph break under --compile
def column_parallel(x, weight, bias, group, sp, overlap):
    x = in_compute_dtype(x)      # under autocast f communicates x in 16 bits, as the matmul would cast it anyway
    if sp or overlap:
        return ColumnLinearFn.apply(x, weight, bias, group, sp, overlap)
    return F.linear(CopyToTP.apply(x, group), weight, bias)      # the textbook form: f, then a local matmul


@torch.compiler.disable
def leave_tp_region(x, group, sp):
    return ReduceScatterToSP.apply(x, group) if sp else ReduceFromTP.apply(x, group)


# ----------------------------------------------------------------------------------------------------------
# the parallel layers. A sharded parameter carries `tp_split = (dim, parts)`: the full tensor is blocks along `dim`
# (module_io.fused_blocks: 3 equal ones for a fused q|k|v, or widths (q_per_kv, 1, 1) under grouped-query attention)
# and a rank keeps its 1/tp slice of each block (module_io.tp_slice; tp_shards.py: init_tp_weights, the way back).

def shard_param(shape, dim, parts, group, device=None, dtype=None):
    shape = [size // dist.get_world_size(group) if i == dim else size for i, size in enumerate(shape)]
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    p.tp_split, p.tp_pad = (dim, parts), 0       # tp_pad: zero rows appended to the full tensor (vocabulary)
    return p


@torch.no_grad()
def load_shard(p, full, group):
    """Fill parameter p with its slice of `full`, the whole tensor (tp_split and tp_pad say which; a replicated
    parameter takes it all): module_io.tp_slice, the rule train_tp's initial weights and checkpoints use too."""
    p.copy_(tp_slice(p, full, group))


class ColumnParallelLinear(nn.Module):
    """y[:, my rows] = x W[my rows]^T + b[my rows]: the output stays split over ranks (no communication)."""

    def __init__(self, in_features, out_features, group, sp=False, overlap=False, parts=1, bias=True, device=None,
                 dtype=None):
        super().__init__()
        self.group, self.sp, self.overlap = group, sp, overlap
        self.weight = shard_param((out_features, in_features), 0, parts, group, device, dtype)
        self.bias = shard_param((out_features,), 0, parts, group, device, dtype) if bias else None
        self.gathered = False                    # inside an sp_gather module: its input is whole, f is done

    def forward(self, x):
        return self.matmul(x, self.bias)

    def matmul(self, x, bias=None):
        # each layer's product with its collectives, in one method: a fused kernel adds the bias after it
        # (kernels/apply.py), and a layer with other GEMMs overrides only this (converters/tp_gemms.py)
        if self.gathered:                        # an sp_gather module took f at its input: a local matmul
            return F.linear(in_compute_dtype(x), self.weight, bias)
        return column_parallel(x, self.weight, bias, self.group, self.sp, self.overlap)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, my cols] W[:, my cols]^T, then + b (replicated; added once, after the sum)."""

    def __init__(self, in_features, out_features, group, sp=False, bias=True, device=None, dtype=None):
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = shard_param((out_features, in_features), 1, 1, group, device, dtype)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            self.bias.sequence_parallel = sp       # under SP each rank sees a sequence chunk: partial grad

    def forward(self, x):
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias      # the bias's gradient: autograd's, in B

    def matmul(self, x):                         # the summed product, bias left out (as ColumnParallelLinear's)
        return leave_tp_region(self.partial(x), self.group, self.sp)

    def partial(self, x):                        # my term of the sum (what a layer with other GEMMs overrides)
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r*V/tp, (r+1)*V/tp): look up the ids it owns, zeros elsewhere, then sum."""

    def __init__(self, vocab_size, dim, group, sp=False, device=None, dtype=None):
        super().__init__()
        self.group, self.sp, n = group, sp, dist.get_world_size(group)
        rows = -(-vocab_size // n)                 # the vocabulary is padded with zero rows up to a multiple of tp
        self.weight = shard_param((rows * n, dim), 0, 1, group, device, dtype)
        self.weight.tp_pad = rows * n - vocab_size
        self.vocab_start = dist.get_rank(group) * rows
        self.n_valid = max(0, min(rows, vocab_size - self.vocab_start))    # my rows that are real tokens

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return leave_tp_region(x, self.group, self.sp)


class VocabParallelLMHead(nn.Module):
    """logits[:, my vocab rows] with an embedding's shard (the tied wte's, or an untied head's own rows), and the
    vocab-parallel cross-entropy."""

    def __init__(self, wte, group, sp=False, overlap=False):
        super().__init__()
        self.weight, self.vocab_start, self.n_valid = wte.weight, wte.vocab_start, wte.n_valid
        self.group, self.sp, self.overlap = group, sp, overlap

    def matmul(self, x):                         # logits [B, T, V/tp] (a matmul as ColumnParallelLinear's)
        return column_parallel(x, self.weight, None, self.group, self.sp, self.overlap)

    @torch.compiler.disable
    def forward(self, x, targets=None):
        logits = self.matmul(x)
        if self.n_valid < logits.shape[-1]:        # padding rows: probability 0, gradient 0
            logits = logits.masked_fill(torch.arange(logits.shape[-1], device=x.device) >= self.n_valid, -math.inf)
        if targets is None:          # generation: gather the vocabulary (the only place full logits exist)
            return gather_seq(logits, self.group, dim=2)[0], None
        return logits, vocab_parallel_loss(logits, targets, self.group)


# ----------------------------------------------------------------------------------------------------------
# applying TP to any model, by module name (docs/copy_out.md). The model computes its heads from its projections'
# width (a reshape to (-1, head_dim)), so a rank's column slice of q, k, v simply runs its share of the heads.

def tensor_parallel(model, plan, group, sp=False, overlap=False, sequence_parallel=(), replicated=(), device=None):
    """Swap the modules `plan` names for tensor-parallel ones, in place. plan: {module name: style}:
        "column"            an nn.Linear whose output features are split (q, k, v; an MLP's gate and up; a head
                            tied to an "embedding": logits [..., V/tp], vocab_parallel_loss): ("column", 3) for q|k|v,
                            ("column", (q_per_kv, 1, 1)) for grouped-query attention's (module_io.fused_blocks)
        "row"               an nn.Linear whose input features are split (attention's output, the MLP's down)
        "embedding"         an nn.Embedding split by vocabulary rows (under SP its output is my sequence chunk)
        "sp_begin"/"sp_end" under SP, a replicated module whose output is cut to my sequence chunk (a replicated
                            embedding; a learned position table's [T, h]) / whose input is gathered whole first (a
                            replicated LM head); else nothing
        "sp_gather"         under SP, a module that reads the sequence length off its input (Hugging Face's
                            attention): its input is gathered whole as TP's f, its column layers just multiply
    A first input may come by keyword, an output be a tuple (module_io.py). Tied parameters stay one Parameter
    (every holder planned, equal shards) or the plan is a ValueError naming them. A module built on the meta
    device gives an empty layer on `device` (fill it: tp_shards.init_tp_weights); a built one gives a layer
    holding this rank's slice of its weights. Under SP every module between sp_begin (or "embedding") and sp_end
    sees my sequence chunk, so the gradients of its replicated parameters are partial sums: name those modules
    in `sequence_parallel` (their parameters get all_reduce_sequence_parallel_grads; row biases are marked
    already). A norm-like module with parameters named in neither `sequence_parallel` nor `replicated` (a norm
    outside the SP region) is a ValueError: its gradient would silently be 1/tp of it. So is a fused q|k|v planned
    "column" without its parts, and a split tp does not divide (module_io.check_tp_plan, before any swap)."""
    check_tp_plan(model, plan, dist.get_world_size(group))
    gathered = [name for name, style in plan.items() if style == "sp_gather"]
    new = {}
    for name, style in plan.items():
        inside = sp and any(name.startswith(g + ".") for g in gathered)    # columns of an sp_gather module
        if style not in EDGES:
            new[name] = parallel_layer(model.get_submodule(name), style, group, sp, overlap, device, inside)
    swap_keeping_ties(model, new)
    for name, style in plan.items():
        if style in EDGES and sp:
            sequence_parallel_edge(model.get_submodule(name), style, group)
    mark_tp_params(model, group, sp, sequence_parallel, replicated)
    return model


def parallel_layer(module, style, group, sp, overlap, device=None, gathered=False):
    """The tensor-parallel layer for `module` (an nn.Linear or nn.Embedding) in `style`, holding this rank's
    slice of its weights (empty when `module` is on the meta device). gathered: a column layer inside an
    sp_gather module, whose input is whole already."""
    kind, parts = style if isinstance(style, tuple) else (style, 1)
    w = module.weight
    kwargs = dict(device=w.device if device is None else device, dtype=w.dtype)
    if kind == "column":
        new = ColumnParallelLinear(module.in_features, module.out_features, group, sp and not gathered, overlap,
                                   parts, module.bias is not None, **kwargs)
        new.gathered = gathered
    elif kind == "row":
        new = RowParallelLinear(module.in_features, module.out_features, group, sp, module.bias is not None, **kwargs)
    else:                        # "embedding" (check_tp_plan refused any other style)
        new = VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, group, sp, **kwargs)
    if not w.is_meta:
        for key, p in new.named_parameters():
            load_shard(p, getattr(module, key).detach().to(p.device), group)
    return new


# ----------------------------------------------------------------------------------------------------------
# applying TP to model.py's GPT (for this script and train_5d.py): the plan above, plus the tied vocab-parallel
# LM head and per-rank dropout streams

def apply_tp(model, group, sp=False, overlap=False, device="cpu"):
    """Swap model.py's layers for tensor-parallel ones, in place (model.py is untouched). Build the model on the
    meta device: new parameters are allocated here, empty, on `device` (which may be "meta" too); fill them
    with init_tp_weights."""
    from common.tp_setup import RankRNG
    from common.model_setup import materialize
    from model import MoE
    rng = (lambda mod: RankRNG(mod, group)) if model.cfg.dropout > 0 else (lambda mod: mod)
    plan, partial = {"transformer.wte": "embedding"}, []
    for i, block in enumerate(model.transformer.h):
        attn, mlp, name = block.attn, block.mlp, f"transformer.h.{i}"
        plan.update({f"{name}.attn.c_attn": ("column", (attn.q_per_kv, 1, 1)), f"{name}.attn.c_proj": "row"})
        attn.core = rng(attn.core)                               # attention dropout: my heads
        if sp:                                                   # residual dropout: my sequence chunk
            attn.resid_dropout = rng(attn.resid_dropout)
        if isinstance(mlp, MoE):     # experts stay whole (train_5d shards them over ep); under SP the block
            partial.append(f"{name}.mlp")   # routes my sequence chunk: router and expert grads are partial sums
            continue
        plan.update({f"{name}.mlp.c_fc": ("column", 2 if mlp.gated else 1), f"{name}.mlp.c_proj": "row"})  # [gate|up]
        if sp:
            mlp.dropout = rng(mlp.dropout)
    norms = [n for n, m in model.named_modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]   # SP: my chunk
    # the head multiplies by wte's shard (tied), or by vocabulary rows of its own split alike (untied)
    own = None if model.cfg.tied else VocabParallelEmbedding(*model.lm_head.weight.shape, group, sp, device=device)
    model.lm_head = None                         # holds wte's weight (tied): rebuilt on wte's shard just below
    tensor_parallel(model, plan, group, sp, overlap, sequence_parallel=partial + norms, device=device)
    model.lm_head = VocabParallelLMHead(model.transformer.wte if own is None else own, group, sp, overlap)
    if sp:
        model.transformer.drop = rng(model.transformer.drop)
    # what is still on the meta device is replicated on every TP rank: the LayerNorms and row-parallel biases
    # (device "meta": shapes only, for train_5d, which cuts the model into stages before materializing)
    return model if torch.device(device).type == "meta" else materialize(model, device)


# ---------------------------------------------------------------------------------------------- the script

def build_tp_model(cfg, vocab_size, group, device, dtype=torch.float32):
    """The GPT with TP layers, this rank's shards only, parameters in `dtype` (fp32, or float64)."""
    from common.tp_shards import init_tp_weights
    from common.model_setup import gpt_config
    from model import GPT
    with torch.device("meta"):
        model = GPT(gpt_config(cfg, vocab_size), seed=cfg.seed)
    apply_tp(model, group, cfg.sp, cfg.tp_overlap, device)
    init_tp_weights(model, cfg.seed, group)
    return model.to(dtype)        # in place: the Parameters (and their tp_split tags) are kept


def extra_args(parser):
    from converters.partition_activations import add_partition_args
    add_partition_args(parser)
    parser.add_argument("--tp_overlap", action=argparse.BooleanOptionalAction, default=False,
                        help="overlap the input-gradient all-reduce with the weight-gradient matmul in backward")


def validate(cfg):
    from common.config import check, grad_accum_steps
    from common.distributed import world_size_from_env
    from common.tp_setup import check_tp
    from converters.partition_activations import check_partition_args
    world = world_size_from_env()
    check(cfg.tp == world, f"--tp {cfg.tp} must equal the number of processes ({world}); "
                           f"combine with data parallelism in train_5d.py")
    check_tp(cfg, cfg.tp, cfg.block_size)
    check_partition_args(cfg, cfg.tp)
    check(cfg.dtype != "float16", "train_tp supports float32, bfloat16 and float64 (fp16: no loss scaling over TP)")
    grad_accum_steps(cfg, 1)


def main(argv=None):
    # the script's plumbing, imported here: the building blocks above need only torch and comm.py
    from common.config import grad_accum_steps, parse_config
    from common.distributed import init_distributed
    from common.metrics import MetricsLogger, SavedActivationBytes
    from common.optim import NonFiniteGuard, configure_optimizer, lr_at, set_lr
    from converters.partition_activations import apply_partition_flags
    from common.evaluation import evaluate, print_sample
    from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
    from common.startup import prepare_data
    from converters.apply import apply_kernels_and_fp8
    from common import checkpoint
    from common.checkpoint import ModuleState, replicated
    from model import flops_per_token
    cfg = parse_config(argv, techniques=("tp", "sp", "fp8"), description=__doc__.split("\n\n")[0],
                       extra_args=extra_args, validate=validate)
    env = init_distributed(cfg)
    group = dist.group.WORLD                     # train_5d.py passes its grid's TP axis instead
    grad_acc = grad_accum_steps(cfg, 1)          # every TP rank processes the same micro-batches
    loader = prepare_data(cfg, env)
    enable_tf32(env.device)
    dtype = resolve_dtype(cfg, env.device)
    model = build_tp_model(cfg, loader.vocab_size, group, env.device, param_dtype(dtype))
    apply_kernels_and_fp8(model, cfg, env.device)      # fused LayerNorm, bias-GeLU; FP8 GEMMs in the TP layers
    apply_partition_flags(cfg, model.cfg, model.transformer.h, group)   # ZeRO-R's Pa (converters/partition_activations.py)
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    guard = NonFiniteGuard(cfg, env.is_main)
    torch.manual_seed(cfg.seed)                  # the shared dropout stream: the same on every TP rank
    held = ModuleState([model], optimizer, replicated, group)   # TP slices, made whole over tp to save
    start = checkpoint.start_from(cfg, env, model.cfg, held)   # my slices
    train_model = torch.compile(model) if cfg.compile else model
    amp, activations = autocast_context(dtype, env.device), SavedActivationBytes(model)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=cfg.tp, resume=cfg.resume)
    if env.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"train_tp: tp={cfg.tp} sp={cfg.sp} overlap={cfg.tp_overlap}, {n_params:,} parameters per rank, "
              f"grad_acc {grad_acc}, {dtype}, {env.device}, steps {start}..{last_step - 1}", flush=True)

    for step in range(start, last_step):
        COMM.reset()
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        for micro in range(grad_acc):
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size)
            with amp, activations.during(micro == 0):   # what the first forward keeps for backward
                _, loss = train_model(x, y)          # the same full loss on every TP rank
            if micro == 0:
                act_bytes = activations.bytes        # saved for backward by one micro-batch (all are alike)
            (loss / grad_acc).backward()
            loss_sum += loss.detach()
        all_reduce_sequence_parallel_grads(model, group)   # SP only: LayerNorm grads summed over TP ranks
        grad_norm = clip_tp_grads(model, cfg.grad_clip, group)
        loss_value = float(loss_sum) / grad_acc
        if guard.step_ok(step, loss_value, grad_norm):   # the loss and norm are global: every rank decides alike
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, COMM.bytes_sent,
                        act_bytes=act_bytes)

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            model.eval()
            with amp:
                val = evaluate(lambda x, y: train_model(x, y)[1], loader, cfg)
            model.train()
            logger.log_eval(step, val)
        if checkpoint.should_save(cfg, step, last_step):
            checkpoint.save(cfg, model.cfg, step + 1, held)   # each gathered tensor written by one rank
    logger.close()
    if cfg.sample_tokens > 0 and not cfg.sp:     # every rank runs the forward (collectives), rank 0 prints
        print_sample(model, loader, cfg, env, collective=True)
    return dict(model=model, cfg=cfg, group=group)


if __name__ == "__main__":
    from common.distributed import destroy
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
