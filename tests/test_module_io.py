"""
common/module_io.py on one process: ties found by identity and kept (or refused, by name) across a module swap;
hooks that reach a module's first input passed by keyword and its first output inside a tuple.
"""
import pytest
import torch
import torch.nn as nn

from common.module_io import on_first_input, on_first_output, shared_parameters, swap_keeping_ties


class Tied(nn.Module):
    """An embedding and a head that share one weight, as transformers' tie_word_embeddings does."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_ties_are_found_by_identity():
    model = Tied()
    assert shared_parameters(model) == {model.embed.weight: [("embed", "weight"), ("head", "weight")]}
    assert shared_parameters(nn.Linear(2, 2)) == {}


def test_a_swap_of_every_holder_keeps_the_tie():
    model = Tied()
    swap_keeping_ties(model, {"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    assert model.head.weight is model.embed.weight


def test_a_swap_that_would_cut_a_tie_names_it_and_changes_nothing():
    model = Tied()
    old = model.embed
    with pytest.raises(ValueError, match=r"embed\.weight and head\.weight are one tied parameter.*not swapped: "
                                         r"head\.weight"):
        swap_keeping_ties(model, {"embed": nn.Embedding(8, 4)})
    assert model.embed is old
    with pytest.raises(ValueError, match="split them differently"):
        swap_keeping_ties(model, {"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 4, bias=False)})


class KeywordTuple(nn.Module):
    """Called as transformers calls its attention: hidden_states by keyword, returning (output, weights)."""

    def forward(self, hidden_states, scale=1.0):
        return hidden_states * scale, None


def test_hooks_reach_a_keyword_input_and_a_tuple_output():
    module = KeywordTuple()
    on_first_input(module, lambda x: x + 1)
    on_first_output(module, lambda y: y * 10)
    x = torch.ones(2)
    assert torch.equal(module(hidden_states=x, scale=2.0)[0], torch.full((2,), 40.0))
    assert torch.equal(module(x)[0], torch.full((2,), 20.0))
    assert module(x)[1] is None
