"""
model.py: the one GPT every nanoscale script trains, plus the accounting that goes with it.

A GPT-2-style pre-LayerNorm decoder in plain single-device PyTorch:

    idx -> wte -> dropout -> [ x + attn(ln_1(x)) ; x + mlp(ln_2(x)) ] x n_layer -> ln_f -> wte^T -> logits

- attention: causal F.scaled_dot_product_attention with rotary position embeddings (RoPE), so there is
  no learned position table and a sequence chunk only needs its global positions (context parallelism);
- MLP: Linear(h, 4h) -> exact erf GeLU -> Linear(4h, h), all linears with biases;
- input and output embeddings tied; the vocabulary is padded up to a multiple of 64;
- optional mixture of experts (n_experts > 0) in every moe_every-th block: E GeLU MLPs, each token sent to its
  top_k by a softmax router, y = sum_k p_k(x) expert_k(x); dropless unless capacity_factor > 0 (an expert then
  keeps ceil(cf * tokens * top_k / E), first choices first). The Switch loss aux_loss_coef * E * sum_e f_e P_e
  (f_e: share of assignments to e, P_e: mean router probability) balances them through the router's gradient
  only; the `global` scope takes f from the previous step's global batch (why: common/routing.py, docs/moe.md).

Parallelism is applied *to* this model by the train_*.py scripts (module swaps, sharding, wrapping), never
written into it. To make those swaps one-liners, the pieces a technique replaces are modules of their own:
`CausalSelfAttention.core` (the softmax(QK^T)V part: ring attention, flash kernels), `MoE.experts` (expert
parallelism) and `GPT.lm_head`.

Deterministic init (docs/parity.md): every parameter is drawn from its own seed, derived from
(seed, parameter name), by `init_parameter`. A sharded layout calls it for one full parameter at a time and
keeps its slice, so every layout starts from bit-identical weights without ever materialising the model.

Parameter count (the Ultra-Scale Playbook's formula, exact for this model, v = padded vocab):
    N = h*v + L*(12*h^2 + 13*h) + 2*h        (dense; each MoE block adds E*h + (E-1)*(8h^2 + 5h))
"""
import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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
    n_experts: int = 0            # experts per MoE block; 0: dense MLP everywhere
    top_k: int = 2                # experts each token is sent to
    moe_every: int = 1            # MoE in blocks moe_every-1, 2*moe_every-1, ... (2: every other block)
    aux_loss_coef: float = 0.01   # weight of the load-balancing loss
    aux_loss_scope: str = "global"  # its f over the previous step's global batch, or each micro-batch
    capacity_factor: float = 0.0  # 0: dropless (every routed token computed)

    def is_moe_block(self, i):
        return self.n_experts > 0 and i % self.moe_every == self.moe_every - 1

    @property
    def padded_vocab_size(self):
        # a multiple of 64 keeps the LM-head matmul on fast paths and divides any tp up to 64
        return (self.vocab_size + 63) // 64 * 64


# ----------------------------------------------------------------------------------------------------------
# rotary position embedding

def rope_cache(head_dim, positions, base=10000.0, param_dtype=torch.float32):
    """The rotations e^(i pos theta_j) for these (global) positions, as view_as_real stores them: [T, D/2, 2];
    fp32 for fp32/16-bit models, float64 for a float64 model (angles of large positions need the bits)."""
    dtype = torch.promote_types(param_dtype, torch.float32)
    # built where the positions are: a table made on the host would be copied to the GPU every forward, a sync
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype, device=positions.device) / head_dim))
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x, rope):
    """Rotate each adjacent pair (x[2j], x[2j+1]) of x [B, T, heads, D] by its position's angle (the GPT-J /
    Llama pairing), in fp32 or wider so that bf16 activations get an accurate rotation."""
    if torch.compiler.is_compiling():   # inductor generates no code for complex ops; this real form fuses
        (a, b), (c, s) = x.unflatten(-1, (-1, 2)).unbind(-1), rope[:, None].unbind(-1)
        return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2).to(x.dtype)
    # eager: one complex multiply is one pass over x, where the real form takes six ops and a copy
    pairs = torch.view_as_complex(x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.view_as_complex(rope)[:, None]).flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# the blocks: attention, MLP, the mixture of experts (routing, experts, MoE), Block, LM head, GPT

