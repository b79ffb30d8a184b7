"""
bench/plan_memory_runs.py: published runs that state a measured memory peak or an out-of-memory, for
bench/plan_validation.py's memory section (predicted / measured memory and the OOM verdicts, apart from MFU).

Each run is described as published; the docstring of the function that builds it says where each input comes from
and what was assumed. What was measured is named per run: torch.cuda.max_memory_reserved ("reserved": torchtitan
logs it as "memory: ... GiB", torchtitan/components/metrics.py, max_reserved_gib) or nvidia-smi ("device"). plan.py's
prediction of the same quantity is compared (planner/memory.memory: "reserved", "device").
"""
import dataclasses

from planner.inputs import MODELS, Layout
from planner.timing import SOFTWARE
from plan_mfu_runs import HELD_OUT
from plan_tables import SETUPS, TITAN_A100, TITAN_H100, Setup

LLAMA3_8B, LLAMA3_70B = MODELS["llama3-8b"], MODELS["llama3-70b"]
LLAMA3_405B = dict(MODELS["llama3-405b"], ends_as_layers=False)     # torchtitan splits the layers alone
TITAN_DOCS = "torchtitan docs/performance.md (Llama 3.1 405B section)"
TRAINY_H200 = "torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"


@dataclasses.dataclass
class MemoryRun:
    setup: Setup
    measured_gib: float       # as published; 0 for a run published to run out of memory
    metric: str               # "reserved" (torch.cuda.max_memory_reserved) or "device" (nvidia-smi)
    modelled: bool = True     # False: the run used something plan.py does not model (torch.compile, Float8)


# rules read from torchtitan's and torch's source after these runs' errors were seen (docs/plan.md, the memory section)
PP_RUNTIME = ("pp micro-batches: torchtitan's default", "pp_outputs_kept", "pp_recv_per_micro_batch")
LOSS_PARALLEL, GATHERED = "loss_parallel's backward", "tp_saves_gathered"


def titan_h100(name, shape, gpus, seq, global_seqs, layout, gib, modelled=False, job=None, seen=()):
    """A row of torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton H100, 96 GB HBM2e: plan.py's
    h100-hbm2e; "Memory(GiB)" is the logged max_reserved_gib, the maximum over all GPUs, footnote 1). Tables 2, 4, 5
    and 6 ran torch.compile and Float8 (plan.py models neither: modelled False); Tables 1 and 3's first rows ran
    neither. Software: timing.SOFTWARE["torchtitan"] (its loss_parallel under TP, torch's pipeline stages keeping
    every micro-batch's output and a receive buffer per micro-batch), the benchmark's torchtitan commit 9dec370
    (2024-12-26) and torch's of 2024-12-23; compiled blocks, whose SwiGLU recomputes silu(gate) (fused_swiglu; with
    these rows' full recompute it changes nothing)."""
    setup = Setup(name, TITAN_H100, shape, gpus, "h100-hbm2e", seq, global_seqs, layout, 0.0, f"{gib} GiB",
                  "torchtitan-2024-12", dict(SOFTWARE["torchtitan"], fused_swiglu=True, **(job or {})), seen=seen)
    return MemoryRun(setup, gib, "reserved", modelled)


def table2(fsdp, cp, seq, gib):
    """Table 2: Llama 3.1 8B, 8 GPUs, FSDP x CP, local batch 1, full activation checkpointing, torch.compile +
    Float8; the global batch is the FSDP degree (one sequence per data-parallel rank)."""
    return titan_h100(f"Llama 3.1 8B, CP {cp}, {seq // 1024}K", LLAMA3_8B, 8, seq, fsdp,
                      Layout(dp=fsdp, cp=cp, zero_stage=3, micro_batch_size=1, recompute="full"), gib)


def table4(gib, name):
    """Table 4: Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8 (torchtitan's TP is sequence-parallel), local batch 16,
    global 512, full activation checkpointing, torch.compile + Float8 (and AsyncTP in its second row)."""
    return titan_h100(name, LLAMA3_70B, 256, 8192, 512,
                      Layout(dp=32, tp=8, sp=True, zero_stage=3, micro_batch_size=16, recompute="full"), gib,
                      seen=(LOSS_PARALLEL, GATHERED))


