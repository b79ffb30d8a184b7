"""Split backward under tensor parallelism (zb1, zbv, dualpipev in train_5d with --tp): the column- and row-parallel
layers and the vocab-parallel LM head, handed a WeightGradStore, return the input gradient in B with its TP
communication and leave the weight gradients for W, which then equal the plain backward's (float64). With FP8 GEMMs
(converters/fp8_tp.py) W runs the layer's own FP8 dW GEMM on the operands F and B quantized: the unsplit
backward's gradients bit for bit, on a simulated H100 whose every _scaled_mm obeys CUDA's rules."""
import torch

from distributed_helper import run_workers


def _split_equals_plain(rank, world, sp, recipe=None):
    import torch.distributed as dist
    import cuda_scaled_mm
    import kernels.fp8 as fp8
    from common.comm import COMM
    from pipeline.weight_grads import WeightGradStore, defer_weight_grads
    from converters.fp8_tp import Float8ParallelGemms
    from converters.tp_gemms import with_gemm_slots
    from train_tp import ColumnParallelLinear, RowParallelLinear
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    group = dist.group.WORLD
    out = {}
    h, f = (256, 256) if recipe == "blockwise" else (8, 12)   # FP8 blockwise: shards of whole 128-blocks
    if recipe is not None:      # kernels/fp8.py on its H100 path, every _scaled_mm under CUDA's rules
        fp8.gemm_kind = cuda_scaled_mm.simulated_gpu("cuda_blocks")
        torch._scaled_mm = cuda_scaled_mm.cuda_rules_scaled_mm(native_blocks=True)
    for split in (False, True):
        torch.manual_seed(0)
        layers = torch.nn.Sequential(ColumnParallelLinear(h, f, group, sp=sp, dtype=torch.float64),
                                     RowParallelLinear(f, h, group, sp=sp, dtype=torch.float64))
        with_gemm_slots(layers)
        for p in layers.parameters():
            torch.nn.init.normal_(p)
        if recipe is not None:
            for layer, cut in zip(layers, ("out", "in")):
                layer.gemm = Float8ParallelGemms(recipe, group, cut)
        store = WeightGradStore()
        if split:
            defer_weight_grads(layers, store)
        x = torch.randn(2, 4, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        local = x.chunk(world, dim=1)[rank] if sp else x                 # SP: my sequence chunk
        COMM.reset()
        layers(local).square().sum().backward()
        after_b = [n for n, p in layers.named_parameters() if p.grad is not None]
        out[split] = dict(dx=x.grad.tolist(), bytes=COMM.bytes_sent, after_b=after_b)
        if split:
            store.close("mb")
            store.compute("mb")
        out[split]["grads"] = {n: p.grad.tolist() for n, p in layers.named_parameters()}   # (plain data: the
    return out                                                                 # worker exits before it is read)


def test_split_backward_under_tp_defers_weight_grads():
    for sp in (False, True):
        for r in run_workers(_split_equals_plain, 2, args=(sp,)):
            plain, split = r[False], r[True]
            assert torch.allclose(torch.tensor(split["dx"]), torch.tensor(plain["dx"]), rtol=1e-12, atol=0)
            assert split["bytes"] == plain["bytes"] > 0                  # B keeps TP's communication
            # B left the matmul weights (and the column bias) to W; the row bias is added after the sum: autograd's
            assert split["after_b"] == ["1.bias"] and len(plain["after_b"]) == 4
            for name, g in plain["grads"].items():
                assert torch.allclose(torch.tensor(split["grads"][name]), torch.tensor(g), rtol=1e-12, atol=1e-12), name


def _fp8_recipes(rank, world, recipes):
    return {recipe: _split_equals_plain(rank, world, True, recipe) for recipe in recipes}


def test_split_backward_of_fp8_tp_layers_is_the_unsplit_one():
    """Each recipe, with SP: dx from B, then dW and db from W, equal to the unsplit FP8 backward's bit for bit."""
    for r in run_workers(_fp8_recipes, 2, args=(("tensorwise", "rowwise", "blockwise", "delayed"),)):
        for recipe, (plain, split) in ((k, (v[False], v[True])) for k, v in r.items()):
            assert split["dx"] == plain["dx"] and split["bytes"] == plain["bytes"] > 0, recipe
            assert split["after_b"] == ["1.bias"], recipe
            assert split["grads"] == plain["grads"], recipe
