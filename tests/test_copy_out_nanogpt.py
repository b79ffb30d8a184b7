"""
Copy-paste into a nanoGPT fork: the habits a nanoGPT user brings either train right or stop with an error that
names the fix (docs/copy_out.md, "A nanoGPT fork").

As test_copy_out.py, each case copies exactly the files of a COPY_TABLE row into a temporary directory beside a
user's own model.py, here shaped as nanoGPT's (a fused c_attn split into q, k, v, a learned position table wpe, the
LM head tied to wte, a loss with ignore_index=-1 inside the forward returning (logits, loss), a generate() sampling
with torch.multinomial), and runs the user's script (TRAIN below) on two gloo processes. In float64, with two
micro-batches per rank and clipping on, DDP, ZeRO-1/2/3 and TP + SP (wpe cut by sequence) give every step's loss
and gradient norm of one process within 1e-12 relative, on targets with -1 among them. The habits, each once:
nanoGPT's per-rank seed before building the model (ReplicaMismatch, DDP and ZeRO), an optimizer step without
finish() (GradsNotFinished), torch's clip_grad_norm_ under ZeRO-1/2/3 and TP (a ValueError naming comm.clip_grad_norm
or clip_tp_grads), ZeRO-3's state_dict() (a ValueError; gathered first it is one process's), c_attn
planned "column" (a ValueError naming ("column", 3)), a vocabulary tp does not divide (the same ValueError on every
rank), generation under TP (the gathered vocabulary samples one process's tokens), and evaluation on rank 0 alone
under ZeRO-3 and TP (stops within the group's timeout, saying every rank must run every forward).
"""
import os
import shutil

from test_copy_out import COPY_TABLE, DATA, run_user_project

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT = 1e-12
TIMEOUT_S = 2           # the user's process-group timeout in the evaluation-on-rank-0 run

MODEL = r'''
"""A nanoGPT-shaped model of the user's own: fused c_attn, learned positions, tied head, ignore_index=-1."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.head_dim = n_embd // n_head

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)      # nanoGPT: .split(n_embd, dim=2); heads off the width
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.mlp = CausalSelfAttention(n_embd, n_head), MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.block_size, self.criterion = block_size, cross_entropy
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight     # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, self.criterion(logits, targets)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, full_vocab=lambda logits: logits):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size:])
            probs = F.softmax(full_vocab(logits)[:, -1, :], dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx
'''

