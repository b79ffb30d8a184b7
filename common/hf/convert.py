"""
common/hf/convert.py: model.py's GPT as transformers' GPTNeoXForCausalLM and back: the config, the parameter names and
the two permutations between them (docs/huggingface.md). Pure functions of dicts and tensors: no file is read here
and transformers is never imported (hf.py does the files; only the tests load transformers).

model.py's GPT is a GPT-NeoX model (pre-LayerNorm with biases, exact GeLU MLP of width 4h, full rotary, sequential
residual, tied embeddings), so every parameter has a NeoX twin of the same shape:

    model.py                          GPTNeoXForCausalLM
    transformer.wte                   gpt_neox.embed_in              (lm_head is tied to it: not stored)
    transformer.h.{i}.ln_1            gpt_neox.layers.{i}.input_layernorm
    transformer.h.{i}.attn.c_attn     gpt_neox.layers.{i}.attention.query_key_value    rows permuted, below
    transformer.h.{i}.attn.c_proj     gpt_neox.layers.{i}.attention.dense
    transformer.h.{i}.ln_2            gpt_neox.layers.{i}.post_attention_layernorm
    transformer.h.{i}.mlp.c_fc        gpt_neox.layers.{i}.mlp.dense_h_to_4h
    transformer.h.{i}.mlp.c_proj      gpt_neox.layers.{i}.mlp.dense_4h_to_h
    transformer.ln_f                  gpt_neox.final_layer_norm

Two things differ in layout only, both in the rows of c_attn (weight and bias), H heads of D dims:

    fusion   model.py: [q heads 0..H-1 | k heads | v heads]     NeoX: [q0 k0 v0 | q1 k1 v1 | ...] per head
    rotary   model.py rotates the pairs (x[2j], x[2j+1])       NeoX rotates the halves (x[j], x[j + D/2])
             by the angle pos * base^(-2j/D), so inside every q and k head row 2j goes to j, row 2j+1 to j + D/2

Both are pure re-orderings (bitwise exact both ways). q.k is unchanged when q and k are permuted alike, which is
why a converter that forgets the rotary permutation still loads and runs: it rotates the wrong pairs by the wrong
angles, and gives a model whose loss is finite but bad.
"""
import re

import torch

# GPTNeoXConfig's defaults where a config.json leaves a field out (transformers 4.x and 5.x alike)
NEOX_DEFAULTS = dict(hidden_act="gelu", layer_norm_eps=1e-5, use_parallel_residual=True, tie_word_embeddings=False,
                     attention_bias=True, rotary_pct=0.25, rotary_emb_base=10000)
LAYER_NORM_EPS = 1e-5                                     # torch.nn.LayerNorm's, model.py's every norm
BLOCK_NAMES = (("ln_1", "input_layernorm"), ("attn.c_attn", "attention.query_key_value"),
               ("attn.c_proj", "attention.dense"), ("ln_2", "post_attention_layernorm"),
               ("mlp.c_fc", "mlp.dense_h_to_4h"), ("mlp.c_proj", "mlp.dense_4h_to_h"))
WTE, HF_WTE = "transformer.wte.weight", "gpt_neox.embed_in.weight"


# ----------------------------------------------------------------------------------------------------------
# names and tensors

def hf_name(name):
    """model.py's parameter name -> GPTNeoXForCausalLM's (the tied lm_head.weight is the embedding's)."""
    if name in (WTE, "lm_head.weight"):
        return HF_WTE
    if name.startswith("transformer.ln_f."):
        return "gpt_neox.final_layer_norm." + name.rsplit(".", 1)[1]
    match = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)", name)
    if match is None:
        raise KeyError(f"{name} has no GPT-NeoX counterpart")
    layer, module, kind = match.groups()
    twin = dict(BLOCK_NAMES).get(module)
    if twin is None:
        raise KeyError(f"{name} has no GPT-NeoX counterpart")
    return f"gpt_neox.layers.{layer}.{twin}.{kind}"


def is_fused_qkv(name):
    return ".attn.c_attn." in name


