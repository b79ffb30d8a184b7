"""FP8 and fused kernels inside tensor-parallel layers (converters/fp8_tp.py, kernels/apply.py, train_tp's layers).

Layers: a column / row-parallel layer with FP8 GEMMs quantizes every operand as one device would (the amaxes maxed
over tp where a scale spans a split tensor or contraction), so every GEMM that contracts over a whole dimension is
bit for bit one device's, and the split ones differ by the fp32 rounding of their tp partial sums only; on the
CPU's path and on a simulated H100 (tests/cuda_scaled_mm.py: every _scaled_mm checked against CUDA's rules).
Training: --kernels triton with tp 2 + SP is train_single --kernels triton in float64 (the interpreter's
precision); each FP8 recipe with tp 2 + SP is the same recipe at tp 1 within docs/kernels.md's bound; the counted
TP bytes are train_tp's plus the amax all-reduces of the recipe, by formula."""
import pytest

from distributed_helper import run_workers
from common.metrics import read_metrics
from train_helpers import EXACT, TRITON_TWO_STEPS, assert_exact, curves, run_single, text_argv

RECIPES = ("tensorwise", "rowwise", "delayed", "blockwise")
SPLIT_FP32 = 1e-6          # a split contraction's fp32 partial sums (~1e-7 measured): the only difference
SPLIT_BF16 = 1e-2          # the same with the GPU's bf16 outputs of row / block-scaled GEMMs (~2.4e-3 measured)


