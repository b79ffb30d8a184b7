"""
planner/timing.py: the published measurements plan.py's step time rests on, and the two formulas that use them: compute
time from FLOPs at an efficiency made of hardware measurements, and the alpha-beta time of a collective (NCCL's
latency model + bandwidth). plan.py's step_time adds the parts up.

    compute   = (matmul FLOPs / GEMM_EFF + attention FLOPs executed / ATTN_EFF) / peak      the kernels
                + element-wise bytes / this GPU's HBM bandwidth                  norms, activations, residual adds
                + MEMORY_BOUND x (the same on A100) x A100's HBM bandwidth / this GPU's   the rest of the rest
                GEMM_EFF: measured maximum achievable matmul FLOP/s / peak, per GPU; ATTN_EFF: the flash kernel's
                published utilization; element-wise bytes: planner/elementwise.py, from the model's operations;
                MEMORY_BOUND: the rest of one measured A100 training step per second of its kernels at the ceilings
                (1/KERNEL_SHARE - 1, x its GEMMs' shape factor), less what its element-wise bytes take
                attention executed: half of 12 L h s with a causal flash kernel (it skips the masked blocks), all of
                it eager (scores computed, then masked); the MFU convention keeps counting 12 L h s either way
    collective = latency + bytes / bandwidth, latency = NCCL's ring model: base + (steps - inter-node steps) *
                 intra-node hop + inter-node steps * network hop; steps 2(n-1) all-reduce, n-1 reduce-scatter /
                 all-gather / all-to-all, 1 send; an all-reduce across nodes the faster of that ring (its latency x
                 1.9 for large messages) and the tree at its own bandwidth (all_reduce_seconds)
"""
import math
from functools import lru_cache

from planner import elementwise as plan_elementwise
from planner import rates as plan_rates
from planner import shape as plan_shape
from planner.inputs import Job, Layout
from model import GPTConfig

# Maximum achievable matmul FLOP/s (bf16, dense, best shape of a sweep) / datasheet peak, measured with
# mamf-finder.py: S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable
# Matmul FLOPS comparison table" (https://github.com/stas00/ml-engineering): A100 SXM 267.9 of 312 TFLOP/s (CUDA
# 12.1), H100 SXM 792.1 of 989 (CUDA 12.1). The benchmark follows Anthony et al. 2024, "The Case for Co-Designing
# Model Architectures with Hardware" (arXiv 2401.14489). H200 is H100's chip and clocks with more HBM: H100's row
# (an assumption); A100 40GB is A100's chip and clocks with less and slower HBM: A100's rows; h100-hbm2e (500 W)
# and B200 have no measured row: H100's fraction (an assumption, see docs).
GEMM_EFF = {"a100": 267.9 / 312, "a100-40gb": 267.9 / 312,
            "h100": 792.1 / 989, "h100-hbm2e": 792.1 / 989, "h200": 792.1 / 989,
            "b200": 792.1 / 989}

# GEMM efficiency by shape, fitted to matmul measurements only (bench/gemm_rows.py reproduces the fit): OpenXLA's
# default matmul performance table for H100 (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/
# matmul_interpolator_data.h, bf16 FLOP/s of m x k x n GEMMs, m, n, k 256-4096) against the measured ceiling:
#     FLOP/s = ceiling / ((1 + (E0 / (m n))^a) (1 + (K0 / k)^b))
# the output's m x n elements (too few tiles to fill the SMs: 412 of 783 TFLOP/s at 1M, rms error 4.7% over 15
# shapes) and the reduction's depth k (392 TFLOP/s at k = 256, rms 1.4% over 5). Other GPUs: H100's (an assumption).
GEMM_SHAPE = dict(e0=9.55e5, a=1.9, k0=263, b=1.3)


def gemm_shape_factor(m, n, k, fit=GEMM_SHAPE):
    """How much longer an m x k x n GEMM takes per FLOP than at the measured ceiling (a fit of GEMM_SHAPE's form)."""
    return (1 + (fit["e0"] / (m * n)) ** fit["a"]) * (1 + (fit["k0"] / k) ** fit["b"])


def linear_factor(rows, n_in, n_out, fit=GEMM_SHAPE):
    """gemm_shape_factor of one linear layer over a step's three GEMMs of equal FLOPs: forward (rows x n_in x n_out),
    input gradient (rows x n_out x n_in) and weight gradient (n_in x rows x n_out: the rows are its depth)."""
    return (gemm_shape_factor(rows, n_out, n_in, fit) + gemm_shape_factor(rows, n_in, n_out, fit)
            + gemm_shape_factor(n_in, n_out, rows, fit)) / 3


