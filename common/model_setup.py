"""
model_setup.py: the GPT a run builds from its flags (gpt_config, the MoE flags and their checks), and real memory
for a model built on the meta device (materialize), the way every rung builds only what a rank keeps.
"""
import math

import torch
import torch.nn as nn

from common.errors import check
from model import GPTConfig

MOE_FLAGS = ("n_experts", "top_k", "moe_every", "aux_loss_coef", "aux_loss_scope", "capacity_factor")
# --arch: the model.GPTConfig fields of each family (sizes, heads, widths, tying and the rotary settings come from
# their own flags; gpt_config builds the model)
LLAMA = dict(norm="rmsnorm", mlp="swiglu", qkv_bias=False, bias=False)
ARCHS = dict(gpt={}, llama=LLAMA, qwen2=dict(LLAMA, qkv_bias=True), mixtral=dict(LLAMA, router_renorm=True))
FAMILY_FLAGS = ("n_kv_head", "ffn_hidden", "tied", "rope_base", "norm_eps")


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
                     rope_scaling=rope_scaling(cfg.rope_scaling), **ARCHS[cfg.arch],
                     **{name: getattr(cfg, name) for name in FAMILY_FLAGS + MOE_FLAGS})


def rope_scaling(text):
    """--rope_scaling as model.GPTConfig's tuple (() for none), or None where it is not four positive numbers."""
    if not text.strip():
        return ()
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        return None
    ok = len(values) == 4 and all(0 < v < math.inf for v in values) and values[1] < values[2]
    return values if ok else None


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
