"""
config.py: the one command line every nanoscale script shares (docs/observability.md).

    cfg = parse_config(argv, techniques=("tp", "sp"))          # only the flags that apply to the script

Flags are `--key value` or `--key=value`. Booleans are `--compile` / `--no-compile`. A bad configuration
exits with one `error: ...` line and exit code 2 before any work starts (`ConfigError` -> `fail`).
"""
import argparse
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, fields

from common.errors import ConfigError, check, fail  # noqa: F401 (the checks every script makes come from here)
from common.checkpoint.files import CKPT_DIR, LATEST, LOCK, resolve_resume
from common.model_setup import ARCHS, rope_scaling
from common.optim import warn_degenerate


# The script being run (train_ddp for `torchrun train_ddp.py`): its runs default to out/<script>.
SCRIPT = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else ""))[0]


@dataclass
class Config:
    # model (vocab size comes from the dataset's meta.json)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256
    dropout: float = 0.0
    arch: str = "gpt"
    n_kv_head: int = 0
    ffn_hidden: int = 0
    tied: bool = True
    rope_base: float = 10000.0
    rope_scaling: str = ""
    norm_eps: float = 1e-5
    # batch: grad_acc = global_batch_size / (micro_batch_size * dp)
    global_batch_size: int = 32
    micro_batch_size: int = 8
    # optimizer: AdamW, linear warmup then cosine decay to min_lr at max_steps
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    max_steps: int = 2000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_bad_steps: int = 3
    # system
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    seed: int = 1337
    recompute: str = "none"
    kernels: str = "auto"
    fp8: str = "none"
    fp8_all_gather: bool = False
    dist_timeout: float = 300.0
    # io and logging
    data_dir: str = os.path.join("data", "stdlib")
    data_mix: str = ""
    out_dir: str = os.path.join("out", SCRIPT) if SCRIPT.startswith("train_") else "out"   # out/train_ddp, ...
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 10
    save_interval: int = 0
    keep_checkpoints: int = 2
    resume: bool = False          # --resume [yes|auto|no], resolved to a bool by parse_config
    init_from: str = ""
    stop_step: int = 0
    sample_tokens: int = 200
    profile: int = 0
    # technique flags: each script enables the ones that apply
    dp: int = 0
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_layout: str = "zigzag"
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    n_microbatches: int = 0
    zero_stage: int = 0
    ep: int = 1
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    aux_loss_coef: float = 0.01
    aux_loss_scope: str = "global"
    capacity_factor: float = 0.0
    bucket_mb: float = 25.0