TRAIN = r'''
"""The user's nanoGPT-style training script, one nanoscale technique copied in. python train.py RUN RANK WORLD PORT
OUT_JSON"""
import json
import os
import sys
import time
from datetime import timedelta

for entry in sys.path:                             # nanoscale is not on the path: only what was copied here
    assert not os.path.exists(os.path.join(entry or ".", "train_5d.py")), f"nanoscale on sys.path: {entry}"

import torch                                       # noqa: E402
import torch.distributed as dist                   # noqa: E402

from data import batch                             # noqa: E402
from model import GPT                              # noqa: E402

run, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
STEPS, GLOBAL, T, CLIP, LR, TIMEOUT_S = 4, 8, 16, 1.0, 1e-2, @TIMEOUT_S@
SHAPE = dict(vocab_size=256, block_size=T, n_layer=2, n_head=4, n_embd=32)


def build(seed=1337, **shape):
    torch.manual_seed(seed)
    return GPT(**{**SHAPE, **shape}).double()


def adamw(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([dict(params=[p for p in params if p.dim() >= 2], weight_decay=0.1),
                              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
                             lr=LR, betas=(0.9, 0.95), eps=1e-8)


def micro_batches(step, ranks=1, me=0):
    """Step `step`'s four micro-batches (targets that are spaces ignored: -1), or rank `me`'s two of them."""
    x, y = batch(step, GLOBAL, T)
    y = y.masked_fill(y == ord(" "), -1)
    chunks = list(zip(x.chunk(4), y.chunk(4)))
    return chunks[me * 4 // ranks: (me + 1) * 4 // ranks]


def one_process():
    model, losses, norms = build(), [], []
    opt = adamw(model)
    for step in range(STEPS):
        total = 0.0
        for x, y in micro_batches(step):
            _, loss = model(x, y)
            (loss / 4).backward()
            total += float(loss) / 4
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    state = sum(float(v.pow(2).sum()) for v in model.state_dict().values())
    untrained = build()
    torch.manual_seed(7)
    tokens = untrained.generate(torch.zeros(1, 1, dtype=torch.long), 8)
    return dict(curve=[losses, norms], state=state, tokens=tokens.tolist())


def refused(fn, error, *words):
    """fn() must raise `error` with every word in its message; returns the message."""
    try:
        fn()
    except error as e:
        assert all(w in str(e) for w in words), e
        return str(e)
    raise AssertionError(f"no {error.__name__}")


def ddp():
    from common.comm import clip_grad_norm
    from train_ddp import DataParallelGrads, GradsNotFinished, ReplicaMismatch, mean_over_group
    group = dist.group.WORLD
    refused(lambda: DataParallelGrads(build(seed=1337 + rank).parameters(), group), ReplicaMismatch, "1337 + rank")
    model = build()                                # the same seed on every rank, then a per-rank one (dropout)
    torch.manual_seed(1337 + rank)
    grads, opt, losses, norms = DataParallelGrads(model.parameters(), group, bucket_mb=0.02), adamw(model), [], []
    for step in range(STEPS):
        total = 0.0
        for micro, (x, y) in enumerate(micro_batches(step, world, rank)):
            grads.require_sync(micro == 1)
            _, loss = model(x, y)
            (loss / 2).backward()
            total += loss.detach() / 2
        grads.finish()
        norms.append(float(clip_grad_norm(grads.grads(), CLIP)))
        opt.step()
        grads.zero_grad()
        losses.append(mean_over_group(total, group))
    model(x, y)[1].backward()                      # the habit: no finish() before the step
    refused(opt.step, GradsNotFinished, "finish()")
    return [losses, norms]


def zero(stage):
    from common.comm import clip_grad_norm
    from train_ddp import ReplicaMismatch, mean_over_group
    from train_zero import ShardedAdamW, ShardedGrads, install_zero3_hooks, shard_model
    group = dist.group.WORLD
    if stage == 3:
        habit = build(seed=1337 + rank)
        refused(lambda: shard_model(habit, 3, group, torch.float64, "cpu", blocks=list(habit.transformer.h)),
                ReplicaMismatch, "manual_seed")
    model = build()
    blocks = list(model.transformer.h)
    shards = shard_model(model, stage, group, torch.float64, "cpu", blocks=blocks, bucket_mb=0.02)
    grads = ShardedGrads(shards, group, stage)
    if stage == 3:
        install_zero3_hooks(model, blocks, shards, grads)
    opt, losses, norms = ShardedAdamW(shards, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8), [], []
    for step in range(STEPS):
        total = 0.0
        for micro, (x, y) in enumerate(micro_batches(step, world, rank)):
            grads.require_sync(stage >= 2 or micro == 1)
            _, loss = model(x, y)
            (loss / 2).backward()
            grads.finish()
            total += loss.detach() / 2
        g = grads.grads()
        norms.append(float(clip_grad_norm(g, CLIP, group=group, dtype=torch.float64)))
        opt.step(LR, g)
        for s in shards:
            s.publish()
        grads.zero_grad()
        losses.append(mean_over_group(total, group))
    # the habit: torch's clip over the model, which sees this rank's slices (1) or no gradient at all (2-3)
    refused(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), ValueError, "comm.clip_grad_norm")
    state = None
    if stage == 3:                                 # the habit: torch.save(model.state_dict()) on rank 0
        refused(model.state_dict, ValueError, "ZeRO-3", "wait()")
        for s in shards:                           # every rank: the whole weights, then its shard again
            s.wait()
        state = sum(float(v.pow(2).sum()) for v in model.state_dict().values())
        for s in shards:
            s.free()
    return [losses, norms], state


def tp_plan(sp):
    plan = {"transformer.wte": "embedding", "lm_head": "column", "transformer.wpe": "sp_begin"}
    for i in range(SHAPE["n_layer"]):
        h = f"transformer.h.{i}"
        plan.update({f"{h}.attn.c_attn": ("column", 3), f"{h}.attn.c_proj": "row", f"{h}.mlp.c_fc": "column",
                     f"{h}.mlp.c_proj": "row"})
        if sp:                                     # nanoGPT's attention reads T off its input: give it the whole
            plan[f"{h}.attn"] = "sp_gather"
    return plan


def tp():
    from common.comm import gather_seq
    from train_tp import all_reduce_sequence_parallel_grads, clip_tp_grads, tensor_parallel, vocab_parallel_loss
    group, plan = dist.group.WORLD, tp_plan(sp=True)
    norms_sp = ["transformer.ln_f"] + [f"transformer.h.{i}.{n}" for i in range(SHAPE["n_layer"]) for n in
                                       ("ln_1", "ln_2")]
    refused(lambda: tensor_parallel(build(), {**plan, "transformer.h.0.attn.c_attn": "column"}, group, sp=True,
                                    sequence_parallel=norms_sp), ValueError, "c_attn", '("column", 3)')
    odd = refused(lambda: tensor_parallel(build(vocab_size=65), plan, group, sp=True, sequence_parallel=norms_sp),
                  ValueError, "lm_head", "65")
    odd_everywhere = [None] * world
    dist.all_gather_object(odd_everywhere, odd)
    model = tensor_parallel(build(), plan, group, sp=True, sequence_parallel=norms_sp)
    model.criterion = lambda logits, y: vocab_parallel_loss(logits, y, group, ignore_index=-1)
    opt, losses, norms = adamw(model), [], []
    for step in range(STEPS):
        total = 0.0
        for x, y in micro_batches(step):           # every TP rank: every micro-batch
            _, loss = model(x, y)
            (loss / 4).backward()
            total += float(loss) / 4
        all_reduce_sequence_parallel_grads(model, group)
        norms.append(float(clip_tp_grads(model, CLIP, group)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    # the habit: torch's clip, each rank by its own shards' norm (the replicated wpe and norms would drift apart)
    refused(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), ValueError, "clip_tp_grads")
    generator = tensor_parallel(build(), tp_plan(sp=False), group)   # generation: TP without SP, untrained
    torch.manual_seed(7)                           # every TP rank samples alike: the same seed
    tokens = generator.generate(torch.zeros(1, 1, dtype=torch.long), 8,
                                full_vocab=lambda logits: gather_seq(logits, group, dim=2)[0])
    return dict(curve=[losses, norms], odd=odd_everywhere, tokens=tokens.tolist())


def sharded_models():
    """A ZeRO-3 and a TP model of the user's, each on a group of its own with the user's short timeout."""
    from train_tp import tensor_parallel
    from train_zero import ShardedGrads, install_zero3_hooks, shard_model
    zero3, tp = build(), build()
    dist.barrier()                                 # (both ranks here: a slow start is no timeout below)
    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S)) for _ in range(2)]
    blocks = list(zero3.transformer.h)
    shards = shard_model(zero3, 3, groups[0], torch.float64, "cpu", blocks=blocks)
    install_zero3_hooks(zero3, blocks, shards, ShardedGrads(shards, groups[0], 3))
    return dict(zero3=zero3, tp=tensor_parallel(tp, tp_plan(sp=False), groups[1]))


def only_rank_0_evaluates(model):
    """nanoGPT's estimate_loss on the master process alone: rank 0's forward must stop within the timeout."""
    start = time.perf_counter()
    message = refused(lambda: model.eval()(micro_batches(0)[0][0]), RuntimeError, "every rank must run every forward")
    return dict(message=message, seconds=time.perf_counter() - start)


def work():
    if run == "data_parallel":
        reference = one_process()
        dp = dict(ddp=ddp(), **{f"zero{s}": zero(s) for s in (1, 2, 3)})
        return dict(reference=reference, got=dp)
    if run == "tp":
        return dict(reference=one_process(), got=tp())
    models = sharded_models()
    if rank != 0:
        time.sleep(2 * TIMEOUT_S + 1)              # busy elsewhere (nanoGPT: the next training step) meanwhile
        return None
    return dict(got={name: only_rank_0_evaluates(model) for name, model in models.items()})


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = work()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)          # no teardown: a group that timed out cannot be left together
'''


