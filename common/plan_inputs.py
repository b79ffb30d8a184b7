"""
plan_inputs.py: what plan.py predicts for, as plain data: the GPU (datasheet numbers and a published efficiency per
row), the model shape (presets or any), the precision recipe, the cluster and batch (Job), and one split of it
(Layout), with the checks that the split divides them and plan.py's command line that builds both.
Nothing here predicts anything; plan.py's formulas read these fields.

    args = parse_args(argv, "...")                 # plan.py's flags (--help lists them)
    job = build_job(args)                          # -> Job
    lay = parse_layout("tp=4,zero_stage=1", job)   # dp defaults to gpus / (tp*cp*pp)
    validate(job, lay)                             # ConfigError (one line) unless the layout divides the job

A layout is valid when
    dp * tp * cp * pp = gpus,   global_seqs = dp * micro_batch_size * grad_acc,   ep | dp*cp and ep | n_experts,
    tp | n_head and padded vocab,   2*cp | seq (zigzag),   pp * v | n_layer,
    v = 2 for zbv and dualpipev (a V), v > 1 for interleaved (and grad_acc % pp = 0), else 1,
    grad_acc >= pp except for afab, zbv and 1f1b, grad_acc >= 2*pp for dualpipev (as train_5d.py and train_pp.py);
    1f1b with fewer micro-batches than stages is all forwards then all backwards: as_run evaluates it as afab.
"""
import argparse
import math
from dataclasses import dataclass, fields, replace

from common.errors import check, fail
from common.peaks import GPU_PEAK_TFLOPS
from model import GPTConfig
from common.pipeline_schedules import SCHEDULES, V_SHAPED
from common.plan_shape import SHAPE_OPTIONS, stage_layer_counts
from common.plan_time import MCORE_BUCKET, SOFTWARE

GIB = 2 ** 30
# Per GPU. peak: peaks.GPU_PEAK_TFLOPS (dense bf16). mem, hbm (bytes/s), nvlink (per direction), net (per GPU, per
# direction): NVIDIA datasheets (A100 80GB SXM: NVLink3 600 GB/s, DGX A100 8x HDR 200 Gb/s; H100 SXM: NVLink4
# 900 GB/s, DGX H100 8x NDR 400 Gb/s; H200 141 GB; HGX B200 180 GB, NVLink5 1.8 TB/s). The compute efficiency of
# each GPU is plan_time's: its measured GEMM and attention ceilings x a software share, each cited there.
# h100-hbm2e: torchtitan's Grand Teton H100 (benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e at 2.4 TB/s,
# 500 W, 400 Gb/s per GPU), whose dense peak that file puts "between SXM and NVL", exact value unknown: NVL's
# 835.5 TFLOP/s is taken (the lower bound).
# a100-40gb: A100 40GB SXM (HBM2 at 1,555 GB/s, NVIDIA A100 datasheet), the other numbers A100 80GB's.
HARDWARE = {
    "a100": dict(peak="A100", mem=80 * GIB, hbm=2.039e12, nvlink=300e9, net=25e9),
    "a100-40gb": dict(peak="A100", mem=40 * GIB, hbm=1.555e12, nvlink=300e9, net=25e9),
    "h100": dict(peak="H100", mem=80 * GIB, hbm=3.35e12, nvlink=450e9, net=50e9),
    "h100-hbm2e": dict(peak="H100", board="NVL", mem=96e9, hbm=2.4e12, nvlink=450e9, net=50e9),
    "h200": dict(peak="H200", mem=141e9, hbm=4.8e12, nvlink=450e9, net=50e9),
    "b200": dict(peak="B200", mem=180e9, hbm=8.0e12, nvlink=900e9, net=50e9),
}
LINK_EFF = 0.8          # NCCL bus bandwidth / link rate (nccl-tests all_reduce on DGX A100/H100: about 75-85%)

