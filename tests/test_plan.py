"""plan.py: its counts equal what the rungs count (ZeRO state bytes and comm bytes of a live train_zero run, parameter
lists of model.py, saved activation bytes), the published tables (ZeRO paper, Korthikanti et al. 2022), pipeline
in-flight counts, the JSON contract and one-line errors for bad input."""
import json
from dataclasses import replace
from itertools import product

import pytest
import torch

import plan
from planner import memory as plan_memory
from common.config import ConfigError
from planner.inputs import LINK_EFF, Job
from distributed_helper import run_workers
from model import GPT, GPTConfig, num_params
from train_ddp import assign_buckets
from train_helpers import tiny_argv

ZERO_WORLD, ZERO_MODEL = 3, dict(n_layer=2, n_head=4, n_embd=40, bucket_mb=0.004)   # 13h = 520: 3 does not divide


def job_for(cfg, **kw):
    return Job(cfg, kw.pop("gpus", 1), kw.pop("gpus_per_node", 8), kw.pop("gpu", "h100"),
                    kw.pop("global_seqs", 8), **kw)


# ----------------------------------------------------------------------------------------------------------
# model states

@pytest.mark.parametrize("arch", ["gpt", "mixtral"])
def test_moe_block_saves_are_plans(arch):
    """An MoE block keeps what plan.py's moe_extra_bytes counts beyond a dense block, for 4h GeLU experts and for
    Mixtral's SwiGLU experts of width f (4f a routed row, gates renormalized) alike: measured as model.py's saves
    (fp32) with and without the experts. The count is train_ep's experts', which keep two int64 regrouping indices per
    routed row that model.py's one-device Experts do not; it leaves out the router's E fp32 balancing weights. (SwiGLU
    experts were counted as GeLU's 9h a row, 9,456 bytes a block too many here.)"""
    from common.config import Config
    from common.metrics import SavedActivationBytes
    from common.model_setup import gpt_config
    shape = dict(arch=arch, n_layer=2, n_head=2, n_embd=16, block_size=32, global_batch_size=2,
                 **(dict(ffn_hidden=24) if arch == "mixtral" else {}))
    moe, dense = Config(**shape, n_experts=4, top_k=2), Config(**shape)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    saved = []
    for cfg in (moe, dense):
        model = GPT(gpt_config(cfg, 64))
        with SavedActivationBytes(model) as tracker:
            model(idx, idx)
        saved.append(tracker.bytes)
    job, lay = plan.plan_job(moe, 64, 1, 1, "h100", "fp32"), plan.Layout(dp=1, micro_batch_size=2)
    assert job.cfg.router_renorm == (arch == "mixtral")
    _, rows, _ = plan_memory.moe_routed_rows(job, lay)
    per_block = (saved[0] - saved[1]) / moe.n_layer
    assert plan_memory.moe_extra_bytes(job, lay) - per_block == 16 * rows - 4 * moe.n_experts
    argv = ["--arch", arch, "--n_layer", "2", "--n_embd", "16", "--n_head", "2", "--vocab", "64", "--n_experts", "4",
            "--gpus", "1", "--seq", "32", "--global_batch_tokens", "64", "--precision", "fp32"]
    cli = plan.build_job(plan.parse_args(argv + (["--ffn_hidden", "24"] if arch == "mixtral" else []), ""))
    assert plan_memory.moe_extra_bytes(cli, lay) == plan_memory.moe_extra_bytes(job, lay)     # plan.py's command line


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_table(stage):
    """ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters, 64 GPUs, K = 12: 120 / 31.4 / 16.6 / 1.9 GB."""
    st = plan_memory.zero_state_bytes([7_500_000_000], 64, stage, "bf16")
    total = st["params"] + st["grads"] + st["optimizer"]
    assert round(total / 1e9, 1) == [120.0, 31.4, 16.6, 1.9][stage]


