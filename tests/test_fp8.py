"""
FP8 (kernels/fp8.py): signal-to-quantization-noise gates from torchao's tests for each recipe, blockwise
scaling beating tensorwise on outliers, and a 100-step toy GPT run in FP8 within 1% of the same run in fp32.
Every test runs fp8.py's GPU path under CUDA's torch._scaled_mm rules (tests/cuda_scaled_mm.py: the CPU kernel
accepts what CUDA refuses), including the shapes MoE experts produce: token counts that are no multiple of 16,
and experts that receive no token at all.
"""
import functools

import pytest
import torch
import torch.nn as nn

from cuda_scaled_mm import scaled_mm_under_cuda_rules, scaled_mm_under_cuda_rules_without_blocks  # noqa: F401
from kernels.fp8 import (E4M3, E5M2, RECIPES, Float8Linear, convert_to_float8, dequantize, fp8_matmul,
                         quantize, sqnr_db)

pytestmark = pytest.mark.usefixtures("scaled_mm_under_cuda_rules")


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_cast_round_trip(granularity):
    torch.manual_seed(0)
    x = torch.randn(130, 300)                                # not multiples of 128: ragged tiles and blocks
    q, scale = quantize(x, E4M3, granularity)
    assert q.dtype == E4M3
    assert sqnr_db(x, dequantize(q, scale, granularity)) >= 25
    q, scale = quantize(x, E5M2, granularity)                # 2 mantissa bits: the gradient format
    assert sqnr_db(x, dequantize(q, scale, granularity)) >= 20


def test_scale_is_fp8_max_over_amax_and_zero_is_safe():
    x = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    _, scale = quantize(x, E4M3, "tensor")
    assert float(scale) == torch.finfo(E4M3).max / 2.0
    q, scale = quantize(torch.zeros(4, 4), E4M3, "row")      # amax clamped away from zero: no inf/nan
    assert torch.isfinite(scale).all() and (q.float() == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_matmul(recipe):
    torch.manual_seed(1)
    a, b = torch.randn(48, 272), torch.randn(80, 272)
    assert sqnr_db(a @ b.t(), fp8_matmul(a, b, E4M3, E4M3, recipe)) >= 25


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_output_and_gradients(recipe):
    torch.manual_seed(2)
    ref = nn.Linear(256, 192)
    fp8 = Float8Linear.from_float(nn.Linear(256, 192), recipe)
    fp8.load_state_dict(ref.state_dict())
    for _ in range(3):   # delayed scaling reads amax histories of earlier steps
        x = torch.randn(4, 40, 256)
        g = torch.randn(4, 40, 192)
        xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref.zero_grad(), fp8.zero_grad()
        yr, yf = ref(xr), fp8(xf)
        yr.backward(g), yf.backward(g)
    assert sqnr_db(yr, yf) >= 18
    assert sqnr_db(ref.weight.grad, fp8.weight.grad) >= 17
    assert sqnr_db(xr.grad, xf.grad) >= 17
    torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)  # the bias stays in high precision
    assert fp8.weight.dtype == torch.float32                  # master weights stay fp32
    if recipe == "delayed":
        assert (fp8.amax_history[:, :3] > 0).all() and (fp8.amax_history[:, 3:] == 0).all()


def test_blockwise_beats_tensorwise_on_outliers():
    torch.manual_seed(3)
    a, b = torch.randn(64, 512), torch.randn(96, 512) * 0.02
    a[:, 7] *= 500.0                                          # one outlier channel, as in LLM activations
    exact = a @ b.t()
    tensorwise = sqnr_db(exact, fp8_matmul(a, b, E4M3, E4M3, "tensorwise"))
    blockwise = sqnr_db(exact, fp8_matmul(a, b, E4M3, E4M3, "blockwise"))
    assert blockwise > tensorwise + 3, (blockwise, tensorwise)


def test_convert_to_float8_swaps_only_the_big_linears():
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    before = dict(model.named_parameters())
    swapped = convert_to_float8(model, "tensorwise")
    assert sorted(swapped) == sorted(f"transformer.h.{i}.{m}" for i in range(2)
                                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    after = dict(model.named_parameters())
    assert list(before) == list(after) and all(before[n] is after[n] for n in before)
    with pytest.raises(ValueError, match="recipe"):
        Float8Linear.from_float(nn.Linear(16, 16), "per-channel")


def test_the_gated_mlps_three_linears_run_fp8():
    """The Llama family's SwiGLU MLP: c_fc holds gate and up ([gate | up] rows), c_proj is down; all three run in
    FP8 (SwiGLU experts too), the router stays in high precision."""
    from model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, norm="rmsnorm", mlp="swiglu",
                    ffn_hidden=48, n_kv_head=2, bias=False, qkv_bias=False, tied=False, n_experts=2, moe_every=2)
    swapped = convert_to_float8(GPT(cfg), "rowwise")
    assert sorted(swapped) == sorted([f"transformer.h.{i}.attn.{m}" for i in range(2) for m in ("c_attn", "c_proj")]
                                     + [f"transformer.h.0.mlp.{m}" for m in ("c_fc", "c_proj")]
                                     + [f"transformer.h.1.mlp.experts.{e}.{m}" for e in range(2) for m in ("c_fc", "c_proj")])