# What a GPU's memory holds besides the tensors (plan_memory.reserved_bytes and usable_bytes; docs/plan.md):
# DEVICE_SHARE: the share of the HBM the driver hands to a process, torch's "total capacity" in every CUDA OOM message
# ("79.15 GiB total capacity" on an A100 80GB, "31.74 GiB" on a V100 32GB: NVIDIA/Megatron-LM #525).
# CUDA_CONTEXT: the context and the loaded kernels, outside the caching allocator: "GPU memory occupied: 1343 MB" after
# the first tensor (Hugging Face transformers docs, "Model training anatomy": "the kernels alone take up 1.3GB").
# NCCL_COMM_BYTES: one communicator's buffers, outside the allocator: per channel a 10 MiB and a 2 MiB buffer, 32
# channels on 8 x H100 (NVIDIA/nccl #1685, NCCL_DEBUG_SUBSYS=ALLOC); "a Ring ... only has 2 connections regardless of the
# scale" and "memory usage is linearly tied to the number of channels" (#986): 32 x 12 MiB per communicator.
# CUBLAS_WORKSPACE: torch's cuBLAS and cuBLASLt workspaces, through the caching allocator (counted as allocated): 32
# MiB each on Hopper (torch's default CUBLAS_WORKSPACE_CONFIG ":4096:8", 8 x 4 MiB).
# ALLOCATOR_RESERVE: what the caching allocator reserves beyond the peak of live tensors, as a share of the tensors
# that come and go each step (activations, logits, buffers; model states are allocated once and do not fragment):
# 16 GiB stranded over 77 GiB of stashed activations at their peak (93 GiB reserved), meta-pytorch/torchrec #4584's
# study of HBM fragmentation, a measurement of the allocator, not of a run plan.py is compared with. The reserve is
# soft: where a cudaMalloc fails the allocator frees its cached blocks and retries (torch.cuda.memory_stats'
# num_alloc_retries), so reserved memory stops at what is usable and only the live tensors can run a GPU out.
DEVICE_SHARE = 79.15 / 80
CUDA_CONTEXT = 1343e6
NCCL_COMM_BYTES = 32 * 12 * 2 ** 20
CUBLAS_WORKSPACE = 2 * 32 * 2 ** 20
ALLOCATOR_RESERVE = 16 / 77
# Presets. gpt2*: model.py's GPT (Radford et al. 2019). llama3-*: Llama 3 as published (Dubey et al. 2024, "The Llama 3
# Herd of Models", arXiv 2407.21783, Table 3: layers, model dimension, FFN dimension, attention heads, 8 key/value
# heads, vocabulary 128K = 128,256 tokens; SwiGLU, untied embeddings); 405B's pipeline split as Sec. 3.3.2 gives it
# (the embedding and the loss each in a layer's place: plan_shape.even_split). gpt3-175b: Brown et al. 2020, Table 2.1
# (GeLU MLP of 4h, full multi-head attention). A plain GPT of Llama's depth and width: --model llama3-8b-gpt.
MODELS = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab=50257),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25, vocab=50257),
    "llama3-8b": dict(n_layer=32, n_embd=4096, n_head=32, vocab=128256, n_kv_head=8, ffn_hidden=14336, gated=True,
                      tied=False),
    "llama3-70b": dict(n_layer=80, n_embd=8192, n_head=64, vocab=128256, n_kv_head=8, ffn_hidden=28672, gated=True,
                       tied=False),
    "llama3-405b": dict(n_layer=126, n_embd=16384, n_head=128, vocab=128256, n_kv_head=8, ffn_hidden=53248,
                        gated=True, tied=False, ends_as_layers=True),
    "llama3-8b-gpt": dict(n_layer=32, n_embd=4096, n_head=32, vocab=128256),
    "llama3-70b-gpt": dict(n_layer=80, n_embd=8192, n_head=64, vocab=128256),
    "gpt3-175b": dict(n_layer=96, n_embd=12288, n_head=96, vocab=51200),
}


GRAD_DTYPES = ("param", "fp32", "both")    # model_state_bytes_per_param's gradient buffers


