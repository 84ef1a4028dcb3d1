"""The input of an inference run, read in the caller as it goes: a tensor, a map-style data set, or any iterable.

Only batches travel to the workers: a map-style data set is read here (``num_workers`` threads ahead) and never
pickled whole, an iterable (a generator, an ``IterableDataset``, a file read line by line) is read once, without
needing its length. Items are numbered by their position in the input; a resumed run skips the done ones by
position (:meth:`Source.items`).

A cheap fingerprint of a few samples (:func:`fingerprint`) goes into the predictions directory's manifest, so a
rerun over other data is refused instead of mixing two runs' outputs.

Example:
    >>> import torch
    >>> src = Source.of(torch.arange(6.0).reshape(3, 2))
    >>> src.n_items, [i for i, _ in src.items(done=lambda i: i == 1)]
    (3, [0, 2])
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from ..errors import ConfigurationError

__all__ = ["Source", "fingerprint"]

# With loader threads, samples are read in chunks of this many, a few chunks per thread ahead.
_READ_CHUNK = 64


class Source:
    """What to read: ``data`` (a tensor, a map-style data set or an iterable), how many items (``None``: unknown
    until read), and the ``collate_fn`` that a ``DataLoader`` given as data brings."""

    def __init__(self, data: Any, n_items: int | None, collate_fn: Callable | None):
        self.data, self.n_items, self.collate_fn = data, n_items, collate_fn
        self._iterator: Iterator | None = None
        self._head: list = []
        self.read = 0  # items read by items() so far, the done ones included: an iterable's length at its end

    @classmethod
    def of(cls, data: Any) -> "Source":
        """The source for ``data``, checked: a clear error for what cannot be read.

        Raises:
            ConfigurationError: A 0-dimensional tensor.
            TypeError: Something that is neither a tensor, a data set, nor iterable.
        """
        collate_fn = None
        if isinstance(data, DataLoader):
            collate_fn, data = data.collate_fn, data.dataset
        if isinstance(data, torch.Tensor):
            if data.dim() == 0:
                raise ConfigurationError("data is a 0-dimensional tensor; parallel_predict splits data along dim 0")
            return cls(data.cpu(), data.shape[0], collate_fn)
        if isinstance(data, (str, bytes, dict)) or isinstance(data, collections.abc.Mapping):
            raise TypeError(f"data must be a tensor, a map-style Dataset (with __len__), a DataLoader, a list of "
                            f"samples or an iterable of them, got {type(data).__name__}")
        if not isinstance(data, IterableDataset) and isinstance(data, (Dataset, Sequence)):
            try:
                return cls(data, len(data), collate_fn)  # type: ignore[arg-type]  # (TypeError below)
            except TypeError:  # a Dataset without __len__: read it as an iterable
                pass
        if isinstance(data, Iterable):
            return cls(data, None, collate_fn)
        raise TypeError(f"data must be a tensor, a map-style Dataset (with __len__), a DataLoader, a list of samples "
                        f"or an iterable of them, got {type(data).__name__}")

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.data, torch.Tensor)

    def collate(self, collate_fn: Callable | None) -> Callable:
        """The collate function: the one given, else the ``DataLoader``'s, else torch's ``default_collate``."""
        return collate_fn or self.collate_fn or default_collate

    def head(self, k: int = 3) -> list:
        """A few samples to fingerprint: the first, middle and last of a sized input; an iterable's first ``k``
        (read once: :meth:`items` gives them again)."""
        if self.n_items is not None:
            n = self.n_items
            return [self.data[i] for i in sorted({0, n // 2, n - 1})] if n else []
        if self._iterator is None:
            self._iterator = iter(self.data)
            self._head = list(itertools.islice(self._iterator, k))
        return list(self._head)

    def items(self, done: Callable[[int], bool] = lambda i: False, num_workers: int = 0
              ) -> Iterator[tuple[int, Any]]:
        """``(index, sample)`` for every item whose index is not ``done``, in input order."""
        if self.n_items is None:
            iterator = self._iterator if self._iterator is not None else iter(self.data)
            self._iterator = None
            return self._numbered(itertools.chain(self._head, iterator), done)
        self.read = self.n_items
        todo = (i for i in range(self.n_items) if not done(i))
        if self.is_tensor or not num_workers:
            return ((i, self.data[i]) for i in todo)
        return _read_ahead(self.data, todo, num_workers)

    def _numbered(self, samples: Iterator, done: Callable[[int], bool]) -> Iterator[tuple[int, Any]]:
        for i, sample in enumerate(samples):
            self.read = i + 1
            if not done(i):
                yield i, sample


def _read_ahead(data, indices: Iterator[int], num_workers: int) -> Iterator[tuple[int, Any]]:
    """``(i, data[i])`` in order, read by ``num_workers`` threads a few chunks ahead (bounded memory).

    Threads, not processes: reading that releases the GIL (file reads, image decoding, tokenizers) runs in
    parallel all the same.
    """
    def read(chunk):
        return [data[i] for i in chunk]

    with ThreadPoolExecutor(num_workers, thread_name_prefix="nn_handler-load") as pool:
        ahead: collections.deque = collections.deque()
        chunks = iter(lambda: list(itertools.islice(indices, _READ_CHUNK)), [])
        for chunk in itertools.chain(chunks, [None]):
            if chunk is not None:
                ahead.append((chunk, pool.submit(read, chunk)))
            while ahead and (chunk is None or len(ahead) > 2 * num_workers):
                done_chunk, future = ahead.popleft()
                yield from zip(done_chunk, future.result())


def fingerprint(samples: list) -> str:
    """A short hash of ``samples``' contents (tensor bytes, shapes and dtypes; plain values; type names else).

    Example:
        >>> import torch
        >>> fingerprint([torch.ones(2)]) == fingerprint([torch.ones(2)]) != fingerprint([torch.zeros(2)])
        True
    """
    digest = hashlib.sha256()
    for sample in samples:
        _feed(digest, sample)
    return digest.hexdigest()[:16]


def _feed(digest, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"tensor{tuple(t.shape)}{t.dtype}".encode())
        # Its raw bytes through ctypes: Tensor.numpy() needs numpy, which is not a dependency.
        digest.update(ctypes.string_at(t.data_ptr(), t.nbytes) if t.numel() else b"")
    elif isinstance(obj, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(obj).encode())
    elif isinstance(obj, collections.abc.Mapping):
        for key, value in obj.items():
            digest.update(repr(key).encode())
            _feed(digest, value)
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{type(obj).__name__}{len(obj)}".encode())
        for value in obj:
            _feed(digest, value)
    elif hasattr(obj, "tobytes"):  # a numpy array
        digest.update(obj.tobytes())
    else:  # its repr may hold an address: the type is what is stable
        digest.update(type(obj).__qualname__.encode())
