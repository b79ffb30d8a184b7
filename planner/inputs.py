"""
planner/inputs.py: what plan.py predicts for, as plain data: the GPU (datasheet numbers and a published efficiency per
row), the model shape (presets or any), the precision recipe, the cluster and batch (Job), and one split of it
(Layout), with the checks that the split divides them.
Nothing here predicts anything; plan.py's formulas read these fields.

    job = Job(GPTConfig(...), gpus=64, gpus_per_node=8, gpu="h100", global_seqs=512)   # or cli.build_job
    lay = Layout(dp=16, tp=4, zero_stage=1)
    validate(job, lay)                             # ConfigError (one line) unless the layout divides the job

plan.py's command line, which builds both from flags, is planner/cli.py.

A layout is valid when
    dp * tp * cp * pp = gpus,   global_seqs = dp * micro_batch_size * grad_acc,   ep | dp*cp and ep | n_experts,
    tp | n_head and padded vocab,   2*cp | seq (zigzag),   pp * v | n_layer,
    v = 2 for zbv and dualpipev (a V), v > 1 for interleaved (and grad_acc % pp = 0), else 1,
    grad_acc >= pp except for afab, zbv and 1f1b, grad_acc >= 2*pp for dualpipev (as train_5d.py and train_pp.py);
    1f1b with fewer micro-batches than stages is all forwards then all backwards: as_run evaluates it as afab.
"""
from dataclasses import astuple, dataclass, fields, replace
from functools import cached_property

from common.errors import check
from common.model_setup import ARCHS
from common.peaks import GPU_PEAK_TFLOPS
from model import GPTConfig
from pipeline.schedules import SCHEDULES, V_SHAPED
from planner.shape import SHAPE_OPTIONS, stage_layer_counts

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

# Presets. gpt2*: model.py's GPT (Radford et al. 2019). llama3-*: Llama 3 as published (Dubey et al. 2024, "The Llama 3
# Herd of Models", arXiv 2407.21783, Table 3: layers, model dimension, FFN dimension, attention heads, 8 key/value
# heads, vocabulary 128K = 128,256 tokens; SwiGLU, untied embeddings; RMSNorm and no biases: arch llama, 8,030,261,248
# parameters for 8B, Meta's count); 405B's pipeline split as Sec. 3.3.2 gives it (the embedding and the loss each in a
# layer's place: shape.even_split). gpt3-175b: Brown et al. 2020, Table 2.1
# (GeLU MLP of 4h, full multi-head attention). A plain GPT of Llama's depth and width: --model llama3-8b-gpt.
MODELS = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab=50257),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25, vocab=50257),
    "llama3-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, vocab=128256, n_kv_head=8, ffn_hidden=14336,
                      gated=True, tied=False),
    "llama3-70b": dict(arch="llama", n_layer=80, n_embd=8192, n_head=64, vocab=128256, n_kv_head=8, ffn_hidden=28672,
                       gated=True, tied=False),
    "llama3-405b": dict(arch="llama", n_layer=126, n_embd=16384, n_head=128, vocab=128256, n_kv_head=8,
                        ffn_hidden=53248, gated=True, tied=False, ends_as_layers=True),
    "llama3-8b-gpt": dict(n_layer=32, n_embd=4096, n_head=32, vocab=128256),
    "llama3-70b-gpt": dict(n_layer=80, n_embd=8192, n_head=64, vocab=128256),
    "gpt3-175b": dict(n_layer=96, n_embd=12288, n_head=96, vocab=51200),
}


def family_config(arch, **fields):
    """model.GPTConfig with the norm, biases and MoE gate renormalization of model.py's family `arch`
    (common.model_setup.ARCHS), the other fields as given. Its MLP and key/value heads stay GPT-2's: a Job holds those
    as its own fields (gated, ffn_hidden, n_kv_head), which shape.py's formulas add to model.py's GPT counts
    (activation_delta_values)."""
    family = ARCHS[arch]
    return GPTConfig(norm=family.get("norm", "layernorm"), qkv_bias=family.get("qkv_bias", True),
                     bias=family.get("bias", True), router_renorm=family.get("router_renorm", False), **fields)