def model_state_bytes_per_param(recipe="fp32", moments="fp32", grad_dtype="param"):
    """Bytes per parameter of params + grads + optimizer state for AdamW (ZeRO paper's accounting).

    fp32: 4 (param) + 4 (grad) + 8 (Adam m, v)                          = 16
    bf16: 2 (param) + 2 (grad) + 12 (fp32 master copy + Adam m, v), K=12 = 16
    moments="bf16" keeps Adam's m and v in 2 bytes each (as recipes that store them in bf16 do): optimizer 4 less
    (fp32) or K = 8 (bf16). Gradients of 16-bit parameters, grad_dtype:
        param   as the parameters (2 bytes)
        fp32    accumulated straight into a 4-byte buffer (Megatron's main_grad: 2 + 4 + 12 = 18, Megatron-LM's README:
                "bf16 param, fp32 grads: 18 bytes per parameter, 6 + 12/d with the distributed optimizer")
        both    16-bit gradients from the backward and a 4-byte buffer they are added into (2 + 2 + 4 + 12 = 20, "20
                bytes / parameter with mixed precision", the seeds' lecture; nanotron's accumulate_grad_in_fp32,
                DeepSpeed's BF16_Optimizer: "4 bytes * params" of fp32 gradients, bigscience tr11-176B-ml README)"""
    table = {"fp32": dict(params=4, grads=4, optim=8), "bf16": dict(params=2, grads=2, optim=12)}
    if recipe not in table or moments not in ("fp32", "bf16"):
        raise ValueError(f"unknown precision recipe {recipe!r} / moments {moments!r}; expected one of {sorted(table)}")
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"unknown gradient dtype {grad_dtype!r}; expected one of {', '.join(GRAD_DTYPES)}")
    out = dict(table[recipe])
    out["optim"] -= 4 if moments == "bf16" else 0
    if out["grads"] < 4:
        out["grads"] = dict(param=out["grads"], fp32=4, both=out["grads"] + 4)[grad_dtype]
    return out



PRECISION = {   # model-state recipe of model_state_bytes_per_param, bytes per activation value
    "bf16": ("bf16", 2),   # bf16 params/grads + fp32 master and AdamW (the ZeRO paper's mixed precision)
    "amp": ("fp32", 2),    # fp32 params/grads/AdamW, bf16 autocast (every train script here on GPU)
    "fp32": ("fp32", 4),
}
RECOMPUTE = ("none", "selective", "full")   # what the search ranks (train_5d's modes)
# and for --layout only: torchtitan's selective op policy (plan_shape.op_recompute_values), which train_5d lacks
LAYOUT_RECOMPUTE = RECOMPUTE + ("op",)
SHAPE = ("n_layer", "n_embd", "n_head", "vocab")   # a MODELS entry; each also a command-line flag


@dataclass(frozen=True)
class Job:
    """What is trained on what: the model, the cluster and the batch."""
    cfg: GPTConfig
    gpus: int
    gpus_per_node: int
    gpu: str
    global_seqs: int
    precision: str = "bf16"  # a PRECISION key
    attn: str = "flash"       # flash: no s x s scores stored (torch's fused SDPA); eager: Korthikanti's 5as/h term
    bucket_mb: float = 25.0
    bucket_mb_per_dp: float = 0.0   # a bucket of max(bucket_mb, this x dp x cp) MiB; 0: the train scripts' fixed
                                    # --bucket_mb (plan.py's command line grows it as Megatron-Core: plan_time)
    eff: float = 0.0          # one efficiency for every executed FLOP; 0: plan_time's measured kernel ceilings
    dp_overlap: bool = True   # gradient reductions overlap the backward (DDP buckets); False: after it, as
                              # Megatron-LM's 2021 "local" DDP (megatron/training.py train_step)
    dp_overlap_style: str = "ddp"   # how (plan_comm.exposed_dp_time): ddp, the last micro-batch's backward hides the
                                    # reductions, ZeRO-1/2's gather after the step; mcore, Megatron-Core's
                                    # --overlap-grad-reduce --overlap-param-gather
    grad_dtype: str = "param"       # a GRAD_DTYPES entry: fp32, a 4-byte gradient buffer instead of 16-bit gradients;
                                    # both, beside them (model_state_bytes_per_param)
    pp_scatter_gather: bool = False   # a pipeline message leaves as 1/t per tp rank and is all-gathered over tp
                                      # on arrival (Megatron-LM, Narayanan et al. 2021 Sec. 4.1); SP does so anyway
    # model shapes beyond model.py's GPT (plan_shape.py): 0 / the defaults are model.py's own
    n_kv_head: int = 0        # key/value heads (GQA); 0: n_head
    ffn_hidden: int = 0       # MLP width; 0: 4 * n_embd
    gated: bool = False       # SwiGLU-style MLP: gate, up and down matrices
    tied: bool = True         # input embedding and LM head share one matrix
    first_stage_layers: int = 0   # layers of the first / last pipeline stage (0: an even share), as Megatron-LM's
    last_stage_layers: int = 0    # --decoder-first/last-pipeline-num-layers
    ends_as_layers: bool = False  # embedding and loss each take a layer's place in the pipeline split (Llama 3)
    # software behaviour (plan_time.py)
    tp_overlap: float = 0.0   # share of tp's communication hidden under GEMMs (plan_time.TP_OVERLAP for published)
    pp_overlap: bool = False  # pipeline sends overlap the next micro-batch's compute (Megatron-Core
                              # --overlap-p2p-communication): only the fill and drain transfers stay exposed
    attn_eff: float = 0.0     # flash attention's share of peak; 0: plan_time.ATTN_EFF (FlashAttention-2's)
    causal: bool = True       # flash attention skips the masked half of the scores (time only; MFU counts all)
    moments: str = "fp32"     # AdamW m and v precision (bf16: 2 + 2 bytes instead of 4 + 4)
    rope: bool = True         # rotary positions: q and k kept again after the rotation (model.py, Llama); False:
                              # learned or ALiBi positions (GPT-2, MPT, BLOOM), nothing rotated kept
    net_gbps: float = 0.0     # the cluster's network per GPU, Gb/s per direction (0: the GPU row's, a DGX's NICs)
    fused_loss: bool = False  # the cross-entropy computed in one kernel from the 16-bit logits (flash-attn's
                              # xentropy, llm-foundry's default): no fp32 copy or softmax of the logits kept

    @property
    def shape(self):
        """The model as a hashable key (for the cached flat_groups): GPTConfig's fields, then the shape options."""
        return (tuple((k, getattr(self.cfg, k)) for k in ("vocab_size", "n_layer", "n_embd", "n_head", "n_experts",
                                                          "moe_every", "top_k"))
                + tuple((k, getattr(self, k)) for k in SHAPE_OPTIONS))

    @property
    def hw(self):
        """The GPU's HARDWARE row (its network per GPU replaced by net_gbps where given)."""
        row = HARDWARE[self.gpu]
        return {**row, "net": self.net_gbps * 1e9 / 8} if self.net_gbps else row

    @property
    def peak(self):
        """Dense bf16 FLOP/s of the GPU's board (SXM unless the row names one), from peaks.GPU_PEAK_TFLOPS (a
        datasheet cited per row)."""
        return GPU_PEAK_TFLOPS[(self.hw["peak"], self.hw.get("board", ""))][0] * 1e12