def gemm_rows_factor(job, tp, rows):
    """The FLOP-weighted linear_factor of a tp rank's GEMMs (a block's four, shape.block_linears, and the LM
    head's h x V/tp) at `rows` rows (micro-batch x seq / cp; / tp per chunk where a collective is pipelined with it):
    how much longer its matmuls take than at the ceiling. 1 with job.eff (one efficiency for everything)."""
    if job.eff:
        return 1.0
    return shape_factor(job.shape, tp, rows, job.gpu)


@lru_cache(maxsize=None)
def shape_factor(shape, tp, rows, gpu):
    """gemm_rows_factor of a Job.shape on `gpu` (its rates_of's fit; cached: the search asks for it per layout)."""
    fit = rates_of(gpu)["gemm_shape"]
    job = plan_shape.job_of_shape(shape)
    cfg = job.cfg
    shapes = [(n_in, n_out, cfg.n_layer) for n_in, n_out in plan_shape.block_linears(job, tp)]
    shapes.append((cfg.n_embd, cfg.padded_vocab_size // tp, 1))
    flops = [n_in * n_out * count for n_in, n_out, count in shapes]
    return sum(f * linear_factor(max(rows, 1), n_in, n_out, fit) for f, (n_in, n_out, _) in zip(flops, shapes)) / sum(
        flops)


# Fraction of peak a flash-attention kernel reaches, forward + backward, on the executed FLOPs of plan's count (4 h s
# per layer forward, 8 backward; halved for causal). FlashAttention-2 (Dao 2023, arXiv 2307.08691, abstract):
# "reaching 50-73% of the theoretical maximum FLOPs/s on A100", the backward the slower pass: 50% taken for forward +
# backward. On H100 the same kernel (what torch's SDPA flash backend runs): "FlashAttention-2 achieving only 35%
# utilization on H100 GPUs" (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, abstract). Both papers' FLOP/s
# count the backward as 2.5x the forward (benchmark_flash_attention.py: fwd_bwd = 3.5 f), plan counts 2x: their
# utilization x 3 / 3.5 on plan's count. H200 and B200: H100's (an assumption). --attn_eff overrides it (e.g. for
# FlashAttention-3 or cuDNN's fused attention).
FLASH_UTILIZATION = {"a100": 0.50, "a100-40gb": 0.50, "h100": 0.35, "h100-hbm2e": 0.35, "h200": 0.35, "b200": 0.35}
ATTN_EFF = {gpu: u * 3 / 3.5 for gpu, u in FLASH_UTILIZATION.items()}

# What a training step spends beyond its GEMM and attention kernels: the memory-bound kernels (norms, activations,
# residual adds, casts, the optimizer's element-wise update) and the gaps between launches. Measured once, on A100,
# by MosaicML llm-foundry (scripts/train/benchmarking/README.md: MPT-7B, seq 2048, 8 x A100-80GB, no activation
# checkpointing: 64.23% MFU = HFU): the time its kernels would take at the A100's ceilings above is KERNEL_SHARE of
# the time it took. Of the rest, the element-wise kernels' bytes (elementwise.bytes_per_token) are priced at
# each GPU's datasheet HBM bandwidth (an upper bound on their speed: nothing fitted); at that price they are 11.6% of
# MPT-7B's rest. What remains (launch gaps, casts, the kernels' shortfall from the bandwidth, what the ceilings miss)
# is priced per FLOP: the same bytes per FLOP of the model, moved at each GPU's own HBM bandwidth (a roofline split:
# on H100 the GEMMs run 2.96x faster than on A100, HBM 1.64x). Pricing all of the rest per element-wise byte instead
# (one effective bandwidth, 11.6% of the datasheet's) was tried and fails: docs/plan.md. No run plan.py is compared
# with went into it (llm-foundry's H100 row of the same model is one of the comparisons).
MPT7B = dict(n_layer=32, n_embd=4096, vocab=50432, seq=2048, micro_batch=6, mfu=0.6423)
A100_HBM = 2.039e12          # inputs.HARDWARE["a100"]["hbm"], the bandwidth of that measurement


def published_rates(gpu):
    """The rates above for `gpu`: GEMM_EFF's ceiling, ATTN_EFF, GEMM_SHAPE (OpenXLA's H100 table, every card)."""
    return dict(gemm_eff=GEMM_EFF[gpu], attn_eff=ATTN_EFF[gpu], gemm_shape=GEMM_SHAPE,
                source="published: MAMF ceiling, FlashAttention utilization, OpenXLA's H100 GEMM table")


def rates_of(gpu):
    """What prices `gpu`'s compute: its measured table (planner/rates.py) where the card was measured, else
    published_rates. Each carries its source, which plan.py prints."""
    return card_rates(gpu, plan_rates.RATES_DIR)


@lru_cache(maxsize=None)
def card_rates(gpu, directory):
    """rates_of with the tables' folder (cached: the search prices thousands of layouts)."""
    return plan_rates.measured(gpu, directory) or published_rates(gpu)


def priced_by(job):
    """Which rates price a job's compute: --eff, or rates_of's source (a measured table, or the published rates)."""
    return f"--eff {job.eff}" if job.eff else rates_of(job.gpu)["source"]


def kernel_time(matmul_flops, attention_flops, rates, peak, attn_eff=0.0):
    """Seconds of the GEMM and attention kernels alone at the ceilings of `rates` (rates_of; attention_flops:
    executed)."""
    return (matmul_flops / rates["gemm_eff"] + attention_flops / (attn_eff or rates["attn_eff"])) / peak


def mpt7b_kernel_share():
    """(kernel time at the A100 ceilings) / (measured time) for the MPT-7B row, N = 12 L h^2 + V h, causal flash, its
    GEMMs at their shapes (micro-batch 6 of 2,048 tokens: linear_factor); the GEMM shape factor used; and the
    measured seconds per token and GPU at 312 TFLOP/s."""
    L, h, s, V = MPT7B["n_layer"], MPT7B["n_embd"], MPT7B["seq"], MPT7B["vocab"]
    matmul, attention = 6 * (12 * L * h * h + V * h), 12 * L * h * s
    rows = MPT7B["micro_batch"] * s
    shapes = [(h, 3 * h, 3 * L * h * h), (h, h, L * h * h), (h, 4 * h, 4 * L * h * h), (4 * h, h, 4 * L * h * h),
              (h, V, V * h)]
    factor = sum(w * linear_factor(rows, n_in, n_out) for n_in, n_out, w in shapes) / sum(w for *_, w in shapes)
    measured = (matmul + attention) / MPT7B["mfu"]
    return kernel_time(matmul * factor, attention / 2, published_rates("a100"), 1.0) / measured, factor, measured / A100_PEAK


def mpt7b_elementwise_seconds():
    """Seconds per token and GPU MPT-7B's element-wise kernels take at A100's datasheet HBM bandwidth
    (elementwise.bytes_per_token: GeLU MLP, learned positions, no dropout, fused loss, no recompute, tp 1)."""
    job = Job(GPTConfig(vocab_size=MPT7B["vocab"], block_size=MPT7B["seq"], n_layer=MPT7B["n_layer"], n_head=32,
                        n_embd=MPT7B["n_embd"]), 8, 8, "a100", 8 * MPT7B["micro_batch"], rope=False, fused_loss=True)
    return plan_elementwise.bytes_per_token(job, Layout(dp=8)) / A100_HBM


A100_PEAK = 312e12
KERNEL_SHARE, MPT7B_GEMM_FACTOR, MPT7B_SECONDS = mpt7b_kernel_share()
# the share of MPT-7B's memory-bound rest its element-wise bytes take at HBM's datasheet bandwidth (0.116), and what
# remains per second of kernel time at the ceilings (shape factor 1): what its kernels and those bytes leave
ELEMENTWISE_SHARE = mpt7b_elementwise_seconds() / ((1 - KERNEL_SHARE) * MPT7B_SECONDS)
MEMORY_BOUND = (1 / KERNEL_SHARE - 1) * MPT7B_GEMM_FACTOR * (1 - ELEMENTWISE_SHARE)


def compute_time(flops, attention_flops, job, gemm_factor, elementwise_bytes):
    """Seconds of the FLOPs of one token (model count + recompute, `attention_flops` of them QK^T / AV) on job's GPU,
    at rates_of(job.gpu) (its measured table where the card was measured, else the published rates): matmuls at peak *
    GEMM_EFF, slower by gemm_factor (gemm_rows_factor of the GEMMs' shapes), a flash kernel's
    attention at peak * ATTN_EFF, half of it when causal (Dao 2023, FlashAttention-2 Sec. 3.1.1: blocks above the
    diagonal are skipped), eager attention as batched matmuls, all of it (the scores are computed, then masked); plus
    the memory-bound rest: `elementwise_bytes` (elementwise.bytes_per_token) at this GPU's HBM bandwidth, and
    MEMORY_BOUND x the same kernels' time on A100 at the ceiling, x A100's HBM bandwidth / this GPU's. job.eff
    (--eff): one efficiency for every executed FLOP."""
    flash = job.attn == "flash"
    attention = attention_flops / (2 if flash and job.causal else 1)
    matmul = flops - attention_flops + (0 if flash else attention)
    attention = attention if flash else 0.0
    if job.eff:
        return (matmul + attention) / (job.peak * job.eff)
    kernels = kernel_time(matmul * gemm_factor, attention, rates_of(job.gpu), job.peak, job.attn_eff)
    on_a100 = kernel_time(matmul, attention, published_rates("a100"), A100_PEAK)
    return kernels + (MEMORY_BOUND * on_a100 * A100_HBM + elementwise_bytes) / job.hw["hbm"]


# NCCL's latency model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel; ring algorithm, Simple protocol, the
# protocol of large messages): baseLat 8.4 us per collective, hwLat 3.4 us per ring step over NVLink, 9.6 us per
# step through the network (releases 2.6-2.17, 2020-23, those of most runs bench/plan_validation.py compares; 2.18
# raised the network step to 14 us; the LL / LL128 protocols NCCL picks for small messages are not modelled); ring
# steps 2(n-1) for all-reduce (2(nodes-1) of them inter-node), n-1 for reduce-scatter and all-gather; the tree
# all-reduce 2 ((n/nodes - 1) * 28 + log2(nodes) * 50) us without base.
# NCCL times a call as latency + bytes / bandwidth and picks the faster algorithm (ring or tree for all-reduce).
NCCL_BASE_S = 8.4e-6
NCCL_HOP_S = dict(nvlink=3.4e-6, net=9.6e-6)
NCCL_TREE_HOP_S = dict(nvlink=28e-6, net=50e-6)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")


def ring_steps(kind, n):
    """Ring steps of one collective over n ranks: 2(n-1) all-reduce, n-1 the others, 1 a send."""
    if kind == "send":
        return 1
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def ring_latency(kind, n, nodes):
    """Seconds of NCCL's ring latency for one collective: base + intra-node steps x NVLink hop + inter-node steps x
    network hop."""
    steps = ring_steps(kind, n)
    inter = min(steps, ring_steps(kind, nodes) if nodes > 1 else 0)
    return NCCL_BASE_S + (steps - inter) * NCCL_HOP_S["nvlink"] + inter * NCCL_HOP_S["net"]


def tree_latency(n, nodes):
    """Seconds of NCCL's tree all-reduce latency: up and down the n/nodes ranks of a node and log2(nodes) levels."""
    per_node = max(1, n // max(nodes, 1))
    return 2 * ((per_node - 1) * NCCL_TREE_HOP_S["nvlink"] + math.log2(max(nodes, 1)) * NCCL_TREE_HOP_S["net"])


@lru_cache(maxsize=None)
@lru_cache(maxsize=None)      # the search asks for the same few groups' latencies for every layout
def latency(kind, n, nodes):
    """Seconds of fixed cost of one collective `kind` over n ranks spread over `nodes` nodes (NCCL's model)."""
    if n <= 1:
        return 0.0
    ring = ring_latency(kind, n, nodes)
    if kind != "all_reduce" or nodes <= 1:
        return ring
    return min(ring, tree_latency(n, nodes))


# What the same model adds to an all-reduce across nodes (tuning.cc at those releases): the ring's latency x 1.9 once
# a message reaches n/16 x 64 KiB (ncclTopoGetAlgoTime: "Plateau effect of ring"), and the tree's bandwidth, half of
# min(0.9 x the bus bandwidth, 80 GB/s beyond 2 nodes, 110 GB/s on 2) (ncclTopoTuneModel), x treeCorrectionFactor
# for its size (Simple protocol, by log2(bytes / 64): "Trees are not perfectly sticking to the model for medium
# sizes"). NCCL runs the faster of the two, each at its latency + bytes / bandwidth. Later releases use 1.4 on compute
# capability 8.0 and up, from 64 bytes per rank and channel (nanotron's cells: 18 of 26 within 15% either way, 17
# without the plateau).
RING_PLATEAU = 1.9
TREE_MAX_BUS_BW = 80e9, 110e9
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9)


def all_reduce_seconds(message, n, nodes, bus_bw):
    """Seconds of one all-reduce of `message` bytes over n ranks on `nodes` nodes at bus bandwidth bus_bw (bytes/s):
    within a node the ring, 2(n-1)/n x message over the bus after its latency; across nodes the faster of that ring
    (its latency x RING_PLATEAU for large messages) and the tree."""
    if n <= 1:
        return 0.0
    plateau = RING_PLATEAU if nodes > 1 and message >= n / 16 * 65536 else 1.0
    ring = ring_latency("all_reduce", n, nodes) * plateau + message * 2 * (n - 1) / n / bus_bw
    if nodes <= 1:
        return ring
    size_class = int(math.log2(max(message / 64, 1)))
    correction = TREE_CORRECTION[size_class] if size_class < len(TREE_CORRECTION) else 1.0
    tree_bw = 0.5 * min(0.9 * bus_bw, TREE_MAX_BUS_BW[nodes <= 2]) * correction
    return min(ring, tree_latency(n, nodes) + message / tree_bw)


# Tensor-parallel communication pipelined with the GEMMs it feeds, as the software modelled does it by default:
# Megatron-LM 2021 and torchtitan's TP (DTensor) run it in the open (0); NeMo / Megatron-Core with Transformer
# Engine's userbuffers (--tp-comm-overlap, "TP communication overlap" in the NeMo performance guide) split each
# SP all-gather / reduce-scatter into tp chunks that run beside the GEMM's chunks (1: every collective so). What that
# hides is derived, not a constant: comm.exposed_tp_time.
TP_OVERLAP = {"megatron-2021": 0.0, "torchtitan": 0.0, "nemo-te": 1.0}


def hardware_flops_per_token(job, recompute):
    """shape.flops_per_token (6N + 12*L*h*T) plus what recompute adds: full a second forward of every block
    (2 N_blocks + 4*L*h*T), selective the attention scores' forward (4*L*h*T), op (torchtitan's policy) the
    forward of the matmuls it does not keep (shape.op_recompute_values). Returns (all, attention's part)."""
    cfg = job.cfg
    attn = plan_shape.attention_flops_per_token(job) * (1 + (recompute in ("selective", "full")) / 3)
    extra = 2 * plan_shape.block_params(job) if recompute == "full" else 0
    extra += cfg.n_layer * plan_shape.op_recompute_values(job)[2] if recompute == "op" else 0
    return plan_shape.flops_per_token(job) + extra + attn - plan_shape.attention_flops_per_token(job), attn


def eager_attention_time(job, lay):
    """Seconds per step a rank's eager (unfused) attention spends streaming its a/t x s x s score tensors (b per
    micro-batch, m micro-batches, L/pp blocks) through HBM in its non-matmul kernels; 0 with flash attention, which
    never writes them (Dao et al. 2022, FlashAttention, Sec. 2-3: standard attention is bound by these accesses) and
    which the measurement behind eff used. Bytes per score element, 16-bit values and 1-byte dropout masks, as
    Megatron-LM's fused scale-mask-softmax and torch's dropout move them:
        softmax 2 + 2 forward, 2 + 2 + 2 backward;  dropout (p > 0) 2 + 1 + 2 forward, 2 + 1 + 2 backward;
        the forward ones again under selective or full recompute;  time = bytes / datasheet HBM bandwidth"""
    if job.attn == "flash":
        return 0.0
    cfg, drop = job.cfg, job.cfg.dropout > 0
    forward = (4 + 5 * drop) * (1 + (lay.recompute in ("selective", "full")))
    elements = cfg.n_head // lay.tp * cfg.block_size ** 2 * job.global_seqs // lay.dp * cfg.n_layer // lay.pp
    return elements * (forward + 6 + 5 * drop) / job.hw["hbm"]


# Megatron-Core's default gradient bucket, "max(40000000, 1000000 * dp_size) parameters (larger DP sizes need larger
# buckets to ensure collectives do not become latency-bound)" (NVIDIA/Megatron-LM megatron/core/distributed/
# distributed_data_parallel_config.py, bucket_size), in plan.py's fp32 MiB: one collective per bucket, so at dp 288 a
# 25 MiB bucket makes ~45x the NCCL calls of Megatron-Core's.
MCORE_BUCKET = dict(bucket_mb=4e7 * 4 / 2 ** 20, bucket_mb_per_dp=1e6 * 4 / 2 ** 20)


# --software: what the software a run used does by default, as Job fields (a flag given beside it wins, even at its
# own default value). Each entry names its source.
SOFTWARE = {
    # Megatron-LM as Narayanan et al. 2021 ran it (SC'21; NVIDIA/Megatron-LM examples/sc21/run_table_1.sh): the
    # attention unfused through HBM (fused scale-mask-softmax, no flash kernel), gradients all-reduced after the
    # backward (--DDP-impl local), pipeline messages scattered over tp and all-gathered on arrival (Sec. 4.1).
    # Its optimizer keeps fp32 main gradients beside the fp16 parameters (Float16OptimizerWithFloat16Params); its
    # vocab-parallel cross-entropy works in place on the fp32 logits (inplace_loss; so do its descendants below).
    "megatron-2021": dict(attn="eager", dp_overlap=False, pp_scatter_gather=True, tp_overlap=0.0, pp_overlap=False,
                          grad_dtype="fp32", inplace_loss=True, fused_bias_dropout_add=True),
    # torchtitan (pytorch/torchtitan, 2024): flash attention through SDPA, FSDP2 prefetching its all-gathers and
    # reducing under the backward, tensor-parallel collectives in the open (its async TP is an opt-in compile pass),
    # pipeline sends blocking (torch.distributed.pipelining). Under TP its loss runs through torch's loss_parallel
    # (torchtitan/parallelisms/parallel_dims.py, loss_parallel_enabled: tp > 1 unless disabled), and torch's pipeline
    # stages of 2024 keep every micro-batch's output until the step ends and a receive buffer per micro-batch
    # (planner/runtime_memory.py says which versions). Its TP is DTensor's: autograd keeps each all-gathered input, and
    # its async TP is torch's micro-pipeline pass (comm.sp_collectives says what each changes).
    "torchtitan": dict(attn="flash", dp_overlap=True, pp_scatter_gather=False, tp_overlap=0.0, pp_overlap=False,
                       loss_parallel=True, pp_outputs_kept="all", pp_recv_per_micro_batch=True,
                       tp_overlap_style="torch", tp_saves_gathered=True),
    # Megatron-Core / NeMo with Transformer Engine as NeMo's performance recipes run it (NeMo Framework user guide,
    # "Communication Overlap"): data-parallel reduce-scatters per bucket under the backward and the parameter
    # all-gathers under the next forward (--overlap-grad-reduce --overlap-param-gather), TP all-gathers and
    # reduce-scatters pipelined with their GEMMs (userbuffers; with SP), pipeline sends under the interleaved chunks;
    # fp32 main gradients beside bf16 parameters (Megatron-LM README: "bf16 param, fp32 grads: 18 bytes"). A gated MLP
    # runs megatron/core/fusions/fused_bias_swiglu.py, whose autograd Function saves its input alone (on unless
    # --no-bias-swiglu-fusion, an argparse store_false).
    "megatron-core": dict(attn="flash", dp_overlap=True, pp_scatter_gather=False, tp_overlap=TP_OVERLAP["nemo-te"],
                          pp_overlap=True, dp_overlap_style="mcore", grad_dtype="fp32", inplace_loss=True,
                          fused_bias_dropout_add=True, fused_swiglu=True, **MCORE_BUCKET),
    # Megatron-DeepSpeed (MT-NLG, BLOOM): Megatron's fused softmax, DeepSpeed's pipeline engine reducing the gradients
    # after the last micro-batch, its BF16_Optimizer's fp32 gradient buffer beside the bf16 gradients ("4 bytes *
    # params", bigscience tr11-176B-ml README).
    "megatron-deepspeed": dict(attn="eager", dp_overlap=False, pp_scatter_gather=False, tp_overlap=0.0,
                               pp_overlap=False, grad_dtype="both", inplace_loss=True, fused_bias_dropout_add=True),
    # Llama 3's stack (Dubey et al. 2024, Sec. 3.3.2): FSDP "asynchronously prefetching sharded model weights and
    # reducing gradients", "asynchronous point-to-point communication in PP"; TP overlap is not stated (none here).
    "llama3": dict(attn="flash", dp_overlap=True, pp_scatter_gather=False, tp_overlap=0.0, pp_overlap=True),
}