HELP = dict(
    n_layer="transformer blocks", n_head="attention heads", n_embd="model width h",
    block_size="sequence length T", dropout="dropout probability (0 for parity tests)",
    arch="the model family: gpt (GPT-2: LayerNorm, GeLU, biases, tied) | llama (RMSNorm, SwiGLU, no biases, untied) "
         "| qwen2 (llama with q/k/v biases) | mixtral (llama's SwiGLU experts, gates renormalized; needs --n_experts)",
    n_kv_head="key/value heads (grouped-query attention; 1: multi-query; 0: n_head)",
    ffn_hidden="MLP (and expert) width (0: 4 * n_embd)",
    tied="the LM head is the input embedding's weight (--no-tied: a head of its own)",
    rope_base="the rotary base theta", norm_eps="the LayerNorms' / RMSNorms' epsilon",
    rope_scaling="Llama 3's rotary scaling as FACTOR,LOW_FREQ_FACTOR,HIGH_FREQ_FACTOR,ORIGINAL_CONTEXT (empty: none)",
    global_batch_size="sequences per optimizer step, the same in every layout",
    micro_batch_size="sequences per forward/backward on one rank",
    lr="peak learning rate", min_lr="learning rate at the end of the cosine decay",
    warmup_steps="linear warmup steps", max_steps="optimizer steps in the schedule",
    weight_decay="AdamW weight decay (applied to >= 2-D parameters only)",
    grad_clip="clip the global gradient norm to this (0 disables)",
    max_bad_steps="stop the run after this many steps in a row with a non-finite loss or gradient norm (each "
                  "such step is skipped: weights and optimizer state untouched)",
    device="auto | cpu | cuda | cuda:N (auto: the local GPU if there is one)",
    dtype="auto | float32 | bfloat16 | float16 | float64 (auto: bfloat16 on GPU, float32 on CPU; float64: the "
          "exactness check of docs/parity.md, everything in float64)",
    compile="torch.compile the model", seed="seed of init, data order and dropout",
    recompute="activation recomputation: none | selective (attention core) | full (whole block)",
    kernels="fused kernels (kernels/): triton | torch (model.py as is) | compile (torch.compile'd fusions) | head "
            "(the Triton LM head alone) | auto (torch until a Triton kernel is measured faster on a GPU)",
    fp8="FP8 matmuls in the blocks' Linear layers (kernels/fp8.py): none | tensorwise | rowwise | blockwise | "
        "delayed; embedding, LM head, norms, softmax and router stay in high precision",
    fp8_all_gather="ZeRO-3 with --fp8 tensorwise | delayed | blockwise: gather each block's FP8 weights already "
                   "quantized (1 byte a value, plus its scales) instead of in the parameter or autocast dtype; the "
                   "same numbers (docs/kernels.md)",
    dist_timeout="seconds before a stuck collective raises instead of hanging",
    data_dir="directory with train.bin, val.bin, meta.json (the default corpus is prepared on first use)",
    data_mix="DIR:WEIGHT,DIR:WEIGHT,...: train on a weighted mixture of prepared corpora instead of --data_dir "
             "(common/data_mix.py; their tokenizers must agree)",
    out_dir="metrics.jsonl and checkpoints go here (default out/SCRIPT, e.g. out/train_ddp: each rung its own, as "
            "a new run refuses a directory holding another run's checkpoint or metrics)",
    eval_interval="evaluate on val every N steps (0 disables)", eval_iters="micro-batches per evaluation",
    log_interval="print a progress line every N steps", save_interval="checkpoint every N steps (0: only at the end)",
    keep_checkpoints="step directories kept in OUT_DIR/ckpt (the newest; older ones are removed after each save)",
    resume="continue from the latest checkpoint in OUT_DIR/ckpt, appending to metrics.jsonl; `--resume auto`: "
           "resume if a complete checkpoint exists, else start fresh (for restarts under torchrun --max-restarts)",
    init_from="start from the weights of a Hugging Face GPTNeoXForCausalLM (--arch gpt), LlamaForCausalLM, "
              "Qwen2ForCausalLM or MixtralForCausalLM directory (config.json + safetensors; python -m common.hf export "
              "writes one; the flags give its shape), AdamW fresh; ignored when resuming (docs/huggingface.md)",
    stop_step="stop before this step, keeping the --max_steps schedule (0: run to max_steps); for time-limited jobs",
    sample_tokens="tokens to generate as a sample at the end (0 disables)",
    profile="trace N optimizer steps with torch.profiler after 2 warm-up steps: out_dir/trace_rank{r}.json per "
            "rank and a top-operators table (profiling.py; 0 disables)",
    dp="data-parallel degree (default: world / (tp*cp*pp))", tp="tensor-parallel degree",
    sp="sequence parallelism on top of tensor parallelism", cp="context-parallel degree",
    cp_layout="ring | zigzag | allgather", pp="pipeline-parallel degree",
    pp_schedule="afab | 1f1b | interleaved | zb1 | zbv | dualpipev",
    pp_virtual="model chunks per pipeline rank (interleaved; 2 for zbv and dualpipev)",
    n_microbatches="pipeline micro-batches per step (default: global / (micro * dp))",
    zero_stage="ZeRO stage 0 | 1 | 2 | 3", ep="expert-parallel degree", n_experts="experts per MoE layer (0: dense)",
    top_k="experts per token", moe_every="an MoE MLP in every N-th block (1: all, 2: every other)",
    aux_loss_coef="weight of the Switch load-balancing loss",
    aux_loss_scope="load-balancing statistics over the global batch (same objective in every layout) or each "
                   "micro-batch (routing.py)", bucket_mb="gradient bucket size in MiB",
    capacity_factor="MoE expert capacity = ceil(cf * tokens * top_k / n_experts), overflow dropped (0: dropless)",
)
CHOICES = dict(arch=list(ARCHS), recompute=["none", "selective", "full"],
               kernels=["auto", "triton", "torch", "compile", "head"],
               fp8=["none", "tensorwise", "rowwise", "blockwise", "delayed"],
               dtype=["auto", "float32", "bfloat16", "float16", "float64"],
               cp_layout=["ring", "zigzag", "allgather"],
               pp_schedule=["afab", "1f1b", "interleaved", "zb1", "zbv", "dualpipev"],
               zero_stage=[0, 1, 2, 3], aux_loss_scope=["global", "micro"])