GRAD_DTYPES = ("param", "fp32", "both")    # model_state_bytes_per_param's gradient buffers
PP_OUTPUTS_KEPT = ("none", "last", "all")  # the stage outputs a pipeline runtime keeps (planner/runtime_memory.py)
TP_OVERLAP_STYLES = ("chunked", "torch")
# Job.loss: the loss code planner/head.py counts ("": read from the fused_loss / inplace_loss / loss_parallel flags)
LOSS_NAMES = ("", "nanoscale", "cross_entropy", "loss_parallel", "vocab_parallel", "megatron", "nanotron", "fused",
              "linear_ce")   # which SP collectives --tp_overlap pipelines (comm.sp_collectives)


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
# and for --layout only: torchtitan's selective op policy (shape.op_recompute_values), which train_5d lacks
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
    dp_overlap_style: str = "ddp"   # how (comm.exposed_dp_time): ddp, the last micro-batch's backward hides the
                                    # reductions, ZeRO-1/2's gather after the step; mcore, Megatron-Core's
                                    # --overlap-grad-reduce --overlap-param-gather
    grad_dtype: str = "param"       # a GRAD_DTYPES entry: fp32, a 4-byte gradient buffer instead of 16-bit gradients;
                                    # both, beside them (model_state_bytes_per_param)
    pp_scatter_gather: bool = False   # a pipeline message leaves as 1/t per tp rank and is all-gathered over tp
                                      # on arrival (Megatron-LM, Narayanan et al. 2021 Sec. 4.1); SP does so anyway
    # model shapes beyond model.py's GPT (planner/shape.py): 0 / the defaults are model.py's own
    n_kv_head: int = 0        # key/value heads (GQA); 0: n_head
    ffn_hidden: int = 0       # MLP width; 0: 4 * n_embd
    gated: bool = False       # SwiGLU-style MLP: gate, up and down matrices
    tied: bool = True         # input embedding and LM head share one matrix
    first_stage_layers: int = 0   # layers of the first / last pipeline stage (0: an even share), as Megatron-LM's
    last_stage_layers: int = 0    # --decoder-first/last-pipeline-num-layers
    ends_as_layers: bool = False  # embedding and loss each take a layer's place in the pipeline split (Llama 3)
    # software behaviour (planner/timing.py)
    tp_overlap: float = 0.0   # share of tp's communication hidden under GEMMs (timing.TP_OVERLAP for published)
    tp_overlap_style: str = "chunked"   # which SP collectives are pipelined (comm.sp_collectives): chunked, all
                                        # (Transformer Engine's userbuffers); torch, those torch's micro-pipeline pass
                                        # fuses with one matmul
    tp_saves_gathered: bool = False   # autograd keeps a TP linear's all-gathered input (torch DTensor, torchtitan), so
                                      # the backward does not gather it again; False: the shard is kept and gathered
                                      # again (Megatron-LM, nanotron, train_tp)
    pp_overlap: bool = False  # pipeline sends overlap the next micro-batch's compute (Megatron-Core
                              # --overlap-p2p-communication): only the fill and drain transfers stay exposed
    attn_eff: float = 0.0     # flash attention's share of peak; 0: timing.ATTN_EFF (FlashAttention-2's)
    causal: bool = True       # flash attention skips the masked half of the scores (time only; MFU counts all)
    moments: str = "fp32"     # AdamW m and v precision (bf16: 2 + 2 bytes instead of 4 + 4)
    fused_bias_dropout_add: bool = False   # dropout fused with the residual add in one kernel (Megatron-LM's
                                           # --bias-dropout-fusion, on by default): planner/elementwise.py
    fused_swiglu: bool = False   # the gated MLP's silu(gate) * up in one kernel or a compiled graph, which recompute
                                 # silu(gate) in the backward: 3f kept per token, eager 4f (shape.mlp_saved_values)
    rope: bool = True         # rotary positions: q and k kept again after the rotation (model.py, Llama); False:
                              # learned or ALiBi positions (GPT-2, MPT, BLOOM), nothing rotated kept
    net_gbps: float = 0.0     # the cluster's network per GPU, Gb/s per direction (0: the GPU row's, a DGX's NICs)
    fused_loss: bool = False  # the cross-entropy computed in one kernel from the 16-bit logits (flash-attn's
                              # xentropy, llm-foundry's default): no fp32 copy or softmax of the logits kept
    inplace_loss: bool = False  # Megatron's vocab-parallel cross-entropy: softmax in place on the fp32 logits, its
                                # gradient in place on the saved softmax (no fp32 gradients beside it)
    loss_parallel: bool = False  # with tp > 1 the loss runs through torch's loss_parallel (DTensor's vocab-parallel
                                 # cross-entropy: 12 bytes per logit in its backward, planner/runtime_memory.py)
    loss: str = ""            # the loss code the stack runs (planner/head.LOSSES, or nanoscale: model.LMHead / train_tp's
                              # vocab-parallel one by tp); "": read from fused_loss, inplace_loss, loss_parallel
    loss_chunks: int = 1      # the loss run over this many chunks of the logits (the fused head: of its tokens)
    pp_outputs_kept: str = "none"   # a PP_OUTPUTS_KEPT entry: the stage outputs of every micro-batch a pipeline
                                    # runtime keeps until the step ends (torch.distributed.pipelining before 2025: all)
    pp_recv_per_micro_batch: bool = False   # a pipeline receive buffer per micro-batch, for activations and for
                                            # gradients, kept (torch.distributed.pipelining's PipelineStage)
    # what the training loop keeps at the start of the backward (memory.memory, other_bytes)
    logits_held: bool = False   # the caller holds the logits through the backward (train_single, train_tp, train_ddp,
                                # train_zero: `_, loss = model(x, y)`); train_5d's stages return the loss alone and
                                # torchtitan deletes them ("del pred ... to avoid peaking memory")
    grads_freed: bool = False   # gradients set to None after each step (optimizer.zero_grad(set_to_none=True): train_
                                # single, FSDP2 in torchtitan), so a step of one micro-batch starts its backward without
                                # them; False: kept in persistent buffers (train_5d's and DDP's buckets, Megatron's
                                # main_grad)
    fp32_residual: bool = True  # under amp the residual stream is fp32 (autocast over fp32 weights: the embedding
                                # and each block's sum are fp32), so the LayerNorms save 4-byte inputs; False where
                                # the forward runs 16-bit weights (FSDP's param_dtype)

    def __hash__(self):
        """A Job is a key of the search's caches (planner/memory.py): hashed by its fields, its GPTConfig's as a tuple
        (the generated hash would refuse the mutable GPTConfig; equality stays the generated field by field)."""
        return hash(self.key)

    @cached_property
    def key(self):
        """Every field as one hashable tuple (built once: a Job is not changed after it is made)."""
        return (astuple(self.cfg),) + tuple(getattr(self, f.name) for f in fields(self)[1:])

    @cached_property
    def shape(self):
        """The model as a hashable key (for the cached flat_groups): GPTConfig's fields, then the shape options.
        Built once per Job (the search asks for it about ten times per layout); a Job is frozen and its cfg is not
        changed after it is made (dataclasses.replace makes a new Job)."""
        return (tuple((k, getattr(self.cfg, k)) for k in ("vocab_size", "n_layer", "n_embd", "n_head", "n_experts",
                                                          "moe_every", "top_k", "norm", "qkv_bias", "bias"))
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
    check(job.pp_outputs_kept in PP_OUTPUTS_KEPT,
          f"unknown pp_outputs_kept {job.pp_outputs_kept!r}; known: {', '.join(PP_OUTPUTS_KEPT)}")
    check(job.loss in LOSS_NAMES, f"unknown loss {job.loss!r}; known: {', '.join(LOSS_NAMES[1:])}")
    check(job.loss != "linear_ce" or lay.tp == 1, "the fused linear cross-entropy head (linear_ce) needs the whole "
                                                  "vocabulary on one rank: tp 1 (under TP the head is vocab-parallel)")
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
