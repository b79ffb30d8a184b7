"""
training.py: what every training loop of the ladder shares and none of them teaches: the dtype and autocast of
--dtype, the fused kernels and FP8 of --kernels / --fp8, opening the data on every rank, evaluation, the
end-of-run sample, and when to save.
train_single.py's loop uses each of these; every other rung's loop is the same loop with its technique added.
"""
import contextlib
import os

import torch
import torch.nn as nn

from common.checkpoint.files import lock_out_dir, remove_stale_temp_files
from common.errors import check, fail
from common.distributed import fail_together
from common.data import GlobalBatchLoader, ensure_dataset
from common.data_mix import MixtureLoader, parse_data_mix, source_val_losses
from kernels import apply_kernels, convert_to_float8
from kernels.apply import compile_block
from kernels.fp8 import check_fp8_support
from compose.fp8_gather import attach_fp8_gathers
from compose.fp8_tp import convert_parallel_to_float8
from model import GPTConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
MOE_FLAGS = ("n_experts", "top_k", "moe_every", "aux_loss_coef", "aux_loss_scope", "capacity_factor")


def resolve_dtype(cfg, device):
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.dtype]


def param_dtype(dtype):
    """Parameters, gradients and optimizer state: fp32 (16-bit compute comes from autocast), or float64 for
    the exactness check (docs/parity.md), where every tensor of the run is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_context(dtype, device):
    """Mixed precision by autocast: matmuls in 16 bits, parameters and optimizer state stay fp32."""
    if dtype in (torch.float32, torch.float64):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def enable_tf32(device):
    """fp32 matmuls on a CUDA GPU in TF32 (tensor cores, 10-bit mantissa), the same in every script; no-op on CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def apply_kernels_and_fp8(model, cfg, device, units=None):
    """--kernels (fused modules) and --fp8 (Float8Linear GEMMs; FP8 GEMMs inside tensor-parallel layers) swapped
    into a model or a pipeline stage in place, parameters unchanged; one clear error line when the device cannot
    run them. units: ZeRO-3's (train_zero's Shards) of this model, whose FP8 weights are then gathered as
    compose/fp8_gather.py says (in fp32, or with --fp8_all_gather quantized). Returns the kernel mode."""
    try:
        mode = apply_kernels(model, cfg.kernels)
        if getattr(cfg, "fp8", "none") != "none":
            check_fp8_support(device)
            convert_to_float8(model, recipe=cfg.fp8)
            convert_parallel_to_float8(model, recipe=cfg.fp8)
    except (ValueError, RuntimeError) as e:
        fail(str(e))
    gather_fp8_units(model, units or [], cfg)
    return mode


def compiled(model, cfg, blocks=()):
    """The model a step calls: itself, or with --compile compiled whole; given `blocks` (where hooks sit on them:
    ZeRO-3's gather, free and reduce-scatter; train_5d's stages always), each block's forward compiled inside the
    hooks instead (kernels/apply.py's compile_block) and the rest (embedding, final norm, head) eager, because
    compiling the whole model would trace the hooks themselves into its graphs (docs/kernels.md)."""
    if not cfg.compile:
        return model
    if not blocks:
        return torch.compile(model)
    for block in blocks:
        compile_block(block)
    return model


def gather_fp8_units(model, units, cfg):
    """ZeRO-3's units of `model` (train_zero's Shards) holding FP8 GEMMs' weights gather them as
    compose/fp8_gather.py says: in fp32, or with --fp8_all_gather quantized; one clear error line where the
    recipe or the device's GEMM cannot take a gathered FP8 weight."""
    try:
        attach_fp8_gathers(model, units, getattr(cfg, "fp8_all_gather", False))
    except ValueError as e:
        fail(str(e))


def prepares_data(env):
    """Who prepares the default corpus: local rank 0 of every node, as nodes need not share a filesystem."""
    return env.local_rank == 0


def prepare_data(cfg, env):
    """The out_dir lock, then the deterministic loader. Rank 0 takes the lock of --out_dir (one run writes there:
    a second one stops here naming the first) and then removes the temporary files of killed saves. Each node's
    local rank 0 prepares the default corpus on first use while the others wait; then every rank opens it. A rank
    that cannot (no dataset on its node) says so itself."""
    error = None
    if env.rank == 0:
        try:
            error = lock_out_dir(cfg.out_dir)
        except OSError as e:
            error = f"--out_dir {cfg.out_dir}: cannot create its lock file ({e})"
    if prepares_data(env) and error is None:
        try:
            for data_dir in data_dirs(cfg):
                ensure_dataset(data_dir)
        except (OSError, ValueError) as e:          # FileNotFoundError is an OSError
            error = str(e)
    fail_together(error, env)                       # also the barrier: the node's corpus is ready
    if env.rank == 0:                               # this run holds the lock: no save of any run is under way
        remove_stale_temp_files(cfg.out_dir)
    loader = None
    try:
        loader = open_loader(cfg, env.device)
        error = memory_problem(cfg, env, loader.vocab_size)
    except (OSError, ValueError) as e:
        error = str(e)
    fail_together(error, env)
    return loader


