"""
planner/rates.py: measured compute rates of a card, one JSON table per card under bench/results/rates/, read when
present; planner/timing.rates_of prices a job's compute with it, and with the published rates (Bekman's MAMF
ceilings, OpenXLA's H100 matmul table, FlashAttention's utilization) only for a card never measured. Every
prediction names the table that priced it (plan.py prints it; --json: "priced_by").

    python bench/gemm_rows.py --measure --save      # on a GPU: writes bench/results/rates/<card>.json

A table (what bench/gemm_rows.py --save writes; the card is an inputs.HARDWARE key, the file's name):
    {"card": "h100", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "peak_tflops": 989.4,
     "gemm": [[m, n, k, TFLOP/s], ...],             bf16 torch.matmul, the shapes of bench/gemm_rows.py
     "gemm_shape": {"e0": ..., "a": ..., "k0": ..., "b": ...},   their fit (timing.GEMM_SHAPE's form)
     "attention": [[batch, heads, seq, head_dim, TFLOP/s], ...]} causal SDPA, forward + backward, on plan's count of
                                                                  executed FLOPs (timing.ATTN_EFF's convention)
gemm_eff is the fastest GEMM row / peak, attn_eff the slowest attention row / peak (the longest sequences price
the attention that matters).
"""
import json
import os
from functools import lru_cache

from common.errors import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES_DIR = os.path.join(ROOT, "bench", "results", "rates")
FIELDS = ("card", "peak_tflops", "gemm", "gemm_shape", "attention")


def table_path(card, directory=None):
    """Where the table of `card` lives."""
    return os.path.join(directory or RATES_DIR, f"{card}.json")


def measured(card, directory=None):
    """The measured rates of `card` (dict(gemm_eff, attn_eff, gemm_shape, source)), or None where never measured.
    A table missing a field, or of another card, is refused (ConfigError naming the file; planner/cli.build_job
    reads the job's card first): a wrong table would price every run silently."""
    return read_table(table_path(card, directory), card)


@lru_cache(maxsize=None)
def read_table(path, card):
    """measured's table at `path` (cached per file: the search prices thousands of layouts)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        table = json.load(f)
    missing = [k for k in FIELDS if k not in table]
    check(not missing and table["card"] == card and table["gemm"] and table["attention"],
          f"{path}: not a rate table of {card!r} (missing {missing or 'rows'}; bench/gemm_rows.py --measure --save "
          "writes one)")
    peak = table["peak_tflops"]
    return dict(gemm_eff=max(row[-1] for row in table["gemm"]) / peak,
                attn_eff=min(row[-1] for row in table["attention"]) / peak,
                gemm_shape=dict(table["gemm_shape"]), source=f"measured: {os.path.relpath(path, ROOT)}")
