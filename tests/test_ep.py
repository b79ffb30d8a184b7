"""train_ep.py: the all_to_all dispatch/combine equals the single-device MoE layer (outputs and gradients),
EP training reproduces train_single.py with --n_experts, and the counted bytes equal the routed rows."""
import json
import os

import pytest
import torch

from distributed_helper import run_workers
from common.metrics import read_metrics
from train_helpers import (EXACT, assert_exact, assert_same_losses, assert_same_weights, curves, run_single, text_argv,
                           tiny_argv)

H = 8


def _to_numpy(obj):
    """Tensors cross the process boundary as numpy arrays (a shared-memory tensor dies with its worker)."""
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    return obj.detach().numpy().copy() if isinstance(obj, torch.Tensor) else obj


def _dispatch_worker(rank, world, n_experts, top_k, dtype_name, idle, capacity_factor):
    """One MoE layer on `world` ranks, each with its own (differently sized) batch of tokens: the reference
    model.MoE on this rank's tokens vs model.MoE with ExpertParallelExperts; returns both results and the
    counted bytes."""
    import torch.distributed as dist
    from common.comm import COMM
    from common.distributed import init_distributed
    from common.config import Config
    from model import MLP, Experts, GPTConfig, MoE, init_parameter
    from train_ep import expert_parallel_moe
    init_distributed(Config(device="cpu"))
    dtype = getattr(torch, dtype_name)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=H, n_experts=n_experts, top_k=top_k,
                    capacity_factor=capacity_factor)
    ref = MoE(cfg, Experts(MLP(cfg) for _ in range(n_experts)))
    ep = expert_parallel_moe(cfg, dist.group.WORLD)
    with torch.no_grad():
        for m in (ref, ep):                            # experts by their global index: the same values
            for name, p in m.named_parameters():
                p.copy_(init_parameter(f"transformer.h.0.mlp.{name}", p.shape, 1, 5))
        for m in (ref, ep):
            m.router.weight[idle] = -1.0           # with inputs around +2, these experts never win
    ref, ep = ref.to(dtype), ep.to(dtype)
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(1, 5 + 3 * rank, H, generator=g) + 2.0).to(dtype)   # uneven token counts per rank
    grad_out = torch.randn(x.shape, generator=g).to(dtype)

    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * grad_out).sum().backward()
    COMM.reset()
    x_ep = x.clone().requires_grad_()
    y_ep = ep(x_ep)
    (y_ep * grad_out).sum().backward()
    counted = dict(COMM.by_op)

    # expected all_to_all bytes from the *reference* routing: rows to other ranks' experts, rows from others
    kept = torch.bincount(ref.routing.expert, minlength=n_experts + 1)[:n_experts]   # bin n_experts: dropped
    table = [torch.zeros_like(kept) for _ in range(world)]
    dist.all_gather(table, kept)                   # raw call: not part of what is being counted
    owner = torch.arange(n_experts) // (n_experts // world)
    sent = int(kept[owner != rank].sum())
    received = sum(int(t[owner == rank].sum()) for s, t in enumerate(table) if s != rank)
    expert_grads = {}
    for name, p in ref.named_parameters():
        if name.startswith("experts."):
            dist.all_reduce(p.grad)                # an expert's gradient sums every rank's tokens
            expert_grads[name] = p.grad
    return _to_numpy(dict(y_ref=ref(x).detach(), y_ep=y_ep.detach(), dx_ref=x_ref.grad, dx_ep=x_ep.grad,
                router_ref=ref.router.weight.grad, router_ep=ep.router.weight.grad, expert_ref=expert_grads,
                expert_ep={n: p.grad for n, p in ep.named_parameters() if n.startswith("experts.")},
                counted=counted, expected_a2a=2 * (sent + received) * H * x.element_size(),
                expected_gather=(world - 1) * n_experts * 8, received=received, kept=int(kept.sum()),
                routed=int(ref.routing.counts.sum())))


def _dispatch_cases(rank, world, cases):
    """Every case in one process group (spawning workers is the slow part on a busy CPU)."""
    return [_dispatch_worker(rank, world, *case) for case in cases]


