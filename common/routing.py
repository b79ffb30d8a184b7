"""
routing.py: the training loop's side of a mixture of experts: keeping the experts' load balanced over an optimizer
step, and the router metrics of metrics.jsonl. A block's forward (model.MoE, its experts local or
train_ep.ExpertParallelExperts) routes in model.py: softmax over the E router logits, each token to its top_k
experts, dropless unless capacity_factor > 0 (model.route), the balancing gradient added by model.BalanceGradient,
each forward's statistics summed into the block's `stats` (model.collect_routing_stats). Here: which MoE blocks a
model has, over how many tokens a step's loss is averaged, the step's end (statistics summed, the next step's f),
and what is logged. Plain single-device torch; the parallel scripts only choose which ranks' statistics are summed
(`end_moe_step`'s reduce).

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
model.BalanceGradient adds to the router probabilities' gradient in every micro-batch (exact under any split). The
first step has no previous f: its balancing gradient is 0, as for a uniform f (sum_e P_e = 1 has no gradient).
The logged `aux_loss` is E * sum_e f_e P_e of the step's own global batch.
"""
import torch


def switch_aux_loss(stats, top_k):
    """E * sum_e f_e * P_e from summed statistics rows [..., 2E + 2] (model.Routing.stats): one value per row."""
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
