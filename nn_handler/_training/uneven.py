"""Uneven training data across ranks: found out before it becomes a collective mismatch.

Every rank must run the same number of DDP steps in an epoch: a rank whose
data ends first goes on to the epoch's all-reduce while the others wait in a
gradient all-reduce, and gloo aborts the job ("Is there a distributed
collective mismatch?") or NCCL hangs. NNHandler raises a
:class:`~nn_handler.ConfigurationError` instead, on every rank at the same
step, naming the ranks that ran out and after how many batches. It does not
train the longer shards on alone (DDP's ``Join``): that silently weights the
ranks' data unequally and costs a collective per step on every run.

What it costs depends on what the loader can promise:

- a map-style dataset under a ``DistributedSampler`` (what NNHandler builds
  from a Dataset or tensors): even by construction, nothing is checked;
- another sized loader (a custom sampler or batch sampler): ``len(loader)``
  is exact, so the ranks compare it once per epoch (one small all-reduce);
- an ``IterableDataset`` (its ``__len__``, if any, is a hint torch does not
  enforce) or a loader without a length: the ranks agree on "one more
  batch?" at every step. The loop fetches the next batch and starts that
  all-reduce, on the side gloo group, before it trains the current one, and
  waits for it only at the next step, so the round trip overlaps the step's
  work instead of adding to it.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from ..errors import ConfigurationError
from ..utils._collectives import check_collective_allowed, side_group
from ..utils._stall import watching

_END = object()


def check_mode(loader: DataLoader, n_batches: int | None) -> str | None:
    """``None`` (even by construction), ``"length"`` (compare ``len`` once) or ``"step"`` (agree every step)."""
    if n_batches is None or isinstance(getattr(loader, "dataset", None), IterableDataset):
        return "step"
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)
    return None if isinstance(sampler, DistributedSampler) else "length"


def check_lengths(n_batches: int, epoch: int) -> None:
    """Every rank's ``len(loader)`` in one all-reduce; raise on every rank when they differ."""
    side = side_group()
    check_collective_allowed("NNHandler.train")
    counts = torch.zeros(side.size, dtype=torch.int64)
    counts[side.rank] = n_batches
    with watching("all_reduce (training batches per rank)"):
        dist.all_reduce(counts, group=side.group)
    counts = counts.tolist()
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise ConfigurationError(
            f"the training loader gives the ranks different numbers of batches in epoch {epoch} ({per_rank}); "
            f"every rank must take the same number of optimizer steps: {_REMEDY}")


def agreed(batches: Iterable[Any], first: int, epoch: int) -> Iterator[Any]:
    """``batches`` while every rank has one more; on every rank a ConfigurationError when only some have.

    ``first``: how many batches of the epoch were trained before (a resumed epoch).
    """
    side = side_group()
    check_collective_allowed("NNHandler.train")
    it = iter(batches)
    counts = torch.zeros(side.size, dtype=torch.int64)

    def ask() -> tuple[Any, Any]:
        batch = next(it, _END)
        counts.zero_()
        counts[side.rank] = batch is not _END
        return batch, dist.all_reduce(counts, group=side.group, async_op=True)

    batch, work = ask()
    seen = first
    while True:
        with watching("all_reduce (one more training batch?)"):
            work.wait()
        have = counts.tolist()
        if not any(have):
            return
        if not all(have):
            out = [r for r, h in enumerate(have) if not h]
            more = [r for r, h in enumerate(have) if h]
            raise ConfigurationError(
                f"the training data gave the ranks different numbers of batches in epoch {epoch}: "
                f"{_ranks(out)} ran out after {seen} batches, {_ranks(more)} had more; every rank must take "
                f"the same number of optimizer steps: {_REMEDY}")
        current = batch
        batch, work = ask()  # answered while the current batch trains
        seen += 1
        yield current


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


_REMEDY = ("make each rank's shard yield the same number of batches (split the stream evenly, drop the remainder), "
           "or pass a map-style Dataset, which NNHandler shards evenly with a DistributedSampler")
