"""Models and data of the training-promise tests, in one process and on 2 ranks (as ``scripts.promises_case``).

- :class:`Tagger` on :func:`token_samples` with :func:`pad_each_batch`: a token model whose batches a collate
  pads each to its own longest row (the usual Hugging Face set-up), returning a plain tuple.
- :class:`Named` on :func:`named_samples`: dict batches with ``labels`` and a per-sample list of names (what
  ``default_collate`` makes of a string field), for a model whose forward takes no ``labels``.
"""

from __future__ import annotations

import torch
from torch import nn

try:  # run as a script: tests/scripts is on sys.path
    from handler_case import make_data, make_model
except ImportError:  # imported by the tests as scripts.promises_case
    from scripts.handler_case import make_data, make_model

LENGTHS = [3, 5, 2, 7, 4, 6, 1]  # in batches of 3: padded to 5, 7 and 1


def token_samples() -> list[dict]:
    return [{"input_ids": torch.arange(1, n + 1)} for n in LENGTHS]


def pad_each_batch(batch: list[dict]) -> dict:
    """Every batch padded to its own longest row, with token 0."""
    longest = max(len(s["input_ids"]) for s in batch)
    return {"input_ids": torch.stack([nn.functional.pad(s["input_ids"], (0, longest - len(s["input_ids"])))
                                      for s in batch])}


class Tagger(nn.Module):
    """Per-token scores, as a plain tuple (``return_dict=False``): ``(scores, (hidden, first), loss)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 2)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        return hidden.sum(-1), (hidden, hidden[:, :1]), hidden.mean()


def named_samples(n: int, seed: int = 0) -> list[dict]:
    X, y = make_data(n, seed=seed)
    return [{"x": X[i], "labels": y[i], "name": f"sample-{i}"} for i in range(n)]


class Named(nn.Module):
    """Takes the inputs and their names, no ``labels``; checks that every sample has its name."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x, name):
        if len(name) != len(x):
            raise AssertionError(f"{len(name)} names for {len(x)} samples")
        return self.net(x)
