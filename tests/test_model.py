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


FAMILY = dict(   # model.py's family fields, each combination one layout (GPT-2 with GQA and SwiGLU, Llama, Qwen2, Mixtral)
    gpt_gqa_swiglu=dict(n_kv_head=2, mlp="swiglu", ffn_hidden=40),
    gpt_untied_moe=dict(tied=False, n_experts=4, moe_every=2, ffn_hidden=24, n_kv_head=1),
    llama=dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=40, n_kv_head=2, qkv_bias=False, bias=False, tied=False),
    qwen2=dict(norm="rmsnorm", mlp="swiglu", n_kv_head=1, qkv_bias=True, bias=False),
    mixtral=dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, qkv_bias=False, bias=False, tied=False, n_experts=4,
                 router_renorm=True),
)


@pytest.mark.parametrize("family", FAMILY)
def test_family_counts_are_the_parameters_and_plan_pys(family):
    """num_params counts every parameter the family's fields build; where plan.py can hold the model (LayerNorm and
    biases: its --n_kv_head --ffn_hidden --gated --tied), its parameters, per-block lists, FLOPs and extra activation
    values are model.py's."""
    from planner import shape as plan_shape
    from planner.inputs import Job
    cfg = GPTConfig(vocab_size=100, block_size=32, n_layer=4, n_head=4, n_embd=32, **FAMILY[family])
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    active = num_params(cfg, cfg.top_k) if cfg.n_experts else num_params(cfg)
    lookup = 0 if cfg.tied else cfg.padded_vocab_size * cfg.n_embd
    assert flops_per_token(cfg) == 6 * (active - lookup) + 12 * 4 * 32 * 32
    if cfg.norm == "layernorm" and cfg.bias and cfg.qkv_bias:
        job = Job(GPTConfig(vocab_size=100, block_size=32, n_layer=4, n_head=4, n_embd=32, n_experts=cfg.n_experts,
                            moe_every=cfg.moe_every), 8, 8, "h100", 8, n_kv_head=cfg.n_kv_head,
                  ffn_hidden=cfg.ffn_hidden, gated=cfg.mlp == "swiglu", tied=cfg.tied)
        assert plan_shape.num_params(job) == num_params(cfg)
        assert plan_shape.flops_per_token(job) == flops_per_token(cfg)
        for i, block in enumerate(model.transformer.h):
            assert plan_shape.block_numels(job, 1, 1, cfg.is_moe_block(i)) == [p.numel() for p in block.parameters()]
        gpt = GPTConfig(n_layer=4, n_head=4, n_embd=32)
        extra = 16 * 2 * 2 * plan_shape.activation_delta_values(job)       # s * b * bytes_per_value * values
        assert activation_bytes_per_layer(16, 2, cfg) == activation_bytes_per_layer(16, 2, gpt) + extra


def test_grouped_query_attention_is_attention_with_repeated_kv_heads():
    """n_kv_head=2 of 4 heads equals multi-head attention whose k and v heads repeat each shared head (float64)."""
    shape = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, norm="rmsnorm", mlp="swiglu",
                 qkv_bias=False, bias=False, tied=False)
    gqa, mha = GPT(GPTConfig(n_kv_head=2, **shape)).double(), GPT(GPTConfig(**shape)).double()
    state = gqa.state_dict()
    for name, w in list(state.items()):
        if name.endswith("c_attn.weight"):
            q, k, v = w.split([32, 16, 16])
            state[name] = torch.cat([q, k.view(2, 8, 32).repeat_interleave(2, 0).view(32, 32),
                                     v.view(2, 8, 32).repeat_interleave(2, 0).view(32, 32)])
    mha.load_state_dict(state)
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], rtol=0, atol=1e-12)


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
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)  # the table's angles are fp32
    # q.k after rotation depends only on the distance between the two positions
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    rot = lambda v, p: apply_rope(v.view(1, 1, 1, D), rope_cache(D, torch.tensor([p]))).flatten()
    assert abs(rot(q, 7) @ rot(k, 3) - rot(q, 104) @ rot(k, 100)) < 1e-5
    assert abs(rot(q, 7) @ rot(k, 3) - rot(q, 7) @ rot(k, 5)) > 1e-3
    # one graph under torch.compile (no complex numbers, which inductor has no code for), the same numbers
    compiled = torch.compile(apply_rope, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, rope_cache(D, pos)), y, rtol=1e-12, atol=1e-12)
    # in a 16-bit dtype the rotation stays in it: no fp32 copy of q and k (the table is cast, as Llama's is)
    half = apply_rope(x.to(torch.bfloat16), rope_cache(D, pos))
    assert half.dtype == torch.bfloat16 and (half.double() - expected).abs().max() < 0.05


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