TECHNIQUE_FLAGS = ("dp", "tp", "sp", "cp", "cp_layout", "pp", "pp_schedule", "pp_virtual", "n_microbatches",
                   "zero_stage", "ep", "n_experts", "top_k", "moe_every", "aux_loss_coef", "aux_loss_scope",
                   "capacity_factor", "bucket_mb", "fp8", "fp8_all_gather")


INT_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")
FLOAT_TEXT = re.compile(r"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*|\s*[+-]?(inf|infinity|nan)\s*", re.I)


def strict(kind):
    """int / float for argparse, reading plain ASCII decimals only: Python's own parsers also take "1_0" as 10 and
    Arabic or full-width digits as numbers, guesses a flag should not make."""
    pattern = INT_TEXT if kind is int else FLOAT_TEXT

    def parse(text):
        if pattern.fullmatch(text) is None:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r} (plain decimal digits"
                                             f"{'' if kind is int else ', an optional exponent, inf or nan'})")
        return kind(text)
    parse.__name__ = kind.__name__
    return parse


def build_parser(description, techniques):
    p = argparse.ArgumentParser(description=description, allow_abbrev=False,   # --tp never means --tp_overlap
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(Config):
        if f.name in TECHNIQUE_FLAGS and f.name not in techniques:
            continue
        if f.name == "resume":                  # `--resume` alone means yes
            p.add_argument("--resume", nargs="?", const="yes", default="no", choices=["yes", "auto", "no"],
                           help=HELP["resume"])
            p.add_argument("--no-resume", dest="resume", action="store_const", const="no", help=argparse.SUPPRESS)
        elif f.type in (bool, "bool"):
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default,
                           help=HELP[f.name])
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            kind = strict(kind) if kind in (int, float) else kind
            p.add_argument(f"--{f.name}", type=kind, default=f.default, choices=CHOICES.get(f.name),
                           help=HELP[f.name])
    return p


def argv_of(flags):
    """The command line that sets `flags` ({name: value}); booleans as --name / --no-name (tests, bench)."""
    argv = []
    for name, value in flags.items():
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        else:
            argv += [f"--{name}", str(value)]
    return argv


def parse_config(argv=None, techniques=(), description=None, extra_args=None, validate=None):
    """Parse argv into a Config; `extra_args(parser)` adds script-only flags (set as attributes),
    `validate(cfg)` adds script-only checks (use `check`). Any ConfigError exits with code 2."""
    parser = build_parser(description, techniques)
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)          # argparse itself exits 2 on unknown flags / bad choices
    names = {f.name for f in fields(Config)}
    cfg = Config(**{k: v for k, v in vars(args).items() if k in names})
    for k, v in vars(args).items():
        if k not in names:
            setattr(cfg, k, v)
    try:
        validate_common(cfg, zero_means_auto={n for n in DEGREES if parser.get_default(n) == 0})
        if validate is not None:
            validate(cfg)
        cfg.resume = resolve_resume(cfg.resume, cfg.out_dir)
        if cfg.init_from and not cfg.resume:     # (a resume continues from its checkpoint, not from these weights)
            from common.hf.interop import check_init_from
            check_init_from(cfg)
    except ValueError as e:                     # a ConfigError, or resolve_resume's
        fail(str(e))
    warn_degenerate(cfg)
    return cfg


FLOAT_FLAGS = ("lr", "min_lr", "weight_decay", "grad_clip", "dist_timeout", "dropout", "aux_loss_coef",
               "capacity_factor", "bucket_mb", "rope_base", "norm_eps")
MAX_DIST_TIMEOUT = 10 ** 7                      # seconds (about 4 months): beyond it, timedelta and gloo overflow


DEGREES = ("tp", "cp", "pp", "pp_virtual", "ep", "top_k", "moe_every")


