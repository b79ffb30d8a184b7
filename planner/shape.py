"""
planner/shape.py: the model shapes plan.py predicts for beyond model.py's GPT, as formulas: grouped-query attention
(n_kv_head key/value heads shared by n_head query heads), any MLP width (ffn_hidden) with a plain or gated (SwiGLU:
three matrices) MLP, tied or untied embeddings, and pipeline stages of uneven size (first and last stages cut
shorter, or a layer count that pp x v does not divide). model.py stays the GPT it is; with the defaults
(n_kv_head = n_head, ffn_hidden = 4h, plain GeLU MLP, tied, even stages) every formula here is model.py's own
(tests/test_plan_shape.py holds them equal), so the exact checks against CPU runs still validate this case.

    per block (tp ranks, kv = n_kv_head * head_dim, f = ffn_hidden, g = 2 gated / 1 plain):
        attention  q, k, v: (h + 2 kv) h / t  (+ biases)     out: h^2 / t
        MLP        up (and gate): g f h / t   (+ biases)     down: f h / t
    parameters     N = V h (x 2 untied) + L (block) + 2h
    FLOPs/token    6 N_matmul + 12 L h s    (N_matmul: every weight a token multiplies; an untied input embedding
                                             is a lookup, not a matmul)
    stages         stage_layer_counts: first / last as given, the rest as even as they go (the earlier middle
                   stages take one more layer when they do not divide); with ends_as_layers the embedding and the
                   loss each take a layer's place (the first and last stage one layer fewer, possibly none)
    held layers    held_layers: the most layer x micro-batch activations a pipeline rank holds, its schedule's
                   action list replayed with each chunk weighted by its layers (uneven stages; an empty chunk
                   holds nothing)
"""
from functools import lru_cache
from types import SimpleNamespace

from common.errors import check
from pipeline.schedules import dualpipe_v, interleaved, placement_of, stage_of, zb_h1, zb_v
from model import GPTConfig