class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask: the part context parallelism and kernels replace."""

    def __init__(self, dropout):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # rows: [q | k | v]
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.core = AttentionCore(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.selective_recompute = cfg.recompute == "selective"

    def forward(self, x, rope):
        qkv = self.c_attn(x)
        B, T, width = qkv.shape  # read after c_attn: under sequence parallelism c_attn gathers the full sequence
        # n_head is read off the weight, so a tensor-parallel shard of c_attn just works with fewer heads
        head_dim = rope.shape[-2] * 2
        qk, v = (t.view(B, T, -1, head_dim) for t in qkv.split([2 * width // 3, width // 3], dim=-1))
        qk = apply_rope(qk, rope)                                     # the q and k heads, rotated in one go
        (q, k), v = qk.transpose(1, 2).chunk(2, dim=1), v.transpose(1, 2)  # [B, H, T, D]
        if self.selective_recompute and self.training:
            # keep q, k, v; recompute the T x T scores in backward (Korthikanti et al. 2022)
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()                                  # exact erf GeLU
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Routing(NamedTuple):
    token: torch.Tensor      # [N*k] token index of each assignment (token-major: token t's slots together)
    expert: torch.Tensor     # [N*k] its expert, or E where the expert's capacity dropped it
    gate: torch.Tensor       # [N*k] its router probability (fp32, or fp64 for an fp64 model)
    counts: torch.Tensor     # [E] assignments routed to each expert, before any dropping
    prob_sum: torch.Tensor   # [E] router probabilities summed over the tokens (no gradient)
    n_tokens: int            # tokens routed

    def stats(self):
        """[assignments per expert (E), probability sums (E), dropped, tokens]: summed over a step's forwards."""
        dropped = (self.expert == len(self.counts)).sum()
        extra = torch.stack([dropped, torch.full_like(dropped, self.n_tokens)])
        return torch.cat([self.counts.double(), self.prob_sum.double(), extra.double()])


class BalanceGradient(torch.autograd.Function):
    """Identity on the router probabilities [N, E]; backward adds `per_token` [E] (MoE.balance_gradient) to each row."""

    @staticmethod
    def forward(ctx, probs, per_token):
        ctx.save_for_backward(per_token)
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad):
        (per_token,) = ctx.saved_tensors
        return grad + per_token.to(grad.dtype), None


def count_per_expert(expert, n_bins):
    """[n_bins] how many entries of `expert` name each bin: a scatter-add, where torch.bincount would sync."""
    return torch.zeros(n_bins, dtype=torch.long, device=expert.device).scatter_add_(0, expert, torch.ones_like(expert))


def route(logits, top_k, capacity_factor=0.0, balance=None):
    """Top-k softmax routing of N tokens ([N, E] router logits); balance(counts) -> [E]: the balancing gradient
    per token (BalanceGradient), or None. Over capacity, an assignment goes to expert E, which no expert runs."""
    N, E = logits.shape
    probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    expert = probs.topk(top_k, dim=-1).indices                    # [N, k], best first
    counts = count_per_expert(expert.reshape(-1), E)
    if balance is not None and probs.requires_grad:
        probs = BalanceGradient.apply(probs, balance(counts))
    gate = probs.gather(1, expert)
    token = torch.arange(N, device=logits.device)[:, None].expand(N, top_k).reshape(-1)
    expert, gate = expert.reshape(-1), gate.reshape(-1)
    if capacity_factor > 0:
        capacity = math.ceil(capacity_factor * N * top_k / E)
        # queue position of each assignment at its expert, all first choices ahead of all second choices
        slot_major = F.one_hot(expert.view(N, top_k).t().reshape(-1), E)
        position = ((slot_major.cumsum(0) - 1) * slot_major).sum(-1)
        keep = (position < capacity).view(top_k, N).t().reshape(-1)
        expert = torch.where(keep, expert, E)
    return Routing(token, expert, gate, counts, probs.detach().sum(0), N)


def combine(n_tokens, token, gate, expert_out):
    """y[t] = sum of gate * expert output over token t's assignments (a dropped one's output is 0)."""
    y = expert_out.new_zeros(n_tokens, expert_out.shape[-1])
    return y.index_add_(0, token, expert_out * gate[:, None].to(expert_out.dtype))


class Experts(nn.ModuleList):
    """The E expert MLPs, called on all routed rows at once: the part expert parallelism replaces (train_ep)."""

    def forward(self, rows, expert):
        """rows [A, h] grouped by expert (expert 0's, then 1's, ..., then E's: dropped by capacity), expert [A]
        their experts -> [A, h], zeros for the dropped. Reads the rows per expert to the host: each GEMM's size."""
        sizes = count_per_expert(expert, len(self) + 1).tolist()
        out = torch.cat([mlp(chunk) for mlp, chunk in zip(self, rows.split(sizes))])
        return torch.cat([out, out.new_zeros(sizes[-1], out.shape[1])]) if sizes[-1] else out


