"""
No host-to-device copy and no read of a device value on the host inside a training step, except where one must
be (DESIGN.md, "Tests"): each is a full stop of the host until the GPU catches up, once per micro-batch or per
layer when it sits in the model. Checked on CPU by tests/step_syncs.py, which reads the device off the code as it
would run on a GPU, on train_single in this process and on the distributed rungs (and train_5d) on 2 gloo ranks.

The places that must read a device value, once per optimizer step: the logged loss and gradient norm, the
non-finite guard (a skipped step must be decided on the host), the MoE routing statistics of the metrics row. And
one that must per layer: expert parallelism's all_to_all split sizes (the host launches the exchange with them).
"""
import collections

import pytest
import torch

from distributed_helper import run_workers
from step_syncs import StepRecorder, record_steps, recorded_step_events
from train_helpers import tiny_argv

ONCE_PER_STEP = ("float(loss_sum)", "float(grad_norm)", "optim.py:step_ok:", "train_ddp.py:mean_over_group:",
                 "routing.py:router_metrics:")
EP_SPLITS = ("train_ep.py:forward:", "train_ep.py:run_experts:")     # .tolist() of the all_to_all split sizes


def unexpected(events, allowed=ONCE_PER_STEP, step=1):
    """Events of one steady-state step (step 0 may build caches) outside the allowed places, counted per place."""
    bad = [e for e in events if e.step == step and not (e.kind == "sync" and any(a in e.where for a in allowed))]
    return collections.Counter(f"{e.kind} at {e.where}" for e in bad)


def test_recorder_sees_what_a_gpu_would_wait_for():
    """The recorder itself: a host-made index moved to the device is a copy, one made with device= is not; a
    host tensor in a device op is mixed; .item() of a device value is a sync, of a host value it is not."""
    x = torch.randn(4, 3)
    with StepRecorder() as rec:
        torch.arange(3).to(x.device)                       # copy
        x[:, torch.arange(2, device=x.device)]             # fine: made on the device
        x + torch.ones(3)                                  # mixed
        x * torch.tensor(2.0)                              # fine: a 0-dim host tensor is a scalar argument
        float(torch.arange(3).sum())                       # fine: a host value
        x.sum().item()                                     # sync
        torch.arange(3).to(torch.float64)                  # fine: a cast stays on the host
    assert [e.kind for e in rec.events] == ["copy", "mixed", "sync"], rec.events
    assert all("test_step_syncs" not in e.where for e in rec.events)   # places are repository lines, never tests


def test_single_step_has_no_host_copies_or_syncs(tiny_data, tmp_path):
    import train_single
    torch.set_num_threads(1)
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=3, global_batch_size=8, micro_batch_size=2)
    _, events = record_steps(lambda: train_single.main(argv))
    assert not unexpected(events), unexpected(events)
    syncs = [e for e in events if e.step == 1 and e.kind == "sync"]
    assert len(syncs) == 3, syncs          # loss, guard, logged norm: once per step, not per micro-batch


RUNGS = {
    "ddp": ("train_ddp", {}),
    "cp_allgather": ("train_cp", dict(cp=2, cp_layout="allgather")),
    "cp_zigzag": ("train_cp", dict(cp=2, cp_layout="zigzag")),
    "pp_1f1b": ("train_pp", dict(pp=2, pp_schedule="1f1b", n_microbatches=4, n_layer=4)),
    "ep": ("train_ep", dict(ep=2, n_experts=2, top_k=1)),
    "tp_sp": ("train_tp", dict(tp=2, sp=True)),
    "zero3": ("train_zero", dict(zero_stage=3)),
    "5d_cp_allgather": ("train_5d", dict(dp=1, tp=1, pp=1, cp=2, cp_layout="allgather")),
}


@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_distributed_step_has_no_host_copies_or_syncs(rung, tiny_data, tmp_path):
    script, flags = RUNGS[rung]
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=3, global_batch_size=8, micro_batch_size=2, **flags)
    allowed = ONCE_PER_STEP + (EP_SPLITS if script == "train_ep" else ())
    for rank, events in enumerate(run_workers(recorded_step_events, 2, args=(script, argv))):
        assert not unexpected(events, allowed), f"rank {rank}: {unexpected(events, allowed)}"
