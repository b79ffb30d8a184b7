"""
moe/layer.py: the mixture-of-experts block model.py's GPT uses in every moe_every-th block (the math it routes with
is moe/router.py's). Plain torch, like model.py.

    Experts   the E expert MLPs, called on all routed rows at once: the part expert parallelism replaces
    MoE       route each token to its top_k experts by a softmax router, run each expert on its rows, add the
              outputs back weighted by the gates: y = sum_k p_k(x) expert_k(x)

Dropless unless capacity_factor > 0 (an expert then keeps ceil(cf * tokens * top_k / E), first choices first). The
Switch loss aux_loss_coef * E * sum_e f_e P_e (f_e: share of assignments to e, P_e: mean router probability)
balances the experts through the router's gradient only; the `global` scope takes f from the previous step's
global batch (why: common/routing.py, docs/moe.md).
"""
import torch
import torch.nn as nn

from moe.router import combine, count_per_expert, route


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
    rows, scatter back weighted by the gates. model.Block passes Experts of its MLPs; train_ep.py passes experts
    that run on the ranks owning them."""

    def __init__(self, cfg, experts):
        super().__init__()
        self.top_k, self.capacity_factor, self.renormalize = cfg.top_k, cfg.capacity_factor, cfg.router_renorm
        self.aux_loss_coef, self.aux_loss_scope = cfg.aux_loss_coef, cfg.aux_loss_scope
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = experts                       # Experts of model.MLPs, or train_ep's ExpertParallelExperts
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
        r = self.routing = route(self.router(tokens), self.top_k, self.capacity_factor, self.balance_gradient,
                                 self.renormalize)
        order = torch.argsort(r.expert, stable=True)                 # rows of expert 0, then 1, ..., dropped
        out = self.experts(tokens[r.token[order]], r.expert[order])
        return combine(tokens.shape[0], r.token[order], r.gate[order], out).view(x.shape)