class MoE(nn.Module):
    """The reference mixture of experts: route, group the assignments by expert, run each expert on its
    rows, scatter back weighted by the gates. train_ep.py passes experts that run on the ranks owning them."""

    def __init__(self, cfg, experts=None):
        super().__init__()
        self.top_k, self.capacity_factor = cfg.top_k, cfg.capacity_factor
        self.aux_loss_coef, self.aux_loss_scope = cfg.aux_loss_coef, cfg.aux_loss_scope
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts([MLP(cfg) for _ in range(cfg.n_experts)]) if experts is None else experts
        # share of the previous step's global batch routed to each expert (zeros: no step yet), in checkpoints
        self.register_buffer("load", torch.zeros(cfg.n_experts))
        self.tokens_per_step = None                  # tokens of this rank's step loss (None: this forward's)
        self.routing, self.stats = None, None        # the last forward's Routing; per-step sums (GPT.forward)

    def balance_gradient(self, counts):
        """d(aux_loss_coef * aux) / d p_t[e] for each token: coef * E * f_e / tokens (BalanceGradient)."""
        dtype = self.router.weight.dtype
        share = counts.to(dtype) / counts.sum() if self.aux_loss_scope == "micro" else self.load.to(dtype)
        tokens = self.tokens_per_step or int(counts.sum()) // self.top_k
        return self.aux_loss_coef * len(share) * share / tokens

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])                          # [N, h]
        r = self.routing = route(self.router(tokens), self.top_k, self.capacity_factor, self.balance_gradient)
        order = torch.argsort(r.expert, stable=True)                 # rows of expert 0, then 1, ..., dropped
        out = self.experts(tokens[r.token[order]], r.expert[order])
        return combine(tokens.shape[0], r.token[order], r.gate[order], out).view(x.shape)


def collect_routing_stats(blocks):
    """Add each MoE block's last routing to its step sums. Called once per forward of the whole model (or
    pipeline stage), not in MoE.forward: a block recomputed in backward (--recompute full) counts once."""
    for m in (block.mlp for block in blocks):
        if getattr(m, "routing", None) is not None:
            m.stats = m.routing.stats() + (0 if m.stats is None else m.stats)


class Block(nn.Module):
    def __init__(self, cfg, moe=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x, rope):
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Module):
    """Logits with the tied embedding weight, and the mean cross-entropy when targets are given."""

    def __init__(self, wte):
        super().__init__()
        self.weight = wte.weight                               # tied, not a second parameter

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
            ln_f=nn.LayerNorm(cfg.n_embd),
        ))
        self.lm_head = LMHead(self.transformer.wte)
        init_weights(self, seed)

    def forward(self, idx, targets=None, pos=None):
        """idx, targets: [B, T] token ids. pos: [T] global positions (default 0..T-1; CP passes its chunk's)."""
        pos = torch.arange(idx.size(1), device=idx.device) if pos is None else pos
        head_dim = self.cfg.n_embd // self.cfg.n_head
        rope = rope_cache(head_dim, pos, self.cfg.rope_base, self.transformer.wte.weight.dtype)
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
    """N = h*v + L*(12h^2 + 13h) + 2h: tied embedding, per-block attention/MLP/LayerNorms, final LayerNorm.
    An MoE block has a router (E*h) and E MLPs (8h^2 + 5h each) instead of one; experts_per_token=k counts
    only the k experts a token uses (the 'active' parameters that set the FLOPs)."""
    h, L, v = cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size
    n_moe = sum(cfg.is_moe_block(i) for i in range(L))
    experts = cfg.n_experts if experts_per_token is None else experts_per_token
    moe_extra = n_moe * (cfg.n_experts * h + (experts - 1) * (8 * h * h + 5 * h))
    return h * v + L * (12 * h * h + 13 * h) + 2 * h + moe_extra


def flops_per_token(cfg, seq_len=None):
    """Training FLOPs per token, forward + backward: 6N + 12*L*h*T (N: active parameters for an MoE).

    Convention (PaLM appendix B, as nanoGPT): 6N for every matmul with a weight (embedding included, as its
    tied weight is the LM head), plus 12*L*h*T for the attention scores QK^T and the weighted sum AV, counted
    as if unmasked (the causal mask's skipped half is not subtracted)."""
    T = seq_len or cfg.block_size
    return 6 * num_params(cfg, cfg.top_k if cfg.n_experts else None) + 12 * cfg.n_layer * cfg.n_embd * T


def activation_bytes_per_layer(seq_len, batch, cfg, bytes_per_value=2, recompute="none", dropout=True):
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, eq. 2).

    With 16-bit activations: s*b*h*(34 + 5*a*s/h). Of the 34, 32 are sixteen tensors of s*b*h values stored
    for backward (attention: qkv input, q, k, v, projection input; MLP: fc input, GeLU input and output (4h
    each); two LayerNorm inputs) and 2 are two 1-byte dropout masks; the 5*a*s/h term is the a*s*s softmax
    output, its dropout mask and the dropped-out probabilities.
    bytes_per_value=4 (fp32): the stored values double, the masks do not: s*b*h*66 + 9*a*s^2*b.
    recompute='selective' (attention core recomputed): the a*s^2 term disappears.
    recompute='full': only the block input is stored: s*b*h*bytes_per_value.
    dropout=False drops the mask bytes (no masks are stored when p = 0)."""
    s, b, h, a = seq_len, batch, cfg.n_embd, cfg.n_head
    if recompute == "full":
        return s * b * h * bytes_per_value
    per_sbh = 16 * bytes_per_value + 2 * int(dropout)
    per_as2b = 0 if recompute == "selective" else 2 * bytes_per_value + int(dropout)
    return s * b * h * per_sbh + a * s * s * b * per_as2b