def nanogpt_project(path, rows):
    """The user's nanoGPT fork: model.py, data.py, train.py and exactly the files of COPY_TABLE's `rows`."""
    os.makedirs(path)
    train = TRAIN.replace("@TIMEOUT_S@", str(TIMEOUT_S))
    for name, text in (("model.py", MODEL), ("data.py", DATA), ("train.py", train)):
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    for name in sorted({f for row in rows for f in COPY_TABLE[row][0]}):
        os.makedirs(os.path.join(path, os.path.dirname(name)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), os.path.join(path, name))
    return str(path)


def close(a, b):
    return abs(a - b) <= EXACT * abs(b)


def same_curve(got, ref, what):
    for name, g, r in zip(("loss", "grad norm"), got, ref):
        assert len(g) == len(r) == 4, (what, g, r)
        for step, (a, b) in enumerate(zip(g, r)):
            assert close(a, b), f"{what}, step {step}: {name} {a!r} vs one process {b!r}"


def test_nanogpt_fork_ddp_and_zero_train_like_one_process(tmp_path):
    """The ZeRO row's files (DDP's among them): DDP and ZeRO-1/2/3 on nanoGPT's model reach one process's curve; a
    per-rank seed is a ReplicaMismatch, a step without finish() a GradsNotFinished, torch's clip_grad_norm_ under
    ZeRO-1/2/3 a ValueError naming comm.clip_grad_norm, ZeRO-3's state_dict() a ValueError (and, gathered on every rank
    first, one process's weights)."""
    result = run_user_project(nanogpt_project(tmp_path / "fork", ["ZeRO-1/2"]), "data_parallel")
    ref = result["reference"]
    same_curve(result["got"]["ddp"], ref["curve"], "DDP")
    for stage in (1, 2, 3):
        curve, state = result["got"][f"zero{stage}"]
        same_curve(curve, ref["curve"], f"ZeRO-{stage}")
    assert close(state, ref["state"]), (state, ref["state"])


