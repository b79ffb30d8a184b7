"""plan.py's step time as the stacks run it: data-parallel overlap per --dp_overlap_style, tensor-parallel overlap
derived from the GEMM and collective times, GEMM efficiency by shape fitted to matmul measurements, 1f1b with fewer
micro-batches than stages as afab, and the interleaved search without v."""
import importlib.util
from dataclasses import replace

import pytest

import plan
from planner import comm as plan_comm
from planner import memory as plan_memory
from planner import timing as plan_time
from planner.cli import build_job, parse_args, parse_layout
from planner.inputs import Job, Layout, validate
from model import GPTConfig

CFG = GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)


def job_for(cfg=CFG, **kw):
    return Job(cfg, kw.pop("gpus", 8), kw.pop("gpus_per_node", 8), kw.pop("gpu", "h100"), kw.pop("global_seqs", 64),
               **kw)


def preset(name, gpus, *flags):
    return build_job(parse_args(["--model", name, "--gpus", str(gpus), "--seq", "8192", "--global_batch_tokens", "2M",
                                 *flags], ""))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_exposed_time_per_style(zero):
    """No overlap: all of it. ddp: what the last micro-batch's backward (every backward at ZeRO-2) cannot hide, never
    less than each round's last bucket, and ZeRO-1/2's gather in full; mcore hides the gather behind the next forward
    and the reductions under the drain too, so it is never slower. ZeRO-3: never less than each micro-batch's first
    gather and last reduce-scatter."""
    lay = Layout(dp=8, zero_stage=zero, micro_batch_size=2)         # m = 4
    reduce, gather, calls, m = 0.4, 0.2 if zero else 0.0, 10, 4
    jobs = {s: job_for(dp_overlap_style=s) for s in ("ddp", "mcore")}
    off = plan_comm.exposed_dp_time(job_for(dp_overlap=False), lay, reduce, gather, calls, 1.0, 0.0)
    assert off == reduce + gather
    rounds = {0: 1, 1: 1, 2: m, 3: m}[zero]
    for compute in (0.0, 0.3, 100.0):
        ddp = plan_comm.exposed_dp_time(jobs["ddp"], lay, reduce, gather, calls, compute, 0.0)
        mcore = plan_comm.exposed_dp_time(jobs["mcore"], lay, reduce, gather, calls, compute, 0.0)
        assert mcore <= ddp <= off
        if zero == 3:
            floor = m * (gather / (2 * m * calls) + reduce / (m * calls))
            assert ddp == pytest.approx(max(reduce + gather - compute, floor))
            continue
        window = 2 / 3 * compute / (1 if zero == 2 else m)
        assert ddp == pytest.approx(max(reduce - window, reduce / calls) + gather)
        if compute == 100.0:             # all hidden but the last bucket of each round (mcore: of the last round)
            assert ddp == pytest.approx(reduce / calls + gather)
            assert mcore == pytest.approx(reduce / (rounds * calls) + (gather / calls if gather else 0.0))


def test_software_sets_the_dp_style():
    assert preset("llama3-8b", 64, "--software", "megatron-core").dp_overlap_style == "mcore"
    assert preset("llama3-8b", 64, "--software", "torchtitan").dp_overlap_style == "ddp"
    job = preset("llama3-8b", 64, "--software", "megatron-core")
    lay = parse_layout("tp=8,zero_stage=1,sp=true,micro_batch_size=1", job)
    fast = plan.evaluate(job, lay)["time_s"]["dp"]
    slow = plan.evaluate(replace(job, dp_overlap_style="ddp"), lay)["time_s"]["dp"]
    assert fast < slow                                # the gather no longer exposed in full


