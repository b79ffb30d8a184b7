"""
common/hf/llama.py: model.py's Llama family as transformers' LlamaForCausalLM, Qwen2ForCausalLM and
MixtralForCausalLM and back: the config, the parameter names and the permutations between them (convert.py does the
same for the default GPT as GPT-NeoX, with the same functions: hf_names, to_hf_pieces, from_hf_pieces, hf_config,
export_problem, class_name). Pure functions of dicts and tensors; transformers is never imported.

    model.py                              Llama / Qwen2 / Mixtral (model.layers.{i}. before each block name)
    transformer.wte                       model.embed_tokens
    transformer.h.{i}.ln_1 / ln_2         input_layernorm / post_attention_layernorm
    transformer.h.{i}.attn.c_attn         self_attn.q_proj, k_proj, v_proj    its rows [q | k | v], split
    transformer.h.{i}.attn.c_proj         self_attn.o_proj
    transformer.h.{i}.mlp.c_fc            mlp.gate_proj, mlp.up_proj          its rows [gate | up], split
    transformer.h.{i}.mlp.c_proj          mlp.down_proj
    transformer.h.{i}.mlp.router          block_sparse_moe.gate               (Mixtral)
    transformer.h.{i}.mlp.experts.{e}     block_sparse_moe.experts.{e}.w1 + w3 (c_fc), w2 (c_proj)
    transformer.ln_f                      model.norm
    lm_head (untied)                      lm_head                             (tied: not stored)

The rotary pairs differ as in GPT-NeoX: model.py rotates (x[2j], x[2j+1]), transformers the halves (x[j], x[j+D/2]),
so inside every q and k head row 2j goes to j and row 2j+1 to j + D/2. Every conversion is a re-ordering or a
split: bitwise exact both ways.
"""
import re

import torch

FAMILY = dict(llama="LlamaForCausalLM", qwen2="Qwen2ForCausalLM", mixtral="MixtralForCausalLM")
# transformers' defaults where a config.json leaves a field out
DEFAULTS = dict(llama=dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, mlp_bias=False),
                qwen2=dict(rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False),
                mixtral=dict(rms_norm_eps=1e-5, rope_theta=1e6, num_key_value_heads=8, num_experts_per_tok=2,
                             num_local_experts=8, router_jitter_noise=0.0))
BLOCK = {"ln_1": ["input_layernorm"], "ln_2": ["post_attention_layernorm"],
         "attn.c_attn": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "attn.c_proj": ["self_attn.o_proj"],
         "mlp.c_fc": ["mlp.gate_proj", "mlp.up_proj"], "mlp.c_proj": ["mlp.down_proj"],
         "mlp.router": ["block_sparse_moe.gate"]}
EXPERT = {"c_fc": ["w1", "w3"], "c_proj": ["w2"]}


# ----------------------------------------------------------------------------------------------------------
# names and tensors

def hf_names(name, mc):
    """model.py's parameter name -> the names of the transformers tensors it is made of."""
    fixed = {"transformer.wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
             "transformer.ln_f.weight": "model.norm.weight"}
    if name in fixed:
        return [fixed[name]]
    match = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)", name)
    expert = match and re.fullmatch(r"mlp\.experts\.(\d+)\.(c_fc|c_proj)", match.group(2))
    if expert:
        return [f"model.layers.{match.group(1)}.block_sparse_moe.experts.{expert.group(1)}.{w}.{match.group(3)}"
                for w in EXPERT[expert.group(2)]]
    if match is None or match.group(2) not in BLOCK:
        raise KeyError(f"{name} has no Llama-family counterpart")
    return [f"model.layers.{match.group(1)}.{twin}.{match.group(3)}" for twin in BLOCK[match.group(2)]]


def rotary_to_halves(t, heads):
    """Rows of `heads` q or k heads, rotary pairs interleaved -> halves (row 2j + c -> row c * D/2 + j)."""
    return t.unflatten(0, (heads, -1, 2)).transpose(1, 2).flatten(0, 2).contiguous()