@pytest.mark.parametrize("moe", [False, True])
def test_parameter_groups_match_the_model(moe):
    """Unsharded, plan's per-block parameter lists are model.py's, and its buckets are assign_buckets' over them."""
    cfg = GPTConfig(vocab_size=100, n_layer=3, n_head=4, n_embd=32, n_experts=4 if moe else 0, moe_every=2)
    model = GPT(cfg)
    shape = Job(cfg, 1, 1, "h100", 1).shape
    numels = [p.numel() for p in model.parameters()]
    assert sum(plan_memory.flat_groups(shape, 1, 1, 1, 1, 0, 3, 25.0)) == sum(numels) == num_params(cfg)
    units = [sum(p.numel() for p in b.parameters()) for b in reversed(model.transformer.h)]
    assert list(plan_memory.flat_groups(shape, 1, 1, 1, 1, 0, 3, 25.0))[:-1] == units
    buckets = assign_buckets(list(reversed(list(model.parameters()))), 0.01 * 2 ** 20)
    assert list(plan_memory.flat_groups(shape, 1, 1, 1, 1, 0, 1, 0.01)) == [sum(p.numel() for p in b) for b in buckets]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shard_sizes(tp):
    """A tp rank holds 1/tp of every split parameter and all of the replicated ones (LayerNorms, the row-parallel
    biases), as train_tp.py shards them; pp stages split the blocks and both ends hold the tied embedding."""
    cfg = GPTConfig(vocab_size=100, n_layer=4, n_head=4, n_embd=32)
    replicated = ("ln_1", "ln_2", "ln_f", "attn.c_proj.bias", "mlp.c_proj.bias")
    expect = sum(p.numel() // (1 if any(r in n for r in replicated) else tp) for n, p in GPT(cfg).named_parameters())
    shape = Job(cfg, 1, 1, "h100", 1).shape
    assert sum(plan_memory.flat_groups(shape, tp, 1, 1, 1, 0, 0, 25.0)) == expect
    first, last = (sum(plan_memory.flat_groups(shape, tp, 1, 2, 1, r, 0, 25.0)) for r in (0, 1))
    assert first + last == expect + cfg.padded_vocab_size * 32 // tp     # the tied embedding twice
    assert last - first == 2 * 32                                         # ln_f


def _zero_worker(rank, world, data_dir, out_root):
    import train_zero
    from common.metrics import read_metrics
    out = {}
    for stage in (1, 2, 3):
        out_dir = f"{out_root}/z{stage}"
        argv = tiny_argv(data_dir, out_dir, max_steps=1, global_batch_size=12, micro_batch_size=2, zero_stage=stage,
                         **{k: v for k, v in ZERO_MODEL.items()})
        train_zero.main(argv)
        if rank == 0:
            out[stage] = read_metrics(out_dir)[0]
    return out


@pytest.fixture(scope="module")
def zero_rows(tiny_data, tmp_path_factory):
    return run_workers(_zero_worker, ZERO_WORLD, args=(tiny_data, str(tmp_path_factory.mktemp("plan_zero"))))[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_and_comm_bytes_equal_train_zero(zero_rows, stage):
    """A live 3-rank train_zero run (fp32, tiny buckets, padding needed): the state bytes per rank it counts equal
    plan's exactly, and so do the bytes it sends (plan's dp bytes + the all-reduce of one fp32 norm scalar)."""
    row = zero_rows[stage]
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=40)
    job = job_for(cfg, gpus=ZERO_WORLD, global_seqs=12, precision="fp32", bucket_mb=ZERO_MODEL["bucket_mb"])
    lay = plan.Layout(dp=ZERO_WORLD, zero_stage=stage, micro_batch_size=2)
    mem = plan_memory.memory(job, lay)
    assert mem["padded_params"] == row["padded_params"] > num_params(cfg)
    assert (mem["params"], mem["grads"], mem["optimizer"]) == \
        (row["state_bytes_params"], row["state_bytes_grads"], row["state_bytes_optim"])
    part = (ZERO_WORLD - 1) / ZERO_WORLD
    predicted = plan.comm_bytes(job, lay, mem["padded_params"])["dp"] + 2 * part * 4
    assert predicted == pytest.approx(row["comm_bytes"], rel=1e-12)


def _bf16_5d_worker(rank, world, argv):
    import train_5d
    from common.metrics import read_metrics
    result = train_5d.main(argv)
    padded = sum(s.padded for s in result["dp_axis"].shards)
    return dict(padded=padded, row=read_metrics(argv[argv.index("--out_dir") + 1])[0]) if rank == 0 else None


def test_bf16_comm_bytes_equal_train_5d(tiny_data, tmp_path):
    """Under bf16 autocast (plan's amp: fp32 states) a live 2-rank train_5d step with ring attention and ZeRO-3 over
    the cp group sends what plan.py predicts on each axis: K/V and dK/dV in bf16 (2 bytes per value), the ZeRO-3
    gathers in bf16 and the gradients reduce-scattered in fp32 (before, plan counted the gathers and dK/dV at 4)."""
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=1, dtype="bfloat16", cp=2, cp_layout="ring", zero_stage=3,
                     micro_batch_size=2)
    got = run_workers(_bf16_5d_worker, 2, args=(argv,))[0]
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    job = job_for(cfg, gpus=2, global_seqs=8, precision="amp")
    lay = plan.Layout(dp=1, cp=2, zero_stage=3, micro_batch_size=2)
    padded = plan_memory.memory(job, lay)["padded_params"]
    assert padded == got["padded"]
    predicted, counted = plan.comm_bytes(job, lay, padded), got["row"]["comm_bytes_by_axis"]
    for axis in ("cp", "dp"):
        assert predicted[axis] == pytest.approx(counted[axis], rel=1e-12), (axis, predicted, counted)


# ----------------------------------------------------------------------------------------------------------
# activations

