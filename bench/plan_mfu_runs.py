"""
bench/plan_mfu_runs.py: published runs added to plan.py's MFU validation after its constants were set (held out:
nothing in plan.py was built or checked against them before they were added, and each was added whatever plan.py's
error on it turned out to be). bench/plan_validation.py puts them in its table and counts them apart. Held out
from the table and from every constant, not necessarily unseen: async TP speed-ups of about 1.1x, the size this
benchmark reports, were known when plan.py's TP overlap was derived; and the rules of planner/comm.sp_collectives
(DTensor keeps the gathered inputs; what torch's async-TP pass fuses) were read from torch's source after these rows'
errors were seen, so for them the four rows are a check, not held out.

Each row describes the run as published; its docstring names the source of each input and what was assumed where
the publication is silent. Left out of this file, with the reason:
- torchtitan's float8 rows (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md's float8 tensorwise and rowwise
  rows, benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md's TPS/GPU): Float8 GEMMs, where plan.py models
  16-bit ones (the rule bench/plan_validation.py applies to torchtitan's 2024-12 70B / 405B rows). The Trainy runs'
  memory is in bench/plan_memory_runs.py, and so are the float8 rows as runs that ran (PUBLISHED_RAN: their OOM
  verdicts).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from planner.inputs import Layout  # noqa: E402
from planner.timing import SOFTWARE, TP_OVERLAP  # noqa: E402
from plan_tables import H100_SXM, LLAMA3_8B, LLAMA3_70B, Setup, titan_mfu  # noqa: E402

TITAN_ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"


def titan_async_tp(name, shape, fsdp, local_batch, recompute, tps, async_tp, n_params, L, h):
    """A bfloat16 row of torchtitan's async TP benchmark (June 2025; checked against the file and its first version,
    commit 5ecb74e, which lists each row's command line). Grand Teton H100 (96 GB HBM2e, 400 Gb/s per GPU, "the
    default 500W power limit"): plan.py's h100-hbm2e, as torchtitan's 2024-12 rows. Layout from the row's heading and
    command: FSDP `fsdp` x TP 8 (--parallelism.tensor_parallel_degree=8; torchtitan's TP is sequence-parallel),
    --training.local-batch-size per data-parallel rank, no gradient accumulation (micro-batch = local batch),
    torch.compile, the row's activation checkpointing (70B: full; 8B: selective "op", plan.py's op policy),
    seq_len 8192 (the llama3_8b.toml / llama3_70b.toml of the benchmark's torchtitan commit 820504e), the 8B / 70B
    shapes of Llama 3.1 (untied, vocabulary 128,256). Software: planner/timing.SOFTWARE["torchtitan"], the states in
    job_of's bf16 recipe as the table's other torchtitan rows; async TP (--parallelism.enable_async_tensor_parallel:
    torch's micro-pipelined TP, an SP all-gather or reduce-scatter split into tp chunks run beside its matmul's
    chunks) is --tp_overlap 1 under the torchtitan entry's tp_overlap_style "torch" (planner/comm.sp_collectives: the
    collectives torch's pass fuses), vanilla TP 0. The page's
    column "tokens/sec" is read as torchtitan's logged tps, per GPU (the metric of its 2024-12 benchmark's
    "TPS/GPU"; the page does not say): assumed. MFU as the 2024-12 rows' (plan_tables.titan_mfu) over H100 SXM's
    989.5 TFLOP/s; what torch.compile fuses is not modelled in time, and in memory only its SwiGLU (fused_swiglu,
    which these rows' full and op recompute leave without effect)."""
    lay = Layout(dp=fsdp, tp=8, sp=True, zero_stage=3, micro_batch_size=local_batch, recompute=recompute)
    job = dict(SOFTWARE["torchtitan"], tp_overlap=TP_OVERLAP["nemo-te"] if async_tp else 0.0, fused_swiglu=True)
    return Setup(name + (", async TP" if async_tp else ", TP"), TITAN_ASYNC_TP, shape, 8 * fsdp, "h100-hbm2e", 8192,
                 fsdp * local_batch, lay, titan_mfu(tps, n_params, L, h, 8192, 128256, H100_SXM),
                 f"{tps} tokens/s/GPU", "torchtitan-2025-06", job, seen=(SP_COLLECTIVES,))


# written after these rows' errors were seen (the module's docstring): which SP collectives torch's async TP pipelines
# and DTensor keeping the gathered inputs
SP_COLLECTIVES = "comm.sp_collectives: DTensor's kept gathers, torch's async-TP fusions"


TITAN_70B = dict(shape=LLAMA3_70B, fsdp=32, local_batch=16, recompute="full", n_params=70.55e9, L=80, h=8192)
TITAN_8B = dict(shape=LLAMA3_8B, fsdp=8, local_batch=12, recompute="op", n_params=8.03e9, L=32, h=4096)
HELD_OUT = [titan_async_tp("Llama 3.1 70B", tps=597.3, async_tp=False, **TITAN_70B),
            titan_async_tp("Llama 3.1 70B", tps=652.4, async_tp=True, **TITAN_70B),
            titan_async_tp("Llama 3.1 8B", tps=4378, async_tp=False, **TITAN_8B),
            titan_async_tp("Llama 3.1 8B", tps=4809.4, async_tp=True, **TITAN_8B)]
