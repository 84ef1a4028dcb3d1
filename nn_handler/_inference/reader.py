"""``Predictions``: the outputs of a predictions directory, in input order, read lazily from its shards.

Opening reads the manifest and the index (``index.safetensors``: which shard holds each item), not the outputs.
``p[i]`` opens item ``i``'s shard (a few recently used shards stay open) and reads only that item's tensors, so
iterating over millions of items holds one item at a time; ``p.stack()`` builds one tensor per output leaf for
fixed-shape outputs (pooled embeddings).

Example:
    >>> import tempfile, torch
    >>> from nn_handler._inference.store import ShardStore, write_shard
    >>> d = tempfile.mkdtemp()
    >>> store = ShardStore.open(d, identity={"n_items": 3})
    >>> _ = write_shard(d, [1, 0], [torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])])
    >>> _ = write_shard(d, [2], [torch.tensor([2.0, 2.0])])
    >>> p = store.finish(3)
    >>> len(p), p[2], p.stack()[:, 0]
    (3, tensor([2., 2.]), tensor([0., 1., 2.]))
    >>> Predictions.open(d)[0:2]
    [tensor([0., 0.]), tensor([1., 1.])]
"""

from __future__ import annotations

import collections
import collections.abc
import json
import operator
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ..errors import PredictionsError
from .layout import INDICES_KEY, MANIFEST, failed_items, read_index, read_manifest, scan_shards, unflatten

__all__ = ["Predictions"]

# Shards kept open: reading in input order visits a few shards in turn (batches sorted by length within a window
# interleave their items); an open shard is a file handle and its parsed header, not its tensors.
OPEN_SHARDS = 16


