"""plan.py's memory as a GPU reports it: gradient buffers per --grad_dtype, allocated / reserved / device / usable, the
OOM verdict on reserved memory, the block recomputed under full recompute, and the peak of train_single's step as
torch's MemTracker counts it under autocast (planner/memory.py)."""
from dataclasses import replace

import pytest

import plan
from planner import head as plan_head
from planner import memory as plan_memory
from planner import runtime_memory as plan_runtime_memory
from planner.cli import build_job, parse_args
from planner.inputs import GIB, Job, Layout, model_state_bytes_per_param
from planner.memory import ALLOCATOR_RESERVE, CUBLAS_WORKSPACE, CUDA_CONTEXT, DEVICE_SHARE, NCCL_COMM_BYTES
from model import GPTConfig

CFG = GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)


def job_for(cfg=CFG, **kw):
    return Job(cfg, kw.pop("gpus", 8), kw.pop("gpus_per_node", 8), kw.pop("gpu", "h100"), kw.pop("global_seqs", 64),
               **kw)


def test_gradient_buffers_per_grad_dtype():
    """16-bit parameters: 16 bytes per parameter with 16-bit gradients, 18 with Megatron's fp32 main_grad (6 + 12/d
    under ZeRO-1, its README's figure), 20 with both (nanotron, DeepSpeed's BF16_Optimizer); fp32 states stay 16.
    The reduction moves the fp32 buffer: 4 bytes per parameter either way."""
    assert [sum(model_state_bytes_per_param("bf16", "fp32", g).values()) for g in ("param", "fp32", "both")] == [16, 18,
                                                                                                                 20]
    assert model_state_bytes_per_param("fp32", grad_dtype="both") == model_state_bytes_per_param("fp32")
    with pytest.raises(ValueError):
        model_state_bytes_per_param("bf16", grad_dtype="fp16")
    lay = Layout(dp=8, zero_stage=1)
    base, megatron = (plan_memory.memory(job_for(grad_dtype=g), lay) for g in ("param", "fp32"))
    P = base["padded_params"]
    assert megatron["grads"] - base["grads"] == pytest.approx(2 * P)
    assert megatron["params"] + megatron["grads"] + megatron["optimizer"] == pytest.approx(6 * P + 12 * P / 8)
    a, b, c = (plan.comm_bytes(job_for(grad_dtype=g), lay, P)["dp_reduce"] for g in ("param", "fp32", "both"))
    assert b == c == 2 * a
    assert build_job(parse_args(["--model", "gpt2", "--software", "megatron-core"], "")).grad_dtype == "fp32"
    assert build_job(parse_args(["--model", "gpt2", "--software", "megatron-deepspeed"], "")).grad_dtype == "both"
    assert build_job(parse_args(["--model", "gpt2", "--software", "megatron-core", "--grad_dtype", "both"],
                                "")).grad_dtype == "both"        # a flag given beside it (not its default) wins


def test_reserved_device_and_usable():
    """allocated = the parts; reserved = allocated + ALLOCATOR_RESERVE x (activations + other), capped at usable
    where the allocated fit (the allocator frees its cache before failing); device = reserved + the CUDA context and
    a NCCL buffer set per communicator; usable = HBM x DEVICE_SHARE less those; OOM exactly when reserved > usable."""
    job = job_for()
    for lay, comms in ((Layout(dp=8), 1), (Layout(dp=2, tp=2, pp=2, sp=True), 3), (Layout(dp=1, cp=2, tp=4), 3)):
        mem = plan_memory.memory(job, lay)
        assert plan_memory.communicators(lay.dp, lay.tp, lay.cp, lay.pp, lay.ep) == comms
        usable = 80 * GIB * DEVICE_SHARE - CUDA_CONTEXT - comms * NCCL_COMM_BYTES
        assert mem["usable"] == pytest.approx(usable)
        assert mem["reserved"] == pytest.approx(min(usable, mem["total"] + ALLOCATOR_RESERVE * (mem["activations"]
                                                                                                + mem["other"])))
        assert mem["device"] == pytest.approx(mem["reserved"] + CUDA_CONTEXT + comms * NCCL_COMM_BYTES)
        assert mem["other"] >= CUBLAS_WORKSPACE
    rows = [plan.evaluate(job, Layout(dp=8, micro_batch_size=b, recompute=rc))
            for b in (1, 8) for rc in ("none", "full")]
    rows.append(plan.evaluate(job, Layout(dp=1, tp=8, micro_batch_size=64)))
    assert any(r["oom"] for r in rows) and any(not r["oom"] for r in rows)
    for r in rows:
        m = r["mem_bytes"]
        assert r["oom"] == (m["reserved"] > m["usable"]) == (m["total"] > m["usable"])
        assert m["total"] <= m["reserved"] and (r["oom"] or m["reserved"] <= m["usable"])


