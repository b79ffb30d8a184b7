"""
No host-to-device copy and no read of a device value on the host inside a training step, except where one must
be (DESIGN.md, "Tests"): each is a full stop of the host until the GPU catches up, once per micro-batch or per
layer when it sits in the model. Checked on CPU by tests/step_syncs.py, which reads the device off the code as it
would run on a GPU, on train_single in this process and on the distributed rungs (and train_5d) on 2 gloo ranks.

The places that must read a device value, once per optimizer step: the logged loss and gradient norm, the
non-finite guard (a skipped step must be decided on the host), the MoE routing statistics of the metrics row. In
train_single, once per log interval: its guard decides on the device and its rows wait for the next log step. And
one that must per MoE block and forward: the rows per expert, where rows are split per expert (each expert's GEMM,
and expert parallelism's all_to_all split sizes, are launched by the host with them). Routing itself reads nothing
(no bincount, boolean mask or nonzero: each would size its output from device values).
"""
import collections

import pytest
import torch

from distributed_helper import run_workers
from step_syncs import StepRecorder, record_steps, recorded_step_events
from train_helpers import tiny_argv

ONCE_PER_STEP = ("float(loss_sum)", "float(grad_norm)", "optim.py:step_ok:", "train_ddp.py:mean_over_group:",
                 "routing.py:router_metrics:")
MOE_READS = ("moe/layer.py:forward: sizes = ", "train_ep.py:dispatch: sizes = ")   # the rows per expert, once per block


def unexpected(events, allowed=ONCE_PER_STEP, step=1):
    """Events of one steady-state step (step 0 may build caches) outside the allowed places, counted per place."""
    bad = [e for e in events if e.step == step and not (e.kind == "sync" and any(a in e.where for a in allowed))]
    return collections.Counter(f"{e.kind} at {e.where}" for e in bad)


def test_recorder_sees_what_a_gpu_would_wait_for():
    """The recorder itself: a host-made index moved to the device is a copy, one made with device= is not (unless
    made from Python data: a host-to-device copy of its values); a host tensor in a device op is mixed; .item() of a
    device value is a sync, of a host value it is not."""
    x = torch.randn(4, 3)
    with StepRecorder() as rec:
        torch.arange(3).to(x.device)                       # copy
        x[:, torch.arange(2, device=x.device)]             # fine: made on the device
        x + torch.ones(3)                                  # mixed
        x * torch.tensor(2.0)                              # fine: a 0-dim host tensor is a scalar argument
        float(torch.arange(3).sum())                       # fine: a host value
        x.sum().item()                                     # sync
        torch.arange(3).to(torch.float64)                  # fine: a cast stays on the host
        torch.tensor(3.0, device=x.device)                 # copy: the Python value travels to the device
        torch.full((), 3.0, device=x.device)               # fine: a fill on the device, nothing copied
    assert [e.kind for e in rec.events] == ["copy", "mixed", "sync", "copy"], rec.events
    assert all("test_step_syncs" not in e.where for e in rec.events)   # places are repository lines, never tests


def test_recorder_sees_ops_whose_output_size_a_gpu_reads_back():
    """On CUDA these read device values back to size their output: a sync each. Their sync-free forms are not."""
    x = torch.randn(6)
    mask = x > 0
    with StepRecorder() as rec:
        ids = torch.tensor([0, 2, 2, 1, 0, 2]).to(x.device)   # (a copy: the device ids of the checks below)
        for op in (lambda: torch.bincount(ids, minlength=3), lambda: ids.nonzero(), lambda: x[mask],
                   lambda: x.masked_select(mask), lambda: torch.unique(ids), lambda: torch.where(mask),
                   lambda: torch.arange(3, device=x.device).repeat_interleave(ids[:3]),
                   lambda: x.__setitem__(mask, 0.0)):
            op()
        torch.zeros(3, device=x.device).scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float))  # counts
        torch.arange(3, device=x.device).repeat_interleave(2)                   # an int: its size is known
        torch.arange(3, device=x.device).repeat_interleave(ids[:3], output_size=4)  # the caller knows its size
        torch.where(mask, x, 0.0)                                                # three arguments: elementwise
        torch.bincount(torch.tensor([0, 1]))                                     # a host tensor: no GPU involved
    assert [e.kind for e in rec.events] == ["copy"] + ["sync"] * 8, rec.events