def _layer_errors(rank, world, cases):
    """Per case (recipe, sp, simulated GPU): relative errors of (y, dx, dW) of a column and a row-parallel layer
    with FP8 GEMMs against a Float8Linear holding the whole weight, over two calls (delayed: its history)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import cuda_scaled_mm
    import kernels.fp8 as fp8
    import train_tp as tp
    from converters.fp8_tp import Float8ParallelGemms
    from converters.tp_gemms import with_gemm_slots
    dist.init_process_group("gloo")
    group, out = dist.group.WORLD, {}
    real = (fp8.gemm_kind, torch._scaled_mm)
    for recipe, sp, gpu in cases:
        fp8.gemm_kind, torch._scaled_mm = real
        if gpu:     # kernels/fp8.py on its H100 path, every _scaled_mm under CUDA's rules
            fp8.gemm_kind = cuda_scaled_mm.simulated_gpu("cuda_blocks")
            torch._scaled_mm = cuda_scaled_mm.cuda_rules_scaled_mm(native_blocks=True)
        # odd widths: shards of 24 and 20 are no multiples of 16 (padded on the GPU path); blockwise: whole blocks
        K, N = (256, 256) if recipe == "blockwise" else (48, 40)
        for kind in ("column", "row"):
            torch.manual_seed(0)
            dense = nn.Linear(K, N).double()
            ref = fp8.Float8Linear.from_float(dense, recipe)
            layer = with_gemm_slots(tp.ColumnParallelLinear(K, N, group, sp) if kind == "column" else
                                    tp.RowParallelLinear(K, N, group, sp)).double()
            for p, full in zip(layer.parameters(), (dense.weight, dense.bias)):
                tp.load_shard(p, full.detach(), group)
            layer.gemm = Float8ParallelGemms(recipe, group, "out" if kind == "column" else "in")
            mine_x = (lambda t: t.chunk(world, -1)[rank]) if kind == "row" else (lambda t: t)
            mine_y = (lambda t: t.chunk(world, -1)[rank]) if kind == "column" else (lambda t: t)
            seq = (lambda t: t.chunk(world, 1)[rank]) if sp else (lambda t: t)
            for call in range(2):
                x = torch.randn(2, 8, K, dtype=torch.float64) * (1 + call)
                dy = torch.randn(2, 8, N, dtype=torch.float64)
                x_ref = x.clone().requires_grad_()
                y_ref = ref(x_ref)
                y_ref.backward(dy)
                x_mine = (seq(x) if kind == "column" else mine_x(x)).clone().requires_grad_()
                y = layer(x_mine)
                y.backward(mine_y(dy) if kind == "column" else seq(dy))
                want_y = mine_y(y_ref.detach()) if kind == "column" else seq(y_ref.detach())
                want_dx = seq(x_ref.grad) if kind == "column" else mine_x(x_ref.grad)
                want_dw = ref.weight.grad.chunk(world, 0 if kind == "column" else 1)[rank]

                def rel(a, b):
                    return float((a.detach() - b).norm() / b.norm())
                out.setdefault((recipe, sp, gpu, kind), []).append(
                    (rel(y, want_y), rel(x_mine.grad, want_dx), rel(layer.weight.grad, want_dw)))
                ref.weight.grad = layer.weight.grad = None
    return out


def test_parallel_fp8_layers_quantize_as_one_device():
    cases = [(r, sp, gpu) for r in RECIPES for sp in (False, True) for gpu in (False, True)]
    errors = run_workers(_layer_errors, 2, args=(cases,), timeout=600)
    for (recipe, sp, gpu, kind), calls in errors[0].items():
        split = SPLIT_BF16 if gpu and recipe in ("rowwise", "blockwise") else SPLIT_FP32
        for y, dx, dw in calls:
            # column: y and dW contract over whole dims, dx over the split out features; row: y over the split in
            whole, part = ((y, dw), dx) if kind == "column" else ((dx, dw), y)
            assert whole == (0.0, 0.0), (recipe, sp, gpu, kind, whole)
            assert part < split, (recipe, sp, gpu, kind, part)


# ----------------------------------------------------------------------------------------------------------
# training: train_5d and train_tp with tp 2 + SP against train_single with the same flags

def _runs(rank, world, jobs):
    """(script, argv) each; rank 0 returns, per run, the kinds of modules in its model and how many layers run FP8."""
    import importlib
    from converters.fp8_tp import Float8ParallelGemms
    out = []
    for script, argv in jobs:
        result = importlib.import_module(script).main(argv)
        model = result.get("model") or result.get("chunks")
        out.append(dict(kinds={type(m).__name__ for m in model.modules()},
                        fp8=sum(isinstance(getattr(m, "gemm", None), Float8ParallelGemms) for m in model.modules())))
    return out if rank == 0 else None


def _axis(out_dir, axis):
    return [r["comm_bytes_by_axis"][axis] for r in read_metrics(out_dir)]


def test_fused_kernels_under_tp_and_sp_equal_tp1(text_data, text_reference_triton, tmp_path):
    """--kernels triton (interpreted) with tp 2 + SP: LayerNorm, bias+GeLU on the column shard, bias+dropout+
    residual after the row sum, flash attention on this rank's heads, the vocab-parallel head unchanged; the curve
    is train_single's with the same kernels, and the counted TP bytes are the unfused run's."""
    opts, ref = TRITON_TWO_STEPS, text_reference_triton
    dirs = {name: str(tmp_path / name) for name in ("fused", "plain")}
    jobs = [("train_5d", text_argv(text_data, dirs["fused"], tp=2, sp=True, kernels="triton", **opts)),
            ("train_5d", text_argv(text_data, dirs["plain"], tp=2, sp=True, **opts))]
    kinds = run_workers(_runs, 2, args=(jobs,), timeout=900)[0][0]["kinds"]
    assert {"FusedLayerNorm", "FusedBlock", "FlashAttentionCore", "VocabParallelLMHead"} <= kinds, kinds
    assert "FusedLMHead" not in kinds and "LayerNorm" not in kinds, kinds
    assert_exact(ref, curves(dirs["fused"]), rtol=EXACT)
    assert _axis(dirs["fused"], "tp") == _axis(dirs["plain"], "tp")


def amax_bytes_per_step(recipe, micro_batches=4, tokens=64, n_embd=32, n_layer=2):
    """The amax all-reduces FP8 adds to a step's TP bytes at tp 2 (comm.py's ring: an all-reduce of S bytes sends
    S at n = 2), float32 values. Per block and micro-batch: tensorwise / delayed maxes one value per split tensor
    (column: W forward, dy backward; row: x and W forward: 8); rowwise the row amaxes of a split contraction's
    operands (column dx: M + K, row y: M + N); blockwise none (its shards are whole blocks)."""
    per_block = dict(tensorwise=8, delayed=8, rowwise=4 * (tokens + n_embd), blockwise=0)[recipe]
    return micro_batches * n_layer * per_block * 4


FP8_STEP0 = dict(loss=1e-5, grad_norm=1e-3)     # docs/kernels.md: the same weights, sums in another fp32 order
FP8_STEP1 = dict(loss=1e-3, grad_norm=1e-2)     # after one AdamW update from gradients that differ that much


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_under_tp_and_sp_equals_tp1(recipe, text_data, tmp_path):
    """Each recipe's FP8 GEMMs in every column / row-parallel layer (tp 2 + SP) against the same recipe at tp 1
    within FP8_STEP0 / FP8_STEP1; train_tp runs it alike (the same curve, the same bytes); the TP bytes are the
    unfused layout's plus the recipe's amax all-reduces. Blockwise needs n_embd / tp a multiple of 128."""
    opts = dict(max_steps=2, micro_batch_size=2, fp8=recipe, **(dict(n_embd=256) if recipe == "blockwise" else {}))
    dirs = {name: str(tmp_path / name) for name in ("single", "5d", "tp", "plain")}
    ref = run_single(text_argv(text_data, dirs["single"], **opts), both_curves=True)[0]
    layout = dict(tp=2, sp=True)
    plain = {k: v for k, v in opts.items() if k != "fp8"}
    jobs = [("train_5d", text_argv(text_data, dirs["5d"], **layout, **opts)),
            ("train_tp", text_argv(text_data, dirs["tp"], **layout, **opts)),
            ("train_5d", text_argv(text_data, dirs["plain"], **layout, **plain))]
    runs = run_workers(_runs, 2, args=(jobs,), timeout=900)[0]
    assert runs[0]["fp8"] == runs[1]["fp8"] == 4 * 2 and runs[2]["fp8"] == 0     # 4 parallel Linears per block
    got = curves(dirs["5d"])
    for step, bound in enumerate((FP8_STEP0, FP8_STEP1)):
        for i, what in enumerate(("loss", "grad_norm")):
            assert abs(got[i][step] - ref[i][step]) <= bound[what] * ref[i][step], (recipe, step, what)
    assert_exact(curves(dirs["tp"]), got)           # train_tp's layers are train_5d's: the same numbers
    tp_bytes = _axis(dirs["5d"], "tp")
    extra = amax_bytes_per_step(recipe, n_embd=opts.get("n_embd", 32))
    assert tp_bytes == [b + extra for b in _axis(dirs["plain"], "tp")], (tp_bytes, extra)
    assert [r["comm_bytes"] for r in read_metrics(dirs["tp"])] == \
        [r["comm_bytes"] for r in read_metrics(dirs["5d"])]