def test_tp_overlap_is_derived_not_a_constant():
    """With --tp_overlap the exposed tp time is each GEMM group's first chunk plus what its GEMM cannot hide, plus the
    GEMMs' slowdown at rows/t; without it, all of it. Against plain TP it predicts about 1.1x on Llama 3 layouts
    (published async-TP gains are about 1.1x; hiding all of it gave 1.2-1.3x)."""
    job = preset("llama3-70b", 64)
    lay = parse_layout("tp=8,sp=true,zero_stage=1,micro_batch_size=1,recompute=full", job)
    overlapped = replace(job, tp_overlap=1.0)
    assert plan_comm.exposed_tp_time(job, lay, 1.0, 5.0, 8192) == 1.0
    slow = plan_time.gemm_rows_factor(overlapped, 8, 1024) / plan_time.gemm_rows_factor(overlapped, 8, 8192) - 1
    assert plan_comm.exposed_tp_time(overlapped, lay, 1.0, 1e6, 8192) == pytest.approx(1 / 8 + 1e6 * slow)
    flops = [i * o for i, o in plan.plan_shape.block_linears(overlapped, 8)]
    expect = sum(0.25 / 8 + max(0.0, 0.25 * 7 / 8 - 0.5 * f / sum(flops)) for f in flops) + 0.5 * slow
    assert plan_comm.exposed_tp_time(overlapped, lay, 1.0, 0.5, 8192) == pytest.approx(expect)
    for model, gpus, layout in (("llama3-70b", 64, "tp=8,sp=true,zero_stage=1,micro_batch_size=1,recompute=full"),
                                ("llama3-8b", 8, "tp=8,sp=true,zero_stage=1,micro_batch_size=1")):
        job = preset(model, gpus)
        lay = parse_layout(layout, job)
        plain = plan.evaluate(job, lay)["tokens_per_s"]
        gain = plan.evaluate(replace(job, tp_overlap=1.0), lay)["tokens_per_s"] / plain
        assert 1.03 < gain < 1.2, (model, gain)


def test_torch_async_tp_pipelines_what_its_pass_fuses():
    """Collectives per block under SP: Megatron's count (the backward gathers each saved shard again) 10, 14 with full
    recompute; DTensor's (autograd keeps the gathered input) 8 and 12, 10 under op recompute, whose policy does not keep
    the gather. torch's micro-pipeline pass leaves the backward's reduce-scatters (a sum of matmuls) and those gathers
    again in the open; Transformer Engine's chunking pipelines all of them. Against plain TP, torchtitan's async TP
    gains less than the chunked kind on its 70B and 8B layouts: about 1.1x, as published (1.09x and 1.10x)."""
    mega, titan = job_for(), job_for(tp_saves_gathered=True)
    assert [plan_comm.sp_collectives(mega, r) for r in ("none", "op", "full")] == [(10, 4), (10, 4), (14, 4)]
    assert [plan_comm.sp_collectives(titan, r) for r in ("none", "op", "full")] == [(8, 2), (10, 4), (12, 2)]
    lay = Layout(dp=1, tp=8, sp=True)
    chunked, torch_style = replace(titan, tp_overlap=1.0), replace(titan, tp_overlap=1.0, tp_overlap_style="torch")
    slow = plan_time.gemm_rows_factor(chunked, 8, 1024) / plan_time.gemm_rows_factor(chunked, 8, 8192) - 1
    # chunked: every collective hidden but its first chunk; torch: 2 of 8 in the open, 6 of 8 so, and their GEMMs' share
    assert plan_comm.exposed_tp_time(chunked, lay, 1.0, 1e9, 8192) == pytest.approx(1 / 8 + 1e9 * slow)
    torch_exposed = plan_comm.exposed_tp_time(torch_style, lay, 1.0, 1e9, 8192)
    assert torch_exposed == pytest.approx(0.25 + 0.75 * (1 / 8 + 1e9 * slow))
    assert plan_comm.exposed_tp_time(torch_style, Layout(dp=1, tp=8), 1.0, 1e9, 8192) == 1.0   # all-reduces: none
    plain_bytes = plan_comm.comm_bytes(titan, lay, 0)["tp"]
    assert plain_bytes == pytest.approx(plan_comm.comm_bytes(mega, lay, 0)["tp"] * 8 / 10)
    for model, gpus, layout, seqs in (("llama3-70b", 256, "dp=32,tp=8,sp=true,zero_stage=3,micro_batch_size=16,"
                                       "recompute=full", 512),
                                      ("llama3-8b", 64, "dp=8,tp=8,sp=true,zero_stage=3,micro_batch_size=12,"
                                       "recompute=op", 96)):
        job = preset(model, gpus, "--software", "torchtitan", "--gpu", "h100-hbm2e",
                     "--global_batch_tokens", str(seqs * 8192))
        lay = parse_layout(layout, job)
        plain = plan.evaluate(job, lay)["tokens_per_s"]
        gain = plan.evaluate(replace(job, tp_overlap=1.0), lay)["tokens_per_s"] / plain
        te_gain = plan.evaluate(replace(job, tp_overlap=1.0, tp_overlap_style="chunked"), lay)["tokens_per_s"] / plain
        assert 1.05 < gain < 1.15 < te_gain, (model, gain, te_gain)