class Predictions(collections.abc.Sequence):
    """A read-only sequence of the item outputs in a predictions directory, in input order, read as needed.

    ``len(p)``, ``p[i]`` (item ``i``'s output at its stored shape: a tensor or the tuple / list / dict the model
    returned), ``p[a:b]`` (a list), iteration, and ``p.stack()`` for fixed-shape outputs. ``p.failed`` lists the
    items that failed under ``on_error="skip"``: they have no output, and ``p[i]`` raises for them.

    Example:
        >>> import tempfile, torch
        >>> from nn_handler._inference.store import ShardStore, write_shard
        >>> d = tempfile.mkdtemp()
        >>> store = ShardStore.open(d, identity={"n_items": 2})
        >>> _ = write_shard(d, [0, 1], [{"tokens": torch.ones(3, 2)}, {"tokens": torch.ones(5, 2)}])
        >>> p = store.finish(2)
        >>> [item["tokens"].shape[0] for item in p]   # each at its own length
        [3, 5]
    """

    def __init__(self, output_dir: Path, manifest: dict, shard_names: list[str], shard_of: torch.Tensor):
        self.output_dir = output_dir
        self._manifest = manifest
        self._names = shard_names
        self._shard_of = shard_of
        self._open: collections.OrderedDict[int, tuple[Any, Any]] = collections.OrderedDict()

    @classmethod
    def open(cls, output_dir: str | os.PathLike) -> "Predictions":
        """The predictions in ``output_dir`` (written by ``parallel_predict(output_dir=...)``), without the model."""
        d = Path(output_dir)
        manifest = read_manifest(d) if d.is_dir() else None
        if manifest is None:
            raise PredictionsError(f"{d} holds no predictions ({MANIFEST} not found): pass the output_dir that "
                                   f"parallel_predict(output_dir=...) wrote")
        n = manifest["n_items"]
        if not manifest["complete"] or n is None:
            raise PredictionsError(f"{d} is incomplete: its run stopped before every item was computed; run the same "
                                   f"parallel_predict call again with this output_dir to compute the missing items")
        indexed = read_index(d, n)
        if indexed is None:  # no index (removed, or the shards changed since): read the shards' index lists
            found, unreadable = scan_shards(d)
            if unreadable:
                raise PredictionsError(f"{d}: shards {unreadable} cannot be read (damaged?); run the same "
                                       f"parallel_predict call again to compute their items")
            shard_of = torch.full((n,), -1, dtype=torch.int32)
            for number, (_, idx, _) in enumerate(found):
                shard_of[idx[idx < n]] = number
            indexed = [name for name, _, _ in found], shard_of
        return cls(d, manifest, *indexed)

    @property
    def failed(self) -> list[dict]:
        """The failed items' ranges and errors: ``{"start", "stop"}`` or ``{"indices"}``, with ``"error"``."""
        return [dict(e) for e in self._manifest["failed"]]

    def __len__(self) -> int:
        return len(self._shard_of)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range: {self.output_dir} holds {n} items")
        return self._item(i % n if n else i)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self._item(i)

    def __repr__(self) -> str:
        failed = sum(len(failed_items(e)) for e in self._manifest["failed"])
        return (f"Predictions({str(self.output_dir)!r}, {len(self)} items"
                + (f", {failed} failed" if failed else "") + ")")

    def __reduce__(self):  # travels as its directory: another process opens it again
        return (type(self).open, (str(self.output_dir),))

    def stack(self, part: str | int | None = None) -> Any:
        """Every item's output stacked along a new dim 0: one tensor per leaf, as the model returned it.

        For fixed-shape outputs (one vector per item); ragged ones (one row per token) raise, as do failed items.
        ``part``: only that entry of a dict (its key) or tuple / list output (its index), e.g. ``stack("pooled")``
        beside a ragged ``"per_residue"``.
        """
        missing = self._shard_of < 0
        if missing.any():
            first = int(missing.nonzero()[0])
            raise PredictionsError(f"stack(): {int(missing.sum())} items of {self.output_dir} have no output "
                                   f"(item {first} first{self._why(first)}); iterate over the others, or rerun "
                                   f"the call without on_error='skip' to compute them")
        if not len(self):
            raise PredictionsError(f"stack(): {self.output_dir} holds no items")
        first = self._handle(int(self._shard_of[0]))[1]
        if isinstance(part, int) and part < 0 and isinstance(first, dict) and "dict" not in first:
            part += len(next(iter(first.values())))  # from the end of a tuple / list output
        # The shapes first, from the shards' headers: a ragged output is refused before any tensor is read.
        structure, example = self._layout(0, part)
        for number in torch.unique(self._shard_of).tolist():
            handle, shard_structure = self._handle(number)
            for index in handle.get_tensor(INDICES_KEY).tolist():
                if _part(shard_structure, part, index) != structure:
                    raise PredictionsError(f"stack(): item {index}'s output is nested as {json.dumps(shard_structure)}"
                                           f", item 0's as {json.dumps(first)}")
                for (leaf, shape, _), key in zip(example, _leaf_keys(structure, _key(index, part))):
                    here = list(handle.get_slice(key).get_shape())
                    if here != shape:
                        what = f"output {leaf!r}" if leaf else "output"
                        raise PredictionsError(
                            f"stack() needs outputs of one shape: item {index}'s {what} is {tuple(here)}, item 0's "
                            f"{tuple(shape)}. Iterate over the Predictions one item at a time, pad them "
                            f"(torch.nn.utils.rnn.pad_sequence), or stack a fixed-shape part: stack(part=...)")
        leaves = [torch.empty((len(self), *shape), dtype=dtype) for _, shape, dtype in example]
        for number in torch.unique(self._shard_of).tolist():
            handle, _ = self._handle(number)
            for index in handle.get_tensor(INDICES_KEY).tolist():
                for out, key in zip(leaves, _leaf_keys(structure, _key(index, part))):
                    out[index] = handle.get_tensor(key)
        it = iter(leaves)
        return unflatten(structure, "", lambda key: next(it))

    # ------------------------------------------------------------------------- reading
    def _item(self, i: int) -> Any:
        number = int(self._shard_of[i])
        if number < 0:
            raise PredictionsError(f"item {i} of {self.output_dir} has no output{self._why(i)}")
        handle, structure = self._handle(number)
        return unflatten(structure, str(i), handle.get_tensor)

    def _why(self, i: int) -> str:
        for entry in self._manifest["failed"]:
            if i in failed_items(entry):
                return f": it failed (on_error='skip') with {entry['error'].strip()}"
        return ": its shard is gone; run the same parallel_predict call again to compute it"

    def _handle(self, number: int) -> tuple[Any, Any]:
        """Shard ``number`` opened (its header parsed, no tensor read) and its structure; the last few stay open."""
        if number in self._open:
            self._open.move_to_end(number)
            return self._open[number]
        path = self.output_dir / self._names[number]
        try:
            handle = _open_shard(path)
            structure = json.loads(handle.metadata()["structure"])
        except Exception as e:  # a damaged or missing file: safetensors raises its own error types
            raise PredictionsError(f"{path} cannot be read ({e}); run the same parallel_predict call again to "
                                   f"compute its items") from e
        self._open[number] = (handle, structure)
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return handle, structure

    def _layout(self, index: int, part: str | int | None) -> tuple[Any, list[tuple[str, list[int], torch.dtype]]]:
        """Item ``index``'s structure (of ``part``) and each of its leaves' ``(path, shape, dtype)``."""
        handle, structure = self._handle(int(self._shard_of[index]))
        structure = _part(structure, part, index)
        leaves = []
        for key in _leaf_keys(structure, _key(index, part)):
            t = handle.get_tensor(key)
            leaves.append((key[len(str(index)) + 1:], list(t.shape), t.dtype))
        return structure, leaves


def _key(index: int, part: str | int | None) -> str:
    return str(index) if part is None else f"{index}/{part}"


def _part(structure: Any, part: str | int | None, index: int) -> Any:
    """The structure of ``part`` of an output nested as ``structure``; a clear error where it has none."""
    if part is None:
        return structure
    kind, children = next(iter(structure.items())) if isinstance(structure, dict) else (structure, None)
    if kind == "dict" and part in children:
        return children[part]
    if kind in ("tuple", "list") and isinstance(part, int) and 0 <= part < len(children):
        return children[part]
    raise PredictionsError(f"stack(part={part!r}): item {index}'s output has no such part (it is nested as "
                           f"{json.dumps(structure)})")


def _leaf_keys(structure: Any, key: str) -> list[str]:
    """The keys of an output's tensors, in the order :func:`.layout.unflatten` reads them."""
    keys: list[str] = []
    unflatten(structure, key, keys.append)
    return keys


def _open_shard(path: Path):
    """A safetensors handle on ``path``: its header parsed, tensors read one by one on request."""
    return safe_open(str(path), framework="pt")