def test_full_recompute_keeps_the_block_it_recomputes():
    """Under full recompute the block being recomputed holds what it keeps without recompute until its backward
    ends: 'other' grows by that block's activations less its stored input, once per rank (not per layer). On the
    last stage that recompute starts after the loss's backward has freed its gradients: the larger of the two."""
    job = job_for()
    full, none = Layout(dp=4, pp=2, recompute="full"), Layout(dp=4, pp=2, recompute="none")
    extra = plan_memory.layer_activation_bytes(job, none) - plan_memory.layer_activation_bytes(job, full)
    for rank in (0, 1):
        base = plan_memory.other_bytes(job, replace(full, recompute="selective"), rank, [1])
        loss = plan_memory.loss_transient_bytes(job, full) if rank == 1 else 0
        assert plan_memory.other_bytes(job, full, rank, [1]) - base == pytest.approx(max(loss, extra) - loss)
    assert extra > 0


def test_plan_sweep_reports_reserved(tmp_path):
    """bench/plan_sweep.py's worker measures max_memory_reserved beside max_memory_allocated, and its verdict is
    plan.py's: reserved against the usable memory of the GPU's total_memory."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_sweep", "bench/plan_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    row = plan.evaluate(job_for(), Layout(dp=8))
    capacity = 80 * GIB * DEVICE_SHARE
    assert sweep.verdict(row, capacity) == ("OOM" if row["oom"] else "fits")
    assert sweep.verdict(row, 0.8 * row["mem_bytes"]["reserved"]) == "OOM"
    exact = row["mem_bytes"]["total"] + CUDA_CONTEXT + NCCL_COMM_BYTES           # the tensors fill the usable memory
    assert sweep.verdict(row, exact) == "close"
    text = "\n".join(sweep.summary([(row, dict(allocated=row["mem_bytes"]["total"],
                                                reserved=row["mem_bytes"]["reserved"] * 1.25), "fits")], capacity))
    assert "median: allocated 1.00, reserved 0.80" in text and "0 close calls apart" in text


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_peak_equals_tracked_train_single_step(recompute):
    """train_single's loop (bf16 autocast over fp32 weights, the logits held by `_, loss = model(x, y)`, gradients set
    to None after each step) on CPU under torch's MemTracker, which counts every live tensor through the dispatcher:
    the second step's peak (AdamW's states exist) is plan.py's allocated memory less cuBLAS's workspaces, within 1%.
    The peak is at the start of the backward: the fp32 log-softmax saved, nll_loss's and log_softmax's fp32 gradients
    in flight, no parameter gradient yet, and 4-byte LayerNorm inputs (the fp32 residual stream); under full recompute
    no block's bf16 weight casts. Before these terms plan.py said 0.89 (none) and 0.95 (full) of it."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from common.config import Config
    from common.optim import configure_optimizer
    from model import GPT
    cfg = GPTConfig(vocab_size=2000, block_size=64, n_layer=2, n_head=4, n_embd=64, recompute=recompute)
    model = GPT(cfg)
    optimizer = configure_optimizer(model.named_parameters(), Config(), "cpu")
    x, y = (torch.randint(0, 2000, (4, 64), generator=torch.Generator().manual_seed(i)) for i in (0, 1))
    tracker = MemTracker()
    tracker.track_external(model, optimizer, x, y)
    with tracker:
        for _step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()       # per-module statistics only: the peak stays
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    job = Job(cfg, 1, 1, "h100", 4, precision="amp", logits_held=True, grads_freed=True)
    predicted = plan_memory.memory(job, Layout(dp=1, micro_batch_size=4, recompute=recompute))["total"]
    assert (predicted - CUBLAS_WORKSPACE) / peak == pytest.approx(1, abs=0.01)