def test_all_reduce_across_nodes_is_timed_as_nccl_times_it():
    """Within a node an all-reduce is the ring: latency + 2(n-1)/n x bytes over the bus. Across nodes NCCL's tuning
    model runs the faster of the ring, its latency x 1.9 once a message reaches n/16 x 64 KiB, and the tree at half of
    min(0.9 x bus, 80 GB/s) x the medium-size correction: never faster than latency + bytes / ring bandwidth. ZeRO-0's
    data-parallel reduction is timed bucket by bucket so: at dp 64 over 32 nodes a 50 MiB bucket on the tree."""
    bw, mib = 80e9, 2 ** 20
    ring = plan_time.ring_latency("all_reduce", 8, 1) + 50 * mib * 2 * 7 / 8 / bw
    assert plan_time.all_reduce_seconds(50 * mib, 8, 1, bw) == pytest.approx(ring)
    tree = plan_time.tree_latency(64, 32) + 50 * mib / (0.5 * 0.9 * bw * 0.7)          # 50 MiB / 64 = 2^19.6: 0.7
    plateau = 1.9 * plan_time.ring_latency("all_reduce", 64, 32) + 50 * mib * 2 * 63 / 64 / bw
    assert plan_time.all_reduce_seconds(50 * mib, 64, 32, bw) == pytest.approx(tree)
    assert tree < plateau
    for message in (2 ** 10, 2 ** 16, 2 ** 22, 2 ** 26, 2 ** 30):
        old = plan_time.latency("all_reduce", 64, 32) + message * 2 * 63 / 64 / bw
        assert plan_time.all_reduce_seconds(message, 64, 32, bw) >= old
    ring_2 = plan_time.ring_latency("all_reduce", 16, 2)             # 2 nodes: the ring's latency is the lower
    assert ring_2 < plan_time.tree_latency(16, 2)
    assert plan_time.all_reduce_seconds(65535, 16, 2, 1e15) == pytest.approx(ring_2, rel=1e-5)   # < 16/16 x 64 KiB
    assert plan_time.all_reduce_seconds(65536, 16, 2, 1e15) == pytest.approx(1.9 * ring_2)
    job = job_for(gpus=512, global_seqs=512, grad_dtype="fp32")
    lay = Layout(dp=64, tp=8, zero_stage=0)
    nbytes = plan_comm.comm_bytes(job, lay, 0)
    groups = plan_memory.memory(job, lay)["groups"]
    n, nodes, _ = plan_comm.axis_group(job, lay, "dp")
    message = nbytes["dp_reduce"] * 64 / (2 * 63) / groups
    reduce, gather = plan_comm.dp_seconds(job, lay, nbytes, 0.0, groups)
    assert (n, nodes, gather) == (64, 64, 0.0)
    assert reduce == pytest.approx(groups * plan_time.all_reduce_seconds(message, 64, 64, plan_comm.link_bandwidth(
        job, lay, "dp")))


def test_dtensor_keeps_the_gathered_inputs():
    """Under SP without recompute, a stack whose autograd keeps the gathered input (tp_saves_gathered) keeps c_attn's
    and c_fc's inputs whole: 2sbh(1 - 1/t) values per layer more; full recompute keeps only the block input."""
    job, lay = job_for(precision="bf16"), Layout(dp=1, tp=4, sp=True, micro_batch_size=2)
    more = plan_memory.layer_activation_bytes(replace(job, tp_saves_gathered=True), lay)
    assert more - plan_memory.layer_activation_bytes(job, lay) == 2 * 2 * 2048 * 2048 * 2 * 3 / 4
    full = replace(lay, recompute="full")
    assert plan_memory.layer_activation_bytes(replace(job, tp_saves_gathered=True), full) == \
        plan_memory.layer_activation_bytes(job, full)