def qkv_to_neox(t, n_head):
    """c_attn rows [q | k | v], rotary pairs interleaved -> NeoX's query_key_value rows, per head [q k v], halves."""
    s = t.unflatten(0, (3, n_head, -1))                                 # [3, H, D, ...]
    qk = s[:2].unflatten(2, (-1, 2)).transpose(2, 3).flatten(2, 3)     # row 2j + c -> row c * D/2 + j
    return torch.cat([qk, s[2:]]).transpose(0, 1).flatten(0, 2).contiguous()


def qkv_from_neox(t, n_head):
    """The inverse of qkv_to_neox."""
    s = t.unflatten(0, (n_head, 3, -1)).transpose(0, 1)                # [3, H, D, ...]
    qk = s[:2].unflatten(2, (2, -1)).transpose(2, 3).flatten(2, 3)     # row c * D/2 + j -> row 2j + c
    return torch.cat([qk, s[2:]]).flatten(0, 2).contiguous()


def to_hf(name, tensor, n_head):
    """(NeoX name, NeoX value) of model.py's parameter `name`."""
    return hf_name(name), qkv_to_neox(tensor, n_head) if is_fused_qkv(name) else tensor


def from_hf(name, tensor, n_head):
    """model.py's value of parameter `name`, from its NeoX twin's value `tensor`."""
    return qkv_from_neox(tensor, n_head) if is_fused_qkv(name) else tensor


# the functions interop.py calls for either family (common/hf/llama.py has the same for the Llama family)

def hf_names(name, mc):
    return [hf_name(name)]


def to_hf_pieces(name, tensor, mc):
    return [to_hf(name, tensor, mc["n_head"])]


def from_hf_pieces(name, tensors, mc):
    return from_hf(name, tensors[0], mc["n_head"])


def class_name(mc):
    return "GPTNeoXForCausalLM"


def export_problem(mc):
    """(field, value, why) of the first model field GPTNeoXForCausalLM cannot hold (the Llama family's fields on a
    LayerNorm + GeLU model), or None."""
    h = mc["n_embd"]
    checks = [("n_experts", mc.get("n_experts", 0), not mc.get("n_experts"), "GPT-NeoX has no mixture of experts"),
              ("n_kv_head", mc.get("n_kv_head", 0), mc.get("n_kv_head", 0) in (0, mc["n_head"]),
               "GPT-NeoX has as many key/value heads as query heads"),
              ("ffn_hidden", mc.get("ffn_hidden", 0), mc.get("ffn_hidden", 0) in (0, 4 * h), "GPT-NeoX's MLP is 4h wide"),
              ("bias", mc.get("bias", True), mc.get("bias", True) and mc.get("qkv_bias", True),
               "GPT-NeoX's linears all have biases"),
              ("tied", mc.get("tied", True), mc.get("tied", True), "this export ties GPT-NeoX's head to its embedding"),
              ("rope_scaling", mc.get("rope_scaling", ()), not mc.get("rope_scaling"), "GPT-NeoX has no rope scaling")]
    return next(((field, value, why) for field, value, ok, why in checks if not ok), None)


def hf_config(mc, dtype, tokenizer_vocab, special=None):
    return neox_config(mc, dtype, tokenizer_vocab, special)


# ----------------------------------------------------------------------------------------------------------
# config.json

def neox_config(model_config, dtype, tokenizer_vocab, special=None):
    """config.json of GPTNeoXForCausalLM for a checkpoint's model_config. The embedding keeps model.py's padded
    rows (a multiple of 64): the padded logits take part in model.py's softmax, so only the padded head gives the
    same probabilities; `tokenizer_vocab_size` says how many of them are real tokens. Rotary settings are written
    both as transformers 4 reads them (rotary_pct, rotary_emb_base) and as 5 does (rope_parameters)."""
    h, base = model_config["n_embd"], model_config.get("rope_base", 10000.0)
    padded = (model_config["vocab_size"] + 63) // 64 * 64
    special = special or {}
    return dict(
        architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", torch_dtype=dtype,
        vocab_size=padded, tokenizer_vocab_size=tokenizer_vocab, hidden_size=h,
        num_hidden_layers=model_config["n_layer"], num_attention_heads=model_config["n_head"],
        intermediate_size=4 * h, hidden_act="gelu", layer_norm_eps=LAYER_NORM_EPS, attention_bias=True,
        use_parallel_residual=False, tie_word_embeddings=True, rotary_pct=1.0, rotary_emb_base=base,
        rope_parameters=dict(rope_type="default", rope_theta=base, partial_rotary_factor=1.0),
        max_position_embeddings=model_config["block_size"], attention_dropout=0.0, hidden_dropout=0.0,
        initializer_range=0.02, use_cache=True, bos_token_id=special.get("bos"), eos_token_id=special.get("eos"),
        pad_token_id=None)


