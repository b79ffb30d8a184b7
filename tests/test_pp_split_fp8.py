"""Zero-bubble schedules (zb1, zbv, dualpipev) with FP8 and the fused kernels: their W step computes what the
unsplit backward would (pipeline/weight_grads.py).

FP8 has no float64 parity with train_single; the reference is the same run with 1f1b and the same recipe.
  - zb1 runs the same GEMMs on the same quantized operands as 1f1b, only later, and adds each micro-batch's
    weight gradient in the same order: the same losses and grad norms, bit for bit, for every recipe.
  - zbv and dualpipev hold both ends of the model on rank 0, where the tied embedding's two gradients add in
    autograd's order instead of 1f1b's all-reduce between two ranks: float64 rounding (1e-16) that in float64
    moves no value across a quantization step in these few steps, so within EXACT (1e-9).
--kernels triton (under TRITON_INTERPRET=1, float64 inside the kernels): zb1 and zbv against 1f1b within EXACT,
the fused LM head's dW now recomputed in W and the fused block's matmuls deferred. train_5d: dp 2 x pp 2 with
ZeRO-2 (reduce-scatters after each W), zb1 and FP8 against the same layout with 1f1b within EXACT.
"""
from distributed_helper import run_workers
from train_helpers import assert_exact, curves, tiny_argv

RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")


def _runs(rank, world, script, argvs):
    import importlib
    main = importlib.import_module(script).main
    for argv in argvs:
        main(argv)


def _run_all(script, world, tmp_path, data, cases, **common):
    """{name: (losses, grad norms)} of train_pp / train_5d runs, one process group for all of them."""
    argvs = [tiny_argv(data, str(tmp_path / name), **{**common, **opts}) for name, opts in cases.items()]
    run_workers(_runs, world, args=(script, argvs), timeout=900)
    return {name: curves(str(tmp_path / name)) for name in cases}


def test_zero_bubble_fp8_equals_1f1b(tiny_data, tmp_path):
    """Every recipe: zb1 is 1f1b bit for bit; zbv and dualpipev (delayed: the recipe with state) within EXACT."""
    cases = {f"{s}_{r}": dict(pp_schedule=s, fp8=r) for r in RECIPES for s in ("1f1b", "zb1")}
    cases.update({f"{s}_delayed": dict(pp_schedule=s, fp8="delayed", pp_virtual=2) for s in ("zbv", "dualpipev")})
    got = _run_all("train_pp", 2, tmp_path, tiny_data, cases, pp=2, n_layer=4, micro_batch_size=2, max_steps=4,
                   dtype="float64")
    for r in RECIPES:
        assert got[f"zb1_{r}"] == got[f"1f1b_{r}"], r
    for s in ("zbv", "dualpipev"):
        assert_exact(got["1f1b_delayed"], got[f"{s}_delayed"])
    assert got["1f1b_tensorwise"] != got["1f1b_rowwise"], "FP8 must be on"


def test_zero_bubble_fused_kernels_equal_1f1b(tiny_data, tmp_path):
    """--kernels triton (interpreted, float64): zb1 and zbv against 1f1b with the same kernels."""
    cases = {s: dict(pp_schedule=s, pp_virtual=2 if s == "zbv" else 1) for s in ("1f1b", "zb1", "zbv")}
    got = _run_all("train_pp", 2, tmp_path, tiny_data, cases, pp=2, n_layer=4, global_batch_size=4,
                   micro_batch_size=2, max_steps=2, dtype="float64", kernels="triton")
    for s in ("zb1", "zbv"):
        assert_exact(got["1f1b"], got[s])


def test_5d_zb1_fp8_equals_1f1b(tiny_data, tmp_path):
    """train_5d, dp 2 x pp 2 with ZeRO-2: zb1 with FP8 (delayed: the recipe with state) against 1f1b with FP8.
    ZeRO-2 reduce-scatters a chunk's gradients after each W under zb1, after each B under 1f1b: what B computes
    (LayerNorms, biases, the head) of two micro-batches can be added on the rank before the reduction instead of
    after it, float64 rounding, so within EXACT."""
    cases = {s: dict(pp_schedule=s) for s in ("1f1b", "zb1")}
    got = _run_all("train_5d", 4, tmp_path, tiny_data, cases, dp=2, pp=2, zero_stage=2, micro_batch_size=1,
                   max_steps=2, fp8="delayed", dtype="float64")
    assert_exact(got["1f1b"], got["zb1"])


def _block_grads(store, compiled=True):
    """Weight gradients of one model.py block under --kernels compile (the FusedBlock compiled whole; with
    compiled=False the same FusedBlock run eagerly) with FP8, over two micro-batches; with a store, each B leaves
    dW to W, run after it."""
    import torch
    from pipeline.weight_grads import defer_weight_grads
    from kernels import apply_kernels, convert_to_float8
    from kernels.apply import FusedBlock
    from model import Block, GPTConfig, rope_cache
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(GPTConfig(n_embd=32, n_head=2, block_size=8, vocab_size=64))])
    if compiled:
        apply_kernels(blocks, "compile")
    else:
        blocks[0] = FusedBlock(blocks[0], "torch")
    convert_to_float8(blocks, "tensorwise")
    if store is not None:
        defer_weight_grads(blocks, store)
    rope = rope_cache(16, torch.arange(8))
    for mb in range(2):
        x = torch.randn(2, 8, 32, requires_grad=True)
        blocks[0](x, rope).backward(torch.randn(2, 8, 32))
        if store is not None:
            assert mb > 0 or all(p.grad is None for n, p in blocks.named_parameters() if n.endswith("fc.weight"))
            store.close(mb)
            store.compute(mb)
    return {n: p.grad for n, p in blocks.named_parameters()}


def test_compiled_fused_block_keeps_fp8_dw_for_w():
    """--kernels compile: the FP8 layers inside a compiled FusedBlock still hand their dW to the store (the
    compiled graph does not swallow B's stash: no dW after the first B), and W's gradients are the unsplit
    backward's. The reference is the same FusedBlock uncompiled, which spares the suite a second cold compile of
    the block (inductor's C++ kernels take seconds each on CPU); the compiled bias+GeLU rounds apart
    from the eager one by float32 ulps (3e-7 here), while a swallowed, doubled or missing micro-batch's dW is a
    difference of order one."""
    import torch
    from pipeline.weight_grads import WeightGradStore
    plain, split = _block_grads(None, compiled=False), _block_grads(WeightGradStore())
    for n in plain:
        torch.testing.assert_close(split[n], plain[n], rtol=1e-5, atol=1e-5 * plain[n].abs().max().item(), msg=n)
