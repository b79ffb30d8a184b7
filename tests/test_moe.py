"""model.py's mixture of experts: the reference layer against a per-token loop, the Switch aux loss, capacity
dropping, global-batch load balancing, parameter/FLOP accounting, init by name, and train_single.py's MoE flags
and router statistics."""
import pytest
import torch

from common.metrics import read_metrics
from model import GPT, MLP, Experts, GPTConfig, MoE, flops_per_token, init_parameter, num_params
from moe.router import route
from common.routing import end_moe_step, moe_blocks, start_moe_training, switch_aux_loss
from train_helpers import run_single, tiny_argv


def small_moe(n_experts=4, top_k=2, capacity_factor=0.0, h=8, seed=0):
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=h, n_experts=n_experts, top_k=top_k,
                    capacity_factor=capacity_factor)
    torch.manual_seed(seed)
    moe = MoE(cfg, Experts(MLP(cfg) for _ in range(n_experts))).double()
    with torch.no_grad():                        # biases are 0 at init: make them count
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def per_token_reference(moe, x):
    """y_t = sum over t's top-k experts e of p_e(x_t) * expert_e(x_t), one token at a time."""
    probs = torch.softmax(moe.router(x), dim=-1)
    ys = []
    for t in range(x.shape[0]):
        gate, experts = probs[t].topk(moe.top_k)
        ys.append(sum(g * moe.experts[int(e)](x[t]) for g, e in zip(gate, experts)))
    return torch.stack(ys)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_equals_per_token_loop(top_k):
    moe = small_moe(top_k=top_k)
    x = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    y = moe(x[None])[0]
    x2 = x.detach().clone().requires_grad_()
    y_ref = per_token_reference(moe, x2)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    g = torch.randn_like(y)
    grads = torch.autograd.grad((y * g).sum(), [x] + list(moe.parameters()), allow_unused=True)
    grads_ref = torch.autograd.grad((y_ref * g).sum(), [x2] + list(moe.parameters()), allow_unused=True)
    for a, b in zip(grads, grads_ref):
        if b is None:                            # an expert no token chose: zero gradient, not None
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_switch_aux_loss_and_its_gradient():
    E, k, N, coef = 4, 2, 50, 0.3
    logits = torch.randn(N, E, dtype=torch.float64) * 2
    r = route(logits, k)
    probs = torch.softmax(logits, -1)
    chosen = torch.zeros(N, E, dtype=torch.float64).scatter_(1, probs.topk(k, -1).indices, 1.0)
    f, P = chosen.sum(0) / (N * k), probs.mean(0)            # share of assignments, mean probability
    assert torch.equal(r.counts, chosen.sum(0).long())
    torch.testing.assert_close(switch_aux_loss(r.stats(), k), E * (f * P).sum(), rtol=1e-12, atol=0)
    # a router that cannot tell experts apart: P_e = 1/E, so the loss is sum_e f_e = 1 whatever f is
    assert float(switch_aux_loss(route(torch.zeros(N, E), k).stats(), k)) == pytest.approx(1.0, abs=1e-6)
    # the balancing gradient BalanceGradient injects = autograd of coef * E * sum f_e P_e (f held constant)
    x = logits.clone().requires_grad_()
    routed = route(x, k, balance=lambda counts: coef * E * counts.double() / counts.sum() / N)
    routed.gate.sum().backward()
    y = logits.clone().requires_grad_()
    p = torch.softmax(y, -1)
    (p.gather(1, p.topk(k, -1).indices).sum() + coef * E * (f * p.mean(0)).sum()).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-15)
    # it pushes probability away from the overloaded expert
    z = torch.zeros(N, E, requires_grad=True)
    top1 = route(z + torch.tensor([1.0, 0, 0, 0]), 1, balance=lambda c: E * (c / c.sum()).float() / N)
    (top1.gate * 0).sum().backward()
    assert (z.grad[:, 0] > 0).all() and (z.grad[:, 1:] < 0).all()