def table5(schedule, v, gib):
    """Table 5: Llama 3.1 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256), full activation
    checkpointing. With pipeline stages torchtitan does not reshard after the forward ("For PP, do not reshard after
    forward to avoid per-microbatch all-gathers", torchtitan's parallelize), and the pipeline schedule accumulates
    the gradients of every micro-batch before reducing them ("we need to accumulate gradients on previous steps and
    reduce them on the last step", torch.distributed.pipelining's backward_maybe_with_nosync): parameters gathered
    and gradients whole through the step, optimizer states sharded, plan.py's ZeRO-1, the gradients in FSDP's fp32
    reduce dtype (torchtitan's mixed_precision_reduce default "float32"; FSDP2 upcasts the unsharded gradient of each
    micro-batch but the last into unsharded_accumulated_grad, _fsdp_param.py to_accumulated_grad_if_needed):
    grad_dtype fp32. Micro-batches: 8 of 4 sequences, as torchtitan's commit of the benchmark (9dec370) builds the
    schedule without pipeline_parallel_microbatches ("n_microbatches = job_config.experimental.
    pipeline_parallel_degree", torchtitan/parallelisms/pipelining_utils.py, build_pipeline_schedule; the config's
    default is None, "the number of pipeline stages"); 2 stages per rank for the interleaved schedule (its
    generate_split_points: "num_stages_per_rank = 2" for a multi-stage schedule). Assumed: the 126 layers split as
    evenly as they go (generate_split_points gives the first and last stages one layer less)."""
    return titan_h100(f"Llama 3.1 405B, {schedule}", LLAMA3_405B, 512, 8192, 256,
                      Layout(dp=8, tp=8, pp=8, sp=True, zero_stage=1, schedule=schedule, v=v, micro_batch_size=4,
                             recompute="full"), gib, job=dict(grad_dtype="fp32"), seen=PP_RUNTIME + (GATHERED,))


def table6(fsdp, cp, seq, gib):
    """Table 6: Llama 3.1 405B, 512 GPUs, FSDP x CP x TP 8 x PP 8, 1F1B, local batch 8 (global 8 x FSDP), full
    activation checkpointing, torch.compile + Float8 + AsyncTP; ZeRO-1 with fp32 gradients as in table5 (PP keeps
    parameters gathered and gradients whole), 8 micro-batches of 1 sequence (the pipeline degree, as in table5)."""
    return titan_h100(f"Llama 3.1 405B, CP {cp}, {seq // 1024}K", LLAMA3_405B, 512, seq, 8 * fsdp,
                      Layout(dp=fsdp, cp=cp, tp=8, pp=8, sp=True, zero_stage=1, micro_batch_size=1,
                             recompute="full"), gib, job=dict(grad_dtype="fp32"), seen=PP_RUNTIME + (GATHERED,))


def trainy_h200(nodes, gib):
    """torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md: Llama 3.1 8B on 4 and 8 hosts of 8 H200
    (141 GB), torchtitan e7c0cae (2025-06-13) with torch 2.8.0a0 (NGC 25.05); "Memory(GiB)" sampled at the 100th
    iteration, torchtitan's max_reserved_gib. Its command line: the llama3_8b.toml of that commit (FSDP over every GPU,
    data_parallel_shard_degree -1; seq_len 8192; selective activation checkpointing, "op" policy) with
    local_batch_size 2, --training.compile and Float8 (tensorwise, FSDP float8 all-gather: plan.py models neither,
    modelled False). That torchtitan compiles the loss under --training.compile (torchtitan/components/loss.py,
    build_cross_entropy_loss: loss_fn = torch.compile(loss_fn)), where torch's min-cut partitioner with inductor's
    decompositions saves the bf16 logits and a per-token max and log-sum-exp, not the fp32 log-softmax, and computes
    the gradient pointwise from them: plan.py's fused_loss (its compiled blocks' SwiGLU, fused_swiglu, is recomputed
    under the op policy anyway)."""
    gpus = 8 * nodes
    setup = Setup(f"Llama 3.1 8B, {gpus} H200", TRAINY_H200, LLAMA3_8B, gpus, "h200", 8192, 2 * gpus,
                  Layout(dp=gpus, zero_stage=3, micro_batch_size=2, recompute="op"), 0.0, f"{gib} GiB",
                  "torchtitan-2024-12", dict(SOFTWARE["torchtitan"], fused_loss=True, fused_swiglu=True), seen=("fused_loss: its compiled loss",))
    return MemoryRun(setup, gib, "reserved", False)