def _loss_parallel_peak_per_logit(rank, world):
    """Bytes per logit at the peak of loss_parallel's forward + backward on a 1-rank mesh (MemTracker), in a fresh
    worker process: an in-process run of the suite may have left a default process group behind."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    local = torch.randn(256, 1000, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    logits = DTensor.from_local(local, mesh, [Shard(1)]).requires_grad_()
    tracker = MemTracker()
    tracker.track_external(logits)
    with tracker, loss_parallel():
        F.cross_entropy(logits.float(), torch.randint(0, 1000, (256,))).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / local.numel()


def test_loss_parallel_backward_measured():
    """torch's loss_parallel (torchtitan's loss under TP) on a 1-rank mesh under torch's MemTracker: its backward's
    peak per logit is the 16-bit logits, the saved fp32 log-softmax and 12 bytes of fp32 working set (zeros, exp of
    the log-softmax, their sum / product), where F.cross_entropy's is 8; head.loss_transient_bytes counts
    those 12 with --loss_parallel and tp > 1, the 8 otherwise."""
    from distributed_helper import run_workers
    per_logit = run_workers(_loss_parallel_peak_per_logit, 1)[0]
    job, lay = job_for(logits_held=True, loss_parallel=True), Layout(dp=4, tp=2)
    logits_count = plan_head.logits_per_micro_batch(job, lay)
    assert per_logit == pytest.approx(4 + plan_head.loss_transient_bytes(job, lay) / logits_count, abs=0.1)
    assert plan_head.loss_transient_bytes(job, lay) / logits_count == 12 + 2
    assert plan_head.loss_transient_bytes(job, Layout(dp=8)) / (2 * logits_count) == 8 + 2   # tp 1: F's


def test_torchtitan_pipeline_keeps_every_output():
    """torch.distributed.pipelining of 2024 (torchtitan's) keeps every stage's output of every micro-batch until the
    step ends: m logits on the last stage's rank, m b*s*h/t outputs per other stage; 'last' keeps the logits alone,
    'none' nothing. Its stages keep a receive buffer per micro-batch for activations (but on the first stage) and for
    gradients (but on the last), those in flight being their first block's saved input; other runtimes two messages.
    memory's 'other' holds them; --software torchtitan sets them and its loss_parallel."""
    job = job_for(global_seqs=32, pp_outputs_kept="all")
    lay = Layout(dp=2, tp=2, pp=2, sp=True, schedule="interleaved", v=2, micro_batch_size=2)
    m, s, h = lay.grad_acc(job), CFG.block_size, CFG.n_embd
    logits, hidden = 2 * s * CFG.padded_vocab_size / 2 * 2, 2 * s * h / 2 * 2      # b = 2, / tp = 2, 2 bytes
    assert plan_runtime_memory.pipeline_outputs_bytes(job, lay, 2, True) == m * (logits + hidden)
    assert plan_runtime_memory.pipeline_outputs_bytes(job, lay, 2, False) == 2 * m * hidden
    assert plan_runtime_memory.pipeline_outputs_bytes(replace(job, pp_outputs_kept="last"), lay, 2, True) == m * logits
    assert plan_runtime_memory.pipeline_outputs_bytes(job, replace(lay, pp=1, dp=4), 2, True) == 0
    for rank, kept in ((0, 2 * m * hidden), (1, m * (logits + hidden))):
        none = plan_memory.other_bytes(replace(job, pp_outputs_kept="none"), lay, rank, [1])
        assert plan_memory.other_bytes(job, lay, rank, [1]) - none == pytest.approx(kept)
    buffers = replace(job, pp_recv_per_micro_batch=True)
    assert plan_runtime_memory.pipeline_buffers_bytes(buffers, lay, 2, True, False, 2.5) == (3 * m - 2.5) * hidden
    assert plan_runtime_memory.pipeline_buffers_bytes(job, lay, 2, True, False, 2.5) == 2 * hidden
    held = plan_memory.in_flight("interleaved", 2, m, 2, 0) / 2          # rank 0's chunk 1 (stage 2), not stage 0
    assert plan_memory.other_bytes(buffers, lay, 0, [1]) - plan_memory.other_bytes(job, lay, 0, [1]) == pytest.approx(
        (3 * m - held - 2) * hidden)
    titan = build_job(parse_args(["--model", "gpt2", "--software", "torchtitan"], ""))
    assert titan.pp_outputs_kept == "all" and titan.loss_parallel and titan.pp_recv_per_micro_batch


def test_close_call_verdict():
    """A prediction within device_memory.CLOSE_CALL (5%) of the usable memory either side is a close call, printed
    with its side and counted apart; beyond it fits or OOM as the oom flag says."""
    from planner.device_memory import CLOSE_CALL, verdict
    usable = 70 * GIB
    assert CLOSE_CALL == 0.05
    assert verdict(0.96 * usable, usable) == verdict(1.04 * usable, usable) == "close"
    assert (verdict(0.94 * usable, usable), verdict(1.06 * usable, usable)) == ("fits", "OOM")
    said = []
    for b, rc in ((1, "full"), (4, "none"), (8, "none")):
        r = plan.evaluate(job_for(gpu="a100-40gb"), Layout(dp=8, micro_batch_size=b, recompute=rc))
        said.append(r["verdict"])
        m = r["mem_bytes"]
        near = abs(m["total"] / m["usable"] - 1) <= CLOSE_CALL
        assert r["verdict"] == ("close" if near else "OOM" if r["oom"] else "fits")
        assert plan.format_row(1, dict(r, verdict="close")).endswith(f"close ({'OOM' if r['oom'] else 'fits'})")
    assert said == ["fits", "close", "OOM"]         # 27%, 97% and 144% of a 40 GB A100's usable memory


def test_peak_rank_names_the_fuller_end():
    """The pipeline rank holding the peak: the last (the LM head and loss) with a large vocabulary and few micro-batches
    in flight, the first (its in-flight micro-batches) with a small one; the printed summary says which."""
    big = job_for(GPTConfig(vocab_size=256000, block_size=4096, n_layer=8, n_head=16, n_embd=1024), global_seqs=16)
    small = job_for(GPTConfig(vocab_size=1024, block_size=4096, n_layer=8, n_head=16, n_embd=1024), global_seqs=16)
    lay = Layout(dp=2, pp=4, micro_batch_size=1)
    assert plan.evaluate(big, lay)["peak_rank"] == 3 and plan.evaluate(small, lay)["peak_rank"] == 0
    from planner.report import peak_place
    assert peak_place(plan.evaluate(big, lay)).endswith("the LM head and loss")
    assert peak_place(plan.evaluate(small, lay)).endswith("micro-batches in flight")


def every_rank_peak(job, lay):
    """The fullest pipeline rank by brute force: memory.rank_memory of every rank (ties: the lowest)."""
    usable = plan.memory(job, lay)["usable"]
    parts = [plan_memory.rank_memory(job, lay, r, usable) for r in range(lay.pp)]
    return max(parts, key=lambda p: (p["reserved"], p["total"], -p["peak_rank"]))


@pytest.mark.parametrize("recv", [False, True])
def test_memory_is_the_fullest_of_every_rank(recv):
    """memory evaluates only the ends and the turn where the stages are even (peak_candidates): for every schedule
    its peak equals the brute-force max over all ranks. With a receive buffer per micro-batch (torch's pipelining)
    a middle rank holds m more than the first; with uneven stages (first_stage_layers) a middle stage of 3 layers
    holds more than the first's 1: every rank is evaluated, and the peak is on a middle rank."""
    cfg = GPTConfig(vocab_size=1024, block_size=512, n_layer=16, n_head=4, n_embd=256)
    for kw, expect_middle in ((dict(), recv), (dict(first_stage_layers=1, last_stage_layers=1), True)):
        job = job_for(cfg, global_seqs=64, pp_recv_per_micro_batch=recv, **kw)
        for schedule, v, mbs in (("1f1b", 1, 1), ("afab", 1, 8), ("interleaved", 2, 2), ("zb1", 1, 1), ("zbv", 2, 2),
                                 ("dualpipev", 2, 1)):
            lay = Layout(dp=2, pp=4, schedule=schedule, v=v, micro_batch_size=mbs, zero_stage=1)
            if kw and v > 1:
                continue                 # first/last_stage_layers cut stages, not chunks
            mem, brute = plan.memory(job, lay), every_rank_peak(job, lay)
            assert (mem["peak_rank"], mem["reserved"]) == (brute["peak_rank"], brute["reserved"]), (schedule, kw)
            if kw or recv:
                assert plan_memory.peak_candidates(job, lay) == tuple(range(4))
            else:
                assert len(plan_memory.peak_candidates(job, lay)) < 4
        assert (0 < mem["peak_rank"] < 3) == expect_middle
