"""
bench/plan_validation.py: plan.py's predicted MFU and OOM verdict for published dense training runs, each run
described as published; writes bench/results/plan_validation.md.

    python bench/plan_validation.py            # prints the table and writes bench/results/plan_validation.md (~1 min)
    python bench/plan_validation.py --out -    # print only

The runs: every row of Narayanan et al. 2021, Table 1 (A100, s = 2048, 32-3,072 GPUs; four of them are also in
bench/plan_tables.md, six are not), torchtitan's Llama 3 rows (A100 and H100, s = 8192) with Llama 3's published
shapes, and Llama 3 405B's pre-training stages (Dubey et al. 2024, Table 4: H100, s = 8,192 and 131,072, 8,192 and
16,384 GPUs). Nothing in plan.py was fitted to any of them: its compute efficiency is measured GEMM and attention
ceilings x one software share from MosaicML's MPT-7B A100 row (common/plan_time.py), its latencies NCCL's.
Every run ran, so the right OOM verdict for each is "fits".
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from common import plan_shape  # noqa: E402
from common.plan_inputs import GIB, MODELS, Layout  # noqa: E402
from common.plan_time import SOFTWARE  # noqa: E402
from plan import evaluate  # noqa: E402
from plan_tables import A100, H100_SXM, SETUPS, Setup, describe, job_of, megatron, write_report  # noqa: E402

LLAMA3 = "Dubey et al. 2024 (arXiv 2407.21783) Table 4"

# Narayanan et al. 2021, Table 1 rows not in plan_tables.SETUPS, with micro-batch, DDP and virtual stages from
# Megatron-LM's examples/sc21/run_table_1.sh (layers per virtual stage 5, 5, 3, 1 for 76B, 145B, 310B, 530B)
MEGATRON_MORE = [
    megatron("3.6B", 30, 3072, 32, 64, 2, 1, 16, 512, 138, overlap=True),
    megatron("7.5B", 36, 4096, 32, 128, 4, 1, 16, 512, 142, overlap=True),
    megatron("39.1B", 48, 8192, 64, 512, 8, 2, 4, 1536, 138),
    megatron("76.1B", 60, 10240, 80, 1024, 8, 4, 2, 1792, 140, v=3),
    megatron("310.1B", 96, 16384, 128, 1920, 8, 16, 1, 2160, 155, v=2),
    megatron("529.6B", 105, 20480, 128, 2520, 8, 35, 1, 2520, 163, v=3),
]


def llama3_405b(name, gpus, cp, seq, tflops):
    """A row of Table 4: TP 8, PP 16, 16M tokens per step, micro-batch 1, SP with TP, optimizer states sharded over
    dp (ZeRO-1 here; the paper's FSDP shards gradients too), no recompute at 8K ("we could pre-train Llama 3 on
    sequences of 8K tokens without activation checkpointing"; not stated at 128K: the same assumed). Stages
    (Sec. 3.3.2): the interleaved schedule with the embedding and the loss each in a layer's place ("we reduce one
    Transformer layer each from the first and the last stages ... the first model chunk on the first stage has only
    the embedding, and the last model chunk on the last stage has only output projection and loss"): chunks of one
    layer, so (126 + 2) / 16 = 8 chunks per rank. The paper's schedule groups N micro-batches per chunk, N between
    PP (Megatron's depth-first order, what plan.py models) and M; the in-flight count is Megatron's at N = PP, the
    fewest of that range. Software: plan_time.SOFTWARE["llama3"] (FSDP prefetching, asynchronous pipeline sends).
    Its MFU is over H100 SXM's 989 TFLOP/s; the paper does not state its FLOP count (plan.py's
    counts the attention scores unmasked: at 131,072 tokens that is 1.4x what a causal count gives)."""
    dp = gpus // (8 * cp * 16)
    shape = MODELS["llama3-405b"]         # its preset splits the pipeline as Sec. 3.3.2 does
    lay = Layout(dp=dp, tp=8, cp=cp, pp=16, sp=True, zero_stage=1, schedule="interleaved", v=8, micro_batch_size=1)
    return Setup(name, LLAMA3, shape, gpus, "h100", seq, 16 * 2 ** 20 // seq, lay, tflops * 1e12 / H100_SXM,
                 f"{tflops} TFLOP/s/GPU", "llama3", dict(SOFTWARE["llama3"]))


LLAMA3_405B = [llama3_405b("Llama 3 405B, 8K", 8192, 1, 8192, 430),
               llama3_405b("Llama 3 405B, 8K", 16384, 1, 8192, 400),
               llama3_405b("Llama 3 405B, 128K", 16384, 16, 131072, 380)]

RUNS = sorted(SETUPS + MEGATRON_MORE, key=lambda s: (s.source, s.gpus)) + LLAMA3_405B


# the --software entry (plan_time.SOFTWARE) each publication's stack is; its row's Job fields are that entry's, but
# for Megatron's two smallest rows, which ran torch DDP (overlapped) instead of its local DDP (run_table_1.sh)
SOFTWARE_OF = {"megatron-2021": "megatron-2021", "torchtitan-2024-04": "torchtitan", "torchtitan-2024-12": "torchtitan",
               "llama3": "llama3"}


def predict(setup):
    """plan.py's prediction for the published layout: MFU (model FLOPs over the publication's peak) and memory."""
    job = job_of(setup)
    row = evaluate(job, setup.layout)
    peak = H100_SXM if setup.gpu.startswith("h100") else A100
    mfu = row["tokens_per_s"] * plan_shape.flops_per_token(job) / (job.gpus * peak)
    return dict(setup=setup, row=row, mfu=mfu, error=mfu / setup.published_mfu - 1)


def table(results):
    within = sum(abs(r["error"]) <= 0.15 for r in results)
    fits = sum(not r["row"]["oom"] for r in results)
    lines = [f"**Predicted MFU within 15% of the published: {within} of {len(results)}. OOM verdict right (the run "
             f"fits): {fits} of {len(results)}.**", "",
             "| run | source | software | GPUs | seq | layout | published | published MFU | plan.py MFU (error) | "
             "predicted memory | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s, row = r["setup"], r["row"]
        lines.append(f"| {s.name} | {s.source} | {SOFTWARE_OF[s.system]} | {s.gpus} {s.gpu} | {s.seq} | "
                     f"{describe(row)} | {s.published_text} | {100 * s.published_mfu:.1f}% | {100 * r['mfu']:.1f}% ({100 * r['error']:+.0f}%) | "
                     f"{row['mem_bytes']['total'] / GIB:.1f} GiB | {'OOM (wrong)' if row['oom'] else 'fits'} |")
    return "\n".join(lines)


HEAD = """# plan.py against published runs

Produced by `python bench/plan_validation.py` (plan.py's defaults; nothing fitted to these runs). MFU = model FLOPs
(6N + 12·L·h·s, N every matmul weight: an untied input embedding is a lookup) / the peak the publication used
(A100 312, H100 SXM 989.5 TFLOP/s); Megatron's and torchtitan's figures converted as in bench/plan_tables.md. Each
run is described as published; where a publication leaves an input out, the row's docstring in the script says
what was assumed. Every run here ran, so "fits" is the right verdict for each.
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_validation.md"), help="file, or -")
    args = p.parse_args(argv)
    text = HEAD + "\n" + table([predict(s) for s in RUNS])
    return write_report(text, args.out)


if __name__ == "__main__":
    main()