CASES = {  # world: [(n_experts, top_k, dtype, idle experts, capacity_factor)]
    2: [(4, 2, "float64", [2, 3], 0.0),   # rank 1's experts get no tokens: it receives nothing at all
        (4, 1, "float32", [0], 0.0),
        (4, 2, "float64", [], 0.5)],      # with a capacity: rows are dropped alike on both sides
    4: [(8, 2, "float64", [5], 0.0)],     # uneven counts, one expert idle
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_dispatch_combine_equals_single_device_moe(world):
    for case, results in zip(CASES[world], zip(*run_workers(_dispatch_cases, world, args=(CASES[world],)))):
        check_dispatch_case(world, *case, results)


def check_dispatch_case(world, n_experts, top_k, dtype, idle, capacity, results):
    tol = dict(rtol=0, atol=1e-10) if dtype == "float64" else dict(rtol=1e-5, atol=1e-6)
    for rank, r in enumerate(results):
        r = {k: (torch.from_numpy(v) if hasattr(v, "dtype") else v) for k, v in r.items()}
        r["expert_ref"], r["expert_ep"] = ({n: torch.from_numpy(a) for n, a in r[k].items()}
                                          for k in ("expert_ref", "expert_ep"))
        torch.testing.assert_close(r["y_ep"], r["y_ref"], **tol)
        torch.testing.assert_close(r["dx_ep"], r["dx_ref"], **tol)
        torch.testing.assert_close(r["router_ep"], r["router_ref"], **tol)
        mine = {n for n in r["expert_ref"] if int(n.split(".")[1]) * world // n_experts == rank}
        assert set(r["expert_ep"]) == mine, "each rank holds exactly its n_experts/world experts"
        for name, grad in r["expert_ep"].items():
            torch.testing.assert_close(grad, r["expert_ref"][name], **tol)
        assert r["counted"]["all_to_all"] == r["expected_a2a"], f"rank {rank}: all_to_all bytes"
        assert r["counted"]["all_gather"] == r["expected_gather"], f"rank {rank}: count-exchange bytes"
        assert set(r["counted"]) == {"all_to_all", "all_gather"}
        assert (r["kept"] < r["routed"]) == (capacity > 0)
    if idle == [2, 3]:
        assert results[1]["received"] == 0 and results[0]["received"] > 0   # the empty exchange was exercised


# ----------------------------------------------------------------------------------------------------------
# training parity with train_single.py --n_experts, and the counted quantities of a training step

MICRO = 2     # global batch 8: grad_acc 4 on one device, 2 at world 2, 1 at world 4 (same micro-batches)


def _train_ep_runs(rank, world, runs):
    """Several train_ep.main configurations in one process group; each rank returns its parameters
    (rank 0 all of its own, the others only their experts)."""
    import train_ep
    out = []
    for argv in runs:
        model = train_ep.main(argv)["model"]
        out.append(_to_numpy({n: p.detach() for n, p in model.named_parameters()
                              if rank == 0 or ".experts." in n}))
    return out


def _val_losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [row["val_loss"] for row in map(json.loads, f) if "val_loss" in row]


def _argv(data, out, **kw):
    return tiny_argv(data, out, micro_batch_size=MICRO, **kw)


def _expert_numel(h):
    return 8 * h * h + 5 * h


def check_counts(rows, world, ep, n_experts, n_moe, a2a_per_micro=None, h=32, dense_numel=None,
                 local_expert_numel=None):
    """The byte convention of docs/observability.md, per optimizer step on rank 0."""
    grad_acc = 8 // (MICRO * world)
    replicas = world // ep
    grad_bytes = 2 * (world - 1) / world * dense_numel * 4
    if replicas > 1:
        grad_bytes += 2 * (replicas - 1) / replicas * local_expert_numel * 4
    for row in rows:
        assert row["counts_bytes"] == n_moe * grad_acc * (ep - 1) * n_experts * 8
        assert row["grad_bytes"] == pytest.approx(grad_bytes, rel=1e-12)
        assert row["param_bytes"] == (dense_numel + local_expert_numel) * 4
        assert row["comm_bytes"] == pytest.approx(row["a2a_bytes"] + row["counts_bytes"] + row["grad_bytes"])
        if a2a_per_micro is not None:
            assert row["a2a_bytes"] == n_moe * grad_acc * a2a_per_micro


@pytest.mark.parametrize("world,runs,resume", [
    # (ep, n_experts, top_k, extra model flags, steps)
    (2, [(2, 4, 1, {}, 20), (2, 4, 2, dict(capacity_factor=1.0, moe_every=2), 10),
         (2, 2, 2, dict(eval_interval=2, eval_iters=2, sample_tokens=3), 3)], True),
    (4, [(4, 8, 2, {}, 20), (2, 4, 1, {}, 20)], False),      # the second: two EP groups, each expert on 2 ranks
])
def test_ep_reproduces_single_device_moe(tiny_data, tmp_path, world, runs, resume):
    from model import GPTConfig, num_params
    argvs = [_argv(tiny_data, str(tmp_path / f"ep{i}"), n_experts=E, top_k=k, max_steps=steps, ep=ep, **kw)
             for i, (ep, E, k, kw, steps) in enumerate(runs)]
    resumed, base = str(tmp_path / "resumed"), argvs[-1]
    if resume:      # the last run again, stopped after 2 steps and resumed from its consolidated checkpoint
        out_at = base.index("--out_dir") + 1
        argvs += [base[:out_at] + [resumed] + base[out_at + 1:] + extra for extra in (["--stop_step", "2"],
                                                                                       ["--resume"])]
    results = run_workers(_train_ep_runs, world, args=(argvs,), timeout=600)
    if resume:
        assert [r["loss"] for r in read_metrics(resumed)] == pytest.approx(
            [r["loss"] for r in read_metrics(str(tmp_path / f"ep{len(runs) - 1}"))], rel=1e-7)
    for i, (ep, E, k, kw, steps) in enumerate(runs):
        ref_losses, ref_state = run_single(_argv(tiny_data, str(tmp_path / f"single{i}"), n_experts=E, top_k=k,
                                                 max_steps=steps, **kw))
        ref_rows, rows = read_metrics(str(tmp_path / f"single{i}")), read_metrics(str(tmp_path / f"ep{i}"))
        assert_same_losses(ref_losses, [r["loss"] for r in rows])
        # the full model: dense weights from rank 0, each expert from the rank of EP group 0 that owns it
        got = {n: torch.from_numpy(a) for r in results[:ep] for n, a in r[i].items()}
        assert_same_weights(ref_state, got)
        for replica in range(ep, world):         # the other EP groups hold identical copies of the experts
            for n, a in results[replica][i].items():
                torch.testing.assert_close(torch.from_numpy(a), got[n], rtol=0, atol=0)
        for a, b in zip(ref_rows, rows):         # router statistics of the whole global batch
            for key in ("tokens_per_expert_min", "tokens_per_expert_max", "dropped_tokens"):
                assert a[key] == b[key], (key, a[key], b[key])
            assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)
        if kw.get("eval_interval"):               # evaluation is collective too, and agrees
            val = [_val_losses(str(tmp_path / name)) for name in (f"single{i}", f"ep{i}")]
            assert len(val[0]) == 2 and val[1] == pytest.approx(val[0], rel=1e-5)
        if kw.get("capacity_factor"):
            assert sum(r["dropped_tokens"] for r in rows) > 0, "the capacity case should drop something"
        cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, n_experts=E, top_k=k,
                        moe_every=kw.get("moe_every", 1))
        n_moe = sum(cfg.is_moe_block(b) for b in range(cfg.n_layer))
        local = n_moe * (E // ep) * _expert_numel(32)
        dense = num_params(cfg) - n_moe * E * _expert_numel(32)
        # top_k = E: every token visits every expert, so the routed rows are known in advance:
        # S = N (E - E/ep) rows sent away, R = (ep - 1) N E/ep rows received, N tokens per micro-batch
        N = MICRO * 16
        a2a = 2 * (N * (E - E // ep) + (ep - 1) * N * E // ep) * 32 * 4 if k == E else None
        check_counts(rows, world, ep, E, n_moe, a2a, dense_numel=dense, local_expert_numel=local)


def test_bad_input_is_one_clear_error(tiny_data, tmp_path, monkeypatch, capsys):
    import train_ep
    monkeypatch.setenv("WORLD_SIZE", "2")             # validated before any process group exists
    for flags, message in [(dict(ep=2, n_experts=3), "not divisible by --ep"),
                           (dict(ep=2, n_experts=4, top_k=5), "--top_k 5 must be between 1 and --n_experts 4"),
                           (dict(ep=4, n_experts=4), "world size 2 is not divisible by --ep 4"),
                           (dict(ep=2, n_experts=0), "needs --n_experts > 0"),
                           (dict(ep=2, n_experts=4, moe_every=3), "no MoE block")]:
        with pytest.raises(SystemExit) as e:
            train_ep.main(tiny_argv(tiny_data, str(tmp_path), **flags))
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


# Mixtral's layout: SwiGLU experts (c_fc rows [gate | up]) whose top-2 gates are renormalized, RMSNorm, GQA, untied
MIXTRAL = dict(arch="mixtral", n_kv_head=2, ffn_hidden=24, tied=False)


@pytest.mark.parametrize("world,runs", [(2, [(2, 4, 2, MIXTRAL)]), (4, [(4, 8, 2, {}), (2, 4, 1, {})])])
def test_float64_parity_exact(text_data, tmp_path, world, runs):
    """float64 on real text, clipping on, 22 steps: expert parallelism (one EP group, or two with every expert
    on 2 ranks; GPT's GeLU experts, and Mixtral's SwiGLU ones) reproduces train_single's MoE within 1e-9 per step
    (loss and grad norm) and in the final weights. Micro-batches of 2 on every rank, the whole batch of 8 in one
    micro-batch in train_single: with global-batch load balancing (the default) the objective does not depend on
    how the batch is split."""
    argvs = [text_argv(text_data, str(tmp_path / f"ep{i}"), micro_batch_size=2, n_experts=E, top_k=k, ep=ep, **kw)
             for i, (ep, E, k, kw) in enumerate(runs)]
    results = run_workers(_train_ep_runs, world, args=(argvs,), timeout=600)
    for i, (ep, E, k, kw) in enumerate(runs):
        ref, ref_state = run_single(text_argv(text_data, str(tmp_path / f"single{i}"), micro_batch_size=8,
                                              n_experts=E, top_k=k, **kw), both_curves=True)
        assert_exact(ref, curves(str(tmp_path / f"ep{i}")))
        got = {n: torch.from_numpy(a) for r in results[:ep] for n, a in r[i].items()}
        assert_same_weights(ref_state, got, rtol=EXACT)


def _scaler_worker(rank, world, agreed):
    """One fp16 loss-scaled step where only rank 0's gradient overflows; returns (skipped, scale)."""
    import torch.distributed as dist
    from train_ep import GroupGradScaler
    dist.init_process_group("gloo")
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = (GroupGradScaler("cpu", dist.group.WORLD) if agreed else torch.amp.GradScaler("cpu"))
    scaler.scale((w * (float("inf") if rank == 0 else 1.0)).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return bool((w == 1).all()), scaler.get_scale()


def test_fp16_overflow_skips_on_every_rank():
    """fp16: an overflow on one rank's (expert) gradients skips the step on every rank, and every rank backs
    off its loss scale the same; torch's per-rank GradScaler would let rank 1 step alone."""
    skipped, scales = zip(*run_workers(_scaler_worker, 2, args=(True,)))
    assert skipped == (True, True) and scales[0] == scales[1] < 2.0 ** 16
    skipped, scales = zip(*run_workers(_scaler_worker, 2, args=(False,)))
    assert skipped == (True, False) and scales[0] != scales[1]      # the drift GroupGradScaler prevents


def test_every_group_has_the_run_timeout(tiny_data, tmp_path, monkeypatch):
    """Subgroups (EP groups, expert replicas, pipeline's tied pair) are created with --dist_timeout, so a
    stopped rank makes the others raise instead of waiting torch's default 30 minutes."""
    import torch.distributed as dist
    from common import comm
    import train_ep
    seen, real = [], dist.new_group

    def recording_new_group(ranks, **kwargs):
        seen.append(kwargs.get("timeout"))
        return real(ranks, **kwargs)
    monkeypatch.setattr(dist, "new_group", recording_new_group)
    try:
        train_ep.main(_argv(tiny_data, str(tmp_path), n_experts=2, ep=1, max_steps=1, dist_timeout=37))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        comm.GROUP_TIMEOUT["s"] = None
    assert seen and all(t is not None and t.total_seconds() == 37 for t in seen), seen