def data_dirs(cfg):
    """The prepared corpora a run reads: --data_dir, or each source of --data_mix."""
    return [d for d, _ in parse_data_mix(cfg.data_mix)] if cfg.data_mix else [cfg.data_dir]


def open_loader(cfg, device):
    """The deterministic loader of one corpus, or of a weighted mixture of several (data_mix.py)."""
    for data_dir in data_dirs(cfg):
        ensure_dataset(data_dir)
    if cfg.data_mix:
        return MixtureLoader(parse_data_mix(cfg.data_mix), cfg.block_size, cfg.global_batch_size, cfg.seed, device)
    return GlobalBatchLoader(cfg.data_dir, cfg.block_size, cfg.global_batch_size, cfg.seed, device)


def materialize(module, device, dtype=torch.float32):
    """Give every parameter still on the meta device real (uninitialised) memory on `device`, in place, keeping
    its attributes (tensor-parallel tags) and its sharing (a tied weight stays one tensor). The way to build
    a big model: GPT on the meta device, cut into stages / swap in sharded layers, materialize what this rank
    keeps, then fill it from model.init_parameter (init_weights, or tp_shards.init_tp_weights for shards)."""
    new = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), p.requires_grad)
                    new[id(p)].__dict__.update(p.__dict__)
                m._parameters[name] = new[id(p)]
        for name, b in m._buffers.items():              # (an MoE block's load statistics: zeros)
            if b is not None and b.is_meta:
                kind = dtype if b.is_floating_point() else b.dtype
                m._buffers[name] = torch.zeros(b.shape, device=device, dtype=kind)
    return module


def gpt_config(cfg, vocab_size):
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, dropout=cfg.dropout, recompute=cfg.recompute,
                     **{name: getattr(cfg, name) for name in MOE_FLAGS})


def check_moe(cfg):
    """The MoE flags' bad values, as one clear error before any work."""
    check(cfg.n_experts >= 0 and cfg.moe_every >= 1, "need --n_experts >= 0 and --moe_every >= 1")
    check(cfg.capacity_factor >= 0 and cfg.aux_loss_coef >= 0,
          "need --capacity_factor >= 0 and --aux_loss_coef >= 0")
    check(cfg.n_experts == 0 or 1 <= cfg.top_k <= cfg.n_experts,
          f"--top_k {cfg.top_k} must be between 1 and --n_experts {cfg.n_experts}")
    check(cfg.n_experts == 0 or cfg.moe_every <= cfg.n_layer,     # else a dense model, silently
          f"--moe_every {cfg.moe_every} > --n_layer: no MoE block among the {cfg.n_layer}")
    check(cfg.n_experts == 0 or cfg.capacity_factor <= cfg.n_experts,   # (an overflow to inf above that)
          f"--capacity_factor {cfg.capacity_factor:g} is above --n_experts {cfg.n_experts}: from n_experts / top_k "
          f"on, an expert has room for every routed token (use 0 for dropless)")


def check_fp8_all_gather(cfg):
    """ZeRO-3's one rule left (its hooks compose with the fused modules, --compile, every FP8 recipe and every
    pipeline schedule: docs/kernels.md). --fp8_all_gather: its gather of FP8 weights already quantized
    (compose/fp8_gather.py), for the recipes whose weight scales are maxes of its shards' amaxes (per tensor or per
    128 x 128 block) and that quantize W once for both its GEMMs."""
    if not getattr(cfg, "fp8_all_gather", False):
        return
    check(cfg.zero_stage == 3 and cfg.fp8 != "none", "--fp8_all_gather needs --zero_stage 3 and --fp8 (it gathers "
          "the blocks' FP8 weights instead of their high-precision values)")
    check(cfg.fp8 != "rowwise", "--fp8_all_gather with --fp8 rowwise: W's forward GEMM scales it per row and its "
          "dgrad GEMM per column, two FP8 encodings of W (2 bytes a value, bf16's): use tensorwise, delayed or "
          "blockwise")
    check(getattr(cfg, "tp", 1) == 1, "--fp8_all_gather with --tp > 1: the tensor-parallel layers quantize their "
          "weight shard inside each GEMM (compose/fp8_tp.py), not from a gathered FP8 weight")


class ValLoss(float):
    """A validation loss; by_source: under --data_mix, each source's own ({} otherwise), for metrics.jsonl."""
    by_source = {}


@torch.no_grad()
def evaluate(loss_fn, loader, cfg):
    """Mean validation loss over eval_iters fixed micro-batches; loss_fn(x, y) -> scalar loss. With a mixture, also
    each source's (its val split alone), so that every rank runs the same forwards (a collective loss_fn)."""
    losses = [float(loss_fn(*loader.micro_batch(i, 0, cfg.micro_batch_size, split="val")))
              for i in range(cfg.eval_iters)]
    val = ValLoss(sum(losses) / len(losses))
    if isinstance(loader, MixtureLoader):
        val.by_source = source_val_losses(loss_fn, loader, cfg)
    return val


