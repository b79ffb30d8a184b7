"""
planner/cli.py: plan.py's command line: its flags (FLAGS, each with its help; --software's stack defaults where a flag
keeps its own), their range checks, and the Job and Layout they build (planner/inputs.py holds both). Every bad value is
one `error:` line and exit 2, before any work (tests/test_plan_inputs.py).

    args = parse_args(argv, "...")                 # plan.py's flags (--help lists them)
    job = build_job(args)                          # -> inputs.Job
    lay = parse_layout("tp=4,zero_stage=1", job)   # dp defaults to gpus / (tp*cp*pp)
"""
import argparse
import math
import sys
from dataclasses import fields

from common.errors import check, fail
from common.model_setup import ARCHS
from pipeline.schedules import V_SHAPED
from planner.inputs import (GRAD_DTYPES, HARDWARE, LOSS_NAMES, MODELS, PP_OUTPUTS_KEPT, PRECISION, SHAPE,
                            TP_OVERLAP_STYLES, Job, Layout, family_config)
from planner.rates import measured as measured_rates
from planner.timing import MCORE_BUCKET, SOFTWARE

FLAGS = [("arch", str, None, "the model family, as model.py's --arch: gpt (LayerNorm, GeLU, biases) | llama (RMSNorm, "
          "SwiGLU, no biases) | qwen2 (llama with q/k/v biases) | mixtral (default: the preset's, else gpt)"),
         ("n_kv_head", int, None, "key/value heads (grouped-query attention; default n_head)"),
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
         ("loss", str, None, "the loss code whose memory is counted (planner/head.py): nanoscale (model.LMHead, train_tp's "
          "vocab-parallel loss under TP) | cross_entropy | loss_parallel | vocab_parallel | megatron | nanotron | fused | "
          "linear_ce (kernels/' fused chunked head); default: from --fused_loss / --inplace_loss / --loss_parallel"),
         ("loss_chunks", int, 1, "the loss run over this many chunks of the logits (a chunked loss; linear_ce: of "
          "its tokens, default its own chunk)"),
         ("inplace_loss", bool, False, "the loss's softmax and gradient computed in place on the fp32 logits "
          "(Megatron's vocab-parallel cross-entropy): no fp32 gradients of the logits beside the softmax"),
         ("fused_bias_dropout_add", bool, False, "dropout and the residual add in one kernel (Megatron-LM's "
          "--bias-dropout-fusion): fewer element-wise bytes (planner/elementwise.py)"),
         ("fused_swiglu", bool, False, "the gated MLP's silu(gate) * up in one kernel or a compiled graph (kernels/"
          "swiglu.py, Megatron-Core's bias-swiglu fusion, torch.compile): 3f kept per token, not eager's 4f"),
         ("loss_parallel", bool, False, "with tp > 1 the loss runs through torch's loss_parallel (torchtitan): "
          "12 bytes per logit in its backward beside the saved log-softmax, not 8"),
         ("pp_outputs_kept", str, "none", "stage outputs a pipeline runtime keeps until the step ends: none | last "
          "(the last stage's logits of every micro-batch) | all (every stage's: torch.distributed.pipelining "
          "before 2025)"),
         ("pp_recv_per_micro_batch", bool, False, "a pipeline receive buffer per micro-batch for activations and one "
          "for gradients, kept across steps (torch.distributed.pipelining); off: two messages in flight"),
         ("fp32_residual", bool, True, "under --precision amp the residual stream is fp32 (autocast over fp32 "
          "weights, as the train scripts run); --no-fp32_residual: the forward runs 16-bit weights (FSDP param_dtype)"),
         ("grads_freed", bool, False, "gradients set to None after each step (zero_grad(set_to_none=True) without "
          "persistent buckets): a step of one micro-batch starts its backward without them"),
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
          "published, timing.ATTN_EFF)"),
         ("dp_overlap", bool, True, "gradient reductions overlap the backward (--no-dp_overlap: after it)"),
         ("dp_overlap_style", str, "ddp", "ddp (the last micro-batch's backward hides the reductions; ZeRO-1/2's "
          "gather exposed) | mcore (Megatron-Core's --overlap-grad-reduce --overlap-param-gather)"),
         ("grad_dtype", str, "param", "gradients of 16-bit parameters: param (16-bit) | fp32 (a 4-byte buffer, "
          "Megatron's main_grad) | both (16-bit ones added into a 4-byte buffer: nanotron, DeepSpeed's "
          "BF16_Optimizer)"),
         ("tp_overlap", float, 0.0, "share of tp communication hidden under its GEMMs, 0-1 (Megatron-LM 2021, "
          "torchtitan: 0; NeMo/Transformer Engine --tp-comm-overlap: 1)"),
         ("tp_overlap_style", str, "chunked", "which SP collectives --tp_overlap pipelines: chunked (all: Transformer "
          "Engine's userbuffers) | torch (those torch's micro-pipeline pass fuses with one matmul: "
          "comm.sp_collectives)"),
         ("tp_saves_gathered", bool, False, "autograd keeps each TP linear's all-gathered input (torch DTensor, "
          "torchtitan): no all-gather again in the backward, a whole input kept (--no-: Megatron, nanotron, train_tp)"),
         ("pp_overlap", bool, False, "pipeline sends overlap compute (Megatron-Core --overlap-p2p-communication)"),
         ("pp_scatter_gather", bool, False, "pipeline messages as 1/tp per rank, all-gathered over tp (Megatron)"),
         ("software", str, None, f"the attention and overlap defaults of one stack: {', '.join(SOFTWARE)} "
          "(timing.SOFTWARE; a flag given beside it wins)"),
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
                                     tp_overlap_style=list(TP_OVERLAP_STYLES),
                                     grad_dtype=list(GRAD_DTYPES), loss=list(LOSS_NAMES[1:]),
                                     pp_outputs_kept=list(PP_OUTPUTS_KEPT), arch=list(ARCHS)).get(name))
    ap.add_argument("--json", action="store_true", help="one JSON object per layout (OOM ones included)")
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    a.given = {name for name, _, _, _ in FLAGS for token in argv           # what --software must not override,
               if token in (f"--{name}", f"--no-{name}") or token.startswith(f"--{name}=")}  # its default too
    return a


