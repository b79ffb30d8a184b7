"""plan.py's compute priced from a card's measured rate table where one exists (planner/rates.py, written by
bench/gemm_rows.py --measure --save), from the published rates otherwise, and the prediction naming which."""
import importlib.util
import json

import pytest

import plan
from model import GPTConfig
from planner import rates as plan_rates
from planner import timing as plan_time
from planner.inputs import Job, Layout

H100_NAME = "NVIDIA H100 80GB HBM3"


def gemm_rows():
    spec = importlib.util.spec_from_file_location("gemm_rows", "bench/gemm_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def rates_dir(tmp_path, monkeypatch):
    """A fresh rate-table folder; the GEMM shape factors cached per card are recomputed around the test."""
    monkeypatch.setattr(plan_rates, "RATES_DIR", str(tmp_path))
    plan_time.shape_factor.cache_clear()
    yield tmp_path
    plan_time.shape_factor.cache_clear()
    plan_time.card_rates.cache_clear()


def job_on(gpu):
    cfg = GPTConfig(vocab_size=32000, block_size=2048, n_layer=8, n_head=16, n_embd=2048)
    return Job(cfg, 8, 8, gpu, 64)


def test_a_measured_table_prices_its_card(rates_dir):
    """A table whose GEMMs ran at half OpenXLA's H100 rates (same shapes) and whose causal attention ran at 200
    TFLOP/s: the H100's GEMM ceiling halves, its shape fit about the published one (the same curve, scaled), attention is
    priced at 200 / 989.4, and the kernels' time grows accordingly; plan.py names the table. An unmeasured card
    (A100) stays on the published rates."""
    rows = gemm_rows()
    gemm = [(m, n, k, t / 2) for m, n, k, t in rows.OUTPUT + rows.DEPTH]
    table = rows.rate_table(gemm, [(1, 32, 8192, 128, 200.0)], H100_NAME, 989.4, "2.11.0")
    path = rows.save_table(table)
    assert path == str(rates_dir / "h100.json") and json.load(open(path))["card"] == "h100"
    measured = plan_time.rates_of("h100")
    assert measured["gemm_eff"] == pytest.approx(783.3 / 2 / 989.4)
    assert measured["attn_eff"] == pytest.approx(200 / 989.4)
    # fitted against the table's own fastest row (783.3), where the published fit took MAMF's 792.1: close, not equal
    assert measured["gemm_shape"] == pytest.approx(plan_time.GEMM_SHAPE, rel=0.06)
    published = plan_time.published_rates("h100")
    assert plan_time.kernel_time(1e12, 0, measured, 1.0) / plan_time.kernel_time(1e12, 0, published, 1.0) == \
        pytest.approx(published["gemm_eff"] / measured["gemm_eff"])
    fast = plan.evaluate(job_on("h100"), Layout(dp=8))
    assert fast["priced_by"].startswith("measured:") and fast["priced_by"].endswith("h100.json")
    assert plan.evaluate(job_on("a100"), Layout(dp=8))["priced_by"].startswith("published:")
    (rates_dir / "h100.json").unlink()
    plan_rates.read_table.cache_clear()
    plan_time.card_rates.cache_clear()
    plan_time.shape_factor.cache_clear()
    slow = plan.evaluate(job_on("h100"), Layout(dp=8))
    assert slow["priced_by"].startswith("published:") and fast["time_s"]["compute"] > 1.4 * slow["time_s"]["compute"]


def test_a_table_of_another_card_is_refused(rates_dir, capsys):
    """A table filed under a card it was not measured on is one `error:` line before any work, not a silent price."""
    (rates_dir / "a100.json").write_text(json.dumps(dict(card="h100", peak_tflops=989.4, gemm=[[1, 1, 1, 1.0]],
                                                         gemm_shape=plan_time.GEMM_SHAPE, attention=[[1, 1, 1, 1, 1.0]])))
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "gpt2", "--gpu", "a100", "--gpus", "8", "--seq", "1024", "--global_batch_tokens", "64K"])
    assert e.value.code == 2 and "not a rate table of 'a100'" in capsys.readouterr().err