MEASURED = ([MemoryRun(SETUPS[4], 82.4, "reserved"), MemoryRun(SETUPS[5], 67.0, "reserved")]   # Tables 1 and 3: FSDP
            + [table2(8 // cp, cp, 32768 * cp, gib) for cp, gib in ((1, 83.9), (2, 84.2), (4, 84.0), (8, 84.5))]
            + [table4(71.9, "Llama 3.1 70B, 2D"), table4(67.6, "Llama 3.1 70B, 2D + AsyncTP")]
            + [table5("1f1b", 1, 82.5), table5("interleaved", 2, 72.7)]
            + [table6(8 // cp, cp, 32768 * cp, gib) for cp, gib in ((1, 75.3), (2, 75.9), (4, 77.1), (8, 84.9))]
            + [trainy_h200(4, 47.96), trainy_h200(8, 46.97)])


def llama2_70b_oom():
    """torchtitan docs/performance.md (2024-04), Llama 2 70B on 64 A100 80GB, FSDP, seq 4096: "the 70B training with
    local batch size 2 will cause an OOM error when selective activation checkpointing is used" (selective op)."""
    shape = dict(arch="llama", n_layer=80, n_embd=8192, n_head=64, vocab=32000, n_kv_head=8, ffn_hidden=28672,
                 gated=True, tied=False)
    layout = Layout(dp=64, zero_stage=3, micro_batch_size=2, recompute="op")
    return Setup("Llama 2 70B, local batch 2, selective op", TITAN_A100, shape, 64, "a100", 4096, 128, layout, 0.0,
                 "OOM", "torchtitan-2024-04")


def llama31_405b_fsdp_oom():
    """torchtitan docs/performance.md, Llama 3.1 405B on 128 H100 ("94GB memory": plan.py's h100-hbm2e row), local
    batch 2, full activation checkpointing, seq 8192: "We do see OOM for 1D parallelism (FSDP2), so we only tested 2D
    parallelism (FSDP2 + Tensor Parallel)"."""
    layout = Layout(dp=128, zero_stage=3, micro_batch_size=2, recompute="full")
    return Setup("Llama 3.1 405B, FSDP 128", TITAN_DOCS, MODELS["llama3-405b"], 128, "h100-hbm2e", 8192, 256, layout,
                 0.0, "OOM", "torchtitan-2024-12")


PUBLISHED_OOM = [llama2_70b_oom(), llama31_405b_fsdp_oom()]


def async_tp_float8(bf16, recipe, tps):
    """A float8 row of torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (tensorwise or rowwise, plain
    or async TP): the run of its bf16 row (plan_mfu_runs.titan_async_tp: the same heading's layout, local batch,
    activation checkpointing and software; its sources there) with Float8 GEMMs. The page states tokens/s and no
    memory; it ran, so its OOM verdict is checked. Float8 is not modelled (plan.py predicts the bf16 run's memory, which
    Float8 would lower) and its MFU is left out (plan.py prices 16-bit GEMMs). Marked as its bf16 row is: the same
    configuration, whose errors DTensor's kept gathers (a memory term) were written while looking at."""
    return dataclasses.replace(bf16, name=f"{bf16.name}, float8 {recipe}", published_mfu=0.0,
                               published_text=f"{tps} tokens/s/GPU, float8 {recipe}")


# the runs of torchtitan's 2025 benchmark files that the MFU table lacks, as runs that ran (verdicts only): the async
# TP page's float8 rows, in HELD_OUT's order (70B plain, 70B async, 8B plain, 8B async). The Trainy H200 page's runs
# are in MEASURED (their memory; their TPS/GPU is Float8's)
FLOAT8_TPS = {"tensorwise": (809.8, 942.4, 5078.1, 5570.1), "rowwise": (599.6, 624.8, 3708.5, 3914.9)}
PUBLISHED_RAN = [async_tp_float8(bf16, recipe, tps) for recipe, speeds in FLOAT8_TPS.items()
                 for bf16, tps in zip(HELD_OUT, speeds)]