def rotary(hf):
    """(fraction, theta, type) of a config.json's rotary settings, each as (the field that holds it, its value):
    transformers 5 writes rope_parameters, 4 rotary_pct / rotary_emb_base / rope_scaling; defaults if absent."""
    where = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(where) if isinstance(hf.get(where), dict) else {}

    def field(key, old_name, default):
        return (f"{where}.{key}", rope[key]) if key in rope else (old_name, hf.get(old_name, default))
    kind = rope.get("rope_type", rope.get("type", "default"))
    return (field("partial_rotary_factor", "rotary_pct", NEOX_DEFAULTS["rotary_pct"]),
            field("rope_theta", "rotary_emb_base", NEOX_DEFAULTS["rotary_emb_base"]), (f"{where}.rope_type", kind))


def architecture_problem(hf, rope_base):
    """(field, value, why model.py cannot represent it) of the first field of config.json `hf` that model.py's
    GPT cannot express, or None. Missing fields take GPTNeoXConfig's defaults."""
    full = {**NEOX_DEFAULTS, **hf}
    (fraction_field, fraction), (theta_field, theta), (type_field, rope_type) = rotary(hf)
    experts = next((k for k in ("num_experts", "num_local_experts", "moe_num_experts") if hf.get(k)), None)
    width = 4 * hf["hidden_size"] if type(hf.get("hidden_size")) is int else None
    checks = [
        ("model_type", hf.get("model_type"), hf.get("model_type") == "gpt_neox",
         "model.py holds GPT-NeoX (--arch gpt) and the Llama family: llama, qwen2, mixtral (common/hf/llama.py)"),
        ("use_parallel_residual", full["use_parallel_residual"], full["use_parallel_residual"] is False,
         "model.py adds attention, then the MLP of the result (sequential); Pythia and GPT-NeoX-20B run them in "
         "parallel"),
        (fraction_field, fraction, fraction == 1.0, "model.py rotates every dimension of a head (full rotary)"),
        (type_field, rope_type, rope_type == "default", "model.py has no rotary scaling"),
        (theta_field, theta, theta == rope_base, f"model.py's rotary base is {rope_base:g}"),
        ("tie_word_embeddings", full["tie_word_embeddings"], full["tie_word_embeddings"] is True,
         "model.py's LM head is its embedding"),
        ("num_key_value_heads", hf.get("num_key_value_heads"),
         hf.get("num_key_value_heads") in (None, hf.get("num_attention_heads")),
         "model.py has as many key/value heads as query heads (no grouped-query attention)"),
        ("hidden_act", full["hidden_act"], full["hidden_act"] == "gelu", "model.py's MLP uses the exact erf GeLU"),
        ("layer_norm_eps", full["layer_norm_eps"], full["layer_norm_eps"] == LAYER_NORM_EPS,
         f"model.py's LayerNorms use eps {LAYER_NORM_EPS:g}"),
        ("attention_bias", full["attention_bias"], full["attention_bias"] is True, "model.py's linears have biases"),
        ("intermediate_size", hf.get("intermediate_size"), width is not None and hf.get("intermediate_size") == width,
         f"model.py's MLP is 4 x hidden_size = {width} wide"),
        (experts, hf.get(experts), experts is None, "model.py's experts are its own MoE blocks, not this MoE"),
    ]
    return next(((field, value, why) for field, value, ok, why in checks if not ok), None)


SHAPE_FLAGS = (("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"), ("hidden_size", "n_embd"))


def shape_problem(hf, cfg):
    """(config.json field, its value, the run's flag, the flag's value) of the first model shape that differs."""
    for field, flag in SHAPE_FLAGS:
        if hf.get(field) != getattr(cfg, flag):
            return field, hf.get(field), flag, getattr(cfg, flag)
    return None