@dataclass(frozen=True)
class Layout:
    """One split of a Job over its GPUs, as train_5d.py's flags name it (v: model chunks per rank, interleaved)."""
    dp: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    zero_stage: int = 0
    schedule: str = "1f1b"
    v: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"

    def grad_acc(self, job):
        """Micro-batches per step on each data-parallel rank: global_seqs / (dp * micro_batch_size)."""
        return job.global_seqs // (self.dp * self.micro_batch_size)


def validate(job, lay):
    """Raise ConfigError unless the layout divides the world, the model, the sequence and the batch."""
    cfg = job.cfg
    check(lay.dp * lay.tp * lay.cp * lay.pp == job.gpus,
          f"dp*tp*cp*pp = {lay.dp}*{lay.tp}*{lay.cp}*{lay.pp} != {job.gpus} GPUs")
    check(cfg.n_head % lay.tp == 0, f"n_head={cfg.n_head} is not divisible by tp={lay.tp}")
    check(cfg.padded_vocab_size % lay.tp == 0, f"padded vocab {cfg.padded_vocab_size} not divisible by tp={lay.tp}")
    check(not lay.sp or lay.tp > 1, "sp needs tp > 1")
    check(not lay.sp or cfg.block_size // lay.cp % lay.tp == 0, f"sp: seq/cp = {cfg.block_size // lay.cp} tokens per "
                                                                f"cp rank is not divisible by tp={lay.tp}")
    check(lay.cp == 1 or cfg.block_size % (2 * lay.cp) == 0, f"seq={cfg.block_size} not divisible by 2*cp (zigzag)")
    check(lay.cp == 1 or job.attn == "flash", "eager attention is modelled without cp only")
    kv = job.n_kv_head or cfg.n_head
    check(kv % lay.tp == 0, f"n_kv_head={kv} is not divisible by tp={lay.tp} (each tp rank holds whole KV heads)")
    uneven = job.first_stage_layers or job.last_stage_layers or job.ends_as_layers
    check(uneven or cfg.n_layer % (lay.pp * lay.v) == 0 or cfg.n_layer >= lay.pp * lay.v,
          f"n_layer={cfg.n_layer} not divisible by pp*v={lay.pp * lay.v}")
    stage_layer_counts(job, lay.pp * lay.v)
    check(job.global_seqs % (lay.dp * lay.micro_batch_size) == 0,
          f"global batch of {job.global_seqs} sequences not divisible by dp*micro_batch_size = "
          f"{lay.dp}*{lay.micro_batch_size}")
    m = lay.grad_acc(job)
    check(lay.schedule in SCHEDULES, f"unknown schedule {lay.schedule!r}; known: {', '.join(SCHEDULES)}")
    check(lay.schedule not in V_SHAPED or lay.v == 2, f"{lay.schedule} places v=2 chunks per rank in a V, not v={lay.v}")
    check(lay.schedule in V_SHAPED or (lay.v > 1) == (lay.schedule == "interleaved"),
          "v > 1 exactly when the schedule is interleaved, zbv or dualpipev")
    check(lay.schedule != "interleaved" or m % lay.pp == 0, "interleaved needs micro-batches % pp == 0")
    check(lay.schedule in ("afab", "zbv", "1f1b") or m >= lay.pp,
          f"{lay.schedule} needs micro-batches per step ({m}) >= pp={lay.pp}")
    check(lay.schedule != "dualpipev" or m >= 2 * lay.pp,
          f"dualpipev needs micro-batches per step ({m}) >= 2 * pp = {2 * lay.pp}")
    check(lay.zero_stage in (0, 1, 2, 3), f"zero_stage {lay.zero_stage}: ZeRO has stages 0, 1, 2 and 3")
    check(lay.zero_stage < 3 or lay.dp * lay.cp > 1, "zero_stage 3 shards over dp x cp: dp*cp = 1 has none")
    check(lay.zero_stage < 3 or lay.schedule != "interleaved" or lay.pp > 1,
          "zero_stage 3 with interleaved needs pp > 1 (train_5d: one rank's two chunks would share the tied weight)")
    check(lay.recompute in LAYOUT_RECOMPUTE, f"unknown recompute {lay.recompute!r}; known: {', '.join(LAYOUT_RECOMPUTE)}")
    check(lay.recompute != "op" or job.attn == "flash", "recompute=op (torchtitan's op policy) is modelled with flash "
                                                        "attention")
    check(lay.ep == 1 or (cfg.n_experts > 0 and cfg.n_experts % lay.ep == 0 and (lay.dp * lay.cp) % lay.ep == 0),
          f"ep={lay.ep} needs experts, and must divide n_experts={cfg.n_experts} and dp*cp={lay.dp * lay.cp}")


