"""Forming batches: a fixed ``batch_size``, or ``max_tokens`` budgets over length-sorted windows.

The input arrives as ``(index, sample)`` pairs in input order (an index is the sample's position in the input),
possibly with the done ones of a resumed run left out. :func:`fixed_batches` cuts it into consecutive runs of
``batch_size``. :func:`token_batches` reads :data:`SORT_WINDOW` items at a time, sorts them by ``length`` and
cuts the sorted run so that a batch's padded size, its longest item times its item count, stays within
``max_tokens`` (fair-esm's ``toks_per_batch``); an item longer than the budget is a batch of its own. Only one
window is held at a time, so an endless iterable is batched in bounded memory.

A :class:`Batch` holds its items' indices and samples (and lengths, when a ``length`` function is given).

Example:
    >>> items = enumerate(["aaaa", "b", "cc", "ddd", "e"])
    >>> [b.indices for b in token_batches(items, max_tokens=4, length=len)]   # lengths 1, 1 | 2 | 3 | 4
    [[1, 4], [2], [3], [0]]
    >>> [b.indices for b in fixed_batches(enumerate("abcde"), batch_size=2)]
    [[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterable, Iterator

__all__ = ["Batch", "SORT_WINDOW", "fixed_batches", "token_batches", "describe"]

#: Items read, sorted by length and cut into token-budget batches together. Larger windows pad less (items of
#: like lengths meet more often) and hold more samples in the caller's memory at once. On benchmarks/
#: bench_inference.py's lengths (log-normal, median 128, up to 512; max_tokens=16,384) 8,192 pads 2.1 % of the
#: tokens, 4,096 pads 3.4 %.
SORT_WINDOW = 8192


@dataclasses.dataclass
class Batch:
    """One batch's items: their positions in the input, their samples, and their lengths (``None`` without)."""

    indices: list[int]
    samples: Any  # a list of samples, or a tensor already batched (rows of a tensor input)
    lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def halves(self) -> tuple["Batch", "Batch"]:
        """The batch split into two (for a retry after running out of memory)."""
        k = len(self.indices) // 2
        cut = (lambda part: part[:k]), (lambda part: part[k:])
        return tuple(Batch(c(self.indices), c(self.samples), None if self.lengths is None else c(self.lengths))
                     for c in cut)  # type: ignore[return-value]


def fixed_batches(items: Iterable[tuple[int, Any]], batch_size: int,
                  length: Callable[[Any], int] | None = None) -> Iterator[Batch]:
    """Consecutive batches of ``batch_size`` items (the last may be shorter), in input order."""
    items = iter(items)
    while chunk := list(itertools.islice(items, batch_size)):
        indices = [i for i, _ in chunk]
        samples = [s for _, s in chunk]
        yield Batch(indices, samples, None if length is None else [_length(length, s, i) for i, s in chunk])


def token_batches(items: Iterable[tuple[int, Any]], max_tokens: int, length: Callable[[Any], int],
                  batch_size: int | None = None, window: int = SORT_WINDOW) -> Iterator[Batch]:
    """Batches whose longest item times their item count is at most ``max_tokens`` (and at most ``batch_size``
    items when given), formed over length-sorted windows of ``window`` items.

    Example:
        >>> [b.lengths for b in token_batches(enumerate([[0] * n for n in (5, 1, 9, 2, 2)]), max_tokens=4, length=len)]
        [[1, 2], [2], [5], [9]]
    """
    items = iter(items)
    while chunk := list(itertools.islice(items, window)):
        measured = sorted(((_length(length, s, i), i, s) for i, s in chunk), key=lambda t: t[0])  # stable
        batch: list[tuple[int, int, Any]] = []
        for entry in measured:
            # Sorted ascending: the new item is the longest, so the padded size is its length times the count.
            full = batch_size is not None and len(batch) >= batch_size
            if batch and (full or entry[0] * (len(batch) + 1) > max_tokens):
                yield _batch(batch)
                batch = []
            batch.append(entry)
        if batch:
            yield _batch(batch)


def _batch(entries: list[tuple[int, int, Any]]) -> Batch:
    return Batch([i for _, i, _ in entries], [s for _, _, s in entries], [n for n, _, _ in entries])


def _length(length: Callable[[Any], int], sample: Any, index: int) -> int:
    n = length(sample)
    if isinstance(n, bool) or not isinstance(n, int):
        try:
            n = int(n.__index__())  # a numpy or 0-d tensor integer
        except (AttributeError, TypeError):
            raise TypeError(f"length(sample) must return an int, got {type(n).__name__} for item {index}") from None
    if n < 0:
        raise ValueError(f"length(sample) must be >= 0, got {n} for item {index}")
    return n


def describe(indices: list[int]) -> str:
    """The items of a batch in a few words: ``"items 40-47"``, or a few of them when they are not consecutive.

    Example:
        >>> describe([3, 4, 5]), describe([7]), describe([9, 2, 30])
        ('items 3-5', 'item 7', 'items 2, 9, 30 (3 items)')
    """
    if len(indices) == 1:
        return f"item {indices[0]}"
    ordered = sorted(indices)
    if ordered[-1] - ordered[0] + 1 == len(ordered):
        return f"items {ordered[0]}-{ordered[-1]}"
    shown = ", ".join(map(str, ordered[:8])) + (", ..." if len(ordered) > 8 else "")
    return f"items {shown} ({len(ordered)} items)"
