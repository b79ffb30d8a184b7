"""
model.py: the one GPT every nanoscale script trains, plus the accounting that goes with it.

A GPT-2-style pre-LayerNorm decoder in plain single-device PyTorch:

    idx -> wte -> dropout -> [ x + attn(ln_1(x)) ; x + mlp(ln_2(x)) ] x n_layer -> ln_f -> wte^T -> logits

- attention: causal F.scaled_dot_product_attention with rotary position embeddings (RoPE), so there is
  no learned position table and a sequence chunk only needs its global positions (context parallelism);
- MLP: Linear(h, 4h) -> exact erf GeLU -> Linear(4h, h), all linears with biases;
- input and output embeddings tied; the vocabulary is padded up to a multiple of 64;
- the Llama family by config fields, one place per module: RMSNorm (`norm`), a SwiGLU MLP of any width (`mlp`,
  `ffn_hidden`), grouped-query attention (`n_kv_head`), q/k/v biases apart from the rest (`qkv_bias`, `bias`;
  Qwen2), untied embeddings (`tied`), Llama 3's rope scaling, SwiGLU experts with renormalized gates (Mixtral);
- optional mixture of experts (n_experts > 0) in every moe_every-th block: E MLPs, each token sent to its top_k
  by a softmax router, y = sum_k p_k(x) expert_k(x) (moe/layer.py: the MoE block; moe/router.py: its math);

Parallelism is applied *to* this model by the train_*.py scripts (module swaps, sharding, wrapping), never
written into it. To make those swaps one-liners, the pieces a technique replaces are modules of their own:
`CausalSelfAttention.core` (the softmax(QK^T)V part: ring attention, flash kernels), `MoE.experts` (expert
parallelism) and `GPT.lm_head`.

Deterministic init (docs/parity.md): every parameter is drawn from its own seed, derived from
(seed, parameter name), by `init_parameter`. A sharded layout calls it for one full parameter at a time and
keeps its slice, so every layout starts from bit-identical weights without ever materialising the model.

Parameter count (the Ultra-Scale Playbook's formula, exact for this model, v = padded vocab):
    N = h*v + L*(12*h^2 + 13*h) + 2*h        (dense; each MoE block adds E*h + (E-1)*(8h^2 + 5h))
and for the family (kv = n_kv_head * h / n_head, f = ffn_hidden, g = 3 SwiGLU / 2 GeLU, n = 2 LayerNorm / 1 RMS):
    N = h*v (x 2 untied) + L*((2h + 2kv)*h + g*f*h + biases + 2*n*h) + n*h    (num_params)
"""
import math
import zlib
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from moe.layer import Experts, MoE
from moe.router import collect_routing_stats


@dataclass
class GPTConfig:
    vocab_size: int = 256     # real vocabulary (from the dataset's meta.json)
    block_size: int = 256     # maximum sequence length
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    recompute: str = "none"   # none | selective (attention core only) | full (whole block)
    rope_base: float = 10000.0
    rope_scaling: tuple = ()      # Llama 3's (factor, low_freq_factor, high_freq_factor, original_max_position)
    # the Llama family (docs/huggingface.md; presets: --arch in common/config.py); the defaults are GPT-2's
    norm: str = "layernorm"       # layernorm | rmsnorm
    norm_eps: float = 1e-5
    mlp: str = "gelu"             # gelu | swiglu (Llama: c_proj(silu(gate) * up), c_fc's rows [gate | up])
    ffn_hidden: int = 0           # the MLP's (and each expert's) width; 0: 4 * n_embd
    n_kv_head: int = 0            # key/value heads, each shared by n_head / n_kv_head query heads; 0: n_head
    qkv_bias: bool = True         # biases on c_attn's q, k, v rows (Qwen2: on these alone)
    bias: bool = True             # biases on every other linear (c_proj, the MLP's)
    tied: bool = True             # the LM head is the input embedding's weight
    router_renorm: bool = False   # a token's top_k gates divided by their sum (Mixtral)
    n_experts: int = 0            # experts per MoE block; 0: dense MLP everywhere
    top_k: int = 2                # experts each token is sent to
    moe_every: int = 1            # MoE in blocks moe_every-1, 2*moe_every-1, ... (2: every other block)
    aux_loss_coef: float = 0.01   # weight of the load-balancing loss
    aux_loss_scope: str = "global"  # its f over the previous step's global batch, or each micro-batch
    capacity_factor: float = 0.0  # 0: dropless (every routed token computed)

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def ffn(self):
        return self.ffn_hidden or 4 * self.n_embd

    def is_moe_block(self, i):
        return self.n_experts > 0 and i % self.moe_every == self.moe_every - 1

    @property
    def padded_vocab_size(self):
        # a multiple of 64 keeps the LM-head matmul on fast paths and divides any tp up to 64
        return (self.vocab_size + 63) // 64 * 64