def as_run(job, lay):
    """The layout as it runs: 1f1b with fewer micro-batches than stages warms up with every micro-batch before its
    first backward, which is afab (the same bubble, (p-1)/(m+p-1), and m in flight); train_5d runs it so."""
    if lay.pp > 1 and lay.schedule == "1f1b" and lay.dp * lay.micro_batch_size and lay.grad_acc(job) < lay.pp:
        return replace(lay, schedule="afab")
    return lay


# ----------------------------------------------------------------------------------------------------------
# command line

FLAGS = [("n_kv_head", int, None, "key/value heads (grouped-query attention; default n_head)"),
         ("ffn_hidden", int, None, "MLP width (default 4 * n_embd)"),
         ("gated", bool, None, "gated MLP (SwiGLU: gate, up, down matrices; default: the preset's, else plain)"),
         ("tied", bool, None, "input embedding tied to the LM head (default: the preset's, else tied)"),
         ("first_stage_layers", int, 0, "layers of the first pipeline stage (0: an even share)"),
         ("last_stage_layers", int, 0, "layers of the last pipeline stage (0: an even share)"),
         ("ends_as_layers", bool, None, "the embedding and the loss each take a layer's place in the pipeline "
          "split (Megatron-Core --account-for-embedding/loss-in-pipeline-split; default: the preset's, llama3-405b's "
          "as Llama 3 split it, else off)"),
         ("rope", bool, True, "rotary position embedding (q and k kept again after the rotation); --no-rope: "
          "learned or ALiBi positions"),
         ("fused_loss", bool, False, "cross-entropy fused in one kernel on the 16-bit logits (flash-attn's xentropy, "
          "llm-foundry's default): the logits and their gradient only, no fp32 copies"),
         ("dropout", float, 0.0, "dropout probability (masks kept for backward when > 0)"),
         ("n_experts", int, 0, "experts per MoE block (0: dense)"), ("top_k", int, 2, "experts per token"),
         ("capacity_factor", float, 0.0, "MoE expert capacity factor (0: dropless, expert memory at the even share; "
          "> 0: bounded by the capacity)"),
         ("gpus", int, 8, "GPUs in all"), ("gpus_per_node", int, 8, "GPUs sharing NVLink"),
         ("gpu", str, "h100", f"one of {', '.join(HARDWARE)}"),
         ("net_gbps", float, None, "network per GPU, Gb/s per direction (default: the GPU row's DGX NICs: A100 200, "
          "H100 400)"), ("seq", int, 4096, "sequence length"),
         ("global_batch_tokens", str, "4M", "tokens per optimizer step (K/M/G binary)"),
         ("precision", str, "bf16", "bf16 (train_zero) | amp (fp32 states, bf16 autocast) | fp32"),
         ("moments", str, "fp32", "AdamW m and v precision: fp32 | bf16"),
         ("attn", str, "flash", "flash (no s x s scores kept) | eager (Korthikanti's 5as/h term)"),
         ("causal", bool, True, "causal flash attention skips the masked half of the scores (time only)"),
         ("bucket_mb", float, 25.0, "gradient bucket MiB (ZeRO padding; one collective each)"),
         ("bucket_mb_per_dp", float, MCORE_BUCKET["bucket_mb_per_dp"], "bucket grown to max(bucket_mb, this x dp x cp) "
          "MiB against NCCL's latency at large dp, as Megatron-Core's (1e6 fp32 params per rank); 0: fixed"),
         ("eff", float, None, "one compute efficiency in (0, 1] for every FLOP (default: plan_time's measured GEMM "
          "and attention ceilings x the software share)"),
         ("attn_eff", float, None, "flash attention's fraction of peak, forward + backward (default: FlashAttention-2's "
          "published, plan_time.ATTN_EFF)"),
         ("dp_overlap", bool, True, "gradient reductions overlap the backward (--no-dp_overlap: after it)"),
         ("dp_overlap_style", str, "ddp", "ddp (the last micro-batch's backward hides the reductions; ZeRO-1/2's gather "
          "exposed) | mcore (Megatron-Core's --overlap-grad-reduce --overlap-param-gather)"),
         ("grad_dtype", str, "param", "gradients of 16-bit parameters: param (16-bit) | fp32 (a 4-byte buffer, "
          "Megatron's main_grad) | both (16-bit ones added into a 4-byte buffer: nanotron, DeepSpeed's BF16_Optimizer)"),
         ("tp_overlap", float, 0.0, "share of tp communication hidden under its GEMMs, 0-1 (Megatron-LM 2021, "
          "torchtitan: 0; NeMo/Transformer Engine --tp-comm-overlap: 1)"),
         ("pp_overlap", bool, False, "pipeline sends overlap compute (Megatron-Core --overlap-p2p-communication)"),
         ("pp_scatter_gather", bool, False, "pipeline messages as 1/tp per rank, all-gathered over tp (Megatron)"),
         ("software", str, None, f"the attention and overlap defaults of one stack: {', '.join(SOFTWARE)} "
          "(plan_time.SOFTWARE; a flag given beside it wins)"),
         ("layout", str, None, "evaluate one layout, e.g. tp=8,zero_stage=1,micro_batch_size=2"),
         ("top", int, 10, "rows printed")]


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, unreadable number, bad choice) are one `error:` line and exit 2, as
    every other bad input of plan.py (argparse's own prints the usage first). A prefix is not a flag: --tp would
    otherwise be read as --tp_overlap (allow_abbrev=False where it is made)."""

    def error(self, message):
        fail(message)


def finite(kind):
    """An argparse type: `kind` (int or float) that also refuses nan and inf (float('nan') reads fine)."""
    def read(text):
        value = kind(text)
        if not math.isfinite(value):
            raise ValueError(text)
        return value
    read.__name__ = kind.__name__     # argparse names the type in its message: "invalid float value: 'nan'"
    return read


def parse_args(argv, description):
    """plan.py's flags: a --model preset or the SHAPE flags, then FLAGS, then --json."""
    ap = OneLineParser(description=description, allow_abbrev=False)
    ap.add_argument("--model", default=None, help=f"preset: {', '.join(MODELS)}")
    for k in SHAPE:
        ap.add_argument(f"--{k}", type=int, default=None, help="model shape (overrides the preset)")
    for name, kind, default, text in FLAGS:
        if kind is bool:
            ap.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=text)
            continue
        ap.add_argument(f"--{name}", type=finite(kind) if kind in (int, float) else kind, default=default, help=text,
                        choices=dict(precision=list(PRECISION), attn=["flash", "eager"], software=list(SOFTWARE),
                                     moments=["fp32", "bf16"], dp_overlap_style=["ddp", "mcore"],
                                     grad_dtype=list(GRAD_DTYPES)).get(name))
    ap.add_argument("--json", action="store_true", help="one JSON object per layout (OOM ones included)")
    return ap.parse_args(argv)


