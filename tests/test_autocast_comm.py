"""
Collectives in the compute dtype under autocast, checked on a CPU (DESIGN.md, "Tests"): a LayerNorm's output is fp32
under bf16 autocast, so without care tensor parallelism's f (its backward all-reduce; under SP its all-gathers)
and expert parallelism's dispatch move 4 bytes per value where the matmul that receives them uses 2.
comm.in_compute_dtype casts such activations before they travel; these tests record the dtype of every activation
handed to a collective in one bf16 step and allow fp32 only where train_single keeps fp32 too: the residual stream
out of the vocabulary-parallel embedding (the fp32 embedding's sum, and under SP its gradient's all-gather).
The traffic of whole rungs is checked the same way, by the dtype of each collective and the bytes counted per step
against a float32 run: ZeRO-3's gathers travel in bf16, at half the bytes, while its gradients are still
reduce-scattered in fp32; the pipeline's sends (the residual stream forward, its gradient back) travel in bf16, at
half the bytes; so do all of ring attention's hops. Before, a bf16 run gathered and sent what a float32 run does,
but for ring attention's K/V (already bf16; its dK/dV were fp32): each test fails there.
"""
import pytest
import torch

from distributed_helper import run_workers
from train_helpers import tiny_argv

WIDTH = 48      # n_embd: no other tensor communicated in these runs ends in 48


def activation_dtypes(rank, world_size, script, argv):
    """A worker: run `script`'s main under bf16 autocast and return (collective, dtype) of every activation (a tensor
    whose last dimension is the model's width; flat buffers are parameters and gradients, and router statistics
    and per-token losses have other shapes) it communicated."""
    import importlib

    import common.comm as comm
    seen, launch = [], comm._launch

    def record(op, group, fn, /, *args, **kwargs):
        tensor = next((t for t in args if isinstance(t, torch.Tensor)), None)    # output and input: one dtype
        if tensor is not None and tensor.dim() >= 2 and tensor.shape[-1] == WIDTH:
            seen.append((op, str(tensor.dtype)))
        return launch(op, group, fn, *args, **kwargs)

    comm._launch = record       # every collective of comm.py goes through _launch
    importlib.import_module(script).main(argv)
    return seen


@pytest.mark.parametrize("script, flags, fp32_per_micro", [
    ("train_tp", dict(tp=2), 1),                  # the embedding's all-reduce (forward)
    ("train_tp", dict(tp=2, sp=True), 2),         # the embedding's reduce-scatter and its gradient's all-gather
    ("train_ep", dict(ep=2, n_experts=4, top_k=2), 0),
])
def test_activations_travel_in_bf16(script, flags, fp32_per_micro, tiny_data, tmp_path):
    argv = tiny_argv(tiny_data, str(tmp_path), dtype="bfloat16", n_embd=WIDTH, max_steps=1, **flags)
    micro_batches = 2 if script == "train_tp" else 1      # global batch 8 of micro-batches of 4 over dp = 1 or 2
    for rank, seen in enumerate(run_workers(activation_dtypes, 2, args=(script, argv))):
        fp32 = [op for op, dtype in seen if dtype == "torch.float32"]
        assert len(seen) > len(fp32), f"rank {rank}: no bf16 activation communicated (is autocast on?): {seen}"
        assert all(dtype in ("torch.float32", "torch.bfloat16") for _, dtype in seen), seen
        assert len(fp32) == fp32_per_micro * micro_batches, \
            f"rank {rank}: {len(fp32)} fp32 activations communicated ({fp32}), expected only the embedding's"


def traffic(rank, world_size, script, argv):
    """A worker: run `script`'s main for one step and return the dtypes its collectives moved ({op: {dtype
    names}}) and the bytes it counted per op, both up to the step's log line (not the checkpoint written after)."""
    import importlib

    import common.comm as comm
    from common.metrics import MetricsLogger
    seen, counted, launch, log_step = {}, {}, comm._launch, MetricsLogger.log_step

    def record(op, group, fn, /, *args, **kwargs):
        tensor = next((t for t in args if isinstance(t, torch.Tensor)), None)
        tensors = [tensor] if tensor is not None else [o.tensor for o in args[0]]     # batch_isend_irecv: P2POps
        if not counted:
            seen.setdefault(op, set()).update(str(t.dtype) for t in tensors)
        return launch(op, group, fn, *args, **kwargs)

    def logged(self, *args, **kwargs):
        counted.update(comm.COMM.by_op)
        return log_step(self, *args, **kwargs)

    comm._launch, MetricsLogger.log_step = record, logged
    importlib.import_module(script).main(argv)
    return seen, counted


def run_traffic(script, tiny_data, tmp_path, **flags):
    """{dtype: (dtypes per op, bytes per op)} of rank 0, for a float32 and a bf16 step."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        argv = tiny_argv(tiny_data, str(tmp_path / dtype), dtype=dtype, max_steps=1, **flags)
        out[dtype] = run_workers(traffic, 2, args=(script, argv))[0]
    return out


def test_zero3_gathers_in_bf16_and_reduces_in_fp32(tiny_data, tmp_path):
    out = run_traffic("train_zero", tiny_data, tmp_path, zero_stage=3, micro_batch_size=2)
    (dtypes, counted), (_, fp32_counted) = out["bfloat16"], out["float32"]
    assert dtypes["all_gather"] == {"torch.bfloat16"}, dtypes
    assert dtypes["reduce_scatter"] == {"torch.float32"}, dtypes       # gradients: reduced in fp32
    assert counted["all_gather"] == fp32_counted["all_gather"] / 2, (counted, fp32_counted)
    assert counted["reduce_scatter"] == fp32_counted["reduce_scatter"], (counted, fp32_counted)


def test_pipeline_sends_bf16(tiny_data, tmp_path):
    out = run_traffic("train_pp", tiny_data, tmp_path, pp=2)
    (dtypes, counted), (_, fp32_counted) = out["bfloat16"], out["float32"]
    assert dtypes["batch_isend_irecv"] == {"torch.bfloat16"}, dtypes
    assert counted["send"] == fp32_counted["send"] / 2 > 0, (counted, fp32_counted)


def test_ring_attention_sends_dkv_in_bf16(tiny_data, tmp_path):
    out = run_traffic("train_cp", tiny_data, tmp_path, cp=2, cp_layout="ring")
    (dtypes, counted), (_, fp32_counted) = out["bfloat16"], out["float32"]
    assert dtypes["batch_isend_irecv"] == {"torch.bfloat16"}, dtypes     # K/V forward, K/V and dK/dV backward
    assert counted["send"] == fp32_counted["send"] / 2 > 0, (counted, fp32_counted)