def test_gemm_efficiency_by_shape_is_the_matmul_fit():
    """timing.GEMM_SHAPE is bench/gemm_rows.py's fit of OpenXLA's H100 matmul table (no training run); the factor
    falls with the rows, so a larger micro-batch runs its GEMMs faster (without a pipeline whose bubble would say
    the opposite)."""
    spec = importlib.util.spec_from_file_location("gemm_rows", "bench/gemm_rows.py")
    gemm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gemm)
    (e0, a, _), (k0, b, _) = gemm.fitted()
    shape = plan_time.GEMM_SHAPE
    assert (e0, a, k0, b) == pytest.approx((shape["e0"], shape["a"], shape["k0"], shape["b"]), rel=0.01)
    job = job_for()
    factors = [plan_time.gemm_rows_factor(job, 1, rows) for rows in (512, 1024, 2048, 8192, 32768)]
    assert factors == sorted(factors, reverse=True) and factors[-1] < 1.05 < 1.1 < factors[0]
    small, large = (plan.evaluate(job, Layout(dp=8, micro_batch_size=b))["time_s"]["compute"] for b in (1, 8))
    assert small > large
    assert plan_time.gemm_rows_factor(replace(job, eff=0.4), 1, 512) == 1.0


def test_1f1b_with_fewer_micro_batches_than_stages_runs_as_afab():
    """1f1b with m < p is accepted and evaluated, printed and launched as afab (the same bubble and m in flight)."""
    job = job_for(global_seqs=2)
    lay = Layout(dp=1, pp=8, micro_batch_size=1)                    # m = 2 < p = 8
    validate(job, lay)
    row = plan.evaluate(job, lay)
    afab = plan.evaluate(job, replace(lay, schedule="afab"))
    assert row["schedule"] == "afab" and row["step_time_s"] == afab["step_time_s"]
    assert row["mem_bytes"] == afab["mem_bytes"]
    assert "--pp_schedule afab" in plan.launch_command(job, row)
    ranked = plan.rank_layouts(job)
    assert len({tuple(sorted((k, str(v)) for k, v in r.items() if k in Layout.__dataclass_fields__))
                for r in ranked}) == len(ranked)                 # searched once, as afab


def test_interleaved_search_without_v_is_each_v_once():
    """An interleaved --layout without v yields each v's layouts once: the union of the searches with v given, no
    more (the search used to visit every candidate of the whole space once per v)."""
    job = preset("llama3-8b", 64)
    fixed = {"pp": 4, "schedule": "interleaved"}
    every = list(plan.consistent_layouts(job, fixed))
    per_v = [set(plan.consistent_layouts(job, {**fixed, "v": v})) for v in range(2, 34 // 4 + 1)]
    assert set(every) == set().union(*per_v) and len(every) == len(set(every)) == sum(map(len, per_v))
    assert plan_memory.memory(job, every[0])                          # each is a layout plan.py evaluates


def test_tied_embedding_sync_is_exposed_once_per_step():
    """With pp > 1 the tied embedding's gradient (V/t x h of each rank, in the reduced dtype) is summed over the first
    and last stage after the backward, a 2-rank all-reduce over pp's link, exposed: across nodes one NIC, within a
    node NVLink; nothing untied, without pp, or where one rank holds both ends (zbv)."""
    job = job_for(gpus=16, global_seqs=16)
    lay = Layout(dp=4, tp=2, pp=2, micro_batch_size=1)
    shard = CFG.padded_vocab_size * CFG.n_embd / 2
    across = plan.evaluate(job, lay)["time_s"]
    ring = 1.9 * plan_time.ring_latency("all_reduce", 2, 2)          # a large message: the ring's plateau latency
    expect = shard * 2 / (job.hw["net"] * 0.8) + ring
    assert across["tied"] == pytest.approx(expect, rel=1e-12)
    fp32 = plan.evaluate(replace(job, grad_dtype="fp32"), lay)["time_s"]["tied"]
    assert fp32 - ring == pytest.approx(2 * (expect - ring), rel=1e-12)
    within = plan.evaluate(job_for(global_seqs=16), Layout(dp=2, tp=2, pp=2, micro_batch_size=1))["time_s"]["tied"]
    assert within == pytest.approx(shard * 2 / (job.hw["nvlink"] * 0.8) + plan_time.latency("all_reduce", 2, 1))
    assert across["total"] == pytest.approx(sum(v for k, v in across.items() if k != "total"), rel=1e-12)
    for other, layout in ((replace(job, tied=False), lay), (job, replace(lay, pp=1, dp=8)),
                          (job, replace(lay, schedule="zbv", v=2))):
        assert plan.evaluate(other, layout)["time_s"]["tied"] == 0.0