def parse_tokens(text):
    """'4M' -> 4 * 2^20 tokens (K, M, G binary, as global batches are usually powers of two)."""
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    check(number.replace(".", "", 1).isdigit(), f"--global_batch_tokens: cannot read {text!r} (e.g. 4M, 524288)")
    return int(float(number) * scale)


def check_flags(a):
    """Every number plan.py reads from its flags is in range (ConfigError naming the flag otherwise)."""
    for k in SHAPE:
        check(getattr(a, k) is None or getattr(a, k) > 0, f"--{k} must be a positive integer, got {getattr(a, k)}")
    for k in ("gpus", "gpus_per_node", "seq", "top", "top_k"):
        check(getattr(a, k) > 0, f"--{k} must be a positive integer, got {getattr(a, k)}")
    check(a.gpus <= a.gpus_per_node or a.gpus % a.gpus_per_node == 0,
          f"--gpus {a.gpus} is not a whole number of nodes of --gpus_per_node {a.gpus_per_node}")
    check(a.n_experts >= 0, f"--n_experts must be >= 0 (0: dense), got {a.n_experts}")
    check(a.n_experts == 0 or a.top_k <= a.n_experts, f"--top_k {a.top_k} exceeds --n_experts {a.n_experts}")
    check(a.capacity_factor >= 0, f"--capacity_factor must be >= 0 (0: dropless), got {a.capacity_factor}")
    check(a.net_gbps is None or a.net_gbps > 0, f"--net_gbps must be positive, got {a.net_gbps}")
    check(a.bucket_mb > 0, f"--bucket_mb must be positive, got {a.bucket_mb}")
    check(a.bucket_mb_per_dp >= 0, f"--bucket_mb_per_dp must be 0 or more, got {a.bucket_mb_per_dp}")
    check(a.eff is None or 0 < a.eff <= 1, f"--eff is a fraction of peak in (0, 1], got {a.eff}")
    check(a.attn_eff is None or 0 < a.attn_eff <= 1, f"--attn_eff is a fraction of peak in (0, 1], got {a.attn_eff}")
    check(0 <= a.tp_overlap <= 1, f"--tp_overlap is a share in [0, 1], got {a.tp_overlap}")
    check(0 <= a.dropout < 1, f"--dropout is a probability in [0, 1), got {a.dropout}")
    for k in ("n_kv_head", "ffn_hidden"):
        check(getattr(a, k) is None or getattr(a, k) > 0, f"--{k} must be a positive integer, got {getattr(a, k)}")
    for k in ("first_stage_layers", "last_stage_layers"):
        check(getattr(a, k) >= 0, f"--{k} must be >= 0 (0: an even share), got {getattr(a, k)}")


