"""
Copy-paste is a use: a technique's building blocks, copied as docs/copy_out.md's table says into a project of
one's own, train that project's own model exactly like one process does.

Each case copies exactly the files its row of COPY_TABLE names into a temporary directory beside a user's own
model.py (a Llama-style model: RMSNorm, SwiGLU, grouped-query attention with RoPE, no biases, an untied head, its
own module names, forward returning logits only; with --experts an MoE of SwiGLU experts), data.py (batches of a
small text) and config.py (a module that raises if imported: the copied files must not import a config.py), and
runs the user's training script (TRAIN below) in two fresh processes on gloo, with numpy unimportable and
nanoscale's root nowhere on sys.path. In float64, with clipping, every step's loss and gradient norm equal the same
model's single-process run within 1e-9 relative. The silent mistakes are loud there too: the optimizer's own
zero_grad() under DataParallelGrads raises GradNotInBucket, a norm left out of sequence_parallel is a ValueError,
ZeRO-1 asked to reduce twice in a step raises ReducedTwice. A second user's project (TRAIN_HF) does the same on
transformers' LlamaForCausalLM (tied and untied, eager and sdpa) and MixtralForCausalLM for EP, with two
micro-batches a step. Each former trap is refused there (a tie a TP plan would cut, a CP forward without its
positions, a mask the CP core cannot apply, ZeRO-1 reducing twice) or would break parity (the pipeline's
activations sent in float32 by default, a tied weight left unsynced across stages, stacked experts).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from distributed_helper import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT = 1e-9

# what a row's text says to copy besides its files for a transformers model (an attention chosen by name)
HF_ALSO = {"CP": ["common/hf/attention.py"]}

# technique -> (what to copy, the building blocks to use, what they expect of the model): docs/copy_out.md's table
COPY_TABLE = {
    "DDP": (["train_ddp.py", "common/comm.py"],
            "`DataParallelGrads(params, group)`: `require_sync`, `finish`, its own `zero_grad`; "
            "`check_replicas_agree`, `mean_over_group`; `comm.clip_grad_norm`",
            "nothing: any model; every rank builds the same initial weights"),
    "ZeRO-1/2": (["train_zero.py", "train_ddp.py", "common/comm.py"],
                 "`shard_model(model, stage, group, dtype, device)`, `ShardedGrads` (stage 1: "
                 "`require_sync(last micro-batch)`, a second reduction raises `ReducedTwice`; stage 2: every "
                 "micro-batch), `ShardedAdamW(shards, weight_decay, betas, eps)`, `Shard.publish`",
                 "fp32 or float64 parameters (their own master copy); AdamW decays the >= 2-D ones"),
    "ZeRO-3": (["train_zero.py", "train_ddp.py", "common/comm.py"],
               "as ZeRO-1/2, `shard_model(..., blocks=)` and `install_zero3_hooks(model, blocks, shards, grads)`",
               "the blocks: modules whose parameters are gathered together, each called once per forward; the "
               "forward may return anything (logits, a loss, a tuple, a transformers output)"),
    "TP + SP": (["train_tp.py", "common/comm.py", "common/module_io.py", "common/tp_grads.py"],
                "`tensor_parallel(model, plan, group, sp, sequence_parallel=)` (column, row, embedding, sp_begin, "
                "sp_end, sp_gather), `vocab_parallel_loss`, `all_reduce_sequence_parallel_grads`, `clip_tp_grads`",
                "projections as `nn.Linear`; heads read off the projection's width (a reshape to (-1, head_dim)); "
                "heads and KV heads divisible by tp; a tied head planned as its embedding is (`column`, logits split "
                "by vocabulary) or a ValueError; under SP a sequence divisible by tp, every norm named, an attention "
                "that reads T off its input planned `sp_gather`, whole-sequence positions (and mask, if any)"),
    "CP": (["train_cp.py", "common/comm.py", "common/cp_layout.py"],
           "`swap_modules(model, names, lambda: ContextParallelAttentionCore(group, layout))`; `local_positions`, "
           "`allreduce_grads`; an attention chosen by name (transformers' `AttentionInterface.register(name, "
           "hf_attention.attention_function(core, pos))`) also `common/hf/attention.py`",
           "causal attention without a mask or dropout (else a ValueError), in a module called on q, k, v [B, H, T, "
           "D] (K/V may have fewer heads; `scale=`) or chosen by name; the forward takes the chunk's global "
           "positions (RoPE); a per-token loss"),
    "PP": (["train_pp.py", "common/comm.py", "pipeline/schedules.py", "pipeline/stages.py",
            "pipeline/tied.py"],
           "`pipeline_stages(before, blocks, after, rank, p, loss_fn=, block_kwargs=)`, `make_schedule`, "
           "`PipelineRunner`; `tied_pair_group`, `tied_grads_sync`, `clip_stage_grads`; zb1, zbv, dualpipev also "
           "`pipeline/weight_grads.py`",
           "a forward that is a chain of modules (embedding, blocks, norm, head); blocks take the activations and "
           "the keywords block_kwargs(x) gives (a transformers layer's rotary cos/sin and mask), return a tensor or "
           "a tuple; a tied weight is one Parameter in before and after; a loss_fn(output, targets) -> mean loss"),
    "EP": (["train_ep.py", "train_ddp.py", "common/comm.py"],
           "`ExpertParallelExperts(make_expert, n_experts, group)` or `ExpertParallelStackedExperts(experts, "
           "n_experts, group)`, `expert_groups`, `ExpertDataParallelGrads(named, ..., is_expert)` and its "
           "`clip(max_norm, ep_group)`",
           "an MoE whose experts are one module, called as experts(rows grouped by expert, expert of each row) -> "
           "rows, or stacked [E, ...] per weight and called as transformers' experts(hidden, top_k_index, "
           "top_k_weights); experts divisible by ep"),
}

# the runs of this test: (row of COPY_TABLE, argument of TRAIN)
RUNS = {"DDP": ("DDP", "ddp"), "ZeRO-1": ("ZeRO-1/2", "zero1"), "ZeRO-2": ("ZeRO-1/2", "zero2"),
        "ZeRO-3": ("ZeRO-3", "zero3"),
        "TP + SP": ("TP + SP", "tp_sp"), "CP ring": ("CP", "cp_ring"), "CP zigzag": ("CP", "cp_zigzag"),
        "PP 1F1B": ("PP", "pp_1f1b"), "EP": ("EP", "ep")}


def markdown_table():
    """COPY_TABLE as docs/copy_out.md shows it."""
    lines = ["| technique | copy (keep the folders) | use | what it expects of the model |", "|---|---|---|---|"]
    for name, (files, blocks, expects) in COPY_TABLE.items():
        lines.append(f"| {name} | {', '.join(f'`{f}`' for f in files)} | {blocks} | {expects} |")
    return "\n".join(lines) + "\n"


def test_docs_show_this_table():
    with open(os.path.join(ROOT, "docs", "copy_out.md")) as f:
        assert markdown_table() in f.read(), "docs/copy_out.md's table differs from COPY_TABLE: paste markdown_table()"


# ----------------------------------------------------------------------------------------------------------
# the user's project: model.py, data.py, config.py and the training script

MODEL = r'''
"""A Llama-style model of the user's own (nothing of nanoscale's)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.scale = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def rotate(x, pos, base=10000.0):
    """RoPE, Llama's half-split pairing, at positions pos [T] for x [B, H, T, D]."""
    half = x.shape[-1] // 2
    angles = pos.to(x.dtype)[:, None] / base ** (torch.arange(half, dtype=x.dtype) / half)
    cos, sin, (a, b) = angles.cos(), angles.sin(), x.split(half, -1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class CausalAttend(nn.Module):
    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.attend = CausalAttend()

    def forward(self, x, pos=None):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(T) if pos is None else pos
        y = self.attend(rotate(q, pos), rotate(k, pos), v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RoutedExperts(nn.ModuleList):
    def forward(self, rows, expert):
        counts = torch.bincount(expert, minlength=len(self)).tolist()
        return torch.cat([e(chunk) for e, chunk in zip(self, rows.split(counts))])


class MoE(nn.Module):
    def __init__(self, dim, hidden, n_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = RoutedExperts([FeedForward(dim, hidden) for _ in range(n_experts)])

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weight, expert = F.softmax(self.gate(x), -1).topk(self.top_k, -1)
        token = torch.arange(len(x)).repeat_interleave(self.top_k)
        order = torch.argsort(expert.reshape(-1), stable=True)
        out = self.experts(x[token[order]], expert.reshape(-1)[order]) * weight.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token[order], out).view(shape)


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden, n_experts, top_k):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = MoE(dim, hidden, n_experts, top_k) if n_experts else FeedForward(dim, hidden)

    def forward(self, x, pos=None):
        h = x + self.attention(self.attention_norm(x), pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab, dim, n_layers, n_heads, n_kv_heads, hidden, n_experts=0, top_k=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, n_heads, n_kv_heads, hidden, n_experts, top_k)
                                     for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, pos=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, pos)
        return self.output(self.norm(h))