# ----------------------------------------------------------------------------------------------------------
# rotary position embedding

def rope_cache(head_dim, positions, base=10000.0, param_dtype=torch.float32, scaling=()):
    """The rotations by pos * theta_j for these (global) positions as (cos, sin) pairs: [T, D/2, 2];
    fp32 for fp32/16-bit models, float64 for a float64 model (angles of large positions need the bits).
    scaling: Llama 3's (factor, low_freq_factor, high_freq_factor, original context), or ()."""
    dtype = torch.promote_types(param_dtype, torch.float32)
    # built where the positions are: a table made on the host would be copied to the GPU every forward, a sync
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype, device=positions.device) / head_dim))
    if scaling:
        # Llama 3's longer context (Meta's reference code): wavelengths beyond context / low slowed down by
        # `factor`, those below context / high kept, the ones between interpolated smoothly
        factor, low, high, context = scaling
        smooth = ((context * inv_freq / (2 * math.pi) - low) / (high - low)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rope_of(cfg, positions, param_dtype):
    """rope_cache of cfg's heads, base and scaling."""
    return rope_cache(cfg.n_embd // cfg.n_head, positions, cfg.rope_base, param_dtype, tuple(cfg.rope_scaling))


def apply_rope(x, rope):
    """Rotate each adjacent pair (a, b) = (x[2j], x[2j+1]) of x [B, T, heads, D] by its position's angle, to
    (a cos - b sin, a sin + b cos) (the GPT-J / Llama pairing): real arithmetic in x's dtype, the table cast to it
    as Llama's reference does (no complex numbers, which inductor cannot fuse, and no fp32 copy of q and k)."""
    cos, sin = rope.to(x.dtype)[:, None].unbind(-1)     # [T, 1, D/2] each: all that backward keeps
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


# ----------------------------------------------------------------------------------------------------------
# the blocks: attention, MLP, Block (an MLP or moe/layer.py's MoE), LM head, GPT

class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask: the part context parallelism and kernels replace."""

    def __init__(self, dropout):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):
        p = self.dropout if self.training else 0.0
        # grouped-query attention: k and v have fewer heads, each serving n_head / n_kv_head query heads
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        assert cfg.n_head % cfg.kv_heads == 0, "n_kv_head must divide n_head"
        self.q_per_kv = cfg.n_head // cfg.kv_heads
        kv_width = cfg.kv_heads * (cfg.n_embd // cfg.n_head)
        self.c_attn = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * kv_width, bias=cfg.qkv_bias)   # rows: [q | k | v]
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.core = AttentionCore(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.selective_recompute = cfg.recompute == "selective"

    def forward(self, x, rope):
        qkv = self.c_attn(x)
        B, T, width = qkv.shape  # read after c_attn: under sequence parallelism c_attn gathers the full sequence
        # the heads are read off the weight (q is q_per_kv times k's width), so a tensor-parallel shard of c_attn
        # just works with fewer heads
        head_dim, kv_width = rope.shape[-2] * 2, width // (self.q_per_kv + 2)
        qk, v = (t.view(B, T, -1, head_dim) for t in qkv.split([width - kv_width, kv_width], dim=-1))
        qk = apply_rope(qk, rope)                                     # the q and k heads, rotated in one go
        qk, v = qk.transpose(1, 2), v.transpose(1, 2)                 # [B, heads, T, D]
        q, k = qk.split([qk.shape[1] - v.shape[1], v.shape[1]], dim=1)
        if self.selective_recompute and self.training:
            # keep q, k, v; recompute the T x T scores in backward (Korthikanti et al. 2022)
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """gelu: c_proj(gelu(c_fc x)) (exact erf GeLU); swiglu: c_fc's rows are [gate | up], c_proj(silu(gate) * up)."""

    def __init__(self, cfg):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.gated else 1) * cfg.ffn, bias=cfg.bias)
        self.act = nn.SiLU() if self.gated else nn.GELU()
        self.c_proj = nn.Linear(cfg.ffn, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        h = self.c_fc(x)
        if self.gated:                     # (a tensor-parallel shard of c_fc holds its slice of each half)
            gate, up = h.chunk(2, dim=-1)
            return self.dropout(self.c_proj(self.act(gate) * up))
        return self.dropout(self.c_proj(self.act(h)))


def norm(cfg):
    """LayerNorm (GPT-2: weight and bias) or RMSNorm (Llama: x / rms(x) * weight), one per use."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg, moe=False):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg)
        self.mlp = MoE(cfg, Experts(MLP(cfg) for _ in range(cfg.n_experts))) if moe else MLP(cfg)

    def forward(self, x, rope):
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Module):
    """Logits with the embedding weight (tied) or its own (untied), and the mean cross-entropy given targets."""

    def __init__(self, wte, tied=True):
        super().__init__()
        # tied: the embedding's parameter, not a second one
        self.weight = wte.weight if tied else nn.Parameter(torch.empty_like(wte.weight))

    def forward(self, x, targets=None):
        logits = F.linear(x, self.weight)
        if targets is None:
            return logits, None
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))   # fp32 at least, float64 stays
        loss = F.cross_entropy(wide.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


class GPT(nn.Module):
    def __init__(self, cfg, seed=0):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.padded_vocab_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, cfg.is_moe_block(i)) for i in range(cfg.n_layer)]),
            ln_f=norm(cfg),
        ))
        self.lm_head = LMHead(self.transformer.wte, cfg.tied)
        init_weights(self, seed)

    def forward(self, idx, targets=None, pos=None):
        """idx, targets: [B, T] token ids. pos: [T] global positions (default 0..T-1; CP passes its chunk's)."""
        pos = torch.arange(idx.size(1), device=idx.device) if pos is None else pos
        rope = rope_of(self.cfg, pos, self.transformer.wte.weight.dtype)
        x = self.transformer.drop(self.transformer.wte(idx))
        for block in self.transformer.h:
            if self.cfg.recompute == "full" and self.training:
                # store only each block's input; the whole block is recomputed in backward
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        logits, loss = self.lm_head(self.transformer.ln_f(x), targets)
        if self.training:
            collect_routing_stats(self.transformer.h)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample tokens autoregressively (no KV cache: this is for a short sample at the end of training)."""
        return generate(lambda ids: self(ids)[0][:, -1], idx, max_new_tokens, self.cfg, temperature, top_k)


@torch.no_grad()
def generate(next_logits, idx, max_new_tokens, cfg, temperature=1.0, top_k=None):
    """Extend idx [B, T] by max_new_tokens sampled tokens; next_logits(idx) -> the logits of the next token
    [B, padded vocab]: GPT's forward, or one that runs on several ranks (a pipeline's, train_pp.py)."""
    for _ in range(max_new_tokens):
        logits = next_logits(idx[:, -cfg.block_size:])[:, : cfg.vocab_size] / max(temperature, 1e-6)
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
    return idx


# ----------------------------------------------------------------------------------------------------------
# deterministic, per-parameter initialisation

def parameter_seed(seed, name):
    """A seed that depends only on (seed, name): identical on every rank, process and layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def init_parameter(name, shape, n_layer, seed):
    """The full initial value of parameter `name` (fp32, CPU). Sharded layouts slice this."""
    if name.endswith((".bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    std = 0.02
    if name.endswith("c_proj.weight"):
        std = 0.02 / math.sqrt(2 * n_layer)        # residual projections (GPT-2 paper)
    g = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.randn(shape, generator=g) * std


@torch.no_grad()
def init_weights(model, seed):
    for name, p in model.named_parameters():
        p.copy_(init_parameter(name, p.shape, model.cfg.n_layer, seed))


# ----------------------------------------------------------------------------------------------------------
# accounting: parameters, FLOPs, memory

def num_params(cfg, experts_per_token=None):
    """The module docstring's N, exact for every config (an MoE block: a router and E MLPs instead of one);
    experts_per_token=k counts only the k experts a token uses (the 'active' parameters that set the FLOPs)."""
    h, L, v, f = cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size, cfg.ffn
    qkv, g = h + 2 * cfg.kv_heads * (h // cfg.n_head), 3 if cfg.mlp == "swiglu" else 2
    norm = h * (1 if cfg.norm == "rmsnorm" else 2)
    attention = qkv * h + qkv * cfg.qkv_bias + h * h + h * cfg.bias
    mlp = g * f * h + ((g - 1) * f + h) * cfg.bias
    n_moe = sum(cfg.is_moe_block(i) for i in range(L))
    experts = cfg.n_experts if experts_per_token is None else experts_per_token
    moe_extra = n_moe * (cfg.n_experts * h + (experts - 1) * mlp)
    embeddings = h * v * (1 if cfg.tied else 2)
    return embeddings + L * (attention + mlp + 2 * norm) + norm + moe_extra


def flops_per_token(cfg, seq_len=None):
    """Training FLOPs per token, forward + backward: 6N + 12*L*h*T (N: active parameters for an MoE).

    Convention (PaLM appendix B, as nanoGPT): 6N for every matmul with a weight (embedding included, as its
    tied weight is the LM head; an untied input embedding is a lookup, not a matmul, and is left out), plus
    12*L*h*T for the attention scores QK^T and the weighted sum AV, counted as if unmasked (the causal mask's
    skipped half is not subtracted)."""
    T = seq_len or cfg.block_size
    lookup = 0 if cfg.tied else cfg.padded_vocab_size * cfg.n_embd
    return 6 * (num_params(cfg, cfg.top_k if cfg.n_experts else None) - lookup) + 12 * cfg.n_layer * cfg.n_embd * T


def activation_bytes_per_layer(seq_len, batch, cfg, bytes_per_value=2, recompute="none", dropout=True):
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, eq. 2).

    With 16-bit activations: s*b*h*(34 + 5*a*s/h). Of the 34, 32 are sixteen tensors of s*b*h values stored
    for backward (attention: qkv input, q, k, v, projection input; MLP: fc input, GeLU input and output (4h
    each); two LayerNorm inputs) and 2 are two 1-byte dropout masks; the 5*a*s/h term is the a*s*s softmax
    output, its dropout mask and the dropped-out probabilities.
    bytes_per_value=4 (fp32): the stored values double, the masks do not: s*b*h*66 + 9*a*s^2*b.
    recompute='selective' (attention core recomputed): the a*s^2 term disappears.
    recompute='full': only the block input is stored: s*b*h*bytes_per_value.
    dropout=False drops the mask bytes (no masks are stored when p = 0).
    The family's shapes change the stored values per token by 3(kv - h) (k and v kv wide, k kept once more after
    RoPE) and by m*f - 8h, m the MLP's saved tensors of width f: SwiGLU 4 (c_fc's gate and up, silu(gate), their
    product), GeLU 2, as planner/shape.py's activation_delta_values counts them (eager; fused SwiGLU keeps 3)."""
    s, b, h, a = seq_len, batch, cfg.n_embd, cfg.n_head
    if recompute == "full":
        return s * b * h * bytes_per_value
    per_sbh = 16 * bytes_per_value + 2 * int(dropout)
    per_as2b = 0 if recompute == "selective" else 2 * bytes_per_value + int(dropout)
    family = 3 * (cfg.kv_heads - a) * (h // a) + (4 if cfg.mlp == "swiglu" else 2) * cfg.ffn - 8 * h
    return s * b * (h * per_sbh + family * bytes_per_value) + a * s * s * b * per_as2b