def kv_dim(job):
    """Key/value width: n_kv_head * head_dim (= h without GQA)."""
    cfg = job.cfg
    return (job.n_kv_head or cfg.n_head) * (cfg.n_embd // cfg.n_head)


def ffn(job):
    """MLP hidden width f (model.py: 4h)."""
    return job.ffn_hidden or 4 * job.cfg.n_embd


def mlp_matrices(job):
    """Weight matrices of f x h in one MLP: 3 gated (gate, up, down), else 2."""
    return 3 if job.gated else 2


def norm_numels(job):
    """One norm's parameters: LayerNorm's weight and bias, RMSNorm's weight alone (model.py's cfg.norm)."""
    return [job.cfg.n_embd] * (1 if job.cfg.norm == "rmsnorm" else 2)


def norm_saved_bytes(job):
    """Bytes per token one norm keeps for its backward beside its input: its fp32 statistics, one value per row.
    LayerNorm its mean and rstd (8: torch's native_layer_norm, kernels/layer_norm.py); RMSNorm its rstd alone (4:
    torch's _fused_rms_norm, which F.rms_norm runs on a GPU where the weight and the input share a dtype, as in every
    stack here; kernels/rms_norm.py). On CPU torch composes rms_norm from element-wise ops instead, whose autograd also
    keeps the normalized input (h values per token): not a GPU's count, so not plan.py's."""
    return 4 if job.cfg.norm == "rmsnorm" else 8


def linear_numels(n_in, n_out, bias, tp=1):
    """A linear's weight (and bias where it has one), n_out / tp of its outputs on a tp rank."""
    return [n_in * n_out // tp] + ([n_out // tp] if bias else [])


def block_numels(job, tp, ep, moe):
    """One block's parameters on a tp rank, in model.parameters() order (model.py's GPT for the defaults).
    Column-parallel c_attn / c_fc (weights and biases / tp), row-parallel projections (weights / tp, biases whole),
    norms whole (LayerNorm: weight and bias; RMSNorm: weight), biases only where cfg.qkv_bias (c_attn) and cfg.bias
    (the others) put them; an MoE block has a whole router (E*h) and E/ep whole experts instead of the MLP
    (expert_start: where they begin)."""
    cfg = job.cfg
    h, kv, f, up = cfg.n_embd, kv_dim(job), ffn(job), mlp_matrices(job) - 1
    attn = (norm_numels(job) + linear_numels(h, h + 2 * kv, cfg.qkv_bias, tp)
            + [h * h // tp] + ([h] if cfg.bias else []) + norm_numels(job))
    if moe:
        return attn + [cfg.n_experts * h] + (linear_numels(h, up * f, cfg.bias) + linear_numels(f, h, cfg.bias)) \
            * (cfg.n_experts // ep)
    return attn + linear_numels(h, up * f, cfg.bias, tp) + [f * h // tp] + ([h] if cfg.bias else [])


def expert_start(job):
    """Index in an MoE block's block_numels where its experts begin (after the attention, norms and router)."""
    return len(block_numels(job, 1, 1, False)) - (2 + 2 * job.cfg.bias) + 1


def block_linears(job, tp):
    """(in, out) features of a block's four GEMMs on a tp rank, in the order a tensor-parallel collective meets them:
    QKV (column-parallel), attention out (row-parallel), MLP up (+ gate, fused), MLP down (row-parallel)."""
    h, kv, f, up = job.cfg.n_embd, kv_dim(job), ffn(job), mlp_matrices(job) - 1
    return [(h, (h + 2 * kv) // tp), (h // tp, h), (h, up * f // tp), (f // tp, h)]


def embedding_numels(job, tp, first, last):
    """Vocab-parallel embedding rows (V/tp x h) on the ranks of the first and last stage: tied, one matrix on
    each end (once where one rank holds both); untied, the input embedding on the first, the LM head on the last."""
    one = job.cfg.padded_vocab_size * job.cfg.n_embd // tp
    if job.tied:
        return [one] if first or last else []
    return [one] * (int(first) + int(last))


SHAPE_OPTIONS = ("n_kv_head", "ffn_hidden", "gated", "tied", "first_stage_layers", "last_stage_layers",
                 "ends_as_layers")


def job_of_shape(shape):
    """A Job.shape (hashable) back as the fields this module's formulas read: cfg and the shape options."""
    items = dict(shape)
    options = {k: items.pop(k) for k in SHAPE_OPTIONS}
    return SimpleNamespace(cfg=GPTConfig(**items), shape=shape, **options)


def num_params(job, active=False):
    """Every parameter (active=True: an MoE block counts only its top_k experts, as model.num_params)."""
    return count_params(job.shape, active)


@lru_cache(maxsize=None)
def count_params(shape, active):
    """num_params of a Job.shape: the embedding(s), L blocks (dense and MoE ones), ln_f."""
    job = job_of_shape(shape)
    cfg = job.cfg
    n_moe = sum(cfg.is_moe_block(i) for i in range(cfg.n_layer))
    dense, moe = sum(block_numels(job, 1, 1, False)), 0
    if n_moe:
        numels, start = block_numels(job, 1, 1, True), expert_start(job)
        moe = sum(numels[:start]) + sum(numels[start:]) * (cfg.top_k / cfg.n_experts if active else 1)
    embed = cfg.padded_vocab_size * cfg.n_embd * (1 if job.tied else 2)
    return embed + (cfg.n_layer - n_moe) * dense + n_moe * round(moe) + sum(norm_numels(job))


def matmul_params(job):
    """Active parameters a token multiplies (the 6N of the FLOP count): all but an untied input embedding."""
    return num_params(job, active=bool(job.cfg.n_experts)) - (0 if job.tied else job.cfg.padded_vocab_size
                                                               * job.cfg.n_embd)


def block_params(job):
    """Active parameters of the L blocks (what full recompute runs forward again)."""
    cfg = job.cfg
    return num_params(job, active=bool(cfg.n_experts)) - cfg.padded_vocab_size * cfg.n_embd * (1 if job.tied else 2) \
        - sum(norm_numels(job))


def attention_flops_per_token(job):
    """12 L h s: QK^T and AV forward (4 h s per layer) and backward (8 h s), unmasked (the MFU convention)."""
    cfg = job.cfg
    return 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def flops_per_token(job):
    """Model FLOPs per token, forward + backward: 6 N_matmul + 12 L h s (model.flops_per_token for the GPT)."""
    return 6 * matmul_params(job) + attention_flops_per_token(job)


def mlp_saved_values(job):
    """Values per token an MLP of width f keeps for its backward beside its input. Plain: c_fc's and GeLU's outputs
    (2f). Gated, eager (`F.silu(gate) * up`: model.py's MLP, Hugging Face's Llama, nanotron, torchtitan uncompiled):
    c_fc's [gate | up] (silu and the product keep views of it), silu's output (the product keeps it) and the product
    (c_proj keeps it), 4f. Gated and fused (job.fused_swiglu: kernels/swiglu.py, Megatron-Core's bias_swiglu_impl,
    torch.compile's min-cut partition of the block): [gate | up] and the product, silu(gate) recomputed in the
    backward, 3f (tests/test_plan.py counts both from autograd's saved tensors)."""
    if not job.gated:
        return 2 * ffn(job)
    return (3 if job.fused_swiglu else 4) * ffn(job)


def activation_delta_values(job):
    """Activation values per token and layer a block keeps beyond model.py's GPT count (which is Korthikanti's 34
    sbh with q, k, v of h each and an MLP keeping c_fc's and GeLU's outputs of 4h each): k and v of kv each (and k
    once more, after RoPE) and the MLP's mlp_saved_values. All of it sits inside the tensor-parallel region: / t on
    a tp rank."""
    h, kv = job.cfg.n_embd, kv_dim(job)
    return 3 * (kv - h) + mlp_saved_values(job) - 8 * h


def op_recompute_values(job):
    """torchtitan's selective op policy (torchtitan/models/llama3/parallelize_llama.py, _save_list and
    _custom_policy): per layer it keeps the block input, the attention kernel's output and every other matmul's
    output in execution order (q, k, v, o, then gate, up, down), so q, v, gate (the first MLP matrix) and down are
    kept and k, o and up are recomputed. Values per token and layer kept (all / t on a tp rank but the input without
    SP), and the forward FLOPs per token and layer it spends again: 2 (h kv + h^2 + f h)."""
    h, kv, f = job.cfg.n_embd, kv_dim(job), ffn(job)
    kept = h + kv + f + (h if job.gated else 0) + h      # q, v, gate/c_fc, down (gated), attention output
    return h, kept, 2 * (h * kv + h * h + f * h)


def stage_layer_counts(job, stages):
    """Layers of each of `stages` pipeline stages (even_split, cached: the search asks for it per layout)."""
    return list(even_split(job.cfg.n_layer, job.first_stage_layers, job.last_stage_layers, stages,
                           job.ends_as_layers))


@lru_cache(maxsize=None)
def even_split(L, first, last, stages, ends=False):
    """Layers of each of `stages` pipeline stages: first_stage_layers / last_stage_layers as given (0: an even
    share), the others as even as they go, the earlier ones taking one more when they do not divide (each >= 1).
    ends: the embedding and the loss each count as one layer of the split and the first and last stage hold one
    transformer layer fewer (Megatron-Core's --account-for-embedding-in-pipeline-split and
    --account-for-loss-in-pipeline-split; Llama 3, Dubey et al. 2024 Sec. 3.3.2: "we reduce one Transformer layer
    each from the first and the last stages", so that with one layer per stage "the first model chunk on the first
    stage has only the embedding, and the last model chunk on the last stage has only output projection and loss")."""
    if ends and stages > 1:
        counts = list(even_split(L + 2, first + (first > 0), last + (last > 0), stages))
        counts[0], counts[-1] = counts[0] - 1, counts[-1] - 1
        check(sum(counts[1:-1]) > 0 or L == counts[0] + counts[-1], f"n_layer={L} leaves middle stages empty")
        return tuple(counts)
    if stages == 1:
        return (L,)
    shared = stages - (first > 0) - (last > 0)
    rest = L - first - last
    check(rest >= shared and (shared > 0 or rest == 0),
          f"n_layer={L} does not fill {stages} pipeline stages with first_stage_layers={first}, "
          f"last_stage_layers={last}")
    share = [rest // shared + (i < rest % shared) for i in range(shared)] if shared else []
    return tuple(([first] if first else []) + share + ([last] if last else []))


GENERATORS = dict(zb1=zb_h1, zbv=zb_v, dualpipev=dualpipe_v)     # (interleaved takes v too)


REPLAYED_ROUNDS = 4     # micro-batches replayed per stage at most (replayed_peak)


def held_layers(job, lay, rank, m):
    """The most layers x micro-batches whose activations pipeline rank `rank` holds at once: its in-flight
    micro-batch-chunks (memory.in_flight), each weighted by its chunk's layers. Even chunks: in_flight x
    layers per chunk; uneven ones (cut ends, an empty embedding or loss chunk): the rank's action list
    (pipeline/schedules.py) replayed, a forward adding its chunk's layers, the backward (W when split)
    releasing them."""
    counts, place = stage_layer_counts(job, lay.pp * lay.v), placement_of(lay.schedule)
    weights = tuple(counts[stage_of(rank, c, lay.pp, place)] for c in range(lay.v))
    if lay.schedule == "afab" or lay.pp == 1:       # every forward before the first backward: all m held at once
        return (m if lay.pp > 1 else 1) * sum(weights)
    if lay.schedule == "1f1b":     # p - rank - 1 warm-up forwards, then one more before each backward (train_pp.py)
        return min(lay.pp - rank, m) * weights[0]
    return replayed_peak(lay.schedule, lay.pp, min(m, REPLAYED_ROUNDS * lay.pp), lay.v, rank, weights)


@lru_cache(maxsize=None)
def replayed_peak(schedule, p, m, v, rank, weights):
    """held_layers for chunk weights `weights` (layers of each of the rank's chunks), m micro-batches. held_layers
    replays at most REPLAYED_ROUNDS x p of them: the peak falls in the warm-up or the steady state, whose pattern
    repeats every p x v forwards, so a longer step holds no more (tests/test_plan_shape.py replays up to 12p in full;
    a step of a million micro-batches would otherwise replay millions of actions per rank)."""
    actions = interleaved(p, m, rank, v) if schedule == "interleaved" else GENERATORS[schedule](p, m, rank)
    release = "W" if schedule in ("zb1", "zbv", "dualpipev") else "B"
    held = peak = 0
    for a in actions:
        held += weights[a.chunk] * ((a.kind == "F") - (a.kind == release))
        peak = max(peak, held)
    return peak
