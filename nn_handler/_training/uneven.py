"""Uneven training (and sharded evaluation) data across ranks: found out before it becomes a collective mismatch.

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
  enforce) or a loader without a length: the ranks fetch :data:`WINDOW`
  batches ahead and agree on how many each holds, one all-reduce (side gloo
  group) per window, started when the window is fetched and waited for when
  the previous window is trained, so its round trip overlaps training.
  On the overhead-bound benchmark model (benchmarks/bench_uneven.py, 2 gloo
  ranks on a loaded 2-core machine, median of per-round ratios against no
  check): a blocking agreement every step 0.68x, an overlapped one every
  step 0.88x, one per window of 8 (shipped) 0.93x; a real model's longer
  steps hide more of it.

Evaluation needs the same under ``strategy="fsdp"`` only: a sharded
forward is a collective, so every rank runs the forward of every batch
together (:func:`even_batches`); under DDP each rank evaluates its batches
alone.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from ..errors import ConfigurationError
from ..utils._collectives import check_collective_allowed, side_group
from ..utils._stall import watching

_END = object()

#: Batches per agreement on an unsized or iterable loader: one all-reduce per this many steps.
WINDOW = 8


def check_mode(loader: DataLoader, n_batches: int | None) -> str | None:
    """``None`` (even by construction), ``"length"`` (compare ``len`` once) or ``"step"`` (agree every step)."""
    if n_batches is None or isinstance(getattr(loader, "dataset", None), IterableDataset):
        return "step"
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)
    return None if isinstance(sampler, DistributedSampler) else "length"


def check_lengths(n_batches: int, epoch: int | None, purpose: str = "training") -> None:
    """Every rank's ``len(loader)`` in one all-reduce; raise on every rank when they differ.

    ``purpose``: ``"training"``, or ``"evaluation"`` (``epoch`` None outside training).
    """
    side = side_group()
    check_collective_allowed(_CALLER[purpose])
    counts = torch.zeros(side.size, dtype=torch.int64)
    counts[side.rank] = n_batches
    with watching(f"all_reduce ({purpose} batches per rank)"):
        dist.all_reduce(counts, group=side.group)
    counts = counts.tolist()
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise ConfigurationError(
            f"the {purpose} loader gives the ranks different numbers of batches{_in(epoch)} ({per_rank}); "
            f"{_WHY[purpose]}: {_REMEDY}")


def agreed(batches: Iterable[Any], first: int, epoch: int | None, window: int | None = None,
           purpose: str = "training") -> Iterator[Any]:
    """``batches`` while every rank has them; on every rank a ConfigurationError once only some have more.

    The ranks agree on how many batches each holds, ``window`` at a time (one
    all-reduce per window), and train the ones all hold. The next window is
    fetched and its all-reduce started as the current one begins training, so
    the round trip runs while it trains; at most ``2 * window`` batches are
    held at once. ``first``: batches of the epoch trained before (a resumed epoch).
    """
    window = WINDOW if window is None else window
    side = side_group()
    check_collective_allowed(_CALLER[purpose])
    it = iter(batches)
    counts = torch.zeros(side.size, dtype=torch.int64)
    ready: deque = deque()  # every rank holds these
    pending: deque = deque()  # fetched, not agreed on yet
    exhausted = False
    seen = first

    def fetch_and_ask():
        nonlocal exhausted
        while not exhausted and len(pending) < window:
            batch = next(it, _END)
            if batch is _END:
                exhausted = True
            else:
                pending.append(batch)
        counts.zero_()
        counts[side.rank] = len(pending)
        return dist.all_reduce(counts, group=side.group, async_op=True)

    work = fetch_and_ask()
    while True:
        with watching(f"all_reduce ({purpose} batches held per rank)"):
            work.wait()
        held = counts.tolist()
        common = min(held)
        ready.extend(pending.popleft() for _ in range(common))
        if max(held) > common:  # some rank has batches another does not: train the common ones, then stop
            while ready:
                seen += 1
                yield ready.popleft()
            out = [r for r, n in enumerate(held) if n == common]
            more = [r for r, n in enumerate(held) if n > common]
            raise ConfigurationError(
                f"the {purpose} data gave the ranks different numbers of batches{_in(epoch)}: "
                f"{_ranks(out)} ran out after {seen} batches, {_ranks(more)} had more; {_WHY[purpose]}: "
                f"{_REMEDY}")
        if common == 0:
            return
        work = fetch_and_ask()  # answered while the ready batches train
        while ready:
            seen += 1
            yield ready.popleft()


def even_batches(loader: DataLoader) -> Iterable[Any]:
    """``loader``'s batches for a sharded evaluation, where every rank must run the forward on every batch.

    Uneven data raises a ConfigurationError on every rank (checked as for
    training) instead of leaving one rank alone in a sharded forward.
    """
    try:
        n_batches = len(loader)
    except TypeError:  # an IterableDataset without __len__
        n_batches = None
    mode = check_mode(loader, n_batches)
    if mode == "length":
        check_lengths(n_batches, None, "evaluation")
    return agreed(loader, 0, None, purpose="evaluation") if mode == "step" else loader


def _in(epoch: int | None) -> str:
    return "" if epoch is None else f" in epoch {epoch}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


_CALLER = {"training": "NNHandler.train", "evaluation": "NNHandler.evaluate"}
_WHY = {"training": "every rank must take the same number of optimizer steps",
        "evaluation": "under strategy='fsdp' every rank runs the sharded forward of every batch together"}
_REMEDY = ("make each rank's shard yield the same number of batches (split the stream evenly, drop the remainder), "
           "or pass a map-style Dataset, which NNHandler shards evenly with a DistributedSampler")