def test_capacity_drops_overflow_first_choices_first():
    E, k, N, cf = 4, 2, 40, 0.75
    logits = torch.randn(N, E) + torch.tensor([2.0, 1.0, 0, 0])   # experts 0 and 1 overloaded
    full, capped = route(logits, k), route(logits, k, capacity_factor=cf)
    capacity = -(-cf * N * k // E)
    kept = torch.bincount(capped.expert, minlength=E + 1)[:E]        # bin E: dropped (their place is kept)
    assert torch.equal(kept, torch.clamp(full.counts, max=int(capacity)))
    assert torch.equal(capped.counts, full.counts) and len(full.token) == N * k
    # every expert that dropped something kept only first choices if it had more first choices than room
    first = torch.zeros(N * k, dtype=torch.bool)
    first[::k] = True
    for e in range(E):
        n_first = int((full.expert[first] == e).sum())
        kept_first = sum(1 for t, x in zip(capped.token, capped.expert) if x == e
                         and full.expert[int(t) * k] == e)
        assert kept_first == min(n_first, int(capacity)), e


def test_param_count_active_params_and_flops():
    h, L, E, k, v = 32, 4, 8, 2, 64
    cfg = GPTConfig(vocab_size=v, n_layer=L, n_head=4, n_embd=h, n_experts=E, top_k=k, moe_every=2)
    model = GPT(cfg)
    dense = h * v + L * (12 * h * h + 13 * h) + 2 * h
    per_expert = 8 * h * h + 5 * h
    assert [cfg.is_moe_block(i) for i in range(L)] == [False, True, False, True]
    counted = sum(p.numel() for p in model.parameters())
    assert counted == num_params(cfg) == dense + 2 * (E * h + (E - 1) * per_expert)
    assert num_params(cfg, experts_per_token=k) == dense + 2 * (E * h + (k - 1) * per_expert)
    assert flops_per_token(cfg) == 6 * num_params(cfg, k) + 12 * L * h * cfg.block_size


def test_dense_model_unchanged_and_experts_initialised_by_name():
    dense = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    assert not any("router" in n or "experts" in n for n, _ in dense.named_parameters())
    assert isinstance(dense.transformer.h[0].mlp, MLP)
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, n_experts=3, top_k=1)
    model = GPT(cfg, seed=7)
    named = dict(model.named_parameters())
    assert "transformer.h.1.mlp.router.weight" in named and "transformer.h.0.mlp.experts.2.c_fc.weight" in named
    for name, p in named.items():                # what an expert-parallel rank builds for its experts alone
        assert torch.equal(p, init_parameter(name, p.shape, cfg.n_layer, seed=7)), name
    w = [named[f"transformer.h.0.mlp.experts.{e}.c_fc.weight"] for e in range(3)]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])


def moe_gpt(scope, coef=0.5, seed=1):
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16, n_experts=4, top_k=2,
                    moe_every=2, aux_loss_coef=coef, aux_loss_scope=scope)
    return GPT(cfg, seed=seed).double()


def test_returned_loss_is_the_cross_entropy():
    model = moe_gpt("micro")
    idx = torch.randint(0, 64, (2, 16))
    _, train_loss = model(idx, idx)
    model.eval()
    _, eval_loss = model(idx, idx)
    assert torch.equal(train_loss, eval_loss)


