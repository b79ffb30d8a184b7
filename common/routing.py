"""
routing.py: how a mixture-of-experts block (model.MoE, its experts local or train_ep.ExpertParallelExperts) sends
tokens to experts and keeps the experts' load balanced. Plain single-device torch; the parallel scripts only choose
which ranks' statistics are summed (`end_moe_step`'s reduce).

Routing: softmax over the E router logits, each token to its top_k experts; dropless unless capacity_factor > 0.

Load balancing, the Switch Transformer loss (Fedus et al. 2021):

    aux = E * sum_e f_e * P_e      f_e  share of the routed assignments that went to expert e (counted: no gradient)
                                   P_e  mean router probability of expert e over the same tokens
    objective = cross-entropy + aux_loss_coef * (sum of aux over the MoE blocks)

aux is 1 when the load is uniform and grows as it concentrates; its gradient moves probability away from the
experts that got more than their share. Over which tokens f and P are taken (--aux_loss_scope) is a choice of
objective, not an implementation detail:

  micro   f and P over one forward's tokens (one micro-batch on one rank): the classic implementation. The
          objective then changes with the micro-batch size and the data-parallel layout, and a micro-batch of a
          few sequences forces every sequence to spread over all experts.
  global  f and P over the whole global batch (every micro-batch on every data-parallel rank): Qiu et al. 2025
          ("Demons in the Detail") report better perplexity and experts that specialise by domain. The same
          objective in every layout. Cost: one all-reduce of 2E+2 numbers per MoE block per step.

The catch in `global` is gradient accumulation: f over the global batch is known only after the last micro-batch's
forward, and by then the first micro-batches' backward has run (1F1B, or any accumulation loop). Only keeping
every micro-batch's graph (the whole batch's activations) or a second forward pass could use it. So `global`
takes f from the previous step's global batch. f enters without gradient, so d objective / d p_t[e] =
coef * E * f_e / N for every token t of the N in the global batch: one constant vector per block, which
BalanceGradient adds to the router probabilities' gradient in every micro-batch (exact under any split). The
first step has no previous f: its balancing gradient is 0, as for a uniform f (sum_e P_e = 1 has no gradient).
The logged `aux_loss` is E * sum_e f_e P_e of the step's own global batch.
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
    """Identity on the router probabilities [N, E]; backward adds `per_token` [E] to every token's gradient:
    the gradient of coef * E * sum_e f_e * P_e with f held constant (P_e = sum_t p_t[e] / tokens)."""

    @staticmethod
    def forward(ctx, probs, per_token):
        ctx.save_for_backward(per_token)
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad):
        (per_token,) = ctx.saved_tensors
        return grad + per_token.to(grad.dtype), None


def count_per_expert(expert, n_bins):
    """[n_bins] how many entries of `expert` name each bin: a scatter-add into zeros. (torch.bincount would size
    its output from expert's max, which CUDA reads back to the host: a sync in every MoE block.)"""
    return torch.zeros(n_bins, dtype=torch.long, device=expert.device).scatter_add_(0, expert, torch.ones_like(expert))


def route(logits, top_k, capacity_factor=0.0, balance=None):
    """Top-k softmax routing of N tokens ([N, E] router logits) and which assignments an expert keeps.
    balance(counts) -> [E]: the load-balancing gradient per token (see BalanceGradient), or None.

    Every shape here is known before the GPU runs (N*k assignments, dropped or not): nothing is read back to the
    host. An assignment over its expert's capacity keeps its place with expert E, a bin past the last expert
    that sorts after every expert's rows and whose rows no expert runs (model.Experts: zeros)."""
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


def switch_aux_loss(stats, top_k):
    """E * sum_e f_e * P_e from summed statistics rows [..., 2E + 2] (Routing.stats): one value per row."""
    E = (stats.shape[-1] - 2) // 2
    counts, prob_sum, n_tokens = stats[..., :E], stats[..., E:2 * E], stats[..., -1:]
    return E * (counts / (n_tokens * top_k) * prob_sum / n_tokens).sum(-1)


def moe_blocks(model):
    """The MoE layers of a model or a pipeline stage (anything with a router and a load)."""
    return [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "load")]


def start_moe_training(model, tokens_per_step):
    """Tell every MoE layer over how many tokens this rank's loss is averaged in one optimizer step (micro-batch
    tokens x accumulation steps, before any tensor-parallel split): the balancing gradient is scaled by it."""
    for m in moe_blocks(model):
        m.tokens_per_step = tokens_per_step


@torch.no_grad()
def end_moe_step(model, reduce=None):
    """After an optimizer step: sum each MoE layer's statistics over the step's forwards (already in m.stats)
    and, with `reduce`, over the ranks that routed the other parts of the global batch; keep the global share
    of assignments per expert as the next step's load (--aux_loss_scope global); return the stacked per-layer
    statistics [layers, 2E + 2] (empty for a dense model) and reset them."""
    layers = moe_blocks(model)
    if not layers or layers[0].stats is None:
        return torch.zeros(0, 0, dtype=torch.float64)
    stats = torch.stack([m.stats for m in layers])
    if reduce is not None:
        reduce(stats)
    E = layers[0].load.numel()
    for m, row in zip(layers, stats):
        m.load.copy_(row[:E] / row[:E].sum())
        m.stats = None
    return stats


def router_metrics(stats, top_k):
    """metrics.jsonl's router fields from end_moe_step's statistics of every MoE layer: tokens per expert
    (min / max over layers and experts), dropped assignments, and the mean over layers of the global-batch aux."""
    if stats.numel() == 0:
        return {}
    E = (stats.shape[-1] - 2) // 2
    return dict(tokens_per_expert_min=int(stats[:, :E].min()), tokens_per_expert_max=int(stats[:, :E].max()),
                dropped_tokens=int(stats[:, -2].sum()), aux_loss=float(switch_aux_loss(stats, top_k).mean()))