@functools.lru_cache(maxsize=None)
def train_toy_gpt(recipe, steps=100):
    """A 2-layer GPT on a learnable token pattern; returns (mean loss of the last 10 steps, first loss). The
    operands are quantized by the torch reference, not the Triton kernels under the interpreter (100 steps
    there take minutes): tests/test_fp8_ops.py shows both give the same values bit for bit."""
    import kernels.fp8 as fp8
    threads, fused_cast = torch.get_num_threads(), fp8.fused_cast
    torch.set_num_threads(1)                                  # small matmuls: one thread is fastest on a busy box
    fp8.fused_cast = lambda t: False
    try:
        return _train_toy_gpt(recipe, steps)
    finally:
        torch.set_num_threads(threads)
        fp8.fused_cast = fused_cast


def _train_toy_gpt(recipe, steps):
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64), seed=0)
    if recipe is not None:
        convert_to_float8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 64, (8, 1), generator=gen)
        seq = (start + 7 * torch.arange(33)) % 64 ^ torch.randint(0, 2, (8, 33), generator=gen)
        _, loss = model(seq[:, :-1], seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10, losses[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_training_tracks_fp32(recipe):
    (ref, first), (fp8, _) = train_toy_gpt(None), train_toy_gpt(recipe)
    assert ref < 0.5 * first                                  # it learned something
    assert abs(fp8 - ref) <= 0.01 * ref, (fp8, ref)



def tiny_gpt(kernel_mode, fp8, device):
    """A 1-layer GPT with --kernels kernel_mode and delayed-scaling FP8 swapped in after the kernels (fp8 =
    'after', train_single's order), before them ('before'), or not at ('none'); returns (model, FP8 names)."""
    from kernels import apply_kernels
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32), seed=0).to(device)
    swapped = convert_to_float8(model, "delayed") if fp8 == "before" else []
    apply_kernels(model, kernel_mode)
    swapped += convert_to_float8(model, "delayed") if fp8 == "after" else []
    return model, swapped


@pytest.mark.parametrize("mode,fp8", [("torch", "after"), ("triton", "after"), ("triton", "before"),
                                      ("compile", "after")])
