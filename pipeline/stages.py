"""
pipeline/stages.py: a model cut into pipeline stages, contiguous runs of its blocks (train_pp.py's building blocks,
split out so the rung reads as its schedule interpreter; docs/copy_out.md). A stage module is what
train_pp.PipelineRunner runs: stage(input, targets) -> the activations, on the last stage the mean loss.

    stages = pipeline_stages([embed], blocks, [norm, head], rank, p, loss_fn=loss_fn)   # this rank's stages

Stage s of S = p*V holds blocks layer_split(L, S)[s]; stage s is chunk s // p of rank s % p, or in a V (zbv,
dualpipev) pipeline.schedules.rank_of(s). A weight that the first and the last stage share (a tied embedding
and LM head) is found by identity and listed in each holder's `tied` (pipeline/tied.py keeps its copies equal).
"""
import torch
import torch.nn as nn

from pipeline.schedules import stage_of



def layer_split(n_layer, n_stages):
    """Blocks of each stage; with an uneven split (--pp_uneven) the first n_layer % S stages get one more."""
    sizes = [n_layer // n_stages + (s < n_layer % n_stages) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def stages_of_rank(n_layer, rank, p, v=1, placement="loop"):
    """[(stage, its blocks, first?, last?)] of this rank's v chunks (stages rank, rank+p, ...; in a V rank and
    2p-1-rank), in chunk order."""
    S = p * v
    ranges = layer_split(n_layer, S)
    return [(s, ranges[s], s == 0, s == S - 1) for s in (stage_of(rank, c, p, placement) for c in range(v))]


class SequentialStage(nn.Module):
    """A pipeline stage of a model whose forward is a chain of modules (embedding, blocks, final norm, head):
    `layers` applied in order; the last stage returns loss_fn(output, targets), the mean over the micro-batch.
    block_kwargs(x): the keyword inputs each of the `n_blocks` blocks after the `n_before` first layers takes
    beside x (a Hugging Face decoder layer's position_embeddings and attention_mask), computed once a stage; a
    block returning a tuple passes on its first item. `tied`: the parameters it shares with another stage."""

    def __init__(self, layers, first, last, loss_fn=None, block_kwargs=None, n_before=0, n_blocks=0, tied=()):
        super().__init__()
        self.layers, self.first, self.last, self.loss_fn = nn.ModuleList(layers), first, last, loss_fn
        self.block_kwargs, self.blocks = block_kwargs, range(n_before, n_before + n_blocks)
        self.tied_at = [(m, key) for m in self.layers.modules() for key, p in m._parameters.items()
                        if any(p is q for q in tied)]

    @property
    def tied(self):
        """The shared parameters this stage holds, looked up now (a swap since, ZeRO's or TP's, is seen)."""
        return list({id(m._parameters[key]): m._parameters[key] for m, key in self.tied_at}.values())

    def forward(self, x, targets=None):
        kwargs = None
        for i, layer in enumerate(self.layers):
            if i in self.blocks and kwargs is None:
                kwargs = {} if self.block_kwargs is None else self.block_kwargs(x)
            out = layer(x, **kwargs) if i in self.blocks else layer(x)
            x = out if isinstance(out, torch.Tensor) else out[0]
        return self.loss_fn(x, targets) if self.last else x


def pipeline_stages(before, blocks, after, rank, p, v=1, placement="loop", loss_fn=None, block_kwargs=None):
    """This rank's stages of any model as SequentialStages (its own modules, not copies): the blocks cut by
    layer_split, `before` (embedding) on the first stage, `after` (final norm, LM head) and loss_fn on the last;
    block_kwargs: see SequentialStage. Parameters that `before` and `after` share (a tied embedding and head,
    found by identity) are each stage's `tied`: on two ranks, pipeline/tied.tied_grads_sync keeps them equal."""
    def params(modules):
        return [q for m in modules for q in m.parameters()]
    tied = [q for q in params(before) if any(q is r for r in params(after))]
    return nn.ModuleList([SequentialStage((list(before) if first else []) + [blocks[i] for i in layers]
                                          + (list(after) if last else []), first, last, loss_fn, block_kwargs,
                                          len(before) if first else 0, len(layers), tied)
                          for _, layers, first, last in stages_of_rank(len(blocks), rank, p, v, placement)])
