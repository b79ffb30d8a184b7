"""
moe/router.py: how model.py's mixture of experts assigns tokens to experts and adds their outputs back, the math
the MoE block (model.MoE) and expert parallelism (train_ep.py) share. Plain torch, like model.py.

    route     top-k of the router's softmax per token (Mixtral: the k gates renormalized to sum 1); an expert over
              its capacity (capacity_factor > 0) drops the assignments that queue last, first choices first
    Routing   the assignments, token-major, and their counts: what the Switch balancing loss and the metrics read
    BalanceGradient   the balancing loss's gradient, added to the router probabilities' (no loss term computed)
    combine   y[t] = sum over t's assignments of gate * expert output
    collect_routing_stats   a forward's routing added to each MoE block's step sums
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


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


def route(logits, top_k, capacity_factor=0.0, balance=None, renormalize=False):
    """Top-k softmax routing of N tokens ([N, E] router logits); balance(counts) -> [E]: the balancing gradient
    per token (BalanceGradient), or None; renormalize: a token's k gates divided by their sum (Mixtral). Over
    capacity, an assignment goes to expert E, which no expert runs."""
    N, E = logits.shape
    probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    expert = probs.topk(top_k, dim=-1).indices                    # [N, k], best first
    counts = count_per_expert(expert.reshape(-1), E)
    if balance is not None and probs.requires_grad:
        probs = BalanceGradient.apply(probs, balance(counts))
    gate = probs.gather(1, expert)
    if renormalize:
        gate = gate / gate.sum(-1, keepdim=True)
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


def collect_routing_stats(blocks):
    """Add each MoE block's last routing to its step sums. Called once per forward of the whole model (or
    pipeline stage), not in MoE.forward: a block recomputed in backward (--recompute full) counts once."""
    for m in (block.mlp for block in blocks):
        if getattr(m, "routing", None) is not None:
            m.stats = m.routing.stats() + (0 if m.stats is None else m.stats)