def test_every_selected_linear_runs_fp8_under_each_kernels_mode(mode, fp8, monkeypatch):
    """Each Linear the FP8 rule selects runs its FP8 GEMMs under every --kernels choice (the fused MLP once read
    c_fc / c_proj's weights itself and skipped them). Witness per layer: delayed scaling pushes the amaxes of
    x and W (forward) and of dy (backward) into the layer's history, which only its FP8 GEMMs do; and the loss
    is the unfused FP8 model's, not the high-precision one's."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if mode == "compile":   # inductor lowers the GEMMs itself: in the full suite a graph compiled for the CPU's
        monkeypatch.undo()  # choices was replayed under the simulated GPU, so this case runs the real CPU kernel
    if mode == "triton":
        pytest.importorskip("triton")
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0)).to(device)
    model, swapped = tiny_gpt(mode, fp8, device)
    assert len(swapped) == 4
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    modules = dict(model.named_modules())
    for name in swapped:
        assert type(modules[name]) is Float8Linear, name
        assert (modules[name].amax_history[:, 0] > 0).all(), f"{name} skipped FP8 under --kernels {mode}"
    fp8_loss = tiny_gpt("torch", "after", device)[0](idx[:, :-1], idx[:, 1:])[1].item()
    high_precision_loss = tiny_gpt("torch", "none", device)[0](idx[:, :-1], idx[:, 1:])[1].item()
    assert abs(loss.item() - fp8_loss) <= 1e-5 * fp8_loss
    assert abs(loss.item() - high_precision_loss) > 10 * abs(loss.item() - fp8_loss)


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_defers_dw_to_a_zero_bubble_w_step(recipe):
    """Under zb1 / zbv / dualpipev (pipeline/weight_grads.py) B returns dx and W runs the dW GEMM on the dy
    B quantized and the x F quantized: the unsplit backward's dx and dW bit for bit, over two micro-batches
    (delayed: its histories); the bias, added after the GEMM, keeps its gradient in B."""
    from pipeline.weight_grads import WeightGradStore, defer_weight_grads
    out = []
    for deferred in (False, True):
        torch.manual_seed(4)
        layer, store = Float8Linear.from_float(nn.Linear(128, 64), recipe), WeightGradStore()
        if deferred:
            defer_weight_grads(nn.Sequential(layer), store)
        dxs = []
        for mb in range(2):
            x = torch.randn(2, 9, 128, requires_grad=True)          # 18 tokens: dW's K padded on the GPU path
            layer(x).backward(torch.randn(2, 9, 64))
            dxs.append(x.grad)
            store.close(mb)
            if deferred:
                assert (mb > 0 or layer.weight.grad is None) and layer.bias.grad is not None
                store.compute(mb)
        out.append((dxs, layer.weight.grad, layer.bias.grad, layer.amax_history.clone()))
    (dx0, w0, b0, h0), (dx1, w1, b1, h1) = out
    assert all(torch.equal(a, b) for a, b in zip(dx0, dx1))
    assert torch.equal(w0, w1) and torch.equal(b0, b1) and torch.equal(h0, h1)


TOKEN_COUNTS = (0, 1, 7, 13, 40, 130)        # what top-k routing gives experts: rarely a multiple of 16, or none


def expert_step(layer, tokens, seed):
    """Forward and backward of one expert Linear on `tokens` rows: (y, dx, dW, db)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.in_features, generator=gen).requires_grad_()
    g = torch.randn(tokens, layer.out_features, generator=gen)
    layer.zero_grad()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_expert_token_counts(recipe):
    """An expert Linear in FP8 for every token count routing may give it: forward and backward pass CUDA's
    rules (dW contracts over the tokens), match the high-precision layer, and an expert without tokens gets an
    empty output and zero gradients."""
    torch.manual_seed(8)
    ref = nn.Linear(64, 48)
    fp8 = Float8Linear.from_float(nn.Linear(64, 48), recipe)
    fp8.load_state_dict(ref.state_dict())
    for tokens in TOKEN_COUNTS:
        got, want = expert_step(fp8, tokens, seed=tokens), expert_step(ref, tokens, seed=tokens)
        assert [t.shape for t in got] == [t.shape for t in want], tokens
        if tokens == 0:
            assert (got[2] == 0).all() and (got[3] == 0).all()
            continue
        floor = 15 if tokens > 1 else 10           # one token: its dW is a single outer product
        for name, a, b in zip(("y", "dx", "dW"), got, want):
            assert sqnr_db(b, a) >= floor, f"{recipe}, {tokens} tokens: {name} at {sqnr_db(b, a):.1f} dB"


@pytest.mark.usefixtures("scaled_mm_under_cuda_rules_without_blocks")
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_expert_token_counts_without_native_block_scales(recipe):
    """The same on a GPU without native block scales (Ada, or cuBLAS < 12.9), where blockwise runs per K-slice."""
    test_fp8_expert_token_counts(recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_moe_model_with_idle_experts(recipe):
    """A GPT whose MoE experts run in FP8, with more experts than tokens (some receive none, the others odd
    counts): a training step passes CUDA's rules and tracks the high-precision model."""
    from model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, n_experts=8, top_k=1)
    idx = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))   # 5 tokens, 8 experts
    losses = {}
    for fp8 in (False, True):
        model = GPT(cfg, seed=0)
        swapped = convert_to_float8(model, recipe) if fp8 else []
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses[fp8] = loss.item()
    counts = torch.bincount(model.transformer.h[0].mlp.routing.expert, minlength=8)
    assert (counts == 0).any() and any(f"experts.{e}.c_fc" in name for name in swapped for e in range(8))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert abs(losses[True] - losses[False]) <= 0.02 * losses[False], losses



def test_delayed_recipe_under_compile_with_two_forwards_in_flight():
    """A pipeline runs several micro-batches' forwards before their backwards. Under torch.compile a graph saved
    the delayed recipe's amax history, which the next forward updates in place, and the first backward failed
    autograd's version check (train_pp --kernels compile --fp8 delayed); the recipe's GEMMs now run outside the
    graph and give eager's gradients and history."""
    torch.manual_seed(0)
    layers = [Float8Linear.from_float(nn.Linear(32, 16), "delayed") for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    xs = [torch.randn(8, 32) for _ in range(2)]
    for layer, run in zip(layers, (torch.compile(layers[0]), layers[1])):
        outs = [run(x) for x in xs]                     # both forwards first, as 1F1B's warm-up does
        for y in reversed(outs):
            y.square().sum().backward()
    assert torch.equal(layers[0].weight.grad, layers[1].weight.grad)
    assert torch.equal(layers[0].amax_history, layers[1].amax_history)
