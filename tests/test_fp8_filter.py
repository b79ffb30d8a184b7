"""
Which Linears run FP8 (kernels/fp8.py's size filter, converters/apply.py's line at start) and that a compiled
FP8 Linear is one graph: on a GPU a Linear whose GEMMs are too small to gain stays in high precision (torchao's
auto-filter thresholds: every block Linear of GPT-2-small under row scales, all but MLP.c_proj under tensor
scales; every one at n_embd 4096), and torch.compile traces Float8Linear's forward and backward without a break.
"""
import pytest
import torch
import torch.nn as nn

import kernels.fp8 as fp8
from cuda_scaled_mm import simulated_gpu
from kernels.fp8 import Float8Linear, convert_to_float8


def gpt_block_linears(C, n_blocks=2):
    """The four Linears of n_blocks GPT blocks at width C, on the meta device (no memory at C = 4096)."""
    def block():
        shapes = dict(c_attn=(C, 3 * C), c_proj=(C, C), c_fc=(C, 4 * C), mlp_proj=(4 * C, C))
        return nn.ModuleDict({name: nn.Linear(*shape, device="meta") for name, shape in shapes.items()})
    return nn.ModuleDict(dict(h=nn.ModuleList([block() for _ in range(n_blocks)])))


@pytest.mark.parametrize("C,recipe,expected", [
    (768, "tensorwise", ["mlp_proj"]), (768, "rowwise", []), (768, "blockwise", []),
    (4096, "tensorwise", ["c_attn", "c_proj", "c_fc", "mlp_proj"]),
    (4096, "rowwise", ["c_attn", "c_proj", "c_fc", "mlp_proj"])])
def test_size_filter_keeps_linears_too_small_to_gain(C, recipe, expected, monkeypatch):
    monkeypatch.setattr(fp8, "gemm_kind", simulated_gpu("cuda"))
    swapped = convert_to_float8(gpt_block_linears(C), recipe, size_filter=True)
    assert swapped == [f"h.{i}.{name}" for i in range(2) for name in expected]
    # without the filter (the kernel API's default) and on a CPU every Linear is swapped
    assert len(convert_to_float8(gpt_block_linears(C), recipe)) == 8
    monkeypatch.setattr(fp8, "gemm_kind", simulated_gpu("cpu"))
    assert len(convert_to_float8(gpt_block_linears(C), recipe, size_filter=True)) == 8


def test_converter_prints_which_layers_run_fp8(monkeypatch, capsys):
    from converters.apply import report_fp8_layers
    monkeypatch.setattr(fp8, "gemm_kind", simulated_gpu("cuda"))
    model = gpt_block_linears(768)
    report_fp8_layers(model, convert_to_float8(model, "tensorwise", size_filter=True), "tensorwise")
    assert capsys.readouterr().out == ("fp8 tensorwise: FP8 GEMMs in 2 Linear layers (2 x h.*.mlp_proj); high "
                                       "precision in 6 (2 x h.*.c_attn, 2 x h.*.c_proj, 2 x h.*.c_fc)\n")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_float8_linear_has_no_graph_break(recipe):
    """torch._dynamo.explain of a Float8Linear (bias included) on the CPU path: one graph, no break (dynamo traces
    the autograd.Function's forward and backward both, or breaks the graph at it). The delayed recipe leaves its
    GEMMs eager on purpose (its amax history; kernels/fp8.py)."""
    torch._dynamo.reset()
    layer = Float8Linear.from_float(nn.Linear(64, 32), recipe)
    explained = torch._dynamo.explain(lambda x: layer(x))(torch.randn(16, 64, requires_grad=True))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