def moe_reads(events, step=1):
    return sum(1 for e in events if e.step == step and e.kind == "sync" and any(a in e.where for a in MOE_READS))


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_a_moe_step_reads_the_rows_per_expert_once_per_block(tiny_data, tmp_path, capacity_factor):
    """2 MoE blocks x 4 micro-batches: 8 reads in a step, one per block and forward, and nothing else (before:
    24 dropless, 48 with a capacity: bincount in routing and in the experts, boolean masks of the kept rows)."""
    import train_single
    torch.set_num_threads(1)
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=3, global_batch_size=8, micro_batch_size=2, n_experts=4,
                     top_k=2, capacity_factor=capacity_factor)
    _, events = record_steps(lambda: train_single.main(argv))
    assert not unexpected(events, ONCE_PER_STEP + MOE_READS), unexpected(events, ONCE_PER_STEP + MOE_READS)
    assert moe_reads(events) == 2 * 4


LOG_READ = ("metrics.py:read_values:",)   # train_single's loss and grad norm, read once per log interval


def test_single_step_reads_nothing_outside_its_log_steps(tiny_data, tmp_path):
    """train_single reads nothing on the host in a step that logs nothing (the non-finite guard decides on the
    device), and at a log step reads the rows waiting since the last one in a single copy (before: 3 reads in
    every step: loss, guard, logged norm)."""
    import train_single
    torch.set_num_threads(1)
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=6, global_batch_size=8, micro_batch_size=2, log_interval=3)
    _, events = record_steps(lambda: train_single.main(argv))
    for step in range(1, 5):                # logged: 0, 3 (log_interval: it reads steps 1-3) and 5 (the last)
        allowed = LOG_READ if step == 3 else ()
        assert not unexpected(events, allowed, step), (step, unexpected(events, allowed, step))
        reads = [e for e in events if e.step == step and e.kind == "sync"]
        assert len(reads) == (1 if allowed else 0), (step, reads)


RUNGS = {
    "ddp": ("train_ddp", {}),
    "cp_allgather": ("train_cp", dict(cp=2, cp_layout="allgather")),
    "cp_zigzag": ("train_cp", dict(cp=2, cp_layout="zigzag")),
    "pp_1f1b": ("train_pp", dict(pp=2, pp_schedule="1f1b", n_microbatches=4, n_layer=4)),
    "pp_zb1_fp8": ("train_pp", dict(pp=2, pp_schedule="zb1", n_microbatches=4, n_layer=4, fp8="delayed")),
    "ep": ("train_ep", dict(ep=2, n_experts=2, top_k=1)),
    "ep_capacity": ("train_ep", dict(ep=2, n_experts=4, top_k=2, capacity_factor=1.0)),
    "tp_sp": ("train_tp", dict(tp=2, sp=True)),
    "zero3": ("train_zero", dict(zero_stage=3)),
    "zero3_fp8_all_gather": ("train_zero", dict(zero_stage=3, fp8="delayed", fp8_all_gather=True)),
    "5d_cp_allgather": ("train_5d", dict(dp=1, tp=1, pp=1, cp=2, cp_layout="allgather")),
}


@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_distributed_step_has_no_host_copies_or_syncs(rung, tiny_data, tmp_path):
    script, flags = RUNGS[rung]
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=3, global_batch_size=8, micro_batch_size=2, **flags)
    allowed = ONCE_PER_STEP + MOE_READS
    for rank, events in enumerate(run_workers(recorded_step_events, 2, args=(script, argv))):
        assert not unexpected(events, allowed), f"rank {rank}: {unexpected(events, allowed)}"
        assert moe_reads(events) == (2 * 2 if script == "train_ep" else 0)     # 2 blocks x 2 micro-batches
