"""plan.py's LM head and loss per stack (planner/head.py): the project's own heads (model.LMHead, the fused chunked
head of kernels/, train_tp's vocab-parallel loss) against torch's MemTracker, which counts every live tensor through
the dispatcher, on CPU; each stack's table row; chunking; the head on the last pipeline stage only."""
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from model import GPTConfig, LMHead
from planner import head as plan_head
from planner import memory as plan_memory
from planner.inputs import Job, Layout
from planner.shape import held_layers

N, V = 512, 4096


def job_for(loss, precision="fp32", n_tokens=N, n_embd=32, **kw):
    cfg = GPTConfig(vocab_size=V, block_size=n_tokens, n_layer=2, n_head=1, n_embd=n_embd)
    return Job(cfg, 1, 1, "h100", 1, precision=precision, loss=loss, **kw)


def predicted(job, lay=Layout(dp=1)):
    """What the loss saves plus its transient: the head's peak beyond its inputs, as head.py counts it."""
    return plan_head.loss_saved_bytes(job, lay) + plan_head.loss_transient_bytes(job, lay)


def tracked_peak(run, *tensors):
    """The peak of live tensors while run() runs, less those alive before it (MemTracker, CPU)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        run()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before


def head_peak(head, h, y, autocast):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _logits, loss = head(h, y)          # as train_single: the logits held through the backward
        loss.backward()
    return tracked_peak(run, head, h, y)


@pytest.mark.parametrize("precision", ["fp32", "amp"])
def test_model_lm_head_tracked(precision):
    """model.LMHead (F.cross_entropy on an fp32 upcast, the logits held): fp32 16 bytes per logit (4 saved + the
    logits + 8 of nll_loss's and log_softmax's gradients), under autocast 14 (+ the casts of h and the weight, 1%)."""
    torch.manual_seed(0)
    head = LMHead(nn.Embedding(V, 32))
    h, y = torch.randn(N, 32, requires_grad=True), torch.randint(0, V, (N,))
    measured = head_peak(head, h, y, precision == "amp")
    job = job_for("nanoscale", precision, logits_held=True)
    assert measured / predicted(job) == pytest.approx(1, abs=0.015)
    assert abs(measured / predicted(replace(job, loss="loss_parallel")) - 1) > 0.1      # the test can tell


def test_fused_head_tracked():
    """kernels/' fused chunked head (torch backend, fp32): dh and dW saved, three [chunk, V] buffers of the torch
    reference and the row losses at the peak, no [N, V] logits: head.fused_head_bytes to within 1%."""
    from kernels.apply import FusedLMHead
    torch.manual_seed(0)
    head = FusedLMHead(LMHead(nn.Embedding(V, 64)), "torch")
    n = 4 * 2048                                    # four of the kernel's 2048-row chunks: no [n, V] logits at once
    h, y = torch.randn(n, 64, requires_grad=True), torch.randint(0, V, (n,))
    measured = head_peak(head, h, y, False)
    job, lay = job_for("linear_ce", n_tokens=n, n_embd=64), Layout(dp=1)
    saved, transient = plan_head.fused_head_bytes(job, lay, backend="torch")
    assert measured / (saved + transient) == pytest.approx(1, abs=0.01)
    unfused = predicted(replace(job, loss="cross_entropy", logits_held=True))
    assert measured < unfused / 3


def test_vocab_parallel_loss_tracked(monkeypatch):
    """common/tp_grads' vocab-parallel cross-entropy (train_tp's and train_5d's under TP), on one rank (its three
    all-reduces the identity): its forward keeps the fp32 copy, logits - max, their exp and the saved softmax alive
    together, 16 bytes per logit beside the 16-bit logits (ours, alive before): a forward peak above its backward's
    (4 saved + 8), which F.cross_entropy's count would miss."""
    import common.tp_grads as tp_grads
    monkeypatch.setattr(tp_grads, "all_reduce", lambda tensor, **kw: tensor)
    monkeypatch.setattr(tp_grads.dist, "get_rank", lambda group: 0)
    logits = torch.randn(N, V, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    measured = tracked_peak(lambda: tp_grads.vocab_parallel_loss(logits, y, None).backward(), logits, y)
    job = job_for("vocab_parallel", "bf16")
    assert measured / (predicted(job) - 2 * N * V) == pytest.approx(1, abs=0.01)     # less the logits, ours
    assert plan_head.per_logit("vocab_parallel", 2, 0)[1] > plan_head.per_logit("vocab_parallel", 2, 2)[2]


def test_each_stack_and_chunking():
    """The table, per logit with 16-bit logits (saved, forward, backward): Megatron's in-place loss 4 + 2 either way,
    nanotron's one fp32 copy more in its forward (its out-of-place max subtraction), torch's loss_parallel 12 in the
    backward; a chunked loss divides the working set beyond the logits, not what each chunk saves."""
    assert plan_head.per_logit("megatron", 2, 0) == (4, 2, 2)
    assert plan_head.per_logit("nanotron", 2, 0) == (4, 6, 2)
    assert plan_head.per_logit("loss_parallel", 2, 2) == (4, 6, 14)
    assert plan_head.per_logit("megatron", 4, 0) == (4, 4, 0)        # fp32 logits: .float() copies nothing
    job, lay = job_for("cross_entropy", "bf16"), Layout(dp=1)
    logits = plan_head.logits_per_micro_batch(job, lay)
    assert plan_head.loss_transient_bytes(job, lay) == 8 * logits
    assert plan_head.loss_transient_bytes(replace(job, loss_chunks=4), lay) == (2 + 4 / 4) * logits   # the forward's
    assert plan_head.loss_saved_bytes(replace(job, loss_chunks=4), lay) == plan_head.loss_saved_bytes(job, lay)
    assert plan_head.loss_of(replace(job, loss="nanoscale"), replace(lay, tp=2)) == "vocab_parallel"
    assert plan_head.loss_of(replace(job, loss="", inplace_loss=True), lay) == "megatron"


def test_head_on_the_last_stage_only():
    """With pipeline stages only the last stage's rank holds the head's saved tensors and transient; under afab it
    holds every micro-batch's saved ones (all forwards first), under 1f1b one."""
    cfg = GPTConfig(vocab_size=V, block_size=256, n_layer=4, n_head=4, n_embd=64)
    job = Job(cfg, 2, 2, "h100", 8, precision="bf16", loss="vocab_parallel")
    for schedule, held in (("1f1b", 1), ("afab", 8)):
        lay = Layout(dp=1, pp=2, schedule=schedule)
        first, last = (plan_memory.activation_bytes(job, lay, r) for r in (0, 1))
        blocks = held_layers(job, lay, 1, 8) * plan_memory.layer_activation_bytes(job, lay)
        assert last - blocks == pytest.approx(held * plan_memory.head_activation_bytes(job, lay))
        assert first == held_layers(job, lay, 0, 8) * plan_memory.layer_activation_bytes(job, lay)
        other = plan_memory.other_bytes(job, lay, 1, [1]) - plan_memory.other_bytes(job, lay, 0, [1])
        assert other == pytest.approx(plan_head.loss_transient_bytes(job, lay))