@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("shape", [(2, 64, 4, 32, 2, 64), (3, 96, 4, 128, 1, 512)])
def test_activation_bytes_equal_saved_tensors(recompute, shape):
    """What autograd keeps for backward in one forward of model.py's GPT (metrics.SavedActivationBytes, fp32, CPU's
    fused attention) equals plan's prediction within 2% (it is within a few bytes)."""
    from common.metrics import SavedActivationBytes
    L, h, a, s, b, v = shape
    cfg = GPTConfig(vocab_size=v, block_size=s, n_layer=L, n_head=a, n_embd=h, recompute=recompute)
    model = GPT(cfg)
    idx = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(0))
    with SavedActivationBytes(model) as saved:
        model(idx, idx)
    job = job_for(cfg, global_seqs=b, precision="fp32")
    predicted = plan_memory.activation_bytes(job, plan.Layout(dp=1, micro_batch_size=b, recompute=recompute), 0)
    assert abs(predicted / saved.bytes - 1) < 0.02


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_rmsnorm_and_swiglu_saves_are_plans(kernels):
    """The Llama family's RMSNorm keeps its input and one fp32 rstd per token, LayerNorm a mean beside it. A GPU runs
    torch's fused rms_norm, whose saves kernels/rms_norm.py's FusedRMSNorm repeats (interpreted here: torch's CPU
    rms_norm is element-wise ops, which also keep the normalized input). model.py's llama GPT with it keeps for
    backward what plan.py counts for the run's --kernels but the loss's one saved scalar: its eager SwiGLU keeps
    c_fc's [gate | up], silu(gate) and the product (4f per token), kernels/' fused one (--kernels triton) recomputes
    silu(gate) (3f). The LayerNorm count (4 bytes per token more in each of the 2L + 1 norms) and the other MLP's
    count (f values per token and layer) are told apart."""
    from common.config import Config
    from common.metrics import SavedActivationBytes
    from common.model_setup import gpt_config
    from kernels.apply import FusedGatedMLP, FusedRMSNorm
    from model import MLP
    cfg = Config(arch="llama", n_layer=2, n_head=2, n_embd=16, ffn_hidden=24, tied=False, block_size=32,
                 global_batch_size=2, kernels=kernels)
    model = GPT(gpt_config(cfg, 64))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.RMSNorm):
                setattr(module, name, FusedRMSNorm(child, "triton"))
            elif isinstance(child, MLP) and kernels == "triton":
                setattr(module, name, FusedGatedMLP(child, "triton"))
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with SavedActivationBytes(model) as saved:
        model(idx, idx)
    job = plan.plan_job(cfg, 64, 1, 1, "h100", "fp32")
    assert job.fused_swiglu == (kernels == "triton")
    predicted = plan_memory.activation_bytes(job, plan.Layout(dp=1, micro_batch_size=2), 0)
    assert saved.bytes - predicted == 4
    layernorm_count = predicted + 4 * 2 * 32 * (2 * cfg.n_layer + 1)
    assert saved.bytes - layernorm_count < -1000
    other_mlp = plan_memory.activation_bytes(replace(job, fused_swiglu=not job.fused_swiglu), plan.Layout(dp=1,
                                             micro_batch_size=2), 0)
    assert abs(other_mlp - predicted) == 4 * 2 * 32 * 24 * cfg.n_layer


def test_moe_rows_even_share_or_capacity_bound():
    """An MoE block's routed rows on an expert rank: dropless the even share N*k (an assumption); with a capacity
    factor E * ceil(cf*N*k/E) computed, at most N*k sent (a bound); N = b*s/cp tokens, /tp under SP."""
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=32, n_experts=6, top_k=2)
    lay = plan.Layout(dp=4, ep=2, micro_batch_size=2)
    assert plan_memory.moe_routed_rows(job_for(cfg), lay) == (128, 256, 256)
    capped = job_for(replace(cfg, capacity_factor=1.25), gpus=4)
    assert plan_memory.moe_routed_rows(capped, lay) == (128, 6 * 54, 256)            # ceil(1.25 * 128 * 2 / 6) = 54
    assert plan_memory.moe_routed_rows(capped, plan.Layout(dp=2, tp=2, sp=True, ep=2, micro_batch_size=2)) == \
        (64, 6 * 27, 128)
    assert "--capacity_factor 1.25" in plan.launch_command(capped, plan.evaluate(capped, lay))


