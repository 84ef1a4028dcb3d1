"""Outputs of several batches joined along the batch dimension, padded to the longest where their shapes differ.

Batches padded each to their own longest row (the usual collate of variable-length sequences) give outputs of
different lengths: a per-token embedding is ``(4, 12, 8)`` in one batch and ``(4, 30, 8)`` in the next. Joining
them pads every mismatched dimension to the longest with ``padding_value`` (-100 by default, as the Hugging Face
``Trainer``'s ``nested_concat``), then concatenates along dim 0. ``NNHandler.predict`` (one process and the shards
the ranks gather under DDP) and the inference engine (``parallel_predict`` in memory) share this one helper.

A leaf position that holds no tensor (a scalar left out, a None) stays None.

Example:
    >>> import torch
    >>> short, long = torch.ones(2, 3), torch.full((1, 5), 2.0)
    >>> pad_concat([short, long], -100)
    tensor([[   1.,    1.,    1., -100., -100.],
            [   1.,    1.,    1., -100., -100.],
            [   2.,    2.,    2.,    2.,    2.]])
    >>> pad_concat([(short, {"n": torch.zeros(2)}), (long, {"n": torch.ones(1)})])[1]
    {'n': tensor([0., 0., 1.])}
"""

from __future__ import annotations

from typing import Any

import torch

from ._tree import combine

__all__ = ["pad_concat", "pad_cat", "PADDING_VALUE"]

PADDING_VALUE = -100  # the Hugging Face Trainer's, and NNHandler.predict's default


def pad_concat(chunks: list, padding_value: float = PADDING_VALUE) -> Any:
    """The chunks' outputs (trees of one structure) joined along dim 0, padded to the longest where they differ."""
    return combine(chunks, lambda leaves: pad_cat(leaves, padding_value))


def pad_cat(leaves: list, padding_value: float = PADDING_VALUE) -> torch.Tensor | None:
    """``torch.cat(leaves)``, each first padded to the longest along every dimension but 0; None if not tensors.

    Example:
        >>> import torch
        >>> pad_cat([torch.zeros(1, 2), torch.ones(1, 1)], padding_value=9).tolist()
        [[0.0, 0.0], [1.0, 9.0]]
    """
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        return None  # a scalar or a dropped entry: None in every batch
    dims = {t.dim() for t in leaves}
    if len(dims) > 1:
        raise ValueError(f"predict() cannot concatenate outputs with {sorted(dims)} dimensions: the model "
                         f"returned tensors of different ranks for the same output in different batches")
    shape = [max(sizes) for sizes in zip(*(t.shape[1:] for t in leaves))]
    if all(list(t.shape[1:]) == shape for t in leaves):
        return torch.cat(leaves)
    padded = []
    for t in leaves:
        out = t.new_full((t.shape[0], *shape), padding_value)
        out[(slice(None), *(slice(0, size) for size in t.shape[1:]))] = t
        padded.append(out)
    return torch.cat(padded)
