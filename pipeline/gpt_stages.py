"""
pipeline/gpt_stages.py: model.py's GPT cut into pipeline stages, for train_pp.py and train_5d.py: views that keep
the GPT's parameter names (its own modules, not copies), built on the meta device so a rank materializes only its
own stages, and the sampler that generates text through the pipeline. A model that is a plain chain of modules
uses pipeline/stages.py instead (docs/copy_out.md).

    chunks = build_stages(gcfg, rank, p, v, seed, device)     # this rank's v stages, train_single's initial values

Stage s of S = p*V holds blocks layer_split(L, S)[s] (pipeline/stages.py); stage 0 also embeds, stage S-1 also
applies ln_f and the LM head with its loss, and holds the tied embedding too (pipeline/tied.py).
"""
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as recompute

from pipeline.stages import stages_of_rank


class StageBlocks(nn.ModuleDict):
    """A stage's blocks keyed by their index in the whole model (parameter names stay transformer.h.5.attn...),
    iterated in order like GPT's ModuleList: code written for a GPT's blocks (train_tp.apply_tp, train_cp's
    attention swap, kernels) runs on a stage unchanged."""

    def __iter__(self):
        return iter(self.values())


class PipelineStage(nn.Module):
    """A view of blocks `layers` of a GPT (its own modules, not copies); the first stage embeds tokens, the
    last one applies ln_f and the LM head and returns the mean loss. Parameter names are the GPT's. The last
    stage holds the tied embedding too (as transformer.wte): on another rank than the first stage it is a
    copy, kept equal by tied_grads_sync."""

    def __init__(self, gpt, layers, first, last):
        super().__init__()
        self.cfg, self.first, self.last = gpt.cfg, first, last
        self.pos = None                          # global positions of this rank's tokens (CP); None: 0..T-1
        self.transformer = nn.ModuleDict()
        if first or (last and gpt.cfg.tied):      # untied: the last stage's LM head has a weight of its own
            self.transformer["wte"] = gpt.transformer.wte
        if first:
            self.transformer["drop"] = gpt.transformer.drop
        self.transformer["h"] = StageBlocks({str(i): gpt.transformer.h[i] for i in layers})
        if last:
            self.transformer["ln_f"] = gpt.transformer.ln_f
            self.lm_head = gpt.lm_head

    @property
    def tied(self):
        """The tied embedding / LM-head weight where this stage holds it (pipeline/tied.py)."""
        return [self.transformer["wte"].weight] if "wte" in self.transformer and self.cfg.tied else []

    def body(self, x):
        """Token ids [b, T] (first stage) or the previous stage's activations [b, T, h] -> [b, T, h]."""
        from model import collect_routing_stats, rope_of
        # RoPE needs only global positions: every stage rebuilds the same small table
        pos = torch.arange(x.shape[1], device=x.device) if self.pos is None else self.pos
        rope = rope_of(self.cfg, pos, next(self.parameters()).dtype)
        if self.first:
            x = self.transformer["drop"](self.transformer["wte"](x))
        for block in self.transformer["h"]:
            full = self.cfg.recompute == "full" and self.training
            x = recompute(block, x, rope, use_reentrant=False) if full else block(x, rope)
        if self.training:
            collect_routing_stats(self.transformer["h"])     # MoE blocks: this forward's routing, counted once
        return x

    def forward(self, x, targets=None):
        """The activations for the next stage, or on the last stage the mean loss over the micro-batch (without
        targets: the logits of the last position, [b, padded vocab], what sampling needs)."""
        x = self.body(x)
        if not self.last:
            return x
        if targets is None:
            return self.lm_head(self.transformer["ln_f"](x[:, -1]))[0]
        return self.lm_head(self.transformer["ln_f"](x), targets)[1]


def stage_views(gpt, rank, p, v, placement="loop"):
    """This rank's V chunks (stages rank, rank+p, ...; in a V rank and 2p-1-rank) of `gpt`: PipelineStage views."""
    return nn.ModuleList([PipelineStage(gpt, layers, first, last)
                          for _, layers, first, last in stages_of_rank(gpt.cfg.n_layer, rank, p, v, placement)])


def build_stages(gcfg, rank, p, v, seed, device, dtype=torch.float32, placement="loop"):
    """This rank's V chunks of a GPT built on the meta device: only their parameters get memory, each filled
    from model.init_parameter (the same values as train_single's), in dtype."""
    from common.model_setup import materialize
    from model import GPT, init_weights
    with torch.device("meta"):
        gpt = GPT(gcfg, seed=seed)
    chunks = materialize(stage_views(gpt, rank, p, v, placement), device, dtype)
    for chunk in chunks:
        init_weights(chunk, seed)                # by name: a stage's names are the GPT's
    return chunks


class PipelineSampler:
    """model.py's generate through the pipeline (runner: train_pp.PipelineRunner): every token is one forward of
    all stages in order, its logits broadcast from the last stage, so that every rank draws the same token with the
    same seed."""

    def __init__(self, runner, chunks, gcfg):
        self.runner, self.chunks, self.cfg = runner, chunks, gcfg

    def eval(self):
        self.chunks.eval()

    def next_logits(self, ids):
        b, t = ids.shape
        return self.runner.forward_only(ids, None, (b, self.cfg.padded_vocab_size), (b, t, self.cfg.n_embd))

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        from model import generate
        return generate(self.next_logits, idx, max_new_tokens, self.cfg, temperature, top_k)