def validate_common(cfg, zero_means_auto=()):
    """The range of every shared flag (a script's own flags are checked by its validate). zero_means_auto: the
    degrees a script's parser defaults to 0, meaning "chosen for you" (train_5d's tp, cp, pp)."""
    from common.distributed import world_size_from_env
    for name in ("n_layer", "n_head", "n_embd", "block_size", "global_batch_size", "micro_batch_size",
                 "max_steps", "eval_iters", "log_interval", "max_bad_steps", "keep_checkpoints"):
        check(getattr(cfg, name) > 0, f"--{name} must be positive, got {getattr(cfg, name)}")
    for name in FLOAT_FLAGS:
        value = getattr(cfg, name)
        check(math.isfinite(value) and value >= 0, f"--{name} must be a finite number >= 0, got {value}")
    check(cfg.dropout < 1.0, f"--dropout must be in [0, 1), got {cfg.dropout}")
    check(cfg.n_embd % cfg.n_head == 0, f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    check((cfg.n_embd // cfg.n_head) % 2 == 0,
          f"head dim n_embd/n_head={cfg.n_embd // cfg.n_head} must be even for rotary embeddings")
    check(cfg.n_kv_head >= 0 and cfg.ffn_hidden >= 0, "--n_kv_head and --ffn_hidden must be >= 0")
    check(cfg.n_head % (cfg.n_kv_head or cfg.n_head) == 0,
          f"--n_kv_head {cfg.n_kv_head} must divide n_head={cfg.n_head} (query heads share each key/value head)")
    check(cfg.arch != "mixtral" or cfg.n_experts > 0, "--arch mixtral is a mixture of experts: give --n_experts")
    check(cfg.rope_base > 0 and cfg.norm_eps > 0, "--rope_base and --norm_eps must be positive")
    check(rope_scaling(cfg.rope_scaling) is not None, f"--rope_scaling {cfg.rope_scaling!r}: give FACTOR,LOW_FREQ_FACTOR,"
          f"HIGH_FREQ_FACTOR,ORIGINAL_CONTEXT (four positive numbers, low < high), or nothing")
    check(cfg.lr > 0, f"--lr must be positive, got {cfg.lr}")
    check(cfg.warmup_steps >= 0, f"--warmup_steps must be >= 0, got {cfg.warmup_steps}")
    check(cfg.min_lr <= cfg.lr, f"--min_lr {cfg.min_lr:g} must not exceed --lr {cfg.lr:g}")
    for name in ("seed", "stop_step", "eval_interval", "save_interval", "sample_tokens", "profile", "dp",
                 "n_experts"):                          # (--n_microbatches: each script says what 0 means)
        check(getattr(cfg, name) >= 0, f"--{name} must be >= 0, got {getattr(cfg, name)}")
    for name in DEGREES:
        least = 0 if name in zero_means_auto else 1
        check(getattr(cfg, name) >= least, f"--{name} must be >= {least}, got {getattr(cfg, name)}")
    check_int_sizes(cfg)
    world = world_size_from_env()               # each rank seeds its dropout with seed + rank: all within 63 bits
    check(cfg.seed <= 2 ** 63 - world, f"--seed must be at most 2**63 - {world} (the seed plus each rank's index "
                                       f"fits in 63 bits), got {cfg.seed}")
    check(cfg.stop_step <= cfg.max_steps, f"--stop_step {cfg.stop_step} is past --max_steps {cfg.max_steps} (the "
                                          f"schedule ends there)")
    check(cfg.out_dir.strip() != "", "--out_dir must name a directory")
    check_out_dir(cfg.out_dir)
    check_system_flags(cfg.device, cfg.dist_timeout)
    check_data_mix(cfg.data_mix, cfg.data_dir)


def check_data_mix(data_mix, data_dir):
    """--data_mix's entries and weights (data_mix.parse_data_mix), refused here before any work."""
    if data_mix:
        from common.data_mix import parse_data_mix
        check(data_dir == Config.data_dir, f"--data_mix replaces --data_dir ({data_dir}): give one of them")
        parse_data_mix(data_mix)


MAX_STEPS = 10 ** 8 - 1         # checkpoints are named step_NNNNNNNN: eight digits
MAX_SAMPLE = 100_000            # the sample is an eyeball check, one forward per token
STEP_COUNTS = ("max_steps", "stop_step", "warmup_steps", "eval_interval", "eval_iters", "log_interval",
               "save_interval", "keep_checkpoints", "max_bad_steps", "profile")


def check_int_sizes(cfg):
    """Integers no run can use: beyond 64 bits (torch and numpy hold them so), step counts past the eight digits of
    a step directory's name, a sample longer than an eyeball check. Found now, not after a hang or an overflow."""
    for name, value in vars(cfg).items():
        check(type(value) is not int or abs(value) < 2 ** 63, f"--{name} {value} does not fit in 64 bits")
    for name in STEP_COUNTS:
        check(getattr(cfg, name) <= MAX_STEPS, f"--{name} must be at most {MAX_STEPS:,} (checkpoint directories "
                                               f"are numbered with 8 digits), got {getattr(cfg, name)}")
    check(cfg.sample_tokens <= MAX_SAMPLE, f"--sample_tokens must be at most {MAX_SAMPLE:,} (one forward per token), "
                                           f"got {cfg.sample_tokens}")


def check_system_flags(device, dist_timeout):
    """--device and --dist_timeout, shared by the train scripts and collectives.py."""
    check(re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,4})?", device) is not None,     # (torch refuses an index past int)
          f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    check(math.isfinite(dist_timeout) and 1 <= dist_timeout <= MAX_DIST_TIMEOUT,
          f"--dist_timeout must be between 1 and {MAX_DIST_TIMEOUT:g} seconds, got {dist_timeout:g}")


MAX_SHOWN, MAX_MIB = 4096, 65536     # collectives.py: elements printed per rank; MiB of one sweep tensor


def parse_collectives_args(argv, description):
    """collectives.py's command line: one `error:` line and exit code 2 for a value out of range."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--numel", type=strict(int), default=0, help="elements of the shown tensors (default: 2 per rank)")
    p.add_argument("--size", nargs="+", type=strict(float), help="only the bandwidth sweep, over these sizes in MiB")
    p.add_argument("--device", default="auto", help="auto: cuda (NCCL) when a GPU is present, else cpu (gloo)")
    p.add_argument("--dist_timeout", type=strict(float), default=300.0, help=HELP["dist_timeout"])
    args = p.parse_args(argv)
    try:
        from common.distributed import launch_env
        launch_env()                            # RANK, WORLD_SIZE, LOCAL_RANK, OMP_NUM_THREADS as the train scripts
        check_system_flags(args.device, args.dist_timeout)
        check(0 <= args.numel <= MAX_SHOWN, f"--numel must be in 0..{MAX_SHOWN} (0: 2 per rank; the walk-through "
                                           f"prints every element), got {args.numel}")
        check(all(0 < s <= MAX_MIB for s in args.size or [1.0]),     # (NaN fails the comparison too)
              f"--size: every size must be in (0, {MAX_MIB}] MiB, got {' '.join(map(str, args.size or []))}")
    except ConfigError as e:
        fail(str(e))
    return args


def check_out_dir(out_dir):
    """out_dir is (or can be created as) a writable directory, and the files a run writes there (metrics, its
    checkpoint) are not directories: found now, not by the first save after all the training."""
    path = os.path.abspath(out_dir)
    existing = path                             # the deepest part of the path that exists already
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    what = f"--out_dir {out_dir}" if existing == path else f"--out_dir {out_dir} cannot be created: {existing}"
    check(os.path.isdir(existing), f"{what} is a file, not a directory")
    check(os.access(existing, os.W_OK | os.X_OK), f"{what} is not writable")
    file, ckpt = os.path.join(path, "metrics.jsonl"), os.path.join(path, CKPT_DIR)
    check(not os.path.isdir(file), f"--out_dir {out_dir}: {file} is a directory; the run writes a file there")
    for name in (file, ckpt, os.path.join(path, LOCK)):
        check(not os.path.islink(name) or os.path.exists(name), f"--out_dir {out_dir}: {name} is a symbolic link "
                                                                  f"that does not resolve (missing, or a loop)")
    for name in (file, os.path.join(path, LOCK)):     # a pipe there would block the run's first open for ever
        check(not os.path.exists(name) or os.path.isdir(name) or os.path.isfile(name),
              f"--out_dir {out_dir}: {name} is not a regular file (a pipe, a socket or a device); the run writes a "
              f"file there")
    check(not os.path.exists(file) or os.access(file, os.W_OK), f"--out_dir {out_dir}: {file} is not writable")
    check(not os.path.exists(ckpt) or os.path.isdir(ckpt), f"--out_dir {out_dir}: {ckpt} is a file; the run "
                                                           f"writes its checkpoints into a directory there")
    check(not os.path.exists(ckpt) or os.access(ckpt, os.W_OK | os.X_OK),
          f"--out_dir {out_dir}: {ckpt} is not writable")
    latest = os.path.join(ckpt, LATEST)
    check(not os.path.isdir(latest), f"--out_dir {out_dir}: {latest} is a directory; each checkpoint save replaces a "
                                     f"file there (remove it)")


def grad_accum_steps(cfg, dp):
    """global = micro * grad_acc * dp; anything else is a configuration error."""
    check(cfg.global_batch_size % (cfg.micro_batch_size * dp) == 0,
          f"global_batch_size={cfg.global_batch_size} is not divisible by micro_batch_size * dp = "
          f"{cfg.micro_batch_size} * {dp}")
    return cfg.global_batch_size // (cfg.micro_batch_size * dp)


def config_dict(cfg):
    return {**asdict(cfg), **{k: v for k, v in vars(cfg).items() if k not in asdict(cfg)}}