def build_job(a):
    """The Job of plan.py's parsed command line: a --model preset, any of whose shape flags override it; --software's
    fields where their flags keep the default."""
    check_flags(a)
    defaults = {name: default for name, _, default, _ in FLAGS}
    for key, value in SOFTWARE.get(a.software, {}).items():
        if getattr(a, key) == defaults[key]:
            setattr(a, key, value)
    check(a.gpu in HARDWARE, f"unknown GPU {a.gpu!r}; known: {', '.join(HARDWARE)}")
    check(a.model is None or a.model in MODELS, f"unknown model {a.model!r}; known: {', '.join(MODELS)}")
    preset = dict(MODELS.get(a.model, {}))
    options = dict(n_kv_head=preset.pop("n_kv_head", 0), ffn_hidden=preset.pop("ffn_hidden", 0),
                   gated=preset.pop("gated", False), tied=preset.pop("tied", True),
                   ends_as_layers=preset.pop("ends_as_layers", False))
    options.update({k: getattr(a, k) for k in options if getattr(a, k) is not None})
    shape = {**preset, **{k: getattr(a, k) for k in SHAPE if getattr(a, k) is not None}}
    check(len(shape) == 4, "give --model or all of --n_layer --n_embd --n_head --vocab")
    check(shape["n_embd"] % shape["n_head"] == 0, "n_embd must be divisible by n_head")
    kv = options["n_kv_head"] or shape["n_head"]
    check(kv <= shape["n_head"] and shape["n_head"] % kv == 0,
          f"--n_kv_head {kv} must divide n_head={shape['n_head']} (query heads share each key/value head)")
    tokens = parse_tokens(a.global_batch_tokens)
    check(tokens % a.seq == 0 and tokens >= a.seq, f"global batch of {tokens} tokens is not a multiple of seq={a.seq}")
    cfg = GPTConfig(vocab_size=shape["vocab"], block_size=a.seq, n_layer=shape["n_layer"], n_head=shape["n_head"],
                    n_embd=shape["n_embd"], dropout=a.dropout, n_experts=a.n_experts, top_k=a.top_k,
                    capacity_factor=a.capacity_factor)
    return Job(cfg, a.gpus, a.gpus_per_node, a.gpu, tokens // a.seq, a.precision, a.attn, a.bucket_mb,
               eff=a.eff or 0.0, dp_overlap=a.dp_overlap, pp_scatter_gather=a.pp_scatter_gather, **options, first_stage_layers=a.first_stage_layers,
               last_stage_layers=a.last_stage_layers, tp_overlap=a.tp_overlap, pp_overlap=a.pp_overlap,
               causal=a.causal, moments=a.moments, attn_eff=a.attn_eff or 0.0, rope=a.rope, fused_loss=a.fused_loss,
               net_gbps=a.net_gbps or 0.0, bucket_mb_per_dp=a.bucket_mb_per_dp, dp_overlap_style=a.dp_overlap_style,
               grad_dtype=a.grad_dtype)