@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_global_balance_equals_the_whole_batch_objective(n_micro):
    """Accumulated over n_micro micro-batches, the gradient is that of cross-entropy + coef * sum over MoE
    blocks of E * sum_e f_e P_e on the whole batch at once (f: the previous step's load, P: this batch's), and
    the logged aux equals E * sum_e f_e P_e of this batch."""
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 16))
    prev = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    model = moe_gpt("global")
    moes = moe_blocks(model)
    for m in moes:
        m.load.copy_(prev)
    start_moe_training(model, idx.numel())
    for x in idx.chunk(n_micro):
        (model(x, x)[1] / n_micro).backward()
    stats = end_moe_step(model)
    # the reference: one forward of the whole batch, the aux written out on the router probabilities
    ref = moe_gpt("global", coef=0.0)
    logits = []
    for m in moe_blocks(ref):
        m.router.register_forward_hook(lambda mod, inp, out: logits.append(out))
    ce = ref(idx, idx)[1]
    probs = [torch.softmax(z, -1) for z in logits]
    aux_prev = [4 * (prev * p.mean(0)).sum() for p in probs]
    (ce + 0.5 * sum(aux_prev)).backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14, msg=name)
    f_now = [torch.bincount(p.topk(2, -1).indices.reshape(-1), minlength=4) / (idx.numel() * 2) for p in probs]
    aux_now = torch.stack([4 * (f * p.mean(0)).sum() for f, p in zip(f_now, probs)])
    torch.testing.assert_close(switch_aux_loss(stats, 2), aux_now.detach(), rtol=1e-12, atol=0)
    for m, f in zip(moes, f_now):                # the next step balances against this batch's load
        torch.testing.assert_close(m.load, f.double(), rtol=1e-15, atol=0)
    # the micro-batch scope is a different objective as soon as the batch is split
    micro = moe_gpt("micro")
    start_moe_training(micro, idx.numel())
    for x in idx.chunk(n_micro):
        (micro(x, x)[1] / n_micro).backward()
    router_grad = [m.router.weight.grad for m in moe_blocks(micro)]
    whole = moe_gpt("micro")
    whole(idx, idx)[1].backward()
    same = all(torch.allclose(a, m.router.weight.grad, rtol=1e-10) for a, m in zip(router_grad, moe_blocks(whole)))
    assert same == (n_micro == 1)


def _stats(rows):
    keys = ("tokens_per_expert_min", "tokens_per_expert_max", "dropped_tokens", "aux_loss")
    return [tuple(r[k] for k in keys) for r in rows]


def test_train_single_moe_router_stats(tiny_data, tmp_path):
    # top_k = E: every expert sees every token, so each count is the whole global batch (8 x 16 tokens)
    argv = tiny_argv(tiny_data, str(tmp_path / "a"), n_experts=2, top_k=2, max_steps=3)
    losses, _ = run_single(argv)
    rows = read_metrics(str(tmp_path / "a"))
    assert [(r[0], r[1], r[2]) for r in _stats(rows)] == [(128, 128, 0)] * 3
    assert all(r["aux_loss"] == pytest.approx(1.0, abs=1e-6) for r in rows)
    # full recomputation re-runs every block in backward: same losses, and the router counted once
    full, _ = run_single(tiny_argv(tiny_data, str(tmp_path / "b"), n_experts=2, top_k=2, max_steps=3,
                                   recompute="full"))
    assert full == pytest.approx(losses, rel=1e-6)
    recomputed = _stats(read_metrics(str(tmp_path / "b")))
    assert len(recomputed) == len(rows)
    for got, want in zip(recomputed, _stats(rows)):     # per row, per field: approx takes no nested lists
        assert got == pytest.approx(want, rel=1e-6)
    # a tight capacity drops assignments, and says how many
    run_single(tiny_argv(tiny_data, str(tmp_path / "c"), n_experts=4, top_k=2, max_steps=2,
                         capacity_factor=0.5))
    rows = read_metrics(str(tmp_path / "c"))
    assert all(r["dropped_tokens"] > 0 and r["tokens_per_expert_max"] > 64 for r in rows)


@pytest.mark.parametrize("flags,message", [(dict(n_experts=2, top_k=3), "--top_k 3 must be between 1"),
                                           (dict(n_experts=2, moe_every=0), "--moe_every must be >= 1"),
                                           (dict(n_experts=2, capacity_factor=-1), "--capacity_factor must be a finite number >= 0")])
def test_train_single_bad_moe_flags(tiny_data, tmp_path, capsys, flags, message):
    import train_single
    with pytest.raises(SystemExit) as e:
        train_single.main(tiny_argv(tiny_data, str(tmp_path), **flags))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