def test_korthikanti_cases():
    """Korthikanti et al. 2022, Table 2, GPT-3 175B shape (a=96, h=12288, s=2048, b=1), t=8, 16-bit, dropout, no
    flash attention: per-layer bytes sbh * (34 + 5as/h), TP (10 + 24/t + 5as/(ht)), TP+SP (34 + 5as/h)/t,
    TP+selective (10 + 24/t), TP+SP+selective 34/t, full 2; SP+selective keeps 5.4x less than TP alone."""
    cfg = GPTConfig(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288, dropout=0.1)
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    job = job_for(cfg, gpus=8, attn="eager")
    sbh, r = s * b * h, 5 * a * s / h

    def per_layer(tp, sp=False, recompute="none"):
        return plan_memory.layer_activation_bytes(job, plan.Layout(dp=8 // tp, tp=tp, sp=sp, recompute=recompute),
                                           extras=False)
    assert per_layer(1) == sbh * (34 + r)
    assert per_layer(t) == pytest.approx(sbh * (10 + 24 / t + r / t))
    assert per_layer(t, sp=True) == pytest.approx(sbh * (34 + r) / t)
    assert per_layer(t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert per_layer(t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert per_layer(t, recompute="full") == sbh * 2
    assert per_layer(t) / per_layer(t, sp=True, recompute="selective") == pytest.approx(5.41, abs=0.01)


# ----------------------------------------------------------------------------------------------------------
# time and schedules

def simulated_schedules(schedule):
    """(p, m, v, pipeline/schedules.simulate's result) for p = 2..6 and every m the schedule takes (train_5d's
    validate: m >= p except afab and zbv, m % p == 0 interleaved, m >= 2p dualpipev)."""
    from pipeline.schedules import simulate
    from train_pp import make_schedule
    v = dict(interleaved=2, zbv=2, dualpipev=2).get(schedule, 1)
    for p in range(2, 7):
        for m in range(1, 4 * p + 2):
            if (m < p and schedule not in ("afab", "zbv") or schedule == "interleaved" and m % p
                    or schedule == "dualpipev" and m < 2 * p):
                continue
            yield p, m, v, simulate(make_schedule(schedule, p, m, v), p, v)


@pytest.mark.parametrize("schedule", ["afab", "1f1b", "zb1", "interleaved", "zbv", "dualpipev"])
def test_pipeline_in_flight_and_bubble_equal_the_simulator(schedule):
    """plan's closed forms against pipeline/schedules.simulate (F = B = W), every rank, p = 2..6, every valid m up to
    4p+1: the micro-batch-chunks each rank holds at its peak are equal, and the bubble plan adds is the simulated
    idle share: bubble / compute = idle / (makespan - idle) on every rank."""
    from planner.inputs import Layout
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=24, n_head=4, n_embd=64)
    for p, m, v, sim in simulated_schedules(schedule):
        assert [plan_memory.in_flight(schedule, p, m, v, r) for r in range(p)] == sim["peak_in_flight"], (p, m)
        job = job_for(cfg, gpus=p, global_seqs=m)
        lay = Layout(dp=1, pp=p, schedule=schedule, v=v)
        t = plan.step_time(job, lay, plan_memory.memory(job, lay))
        for idle in sim["idle"]:
            assert t["bubble"] / t["compute"] == pytest.approx(idle / (sim["makespan"] - idle), rel=1e-12), (p, m)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_placement_states_match_the_stages(schedule):
    """In a V rank r holds stages r and 2p-1-r (pipeline.gpt_stages.stage_views): plan's parameter count per rank equals the
    views' (rank 0 holds the embedding once, tied, with ln_f), and the ranks together hold the model once."""
    from pipeline.schedules import placement_of
    from pipeline.gpt_stages import stage_views
    cfg = GPTConfig(vocab_size=100, n_layer=8, n_head=4, n_embd=32)
    with torch.device("meta"):
        gpt = GPT(cfg)
    shape, p = Job(cfg, 1, 1, "h100", 1).shape, 2
    counts = [sum(plan_memory.flat_groups(shape, 1, 1, p, 2, r, 0, 25.0, placement_of(schedule))) for r in range(p)]
    assert counts == [sum(x.numel() for x in stage_views(gpt, r, p, 2, "v").parameters()) for r in range(p)]
    assert sum(counts) == num_params(cfg)
    assert plan_memory.end_ranks(plan.Layout(dp=1, pp=p, schedule=schedule, v=2)) == (0, 0)


def test_plan_and_train_5d_accept_the_same_layouts(monkeypatch):
    """On 8 ranks, over every dp x cp x pp, ep (dividing dp*cp, not only dp; none for a dense model), schedule with v,
    micro-batches per step and ZeRO stage (ZeRO-3 with and without resharding after forward, which plan.py does not
    tell apart): plan's validate and train_5d's accept exactly the same layouts (V schedules need v = 2, dualpipev
    m >= 2p, others but afab, zbv and 1f1b m >= p, interleaved m % p == 0; ZeRO-3 dp*cp > 1 and, interleaved, p > 1).
    1f1b with m < p is afab (planner/inputs.as_run), and train_5d is asked for the layout as it runs."""
    import train_5d
    from common.config import Config
    from planner.inputs import Layout, as_run, validate
    monkeypatch.setenv("WORLD_SIZE", "8")
    schedules = [("afab", 1), ("1f1b", 1), ("zb1", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("zbv", 1)]
    verdicts = []
    for cp, pp, experts in product([1, 2, 4], [1, 2, 4], [0, 8]):
        dp, model = 8 // (cp * pp), dict(n_layer=8, n_head=4, n_embd=32, block_size=16, n_experts=experts)
        for ep, (schedule, v), seqs, zero, reshard in product([1, 2, 4, 8], schedules, [dp, 2 * dp, 8 * dp],
                                                              [0, 1, 2, 3], [True, False]):
            job = job_for(GPTConfig(vocab_size=64, **model), gpus=8, global_seqs=seqs)
            lay = Layout(dp=dp, cp=cp, pp=pp, ep=ep, schedule=schedule, v=v, zero_stage=zero)
            run = as_run(job, lay)
            cfg = Config(**model, dp=dp, cp=cp, pp=pp, ep=ep, pp_schedule=run.schedule, pp_virtual=v,
                         global_batch_size=seqs, micro_batch_size=1, zero_stage=zero)
            cfg.layout, cfg.plan_gpu, cfg.reshard_after_forward = "", "", reshard   # train_5d's own flags
            verdicts.append((lay, accepts(validate, job, lay), accepts(train_5d.validate, cfg)))
    assert [lay for lay, ours, theirs in verdicts if ours != theirs] == []
    for zero in range(4):     # each stage: some layouts accepted, some refused
        mine = [ours for lay, ours, _ in verdicts if lay.zero_stage == zero]
        assert 0 < sum(mine) < len(mine), zero
    assert any(ours for lay, ours, _ in verdicts if lay.zero_stage == 3 and lay.pp > 1 and lay.ep > 1
               and lay.schedule in ("zb1", "zbv", "dualpipev"))


def test_plan_and_train_5d_accept_the_same_tp_layouts(monkeypatch):
    """On 8 ranks, over tp with and without SP, cp, sequence lengths, heads, vocabularies and ZeRO-3: plan's validate
    and train_5d's accept exactly the same layouts (heads by tp, the sequence by 2cp, under SP its cp chunk by tp)."""
    import train_5d
    from common.config import Config
    from planner.inputs import Layout, validate
    monkeypatch.setenv("WORLD_SIZE", "8")
    verdicts = []
    for vocab, tp, sp, cp, seq, heads, zero in product([64, 65], [1, 2, 4, 8], [False, True], [1, 2, 4], [8, 12, 16],
                                                       [4, 6, 8], [0, 3]):
        if 8 % (tp * cp) == 0:
            dp, model = 8 // (tp * cp), dict(n_layer=2, n_head=heads, n_embd=48, block_size=seq)
            job = job_for(GPTConfig(vocab_size=vocab, **model), gpus=8, global_seqs=2 * dp)
            lay = Layout(dp=dp, tp=tp, cp=cp, sp=sp, zero_stage=zero)
            cfg = Config(**model, dp=dp, tp=tp, cp=cp, pp=1, sp=sp, global_batch_size=2 * dp, micro_batch_size=1,
                         zero_stage=zero)
            cfg.layout, cfg.plan_gpu, cfg.reshard_after_forward = "", "", True
            verdicts.append((lay, seq, heads, accepts(validate, job, lay), accepts(train_5d.validate, cfg)))
    assert [v[:3] for v in verdicts if v[3] != v[4]] == []
    assert 0 < sum(v[3] for v in verdicts) < len(verdicts)


def accepts(validate, *args):
    try:
        validate(*args)
    except ConfigError:
        return False
    return True


def test_tp_and_cp_bytes_follow_the_rungs():
    """Per block and micro-batch: TP 8 (SP 10) x (t-1)/t x S, as tests/test_tp.py counts; ring CP (cp-1) K/V hops
    forward, (cp-1) K/V + cp dK/dV (in K/V's dtype) backward, as tests/test_cp.py counts."""
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, n_embd=32)
    job = job_for(cfg, gpus=4, global_seqs=2, precision="fp32")
    S = 2 * 64 * 32 * 4
    for sp, k in ((False, 8), (True, 10)):
        assert plan.comm_bytes(job, plan.Layout(dp=1, tp=4, sp=sp, micro_batch_size=2), 0)["tp"] == k * 3 / 4 * S
    kv = 2 * 2 * 16 * 32 * 4
    assert plan.comm_bytes(job, plan.Layout(dp=1, cp=4, micro_batch_size=2), 0)["cp"] == 3 * kv * 2 + 4 * kv


@pytest.mark.parametrize("dropout,recompute,per_element", [(0.1, "none", 20), (0.1, "full", 29), (0.1, "selective", 29),
                                                          (0.0, "none", 10), (0.0, "full", 14)])
def test_eager_attention_hbm_time(dropout, recompute, per_element):
    """Eager attention streams a/t x s^2 score elements per sequence, block and rank through HBM: softmax 4 + 6
    bytes, dropout 5 + 5, the forward part again under recompute; flash attention none of it."""
    cfg = GPTConfig(vocab_size=64, block_size=128, n_layer=4, n_head=8, n_embd=64, dropout=dropout)
    job = job_for(cfg, gpus=8, global_seqs=16, attn="eager")
    lay = plan.Layout(dp=2, tp=2, pp=2, micro_batch_size=2, recompute=recompute)
    elements = (8 // 2) * 128 ** 2 * (16 // 2) * (4 // 2)
    assert plan.eager_attention_time(job, lay) == pytest.approx(elements * per_element / 3.35e12, rel=1e-12)
    assert plan.eager_attention_time(job_for(cfg, gpus=8, global_seqs=16), lay) == 0


def test_published_software_options():
    """Megatron-LM 2021's behaviour as Job fields: gradients reduced after the backward (no overlap: the whole
    reduction is exposed), pipeline messages as 1/t per tp rank plus a tp all-gather on arrival. (Buckets of 4 KiB:
    overlap hides all but a round's last bucket, so with one bucket it would hide nothing.)"""
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=64)
    lay = plan.Layout(dp=2, tp=2, pp=2, micro_batch_size=1)
    plain, megatron = (job_for(cfg, gpus=8, gpus_per_node=2, global_seqs=8, dp_overlap=o, pp_scatter_gather=not o,
                               bucket_mb=2 ** -8, bucket_mb_per_dp=0.0) for o in (True, False))
    a, b = (plan.comm_bytes(j, lay, 1000) for j in (plain, megatron))
    S, m = 64 * 64 * 2, 4
    assert (a["pp"], b["pp"]) == (2 * m * S, 2 * m * S / 2) and b["tp"] - a["tp"] == 2 * m * S / 2
    mem = plan_memory.memory(megatron, lay)
    t = plan.step_time(megatron, lay, mem)
    dp_bytes = plan.comm_bytes(megatron, lay, mem["padded_params"])["dp"]
    alpha = plan.comm_latency(megatron, lay, mem["groups"])["dp"]      # NCCL's fixed cost per collective
    assert t["dp"] == pytest.approx(dp_bytes / plan.link_bandwidth(megatron, lay, "dp") + alpha, rel=1e-12)
    assert plan.step_time(plain, lay, plan_memory.memory(plain, lay))["dp"] < t["dp"]


def test_ring_collectives_across_nodes_use_every_members_nic():
    """A tp or dp ring across nodes moves its bytes through the NICs of its members on a node (NCCL: a channel per
    NIC, each entering and exiting a node once), capped by NVLink; point-to-point axes get one GPU's share."""
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=32, n_embd=64)
    job = job_for(cfg, gpus=64, gpu="a100", global_seqs=64)
    nvlink, net = 300e9 * LINK_EFF, 25e9 * LINK_EFF
    bw = plan.link_bandwidth
    assert bw(job, plan.Layout(dp=32, pp=2), "dp") == 8 * 25e9 * LINK_EFF        # 4 whole nodes: 8 NICs each
    assert bw(job, plan.Layout(dp=32, tp=2), "dp") == 4 * 25e9 * LINK_EFF        # 4 members per node
    assert bw(job, plan.Layout(dp=8, tp=8), "dp") == net                               # one member per node
    assert bw(job, plan.Layout(dp=8, tp=8), "tp") == nvlink                            # inside the node
    assert bw(job, plan.Layout(dp=4, tp=16), "tp") == 8 * 25e9 * LINK_EFF < nvlink
    assert bw(job, plan.Layout(dp=2, pp=32), "pp") == net and bw(job, plan.Layout(dp=4, cp=16), "cp") == net
    wide = job_for(cfg, gpus=64, gpus_per_node=16, gpu="a100", global_seqs=64)     # 16 NICs x 25 GB/s > NVLink
    assert bw(wide, plan.Layout(dp=64), "dp") == nvlink


# the statements of Narayanan et al. 2021 (Secs. 5.3.2-5.7) plan.py agrees with (bench/plan_layouts.md says why it
# disagrees with the others: fig12's second, fig15's first, fig16, fig17's second and third)
AGREED = [("fig12", 0), ("fig13", 0), ("fig14", 0), ("fig15", 1), ("fig17", 0), ("fig18", 0)]


def test_published_layout_comparisons():
    """bench/plan_layouts.py on the paper's sweeps of one model on one cluster (examples/sc21/run_figure_N.sh):
    interleaved ahead of 1F1B by less as the batch grows; peak at t = 8 for the 162.2B model on 64 GPUs; throughput
    falling with p against d for the 5.9B model; tensor-parallel comm the largest part exactly when t > 8; recompute
    slower at equal batch; scatter/gather ahead, most at the largest batch."""
    layouts = load_bench("plan_layouts")
    checks = {(sweep.key, i): (ok, said) for sweep, _, cs in layouts.evaluate_sweeps()
              for i, (_, ok, said) in enumerate(cs)}
    assert len(checks) == 11
    for key in AGREED:
        assert checks[key][0], (key, checks[key][1])
    fig13 = dict(layouts.evaluate_sweeps([s for s in layouts.SWEEPS if s.key == "fig13"])[0][1])
    for batch, rows in fig13.items():      # t=8 ahead of every other split, none predicted OOM
        speeds = {label: v for label, _, v in rows}
        assert None not in speeds.values() and max(speeds, key=speeds.get) == "t=8 p=8"


def test_plan_tables_setup():
    """bench/plan_tables.py (it writes bench/plan_tables.md): its conversions give the published figures (Megatron's
    137 TFLOP/s is 44% of 312, torchtitan's 2,973 TPS/GPU its 58.2% when the embedding is counted, as torchtitan did in
    2024-04), and a setup compares to one row with its ranks."""
    tables = load_bench("plan_tables")
    assert round(137e12 / tables.A100, 2) == 0.44 and tables.megatron_mfu(137, 24, 2304, 2048, 51200) < 0.44
    assert round(tables.titan_mfu(2973, 8.03e9 + 128256 * 4096, 32, 4096, 8192, 128256, tables.A100), 3) == 0.582
    c = tables.compare(tables.SETUPS[0])
    assert c["row"]["dp"] == 32 and c["rank"] >= 1 and c["rank_offered"] <= c["n_offered"] < c["n"]
    assert abs(c["error"]) < 1


def load_bench(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, f"bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_plan_sweep_dry(tmp_path):
    """`python bench/gpu_check.py --plan_sweep --dry` (what a GPU machine runs without --dry): 12 train_5d layouts
    spread over both sides of the GPU's memory, each accepted by train_5d's validate; and the comparison it prints
    once measured: OOM verdicts right and the allocated and reserved ratios (here against made-up measurements)."""
    gpu_check, sweep = load_bench("gpu_check"), load_bench("plan_sweep")
    assert gpu_check.main(["--plan_sweep", "--dry", "--out", str(tmp_path), "--plan_gpus", "4"]) == 0
    rows = [line for line in (tmp_path / "plan_sweep.md").read_text().splitlines() if line.startswith("| dp=")]
    assert len(rows) == sweep.RUNS and any("| fits | not run |" in r for r in rows) and any("| OOM |" in r for r in rows)
    layouts = sweep.sweep_layouts(2, "h100", 80 * 2 ** 30, 256, runs=4)
    measured = [(r, dict(allocated=r["mem_bytes"]["total"] * 1.25, reserved=r["mem_bytes"]["reserved"] / 0.8), "fits")
                for r in layouts[:2]]
    measured += [(r, None, "OOM") for r in layouts[2:]] + [(layouts[0], None, "failed (exit 1)")]
    capacity = layouts[1]["mem_bytes"]["reserved"] + plan_memory.CUDA_CONTEXT + 2 * plan_memory.NCCL_COMM_BYTES
    assert layouts[2]["mem_bytes"]["total"] > plan_memory.usable_bytes(capacity, 0)    # the first two fit, not the rest
    text = "\n".join(sweep.summary(measured, capacity))
    assert "OOM predicted right: 4 of 4 runs" in text and "median: allocated 0.80, reserved 0.80" in text


def test_more_devices_never_need_more_state_memory():
    """Sharding only helps: for a fixed layout otherwise, ZeRO stages 1-3 each cut model states below the last."""
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    job = job_for(cfg, gpus=8, global_seqs=64)
    states = [sum(plan_memory.memory(job, plan.Layout(dp=8, zero_stage=z))[k] for k in ("params", "grads", "optimizer"))
              for z in range(4)]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 7


# ----------------------------------------------------------------------------------------------------------
# command line

def test_json_lists_every_valid_layout(capsys):
    rows = plan.main(["--model", "gpt2", "--gpus", "8", "--gpu", "a100", "--seq", "1024", "--global_batch_tokens",
                      "64K", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == len(rows) > 100
    keys = {"dp", "tp", "cp", "pp", "ep", "zero_stage", "schedule", "micro_batch_size", "recompute", "mem_bytes",
            "step_time_s", "tokens_per_s", "mfu", "oom"}
    for r in lines:
        assert keys <= set(r) and r["dp"] * r["tp"] * r["cp"] * r["pp"] == 8
        parts = r["mem_bytes"]
        tensors = ("params", "grads", "optimizer", "activations", "other")
        assert parts["total"] == pytest.approx(sum(parts[k] for k in tensors))
        assert parts["total"] <= parts["reserved"] and parts["device"] > parts["reserved"]
        assert r["oom"] == (parts["reserved"] > parts["usable"]) == (parts["total"] > parts["usable"])
        assert parts["usable"] < 79.15 * 2 ** 30 - 1.3e9
    fits = [r for r in lines if not r["oom"]]
    assert fits[0]["tokens_per_s"] == max(r["tokens_per_s"] for r in fits)


def test_table_and_launch_command(capsys):
    plan.main(["--model", "gpt2", "--gpus", "16", "--gpu", "h100", "--seq", "1024", "--global_batch_tokens", "256K",
               "--top", "3"])
    out = capsys.readouterr().out
    assert "torchrun --nnodes 2 --nproc_per_node 8 train_5d.py --dp" in out and "--global_batch_size 256" in out


def test_big_model_needs_sharded_states():
    """llama3-70b (70.6B parameters, 16 bytes each in states) cannot fit 8 H100s at all; on 32 the best layout
    fits, and every layout that shards nothing (tp = pp = 1, no ZeRO) is OOM."""
    argv = ["--model", "llama3-70b", "--gpu", "h100", "--seq", "4096", "--global_batch_tokens", "256K", "--json"]
    with pytest.raises(SystemExit) as exit_:          # every row printed, then one error line and no launch line
        plan.main(argv + ["--gpus", "8"])
    assert exit_.value.code == 2
    rows = plan.main(argv + ["--gpus", "32"])
    assert not rows[0]["oom"] and (rows[0]["tp"] * rows[0]["pp"] > 1 or rows[0]["zero_stage"] > 0)
    assert all(r["oom"] for r in rows if r["tp"] * r["pp"] == 1 and r["zero_stage"] == 0)


# ----------------------------------------------------------------------------------------------------------
# train_5d --layout auto

def auto_cfg(**shape):
    """A train_5d config for --layout auto (its parser adds --layout and --plan_gpu to config.Config's flags)."""
    from common.config import Config
    cfg = Config(**shape)
    cfg.layout, cfg.plan_gpu = "auto", "h100"
    return cfg


def test_auto_layout_is_the_fastest_runnable_layout_that_fits(monkeypatch):
    import train_5d
    from plan import accepted_by, choose_layout, fits_in
    from planner.inputs import GIB
    monkeypatch.setenv("WORLD_SIZE", "8")
    job = job_for(GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, n_embd=2048), gpus=8,
                  global_seqs=64, precision="amp")
    runs = accepted_by(train_5d.validate, auto_cfg(block_size=2048, n_layer=24, n_head=16, n_embd=2048,
                                                   global_batch_size=64, dtype="bfloat16"))
    rows = plan.rank_layouts(job)
    assert any(not runs(r) and not r["oom"] for r in rows)      # ZeRO-3 etc. are ranked but refused by train_5d
    v_shaped = [r for r in rows if r["schedule"] in ("zbv", "dualpipev")]
    assert any(runs(r) for r in v_shaped if r["tp"] > 1)   # zbv / dualpipev with tp > 1: TP's layers split too
    roomy = choose_layout(job, 80 * GIB, runs)[0]
    tight = roomy["mem_bytes"]["reserved"] + 79.15 * GIB - roomy["mem_bytes"]["usable"] - 2 ** 20   # too small for it
    for memory in (80 * GIB, tight):
        best, fits = choose_layout(job, memory, runs)
        assert runs(best) and fits_in(best, memory)
        runnable = [r for r in rows if runs(r) and not r["oom"] and fits_in(r, memory)]
        assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in runnable)
    assert choose_layout(job, tight, runs)[0] != roomy


def _auto_run(rank, world, argv):
    import train_5d
    result = train_5d.main(argv)
    return dict(result["grid"].sizes, ep=result["grid"].ep, schedule=result["cfg"].pp_schedule,
                micro=result["cfg"].micro_batch_size, zero=result["cfg"].zero_stage)


def test_train_5d_layout_auto_runs_plans_choice(tiny_data, tmp_path, monkeypatch):
    """On CPU with --plan_gpu: train_5d runs the layout plan.py chooses for the same job."""
    import train_5d
    from plan import accepted_by, choose_layout, plan_job
    from planner.inputs import HARDWARE
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=2, layout="auto", plan_gpu="h100", n_layer=4)
    got = run_workers(_auto_run, 4, args=(argv,), timeout=600)[0]
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = auto_cfg(n_layer=4, n_head=4, n_embd=32, block_size=16, global_batch_size=8, dtype="float32")
    best, _ = choose_layout(plan_job(cfg, 64, 4, 4, "h100", "fp32"), HARDWARE["h100"]["mem"],
                            accepted_by(train_5d.validate, cfg))
    assert got == dict(dp=best["dp"], tp=best["tp"], cp=best["cp"], pp=best["pp"], ep=best["ep"],
                       schedule=best["schedule"], micro=best["micro_batch_size"], zero=best["zero_stage"])


@pytest.mark.parametrize("flags,message", [(dict(layout="auto"), "--layout auto plans for a GPU: none here"),
                                           (dict(layout="auto", tp=2), "leave out --dp --tp --cp --pp --ep")])
def test_train_5d_layout_auto_errors(tiny_data, tmp_path, capsys, flags, message):
    import train_5d
    with pytest.raises(SystemExit) as e:
        train_5d.main(tiny_argv(tiny_data, str(tmp_path), **flags))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_plan_nanotron_cells():
    """bench/plan_nanotron.py's cells as nanotron's figure states them: each layout fills its nodes' 8 GPUs, each step
    is the sweep's 256 sequences (2^20 tokens at 4,096), and the shapes give the figure's parameter counts by the
    sweep script's estimate (tied embeddings under an intermediate size of 10,000)."""
    nanotron = load_bench("plan_nanotron")
    for model, nodes, dp, tp, pp, accumulation, mbs, *_ in nanotron.CELLS:
        assert dp * tp * pp == 8 * nodes and dp * accumulation * mbs == 256
    counts = {}
    for model, (L, h, a, ffn) in nanotron.SHAPES.items():
        counts[model] = 131072 * h * (1 if ffn < 10_000 else 2) + L * (3 * h * ffn + 4 * h * h)
    assert [round(n / 1e9, 2) for n in counts.values()] == [1.34, 3.57, 8.86, 79.99]
