"""Forming inference batches (nn_handler._inference.batching) and reading the input (sources), without processes."""

import random

import pytest
import torch
from torch.utils.data import IterableDataset

from nn_handler._inference.batching import fixed_batches, token_batches
from nn_handler._inference.engine import assemble, split_items, trim
from nn_handler._inference.sources import Source, fingerprint


def test_token_batches_never_exceed_the_budget_and_cover_every_item_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(500)] + [80, 75]  # two items longer than the budget
    batches = list(token_batches(enumerate(lengths), max_tokens=64, length=lambda n: n, window=100))
    assert sorted(i for b in batches for i in b.indices) == list(range(len(lengths)))
    for b in batches:
        assert max(b.lengths) * len(b) <= 64 or len(b) == 1
        assert b.samples == b.lengths == [lengths[i] for i in b.indices]
    assert {tuple(b.indices) for b in batches if max(b.lengths) > 64} == {(500,), (501,)}
    # Each window is sorted on its own: no batch mixes items of two windows.
    assert all(len({i // 100 for i in b.indices}) == 1 for b in batches)
    capped = list(token_batches(enumerate([1] * 10), max_tokens=64, length=lambda n: n, batch_size=4))
    assert [len(b) for b in capped] == [4, 4, 2]


def test_fixed_batches_keep_input_order_and_the_items_left_out():
    batches = list(fixed_batches(((i, str(i)) for i in range(10) if i not in (3, 4)), batch_size=3, length=len))
    assert [b.indices for b in batches] == [[0, 1, 2], [5, 6, 7], [8, 9]] and batches[0].lengths == [1, 1, 1]
    assert [h.indices for h in batches[0].halves()] == [[0], [1, 2]]


def test_a_bad_length_is_named_with_its_item():
    with pytest.raises(TypeError, match="length.sample. must return an int, got str for item 1"):
        list(token_batches(enumerate([1, "x"]), 8, length=lambda s: s))


class _Stream(IterableDataset):
    def __iter__(self):
        return iter([torch.full((2,), float(i)) for i in range(5)])


def test_an_iterable_is_read_once_without_its_length_and_skips_the_done_items():
    source = Source.of(_Stream())
    assert source.n_items is None and fingerprint(source.head()) == fingerprint(list(_Stream())[:3])
    assert [i for i, _ in source.items(done=lambda i: i < 2)] == [2, 3, 4]
    tail_done = Source.of(iter(range(5)))
    assert [i for i, _ in tail_done.items(done=lambda i: i >= 3)] == [0, 1, 2] and tail_done.read == 5


def test_per_item_outputs_are_split_and_trimmed_and_assembled_in_input_order():
    out = {"tokens": torch.arange(24.0).reshape(2, 4, 3), "pooled": torch.ones(2, 4)}
    first, second = split_items(out, 2)
    assert trim(first, 2, 4)["tokens"].shape == (2, 3) and trim(first, 2, 4)["pooled"].shape == (4,)
    with pytest.raises(ValueError, match="the batch's 3 items along dim 0, got a tensor of shape \\(2, 4\\)"):
        split_items(out["pooled"], 3)
    parts = [([2, 0], torch.tensor([[20.0], [0.0]]), False), ([1], torch.tensor([[1.0, 1.0]]), False)]
    assert assemble(parts, -100).tolist() == [[0.0, -100.0], [1.0, 1.0], [20.0, -100.0]]
    assert assemble([([1, 0], ["b", "a"], True)], -100) == ["a", "b"]