def parse_tokens(text):
    """'4M' -> 4 * 2^20 tokens (K, M, G binary, as global batches are usually powers of two)."""
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    check(number.replace(".", "", 1).isdigit(), f"--global_batch_tokens: cannot read {text!r} (e.g. 4M, 524288)")
    return int(float(number) * scale)


# What plan.py searches within seconds (each layout costs O(layers), the grid O(divisors of gpus)): the deepest
# published transformer has 1,000 layers (DeepNet, Wang et al. 2022), the largest clusters about 10^5 GPUs.
MAX_LAYERS, MAX_GPUS = 1024, 2 ** 20


def check_flags(a):
    """Every number plan.py reads from its flags is in range (ConfigError naming the flag otherwise)."""
    check(a.n_layer is None or a.n_layer <= MAX_LAYERS, f"--n_layer {a.n_layer}: plan.py plans up to {MAX_LAYERS} "
                                                        "layers (a search over more would not end in seconds)")
    check(a.gpus <= MAX_GPUS, f"--gpus {a.gpus}: plan.py plans up to {MAX_GPUS} GPUs (a search over more would not "
                              "end in seconds)")
    for k in SHAPE:
        check(getattr(a, k) is None or getattr(a, k) > 0, f"--{k} must be a positive integer, got {getattr(a, k)}")
    for k in ("gpus", "gpus_per_node", "seq", "top", "top_k", "loss_chunks"):
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
    fields where their flags were not given (given at its default value, a flag still wins)."""
    check_flags(a)
    for key, value in SOFTWARE.get(a.software, {}).items():
        if key not in a.given:
            setattr(a, key, value)
    check(a.gpu in HARDWARE, f"unknown GPU {a.gpu!r}; known: {', '.join(HARDWARE)}")
    measured_rates(a.gpu)                             # a rate table of this card that cannot be read: error here
    check(a.model is None or a.model in MODELS, f"unknown model {a.model!r}; known: {', '.join(MODELS)}")
    preset = dict(MODELS.get(a.model, {}))
    arch = a.arch or preset.get("arch", "gpt")
    preset.pop("arch", None)
    options = dict(n_kv_head=preset.pop("n_kv_head", 0), ffn_hidden=preset.pop("ffn_hidden", 0),
                   gated=preset.pop("gated", ARCHS[arch].get("mlp") == "swiglu"), tied=preset.pop("tied", True),
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
    cfg = family_config(arch, vocab_size=shape["vocab"], block_size=a.seq, n_layer=shape["n_layer"],
                        n_head=shape["n_head"], n_embd=shape["n_embd"], dropout=a.dropout, n_experts=a.n_experts,
                        top_k=a.top_k, capacity_factor=a.capacity_factor)
    return Job(cfg, a.gpus, a.gpus_per_node, a.gpu, tokens // a.seq, a.precision, a.attn, a.bucket_mb,
               eff=a.eff or 0.0, dp_overlap=a.dp_overlap, pp_scatter_gather=a.pp_scatter_gather, **options, first_stage_layers=a.first_stage_layers,
               last_stage_layers=a.last_stage_layers, tp_overlap=a.tp_overlap, pp_overlap=a.pp_overlap,
               causal=a.causal, moments=a.moments, attn_eff=a.attn_eff or 0.0, rope=a.rope, fused_loss=a.fused_loss,
               net_gbps=a.net_gbps or 0.0, bucket_mb_per_dp=a.bucket_mb_per_dp, dp_overlap_style=a.dp_overlap_style,
               grad_dtype=a.grad_dtype, inplace_loss=a.inplace_loss, fp32_residual=a.fp32_residual,
               grads_freed=a.grads_freed, loss_parallel=a.loss_parallel, loss=a.loss or "", loss_chunks=a.loss_chunks, pp_outputs_kept=a.pp_outputs_kept,
               pp_recv_per_micro_batch=a.pp_recv_per_micro_batch,
               fused_bias_dropout_add=a.fused_bias_dropout_add, fused_swiglu=a.fused_swiglu, tp_overlap_style=a.tp_overlap_style,
               tp_saves_gathered=a.tp_saves_gathered)


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