BOOLEAN = {"true": True, "1": True, "false": False, "0": False}   # anything else (yes, on, y) is refused


def read_layout_value(key, kind, value):
    """One --layout value as Layout's field `key` reads it; ConfigError (naming key and value) when it cannot."""
    if kind is bool:
        check(value.lower() in BOOLEAN, f"--layout: {key}={value!r} is not a boolean (true/false or 1/0)")
        return BOOLEAN[value.lower()]
    if kind is int:
        check(value.isdigit(), f"--layout: {key}={value!r} is not a whole number")
        number = int(value)
        if key == "zero_stage":
            check(number in (0, 1, 2, 3), f"--layout: zero_stage={number}; ZeRO has stages 0, 1, 2 and 3")
        else:
            check(number > 0, f"--layout: {key}={number} must be a positive integer")
        return number
    check(value != "", f"--layout: {key} has no value")
    return value


def parse_layout(text, job):
    """'tp=4,zero_stage=1,schedule=interleaved,...' (Layout's fields; dp defaults to gpus / (tp*cp*pp))."""
    kinds = {f.name: f.type for f in fields(Layout)}
    values = {}
    for item in text.split(","):
        key, eq, value = item.strip().partition("=")
        check(eq == "=", f"--layout: {item!r} is not key=value (e.g. tp=8,zero_stage=1)")
        check(key in kinds, f"--layout: unknown key {key!r}; known: {', '.join(kinds)}")
        check(key not in values, f"--layout: {key} is given twice")
        values[key] = read_layout_value(key, kinds[key], value.strip())
    rest = values.get("tp", 1) * values.get("cp", 1) * values.get("pp", 1)
    check(job.gpus % rest == 0, f"tp*cp*pp = {rest} does not divide {job.gpus} GPUs")
    check(values.get("pp", 1) > 1 or values.get("schedule", "1f1b") == "1f1b" and values.get("v", 1) == 1,
          f"--layout: schedule={values.get('schedule', '1f1b')} v={values.get('v', 1)} needs pp > 1 (a pipeline)")
    values.setdefault("dp", job.gpus // rest)
    values.setdefault("v", 2 if values.get("schedule") in ("interleaved",) + V_SHAPED else 1)
    return Layout(**values)
