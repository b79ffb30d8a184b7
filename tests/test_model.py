"""model.py: the parameter-count, FLOP and memory formulas, and deterministic per-parameter init."""
import pytest
import torch

from model import GPT, GPTConfig, activation_bytes_per_layer, flops_per_token, init_parameter, num_params
from planner.inputs import model_state_bytes_per_param


@pytest.mark.parametrize("L,H,h,vocab", [(1, 1, 8, 10), (2, 4, 32, 64), (3, 6, 48, 256), (4, 2, 64, 50257)])
def test_param_count_matches_playbook_formula(L, H, h, vocab):
    cfg = GPTConfig(vocab_size=vocab, block_size=16, n_layer=L, n_head=H, n_embd=h)
    model = GPT(cfg)
    counted = sum(p.numel() for p in model.parameters())    # the tied LM head is not counted twice
    v = (vocab + 63) // 64 * 64
    assert cfg.padded_vocab_size == v and v % 64 == 0 and v >= vocab
    assert counted == num_params(cfg) == h * v + L * (12 * h * h + 13 * h) + 2 * h


def test_flops_per_token_hand_computed():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    n = 128 * 256 + 4 * (12 * 128 * 128 + 13 * 128) + 2 * 128   # = 826_112
    assert num_params(cfg) == 826_112 == n
    assert flops_per_token(cfg) == 6 * 826_112 + 12 * 4 * 128 * 64
    assert flops_per_token(cfg, seq_len=32) == 6 * 826_112 + 12 * 4 * 128 * 32


def test_model_state_bytes():
    assert sum(model_state_bytes_per_param("fp32").values()) == 16
    assert model_state_bytes_per_param("bf16") == dict(params=2, grads=2, optim=12)
    with pytest.raises(ValueError):
        model_state_bytes_per_param("fp64")


def test_activation_bytes_korthikanti():
    cfg = GPTConfig(n_embd=64, n_head=4)
    s, b, h, a = 32, 2, 64, 4
    assert activation_bytes_per_layer(s, b, cfg) == s * b * h * 34 + 5 * a * s * s * b
    assert activation_bytes_per_layer(s, b, cfg, recompute="selective") == s * b * h * 34
    assert activation_bytes_per_layer(s, b, cfg, recompute="full") == s * b * h * 2
    assert activation_bytes_per_layer(s, b, cfg, bytes_per_value=4) == s * b * h * 66 + 9 * a * s * s * b
    assert activation_bytes_per_layer(s, b, cfg, dropout=False) == s * b * h * 32 + 4 * a * s * s * b


def test_init_is_per_parameter_and_deterministic():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    a, b, c = GPT(cfg, seed=3), GPT(cfg, seed=3), GPT(cfg, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        # a single parameter can be rebuilt alone, without the model (what a sharded layout does)
        assert torch.equal(pa, init_parameter(name, pa.shape, cfg.n_layer, seed=3)), name
        if pa.std() > 0:
            assert not torch.equal(pa, pc), name
    # residual projections get std 0.02 / sqrt(2L); biases zero; LayerNorm weights one
    w = init_parameter("transformer.h.0.attn.c_proj.weight", (512, 512), 2, 0)
    assert abs(w.std().item() - 0.02 / 2) < 1e-3
    assert init_parameter("transformer.h.1.mlp.c_fc.bias", (8,), 2, 0).abs().sum() == 0
    assert torch.equal(init_parameter("transformer.ln_f.weight", (8,), 2, 0), torch.ones(8))


def test_rope_rotates_adjacent_pairs_and_keeps_relative_positions():
    from model import apply_rope, rope_cache
    D, pos = 8, torch.tensor([0, 1, 5, 9])
    x = torch.randn(2, 4, 3, D, dtype=torch.float64)                # [B, T, heads, D]
    y = apply_rope(x, rope_cache(D, pos))
    assert y.dtype == torch.float64
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = (pos[:, None] * theta)[:, None]                        # [T, 1, D/2]
    a, b = x[..., 0::2], x[..., 1::2]
    expected = torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1).flatten(-2)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)  # the table is complex64
    # q.k after rotation depends only on the distance between the two positions
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    rot = lambda v, p: apply_rope(v.view(1, 1, 1, D), rope_cache(D, torch.tensor([p]))).flatten()
    assert abs(rot(q, 7) @ rot(k, 3) - rot(q, 104) @ rot(k, 100)) < 1e-5
    assert abs(rot(q, 7) @ rot(k, 3) - rot(q, 7) @ rot(k, 5)) > 1e-3
    # under torch.compile the same rotation is written without complex numbers (inductor has no complex codegen)
    compiled = torch.compile(apply_rope, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, rope_cache(D, pos)), y, rtol=1e-12, atol=1e-12)


def test_rope_positions_and_causality():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 64, (2, 12))
    full, _ = model(idx)
    # causal: a prefix's logits do not depend on later tokens
    prefix, _ = model(idx[:, :7])
    torch.testing.assert_close(prefix, full[:, :7])
    # explicit default positions give the same result
    same, _ = model(idx, pos=torch.arange(12))
    torch.testing.assert_close(same, full)