def decode(tokens, meta, data_dir=None):
    """Token ids -> text: GPT-2 BPE, raw bytes, a character table `itos` (nanoGPT's character-level meta.pkl, or
    a list in meta.json), or the corpus's Hugging Face tokenizer.json. Any other tokenizer has no decoder here:
    ValueError, and the sample says so."""
    if meta.get("tokenizer") == "hf":
        from common.hf.tokenizer import decode_with
        return decode_with(data_dir, tokens)
    if meta.get("tokenizer") == "gpt2":
        import tiktoken
        return tiktoken.get_encoding("gpt2").decode(tokens)
    if "itos" in meta:
        itos = meta["itos"]
        table = dict(enumerate(itos)) if isinstance(itos, list) else {int(k): v for k, v in itos.items()}
        return "".join(table.get(t, "\ufffd") for t in tokens)
    if meta.get("tokenizer") == "byte":
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    raise ValueError(f"the dataset's tokenizer {meta.get('tokenizer')!r} is unknown here; meta.json needs "
                     f"tokenizer byte, gpt2 or hf, or an itos list (the text of each token id)")


def print_sample(model, loader, cfg, env, collective=False):
    """Generate a short continuation of a validation snippet: the eyeball test that training worked, printed by
    rank 0. collective: every rank generates too (a sharded model's forward is collective: TP, EP, ZeRO-3), with
    the same seed and prompt, hence the same tokens."""
    if cfg.sample_tokens <= 0 or (env.rank != 0 and not collective):
        return
    model.eval()
    prompt, _ = loader.micro_batch(0, 0, 1, split="val")
    prompt = prompt[:, : min(32, cfg.block_size)]
    torch.manual_seed(cfg.seed)
    out = model.generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=50)
    try:
        text = decode(out[0].tolist(), loader.meta, loader.data_dir)
    except Exception as e:  # e.g. tiktoken cannot fetch its vocabulary offline
        text = f"<cannot decode: {e}>"
    if env.rank == 0:
        print(f"---- sample ----\n{text}\n----------------", flush=True)


GiB = 2 ** 30


def least_memory(cfg, vocab_size, dtype):
    """(bytes, what): a lower bound of one run's memory, whatever its layout: weights, gradients and AdamW's two
    moments of every matrix (norms and biases left out), the offsets of a global batch, and of one micro-batch the
    logits and the activations a block keeps for its backward (at least 14 h per token without recomputation: the
    inputs of both norms, q k v, the attention output, the MLP's 4h input and 4h GeLU output; h with it)."""
    h, layers, size = cfg.n_embd, cfg.n_layer, param_dtype(dtype).itemsize
    moe = layers // cfg.moe_every if cfg.n_experts > 0 else 0      # blocks moe_every-1, 2*moe_every-1, ...
    params = vocab_size * h + layers * 4 * h * h + (layers - moe + moe * cfg.n_experts) * 8 * h * h
    tokens = cfg.micro_batch_size * cfg.block_size
    kept = h * (layers if cfg.recompute != "none" else 14 * layers)
    act = tokens * (kept + 2 * vocab_size) * min(size, dtype.itemsize)
    total = 4 * params * size + act + 8 * cfg.global_batch_size
    return total, (f"{params:,} parameters: {4 * params * size / GiB:,.1f} GiB of weights, gradients and AdamW's "
                   f"moments in {size}-byte floats; activations of --micro_batch_size {cfg.micro_batch_size} x "
                   f"--block_size {cfg.block_size}: {act / GiB:,.1f} GiB")


def memory_problem(cfg, env, vocab_size):
    """A run that cannot fit, said before the model is built (not an allocator's crash, an OOM kill or swapping):
    its least memory, split over every rank (the most any layout shares it), against this rank's device (free
    memory) or this host (MemAvailable, shared by its ranks). None if it may fit."""
    need, what = least_memory(cfg, vocab_size, resolve_dtype(cfg, env.device))
    per_rank = need // env.world_size
    if env.device.type == "cuda":
        have, where = torch.cuda.mem_get_info(env.device)[0], f"{env.device} has"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.world_size > 1 else 1
        have, where = host_available(), f"this host has available (MemAvailable, for {local} rank(s))"
        per_rank *= local
    if have is None or per_rank <= have:
        return None
    return (f"the model and one micro-batch need at least {need / GiB:,.1f} GiB ({what}); split over "
            f"{env.world_size} rank(s), {per_rank / GiB:,.1f} GiB here, but {where} {have / GiB:,.1f} GiB: use a "
            f"smaller --n_layer / --n_embd / --micro_batch_size / --block_size, or more devices")


def host_available():
    """MemAvailable of /proc/meminfo in bytes (Linux), else None (not checked)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def fits_on_device(n_bytes, device):
    """Whether n_bytes more fit on `device` now: on CUDA, the driver's free memory plus what torch's allocator holds
    unused (torch.cuda.mem_get_info; memory_reserved - memory_allocated). Host memory is not checked (True)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return n_bytes <= free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def should_save(cfg, step, last_step):
    return step == last_step - 1 or (cfg.save_interval > 0 and (step + 1) % cfg.save_interval == 0)