def test_nanogpt_fork_tp_sp_trains_like_one_process(tmp_path):
    """The TP row's files: fused c_attn ("column", 3), wpe cut by sequence, the tied head's vocabulary split and
    ignore_index=-1 reach one process's curve; c_attn planned "column" and a vocabulary of 65 are refused (the same
    error on both ranks), and so is torch's clip_grad_norm_ (naming clip_tp_grads); generation from the gathered
    vocabulary samples one process's tokens on every rank."""
    result = run_user_project(nanogpt_project(tmp_path / "fork", ["TP + SP"]), "tp")
    got, ref = result["got"], result["reference"]
    same_curve(got["curve"], ref["curve"], "TP + SP")
    assert got["odd"][0] == got["odd"][1] and "pad" in got["odd"][0], got["odd"]
    assert got["tokens"] == ref["tokens"], (got["tokens"], ref["tokens"])


def test_nanogpt_fork_evaluation_on_rank_0_alone_stops_with_the_cause(tmp_path):
    """nanoGPT evaluates on the master process only: under ZeRO-3 and TP that forward's collectives wait for ranks
    that never come; it stops within the group's timeout with a line saying every rank must run every forward."""
    result = run_user_project(nanogpt_project(tmp_path / "fork", ["ZeRO-3", "TP + SP"]), "rank_0_evaluates")
    for name, got in result["got"].items():
        assert "every rank must run every forward" in got["message"], (name, got)
        assert got["seconds"] < TIMEOUT_S + 5, (name, got)
