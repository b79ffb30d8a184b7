"""train_ep.py: the all_to_all dispatch/combine equals the single-device MoE layer (outputs and gradients),
EP training reproduces train_single.py with --n_experts, and the counted bytes equal the routed rows."""
import os

import pytest
import torch

from distributed_helper import run_workers
from metrics import read_metrics
from train_helpers import assert_same_losses, assert_same_weights, run_single, tiny_argv

H = 8


def _to_numpy(obj):
    """Tensors cross the process boundary as numpy arrays (a shared-memory tensor dies with its worker)."""
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    return obj.detach().numpy().copy() if isinstance(obj, torch.Tensor) else obj


def _dispatch_worker(rank, world, n_experts, top_k, dtype_name, idle, capacity_factor):
    """One MoE layer on `world` ranks, each with its own (differently sized) batch of tokens: the reference
    model.MoE on this rank's tokens vs ExpertParallelMoE; returns both results and the counted bytes."""
    import torch.distributed as dist
    from comm import COMM, init_distributed
    from config import Config
    from model import GPTConfig, MoE, init_parameter
    from train_ep import ExpertParallelMoE
    init_distributed(Config(device="cpu"))
    dtype = getattr(torch, dtype_name)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=H, n_experts=n_experts, top_k=top_k,
                    capacity_factor=capacity_factor)
    ref, ep = MoE(cfg), ExpertParallelMoE(cfg, 0, dist.group.WORLD, seed=5)
    with torch.no_grad():
        for name, p in ref.named_parameters():
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
    kept = torch.bincount(ref.routing.expert, minlength=n_experts)
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
                expected_gather=(world - 1) * n_experts * 8, received=received, kept=int(kept.sum()), routed=int(ref.routing.counts.sum())))


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