def rotary_from_halves(t, heads):
    """The inverse of rotary_to_halves."""
    return t.unflatten(0, (heads, 2, -1)).transpose(1, 2).flatten(0, 2).contiguous()


def kv_heads(mc):
    return mc.get("n_kv_head") or mc["n_head"]


def to_hf_pieces(name, tensor, mc):
    """[(transformers name, value)] of model.py's parameter `name` (c_attn and c_fc split, q and k re-ordered)."""
    names = hf_names(name, mc)
    if ".attn.c_attn." in name:
        kv = kv_heads(mc) * (mc["n_embd"] // mc["n_head"])
        q, k, v = tensor.split([tensor.shape[0] - 2 * kv, kv, kv])
        parts = [rotary_to_halves(q, mc["n_head"]), rotary_to_halves(k, kv_heads(mc)), v]
    else:
        parts = tensor.chunk(len(names))
    return list(zip(names, parts))


def from_hf_pieces(name, tensors, mc):
    """model.py's value of parameter `name` from its transformers tensors (in hf_names' order)."""
    if ".attn.c_attn." in name:
        q, k, v = tensors
        return torch.cat([rotary_from_halves(q, mc["n_head"]), rotary_from_halves(k, kv_heads(mc)), v])
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


# ----------------------------------------------------------------------------------------------------------
# config.json

def model_type_of(mc):
    """Which class holds a model config: mixtral with experts, qwen2 for q/k/v biases alone, else llama."""
    if mc.get("n_experts", 0):
        return "mixtral"
    return "qwen2" if mc.get("qkv_bias") and not mc.get("bias") else "llama"


def class_name(mc):
    return FAMILY[model_type_of(mc)]


def export_problem(mc):
    """(field, value, why) of the first model field no class of the family can hold, or None."""
    kind = model_type_of(mc)
    checks = [("norm", mc.get("norm"), mc.get("norm") == "rmsnorm", "the Llama family's norms are RMSNorms"),
              ("mlp", mc.get("mlp"), mc.get("mlp") == "swiglu", "the Llama family's MLPs are SwiGLU"),
              ("qkv_bias", mc.get("qkv_bias"), kind != "llama" or mc.get("qkv_bias") == mc.get("bias"),
               "LlamaForCausalLM's attention_bias covers q, k, v and o alike")]
    if kind == "mixtral":
        checks += [("bias", mc.get("bias"), not mc.get("bias") and not mc.get("qkv_bias"), "Mixtral has no biases"),
                   ("moe_every", mc.get("moe_every", 1), mc.get("moe_every", 1) == 1, "every Mixtral block is MoE"),
                   ("capacity_factor", mc.get("capacity_factor"), not mc.get("capacity_factor"),
                    "Mixtral's experts drop no token"),
                   ("router_renorm", mc.get("router_renorm"), mc.get("router_renorm") is True,
                    "Mixtral renormalizes its top-k gates")]
    return next(((field, value, why) for field, value, ok, why in checks if not ok), None)


def hf_config(mc, dtype, tokenizer_vocab, special=None):
    """config.json of the family's class for a checkpoint's model_config (the padded vocabulary, as convert.py)."""
    kind, special = model_type_of(mc), special or {}
    h, heads, base = mc["n_embd"], mc["n_head"], mc.get("rope_base", 10000.0)
    rope = dict(rope_type="default", rope_theta=base)
    if mc.get("rope_scaling"):
        factor, low, high, context = mc["rope_scaling"]
        rope = dict(rope_type="llama3", rope_theta=base, factor=factor, low_freq_factor=low, high_freq_factor=high,
                    original_max_position_embeddings=int(context))
    config = dict(
        architectures=[FAMILY[kind]], model_type=kind, torch_dtype=dtype, vocab_size=(mc["vocab_size"] + 63) // 64 * 64,
        tokenizer_vocab_size=tokenizer_vocab, hidden_size=h, intermediate_size=mc.get("ffn_hidden") or 4 * h,
        num_hidden_layers=mc["n_layer"], num_attention_heads=heads, num_key_value_heads=kv_heads(mc),
        head_dim=h // heads, hidden_act="silu", max_position_embeddings=mc["block_size"],
        rms_norm_eps=mc.get("norm_eps", 1e-5), tie_word_embeddings=mc.get("tied", True), rope_theta=base,
        rope_parameters=rope, attention_dropout=0.0, initializer_range=0.02, use_cache=True,
        bos_token_id=special.get("bos"), eos_token_id=special.get("eos"), pad_token_id=None)
    if kind == "llama":
        config.update(attention_bias=mc.get("bias"), mlp_bias=mc.get("bias"), pretraining_tp=1)
    elif kind == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    else:
        config.update(num_local_experts=mc["n_experts"], num_experts_per_tok=mc["top_k"], sliding_window=None,
                      router_aux_loss_coef=mc.get("aux_loss_coef", 0.01), output_router_logits=False,
                      router_jitter_noise=0.0)
    return config


def rope_settings(hf):
    """(theta, rope_type, the rope dict) of a config.json: transformers 5's rope_parameters, or 4's fields."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", DEFAULTS[hf["model_type"]]["rope_theta"]))
    return theta, rope.get("rope_type", rope.get("type", "default")), rope


def architecture_problem(hf):
    """(field, value, why) of the first field of config.json `hf` that model.py cannot represent, or None."""
    full = {**DEFAULTS[hf["model_type"]], **hf}
    heads, h = hf.get("num_attention_heads"), hf.get("hidden_size")
    _, rope_type, rope = rope_settings(hf)
    window = full.get("use_sliding_window", full.get("sliding_window") is not None)
    checks = [
        ("hidden_act", full.get("hidden_act", "silu"), full.get("hidden_act", "silu") == "silu",
         "model.py's SwiGLU gates with SiLU"),
        ("head_dim", hf.get("head_dim"), hf.get("head_dim") in (None, (h or 0) // (heads or 1)),
         f"model.py's heads are hidden_size / num_attention_heads = {(h or 0) // (heads or 1)} wide"),
        ("rope_parameters.rope_type", rope_type, rope_type in ("default", "llama3"),
         "model.py has Llama 3's rotary scaling and none other"),
        ("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0), rope.get("partial_rotary_factor", 1.0) == 1,
         "model.py rotates every dimension of a head"),
        ("sliding_window", full.get("sliding_window"), not window, "model.py's attention sees the whole block"),
        ("attention_bias", full.get("attention_bias"), full.get("attention_bias") == full.get("mlp_bias"),
         "model.py's o_proj and MLP biases come together (its bias field)"),
        ("router_jitter_noise", full.get("router_jitter_noise"), not full.get("router_jitter_noise"),
         "model.py's router adds no noise"),
    ]
    return next(((field, value, why) for field, value, ok, why in checks if not ok), None)


def model_fields(hf):
    """{GPTConfig field: (its value for config.json `hf`, the config.json field it comes from)}."""
    kind, full = hf["model_type"], {**DEFAULTS[hf["model_type"]], **hf}
    theta, rope_type, rope = rope_settings(hf)
    scaling = () if rope_type == "default" else (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                                 rope["original_max_position_embeddings"])
    fields = dict(
        n_kv_head=(full.get("num_key_value_heads") or hf["num_attention_heads"], "num_key_value_heads"),
        ffn_hidden=(hf["intermediate_size"], "intermediate_size"),
        tied=(bool(full.get("tie_word_embeddings", False)), "tie_word_embeddings"),
        rope_base=(float(theta), "rope_theta"), norm_eps=(full["rms_norm_eps"], "rms_norm_eps"),
        rope_scaling=(tuple(float(x) for x in scaling), "rope_parameters"),
        qkv_bias=(kind == "qwen2" or bool(full.get("attention_bias")), "model_type"),
        bias=(bool(full.get("attention_bias")), "attention_bias"))
    if kind == "mixtral":
        fields.update(n_experts=(full["num_local_experts"], "num_local_experts"),
                      top_k=(full["num_experts_per_tok"], "num_experts_per_tok"))
    return fields