'''

DATA = r'''
"""The user's data: byte-level batches of a small text (a standard-library module), no numpy."""
import os
import sysconfig

import torch

with open(os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"), "rb") as f:
    TOKENS = torch.tensor(list(f.read()), dtype=torch.long)


def batch(step, size, seq_len):
    """Step `step`'s global batch: size windows of the text, (inputs, next-token targets)."""
    starts = torch.randint(0, len(TOKENS) - seq_len - 1, (size,), generator=torch.Generator().manual_seed(step))
    rows = torch.stack([TOKENS[s: s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]
'''

RECIPE = r'''
"""The user's own recipe, shared by their training scripts: AdamW's groups, the loss, a rank's rows of a batch, and
one script's work run on a gloo process, its result written beside the one-process run's."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

LR = 1e-2


def adamw(named):
    named = [p for _, p in named]
    return torch.optim.AdamW([dict(params=[p for p in named if p.dim() >= 2], weight_decay=0.1),
                              dict(params=[p for p in named if p.dim() < 2], weight_decay=0.0)],
                             lr=LR, betas=(0.9, 0.95), eps=1e-8)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def rows_of(x, y, rank, world):
    n = len(x) // world
    return x[rank * n: (rank + 1) * n], y[rank * n: (rank + 1) * n]


def train_ddp(model, logits_of, batches, clip):
    """DataParallelGrads on `model` over the default group, two micro-batches a step (the first without
    communication): per step of `batches` the mean loss and the grad norm; then the optimizer's own zero_grad(),
    which would detach the gradients from their buckets, must be refused at the next backward."""
    from common.comm import clip_grad_norm
    from train_ddp import DataParallelGrads, GradNotInBucket, check_replicas_agree, mean_over_group
    group, losses, norms = dist.group.WORLD, [], []
    check_replicas_agree(list(model.parameters()), group)
    grads, opt = DataParallelGrads(model.parameters(), group, bucket_mb=0.02), adamw(model.named_parameters())
    for x, y in batches:
        total = 0.0
        for micro in range(2):
            grads.require_sync(micro == 1)
            loss = loss_fn(logits_of(model, x.chunk(2)[micro]), y.chunk(2)[micro])
            (loss / 2).backward()
            total += loss.detach() / 2
        grads.finish()
        norms.append(float(clip_grad_norm(grads.grads(), clip)))
        opt.step()
        grads.zero_grad()
        losses.append(mean_over_group(total, group))
    opt.zero_grad()                                # the mistake: the optimizer's own, grads set to None
    try:
        loss_fn(logits_of(model, x), y).backward()
        raise AssertionError("the optimizer's zero_grad() went unnoticed")
    except GradNotInBucket:
        pass
    return losses, norms


def train_zero(stage, model, blocks, logits_of, batches, clip):
    """ZeRO-`stage` on `model` over the default group: per step of `batches` (this rank's rows, two micro-batches)
    the mean loss and the grad norm; then ZeRO-1's mistake, a reduction each micro-batch, must be refused."""
    from common.comm import clip_grad_norm
    from train_ddp import mean_over_group
    from train_zero import ReducedTwice, ShardedAdamW, ShardedGrads, install_zero3_hooks, shard_model
    group, losses, norms = dist.group.WORLD, [], []
    shards = shard_model(model, stage, group, torch.float64, "cpu", blocks=blocks, bucket_mb=0.02)
    grads = ShardedGrads(shards, group, stage)
    if stage == 3:
        install_zero3_hooks(model, blocks, shards, grads)
    opt = ShardedAdamW(shards, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for x, y in batches:
        total = 0.0
        for micro in range(2):
            grads.require_sync(stage >= 2 or micro == 1)   # ZeRO-2/3 reduce-scatter every micro-batch, ZeRO-1 once
            loss = loss_fn(logits_of(model, x.chunk(2)[micro]), y.chunk(2)[micro])
            (loss / 2).backward()
            grads.finish()
            total += loss.detach() / 2
        g = grads.grads()
        norms.append(float(clip_grad_norm(g, clip, group=group, dtype=torch.float64)))
        opt.step(LR, g)
        for s in shards:
            s.publish()
        grads.zero_grad()
        losses.append(mean_over_group(total, group))
    if stage == 1:                                 # the mistake: ZeRO-1 asked to reduce every micro-batch
        try:
            for micro in range(2):
                grads.require_sync(True)
                loss_fn(logits_of(model, x.chunk(2)[micro]), y.chunk(2)[micro]).backward()
                grads.finish()
            raise AssertionError("a second ZeRO-1 reduction in one step went unnoticed")
        except ReducedTwice:
            pass
    return losses, norms


def run_on_gloo(rank, world, port, out, work, one_process):
    """work() on this rank of a gloo group; rank 0 then writes its result, one_process()'s and the modules of this
    project the work imported (nanoscale's copied files among them) to `out`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    got = work()
    dist.barrier()                                 # both ranks done before either leaves the group
    dist.destroy_process_group()
    copied = sorted(m for m in sys.modules if m.split(".")[0] in ("common", "pipeline", "model", "config", "data")
                    or m.startswith("train_"))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(got=got, one_process=one_process(), modules=copied), f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # gloo's threads can abort the interpreter's teardown now and then ("terminate called without
                    # an active exception"), as common/distributed.destroy_at_exit says: the work is done and written
'''

CONFIG = r'''
raise ImportError("config.py is this project's own: nanoscale's copied building blocks must not import it")
'''

TRAIN = r'''
"""The user's training script: model.py and data.py of their own, one nanoscale technique copied in.
python train.py RUN RANK WORLD PORT OUT_JSON"""
import os
import sys
import warnings

sys.modules["numpy"] = None                        # this project has no numpy: nothing copied may need it
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
for entry in sys.path:                             # nor is nanoscale on the path: only what was copied here
    assert not os.path.exists(os.path.join(entry or ".", "train_5d.py")), f"nanoscale on sys.path: {entry}"

import torch                                       # noqa: E402
import torch.distributed as dist                   # noqa: E402

from data import batch                             # noqa: E402
from model import Llama                            # noqa: E402
from recipe import adamw, loss_fn, rows_of, run_on_gloo, train_ddp, train_zero   # noqa: E402

run, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
STEPS, GLOBAL, T, CLIP, WORLD = 5, 8, 16, 1.0, None
SHAPE = dict(vocab=256, dim=32, n_layers=4 if run.startswith("pp") else 2, n_heads=4, n_kv_heads=2, hidden=64,
             n_experts=4 if run == "ep" else 0)


def build():
    torch.manual_seed(0)                           # every rank builds the same initial weights
    return Llama(**SHAPE).double()


def my_rows(x, y):
    return rows_of(x, y, rank, world)


def one_process():
    model, losses, norms = build(), [], []
    opt = adamw(model.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms


def ddp():
    batches = [my_rows(*batch(step, GLOBAL, T)) for step in range(STEPS)]
    return train_ddp(build(), lambda m, x: m(x), batches, CLIP)


def zero(stage):
    model = build()
    batches = [my_rows(*batch(step, GLOBAL, T)) for step in range(STEPS)]
    return train_zero(stage, model, list(model.layers), lambda m, x: m(x), batches, CLIP)


def tp_sp():
    from train_tp import all_reduce_sequence_parallel_grads, clip_tp_grads, tensor_parallel
    plan, norms_sp = {"tok_embeddings": "embedding", "output": "sp_end"}, ["norm"]
    for i in range(SHAPE["n_layers"]):
        plan.update({f"layers.{i}.attention.{w}": "column" for w in ("wq", "wk", "wv")})
        plan.update({f"layers.{i}.feed_forward.{w}": "column" for w in ("w1", "w3")})
        plan.update({f"layers.{i}.attention.wo": "row", f"layers.{i}.feed_forward.w2": "row"})
        norms_sp += [f"layers.{i}.attention_norm", f"layers.{i}.ffn_norm"]
    try:                                           # the mistake: a norm left out under SP
        tensor_parallel(build(), plan, WORLD, sp=True, sequence_parallel=norms_sp[1:])
        raise AssertionError("a norm left out of sequence_parallel went unnoticed")
    except ValueError as e:
        assert "['norm']" in str(e), e
    model, losses, norms = tensor_parallel(build(), plan, WORLD, sp=True, sequence_parallel=norms_sp), [], []
    opt = adamw(model.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)              # every TP rank: the whole batch
        loss = loss_fn(model(x), y)
        loss.backward()
        all_reduce_sequence_parallel_grads(model, WORLD)
        norms.append(float(clip_tp_grads(model, CLIP, WORLD)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms


def cp(layout):
    from common.comm import all_reduce, clip_grad_norm
    from train_cp import ContextParallelAttentionCore, allreduce_grads, local_positions, swap_modules
    model, losses, norms = build(), [], []
    cores = [f"layers.{i}.attention.attend" for i in range(SHAPE["n_layers"])]
    swap_modules(model, cores, lambda: ContextParallelAttentionCore(WORLD, layout))
    pos, opt = local_positions(layout, T, world, rank), adamw(model.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)              # every CP rank: its positions of every sequence
        loss = loss_fn(model(x[:, pos], pos=pos), y[:, pos])
        (loss / world).backward()
        allreduce_grads(model.parameters(), WORLD)
        norms.append(float(clip_grad_norm([p.grad for p in model.parameters()], CLIP)))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        all_reduce(total, group=WORLD)
        losses.append(float(total) / world)
    return losses, norms


def pp_1f1b():
    from common.comm import broadcast, clip_grad_norm
    from train_pp import PipelineRunner, make_schedule, pipeline_stages
    model, losses, norms, m = build(), [], [], 4
    micro = GLOBAL // m
    stages = pipeline_stages([model.tok_embeddings], list(model.layers), [model.norm, model.output], rank, world,
                             loss_fn=loss_fn)
    schedules = make_schedule("1f1b", world, m)
    runner = PipelineRunner(stages, WORLD, schedules, m, (micro, T, SHAPE["dim"]), torch.device("cpu"))   # float64
    opt = adamw(stages.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)
        loss_sum = runner.step(schedules[rank], lambda mb: (x[mb * micro: (mb + 1) * micro],
                                                            y[mb * micro: (mb + 1) * micro]))
        norms.append(float(clip_grad_norm([p.grad for p in stages.parameters()], CLIP, group=WORLD,
                                          dtype=torch.float64)))
        opt.step()
        opt.zero_grad()
        broadcast(loss_sum, src=world - 1, group=WORLD)   # the last stage has the loss
        losses.append(float(loss_sum) / m)
    return losses, norms


def ep():
    from train_ddp import mean_over_group
    from train_ep import ExpertDataParallelGrads, ExpertParallelExperts, expert_groups
    ep_group, replicas = expert_groups(world, world)
    model, losses, norms = build(), [], []
    for layer in model.layers:
        experts = layer.feed_forward.experts
        layer.feed_forward.experts = ExpertParallelExperts(lambda e: experts[e], SHAPE["n_experts"], ep_group)
    named = list(model.named_parameters())
    grads = ExpertDataParallelGrads(named, WORLD, replicas, world, 0.02, is_expert=lambda name: ".experts." in name)
    opt = adamw(named)
    for step in range(STEPS):
        x, y = my_rows(*batch(step, GLOBAL, T))
        grads.require_sync(True)
        loss = loss_fn(model(x), y)
        loss.backward()
        grads.finish()
        norms.append(float(grads.clip(CLIP, ep_group)))   # experts by their rank, the dense replicas once
        opt.step()
        grads.zero_grad()
        losses.append(mean_over_group(loss, WORLD))
    return losses, norms


RUNS = dict(ddp=ddp, zero1=lambda: zero(1), zero2=lambda: zero(2), zero3=lambda: zero(3), tp_sp=tp_sp,
            cp_ring=lambda: cp("ring"), cp_zigzag=lambda: cp("zigzag"), pp_1f1b=pp_1f1b, ep=ep)

def work():
    global WORLD
    WORLD = dist.group.WORLD
    return RUNS[run]()


if __name__ == "__main__":
    run_on_gloo(rank, world, port, out, work, one_process)
'''

# transformers' own models: a row's runs (each over VARIANTS: tied and untied, eager and sdpa) in one launch
HF_RUNS = {"DDP": ("DDP", "ddp"), "ZeRO-1/2/3": ("ZeRO-1/2", "zero"), "TP + SP": ("TP + SP", "tp_sp"),
           "CP ring + zigzag": ("CP", "cp"), "PP 1F1B": ("PP", "pp_1f1b"), "EP (Mixtral)": ("EP", "ep")}

TRAIN_HF = r'''
"""The user's training script on Hugging Face transformers' own Llama (and Mixtral for EP), one nanoscale technique
copied in. python train_hf.py RUN RANK WORLD PORT OUT_JSON"""
import os
import sys

for entry in sys.path:                             # nanoscale is not on the path: only what was copied here
    assert not os.path.exists(os.path.join(entry or ".", "train_5d.py")), f"nanoscale on sys.path: {entry}"

import torch                                       # noqa: E402
import torch.distributed as dist                   # noqa: E402
import torch.nn.functional as F                    # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402

from data import batch                             # noqa: E402
from recipe import adamw, loss_fn, rows_of, run_on_gloo, train_ddp, train_zero   # noqa: E402

run, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
STEPS, GLOBAL, T, CLIP, WORLD = 4, 8, 16, 0.5, None
VARIANTS = [(True, "eager"), (False, "sdpa")]      # (tie_word_embeddings, attn_implementation)
# CP swaps the attention for its own: tied and untied, each against sdpa in one process (eager's softmax runs in
# float32 even in a float64 model, so it is no float64 reference for an attention computed in float64)
CP_VARIANTS = [(True, "sdpa"), (False, "sdpa")]
E = 4                                              # Mixtral's experts


def build(tied, attn, moe=False):
    """A tiny transformers model in float64; every rank builds the same initial weights."""
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=T, tie_word_embeddings=tied, attn_implementation=attn)
    torch.manual_seed(0)
    if moe:
        return MixtralForCausalLM(MixtralConfig(num_local_experts=E, num_experts_per_tok=2, **shape,
                                                experts_implementation="eager")).double()   # grouped_mm: no float64
    return LlamaForCausalLM(LlamaConfig(**shape)).double()


def my_rows(x, y):
    return rows_of(x, y, rank, world)


def micro(x, y, i):                                # gradient accumulation: two micro-batches
    return x.chunk(2)[i], y.chunk(2)[i]


def one_process(tied, attn, moe=False):
    model, losses, norms = build(tied, attn, moe), [], []
    opt = adamw(model.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)
        loss = loss_fn(model(input_ids=x).logits, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def ddp(tied, attn):
    batches = [my_rows(*batch(step, GLOBAL, T)) for step in range(STEPS)]
    return train_ddp(build(tied, attn), lambda m, x: m(input_ids=x).logits, batches, CLIP)


def zero(stage, tied, attn):
    model = build(tied, attn)
    batches = [my_rows(*batch(step, GLOBAL, T)) for step in range(STEPS)]
    return train_zero(stage, model, list(model.model.layers), lambda m, x: m(input_ids=x).logits, batches, CLIP)


def tp_sp(tied, attn):
    from train_tp import all_reduce_sequence_parallel_grads, clip_tp_grads, tensor_parallel, vocab_parallel_loss
    # a tied head must share the embedding's vocabulary shard ("column"); an untied one may stay whole ("sp_end")
    plan, norms_sp = {"model.embed_tokens": "embedding", "lm_head": "column" if tied else "sp_end"}, ["model.norm"]
    for i in range(2):
        layer = f"model.layers.{i}"
        plan.update({f"{layer}.self_attn.{w}": "column" for w in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{layer}.mlp.{w}": "column" for w in ("gate_proj", "up_proj")})
        plan.update({f"{layer}.self_attn.o_proj": "row", f"{layer}.mlp.down_proj": "row"})
        plan[f"{layer}.self_attn"] = "sp_gather"   # HF's attention reads T off its input: give it the whole
        norms_sp += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    if tied:                                       # the mistake: a tied head left whole beside a split embedding
        try:
            tensor_parallel(build(tied, attn), {**plan, "lm_head": "sp_end"}, WORLD, sp=True,
                            sequence_parallel=norms_sp)
            raise AssertionError("a tie cut by the plan went unnoticed")
        except ValueError as e:
            assert "lm_head.weight" in str(e) and "model.embed_tokens.weight" in str(e), e
    model = tensor_parallel(build(tied, attn), plan, WORLD, sp=True, sequence_parallel=norms_sp)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    pos = torch.arange(T)[None]                    # HF would take T/tp off the embedding's sequence chunk
    mask = torch.full((T, T), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    losses, norms, opt = [], [], adamw(model.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)              # every TP rank: the whole batch
        total = 0.0
        for i in range(2):
            xm, ym = micro(x, y, i)                # eager: a mask for the whole sequence (sdpa: causal, no mask)
            logits = model(input_ids=xm, position_ids=pos, attention_mask=mask if attn == "eager" else None).logits
            loss = vocab_parallel_loss(logits, ym, WORLD) if tied else loss_fn(logits, ym)
            (loss / 2).backward()
            total += float(loss.detach()) / 2
        all_reduce_sequence_parallel_grads(model, WORLD)
        norms.append(float(clip_tp_grads(model, CLIP, WORLD)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def cp(layout, tied, attn):
    from transformers import AttentionInterface
    from common.comm import all_reduce, clip_grad_norm
    from common.hf.attention import attention_function
    from train_cp import ContextParallelAttentionCore, allreduce_grads, local_positions
    core = ContextParallelAttentionCore(WORLD, layout)
    pos = local_positions(layout, T, world, rank)
    torch.manual_seed(1)                           # scale= and a refused mask, against torch's own attention
    q, k, v = torch.randn(2, 4, T, 8, dtype=torch.float64), *torch.randn(2, 2, 2, T, 8, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True,
                                          scale=0.3)[:, :, pos]
    assert torch.allclose(core(q[:, :, pos], k[:, :, pos], v[:, :, pos], scale=0.3), want, rtol=0, atol=1e-12)
    try:
        core(q[:, :, pos], k[:, :, pos], v[:, :, pos], attn_mask=torch.ones(len(pos), len(pos), dtype=torch.bool))
        raise AssertionError("a mask the core cannot apply went unnoticed")
    except ValueError:
        pass
    AttentionInterface.register(f"cp_{layout}", attention_function(core, positions=pos))
    model = build(tied, attn)
    model.set_attn_implementation(f"cp_{layout}")  # every layer's attention: the core on this rank's chunk
    if layout == "zigzag":                         # the mistake: positions left to HF (0..T/cp-1)
        try:
            model(input_ids=batch(0, GLOBAL, T)[0][:, pos])
            raise AssertionError("a forward without position_ids went unnoticed")
        except ValueError as e:
            assert "position_ids" in str(e), e
        AttentionInterface.register(f"cp_{layout}", attention_function(core, positions=pos))
        model.set_attn_implementation(f"cp_{layout}")
    losses, norms, opt = [], [], adamw(model.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)              # every CP rank: its positions of every sequence
        total = torch.zeros((), dtype=torch.float64)
        for i in range(2):
            xm, ym = micro(x, y, i)
            loss = loss_fn(model(input_ids=xm[:, pos], position_ids=pos[None]).logits, ym[:, pos])
            (loss / (2 * world)).backward()
            total += loss.detach() / 2
        allreduce_grads(model.parameters(), WORLD)
        norms.append(float(clip_grad_norm([p.grad for p in model.parameters()], CLIP)))
        opt.step()
        opt.zero_grad()
        all_reduce(total, group=WORLD)
        losses.append(float(total) / world)
    return losses, norms


def pp_1f1b(tied, attn):
    from transformers.masking_utils import create_causal_mask
    from common.comm import broadcast
    from pipeline.tied import clip_stage_grads, tied_grads_sync, tied_pair_group
    from train_pp import PipelineRunner, make_schedule, pipeline_stages
    model, losses, norms, m = build(tied, attn), [], [], 4
    inner, size = model.model, GLOBAL // m

    def block_kwargs(h):                           # what each HF decoder layer takes besides the hidden states
        at = torch.arange(h.shape[1])[None]
        return dict(position_ids=at, position_embeddings=inner.rotary_emb(h, at), attention_mask=create_causal_mask(
            config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=at))
    stages = pipeline_stages([inner.embed_tokens], list(inner.layers), [inner.norm, model.lm_head], rank, world,
                             loss_fn=loss_fn, block_kwargs=block_kwargs)
    assert bool(stages[0].tied) == tied            # the tied embedding and head, found by identity
    schedules, tied_group = make_schedule("1f1b", world, m), tied_pair_group(world, 1)
    runner = PipelineRunner(stages, WORLD, schedules, m, (size, T, 32), torch.device("cpu"))   # sends float64
    opt = adamw(stages.named_parameters())
    for step in range(STEPS):
        x, y = batch(step, GLOBAL, T)
        loss_sum = runner.step(schedules[rank], lambda mb: (x[mb * size: (mb + 1) * size],
                                                            y[mb * size: (mb + 1) * size]))
        tied_grads_sync(stages, tied_group)        # the tied weight's two copies: one gradient
        norms.append(float(clip_stage_grads(stages, CLIP, WORLD, torch.device("cpu"))))
        opt.step()
        opt.zero_grad()
        broadcast(loss_sum, src=world - 1, group=WORLD)   # the last stage has the loss
        losses.append(float(loss_sum) / m)
    return losses, norms


def ep(tied, attn):
    from train_ddp import mean_over_group
    from train_ep import ExpertDataParallelGrads, ExpertParallelStackedExperts, expert_groups
    ep_group, replicas = expert_groups(world, world)
    model, losses, norms = build(tied, attn, moe=True), [], []
    for layer in model.model.layers:               # Mixtral's experts: one [E, ...] tensor per weight
        layer.mlp.experts = ExpertParallelStackedExperts(layer.mlp.experts, E, ep_group)
    named = list(model.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(named)   # the checkpoint's names
    grads = ExpertDataParallelGrads(named, WORLD, replicas, world, 0.02, is_expert=lambda name: ".experts." in name)
    opt = adamw(named)
    for step in range(STEPS):
        x, y = my_rows(*batch(step, GLOBAL, T))
        total = 0.0
        for i in range(2):
            grads.require_sync(i == 1)
            xm, ym = micro(x, y, i)
            loss = loss_fn(model(input_ids=xm).logits, ym)
            (loss / 2).backward()
            total += loss.detach() / 2
        grads.finish()
        norms.append(float(grads.clip(CLIP, ep_group)))   # experts by their rank, the dense replicas once
        opt.step()
        grads.zero_grad()
        losses.append(mean_over_group(total, WORLD))
    return losses, norms


RUNS = dict(ddp=[ddp], zero=[lambda *v: zero(1, *v), lambda *v: zero(2, *v), lambda *v: zero(3, *v)],
            tp_sp=[tp_sp], cp=[lambda *v: cp("ring", *v), lambda *v: cp("zigzag", *v)], pp_1f1b=[pp_1f1b], ep=[ep])

def work():
    global WORLD
    WORLD = dist.group.WORLD
    return [fn(*variant) for fn in RUNS[run] for variant in variants]


def one_process_runs():                            # the reference of each run of `work`
    return [one_process(*variant, moe=run == "ep") for variant in variants] * len(RUNS[run])


if __name__ == "__main__":
    variants = CP_VARIANTS if run == "cp" else VARIANTS
    run_on_gloo(rank, world, port, out, work, one_process_runs)
'''


def user_project(path, files):
    """A directory with the user's own files and exactly `files` copied from nanoscale (folders kept)."""
    os.makedirs(path)
    for name, text in (("model.py", MODEL), ("data.py", DATA), ("recipe.py", RECIPE), ("config.py", CONFIG),
                       ("train.py", TRAIN), ("train_hf.py", TRAIN_HF)):
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    for name in files:
        os.makedirs(os.path.join(path, os.path.dirname(name)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), os.path.join(path, name))
    return path


def run_user_project(path, run, world=2, timeout=300, script="train.py"):
    """The user's `script` on `world` processes of its own (gloo, CPU); rank 0's JSON result."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(OMP_NUM_THREADS="1")
    port, out = free_port(), os.path.join(path, "result.json")
    procs = [subprocess.Popen([sys.executable, script, run, str(r), str(world), str(port), out], cwd=path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    with open(out) as f:
        return json.load(f)


def copied_modules(files):
    """The modules a copy of `files` holds: each file's, and the folders above it (packages without __init__.py)."""
    names = {f[:-3].replace("/", ".") for f in files}
    return names | {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}


@pytest.mark.parametrize("name", list(RUNS))
def test_copied_blocks_train_a_foreign_model_like_one_process(tmp_path, name):
    row, run = RUNS[name]
    files = COPY_TABLE[row][0]
    result = run_user_project(user_project(str(tmp_path / "project"), files), run)
    for what, (got, ref) in zip(("loss", "grad norm"), zip(result["got"], result["one_process"])):
        assert len(got) == len(ref) == 5
        for step, (a, b) in enumerate(zip(ref, got)):
            assert abs(a - b) <= EXACT * abs(a), f"{name}, step {step}: {what} {b!r} vs one process {a!r}"
    copied = copied_modules(files) | {"common"}
    assert set(result["modules"]) <= copied | {"model", "data"}, result["modules"]   # nothing that was not copied


@pytest.mark.parametrize("name", list(HF_RUNS))
def test_copied_blocks_train_transformers_models_like_one_process(tmp_path, name):
    """The same with transformers' LlamaForCausalLM (MixtralForCausalLM for EP), tiny configs built in the test,
    tied and untied, eager and sdpa: every step's loss and grad norm as one process's, each former trap refused."""
    pytest.importorskip("transformers")
    row, run = HF_RUNS[name]
    files = COPY_TABLE[row][0] + HF_ALSO.get(row, [])
    result = run_user_project(user_project(str(tmp_path / "project"), files), run, script="train_hf.py")
    assert len(result["got"]) == len(result["one_process"]) >= 2
    for variant, (got_run, ref_run) in enumerate(zip(result["got"], result["one_process"])):
        for what, got, ref in zip(("loss", "grad norm"), got_run, ref_run):
            assert len(got) == len(ref) == 4
            for step, (a, b) in enumerate(zip(ref, got)):
                assert abs(a - b) <= EXACT * abs(a), f"{name} #{variant}, step {step}: {what} {b!r} vs {a!r}"
    copied = copied_modules(files) | {"common"}
    assert set(result["modules"]) == copied | {"data"}, result["modules"]   # the row's files, all of them used
