"""Shards and the manifest of a predictions directory: atomic writes, what is done, resume, refusal of a mismatch.

A directory that ``parallel_predict(output_dir=...)`` writes holds, all readable without nn_handler:

- ``shard-<its first item, 12 digits>-<its item count>.safetensors``: one finished batch. The tensor
  ``__indices__`` (int64) holds its items' positions in the input; item ``i``'s output is the tensor ``"<i>"``,
  or for a tuple / list / dict output one tensor per leaf, ``"<i>/<path>"`` (``"17/0"``, ``"17/pooled"``,
  ``"17/hidden/2"``). The file's metadata ``structure`` is the output's nesting as JSON (``"tensor"``,
  ``{"tuple": [...]}``, ``{"list": [...]}``, ``{"dict": {"key": ...}}``, ``"none"``). Each item's tensors are
  stored at its own shape (trimmed: no padding), so one item reads alone.
- ``manifest.json``: the run's identity (data size, fingerprint, settings), ``n_items``, ``complete``, the items
  that failed (``on_error="skip"``) and this description.
- ``index.safetensors``, written when the run completes: ``shard_of`` (int32, one per item, -1 where none) into the
  shards listed by ``shard_first`` and ``shard_count`` (int64), so reading back opens no shard until needed.

Every file appears atomically: written to a temporary ``.<name>.tmp.<pid>.<random>`` in the directory, then
renamed. What is done is read from the shard files themselves, so a kill between a shard's rename and anything
else loses nothing, and a rerun of the same batch replaces its shard (same name) instead of adding one.

Example:
    >>> import tempfile, torch
    >>> from safetensors.torch import load_file
    >>> d = tempfile.mkdtemp()
    >>> store = ShardStore.open(d, identity={"n_items": 3})
    >>> write_shard(d, [2, 0], [(torch.ones(2), torch.tensor(7)), (torch.zeros(1), torch.tensor(5))])
    'shard-000000000000-2.safetensors'
    >>> store.done_mask().tolist()
    [True, False, True]
    >>> sorted(load_file(f"{d}/shard-000000000000-2.safetensors"))   # no nn_handler needed to read it
    ['0/0', '0/1', '2/0', '2/1', '__indices__']
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import ConfigurationError, PredictionsError
from .layout import (FORMAT, INDICES_KEY, LAYOUT, MANIFEST, OURS, VERSION, atomic_write, failed_items, is_temp,
                     read_manifest, scan_shards, shard_files, shard_name, write_index, write_safetensors)
from .reader import Predictions

__all__ = ["write_shard", "ShardStore"]

log = logging.getLogger(__name__)

def write_shard(output_dir: str | os.PathLike, indices: Sequence[int], items: list) -> str:
    """Write one batch's item outputs atomically into ``output_dir``; returns the shard's file name.

    ``items[k]`` is the output of input item ``indices[k]``: a CPU tensor or a tuple / list / dict of them (nested;
    None allowed), the same structure for every item, each at its own shape. Needs no state but the directory, so
    any process may call it (a worker, a Ray actor on another node with shared storage).
    """
    indices = [int(i) for i in indices]
    if not indices or len(indices) != len(items):
        raise ValueError(f"write_shard() needs one item per index, got {len(indices)} indices and {len(items)} items")
    if min(indices) < 0 or len(set(indices)) != len(indices):
        raise ValueError(f"write_shard(): item indices must be distinct and >= 0, got {indices[:10]}...")
    tensors: dict[str, torch.Tensor] = {INDICES_KEY: torch.tensor(indices, dtype=torch.int64)}
    structure = None
    for index, item in zip(indices, items):
        spec = _flatten(item, str(index), tensors, f"item {index}'s output")
        if structure is None:
            structure = spec
        elif spec != structure:
            raise ValueError(f"write_shard(): item {index}'s output is nested as {json.dumps(spec)}, item "
                             f"{indices[0]}'s as {json.dumps(structure)}; a batch's outputs must share one structure")
    metadata = {"format": FORMAT, "version": str(VERSION), "structure": json.dumps(structure)}
    name = shard_name(indices)
    atomic_write(Path(output_dir) / name, lambda f: write_safetensors(f, tensors, metadata))
    return name


def _flatten(obj: Any, key: str, out: dict, where: str) -> Any:
    """Put ``obj``'s tensors into ``out`` under ``key`` and ``key/<path>``; returns its structure as JSON data."""
    if isinstance(obj, torch.Tensor):
        if key in out:
            raise ValueError(f"{where}: two tensors would be stored as {key!r} (a dict key with '/' in it?)")
        # An item is often a row of the batch's output: only its own bytes are written (write_safetensors).
        out[key] = obj.detach().cpu().contiguous()
        return "tensor"
    if obj is None:
        return "none"
    if isinstance(obj, Mapping):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"{where}: a dict output needs str keys to be stored, got {list(obj)[:5]}")
        return {"dict": {k: _flatten(v, f"{key}/{k}", out, f"{where}[{k!r}]") for k, v in obj.items()}}
    if isinstance(obj, (tuple, list)):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {kind: [_flatten(v, f"{key}/{i}", out, f"{where}[{i}]") for i, v in enumerate(obj)]}
    raise TypeError(f"{where} holds a {type(obj).__name__}: outputs are stored as tensors, alone or in tuples, "
                    f"lists and dicts (None allowed)")


def _as_json(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"the run's identity must be JSON data (str, numbers, lists, dicts), got {value!r}") from e


def _differences(old: Any, new: Any, where: str = "") -> list[str]:
    """``"key: old -> new"`` for each leaf where two JSON values differ (dicts compared key by key)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in _differences(old.get(k, "<absent>"), new.get(k, "<absent>"), f"{where}.{k}" if where else k)]
    return [] if old == new else [f"{where or 'identity'}: {json.dumps(old)} -> {json.dumps(new)}"]


def _failure_entry(indices: Sequence[int], error: str) -> dict:
    ordered = sorted(int(i) for i in indices)
    if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return {"start": ordered[0], "stop": ordered[-1] + 1, "error": error}
    return {"indices": ordered, "error": error}



class ShardStore:
    """The caller's side of a predictions directory, one per run: the manifest, what is done, failures, finishing.

    Workers write shards with :func:`write_shard`; this side never holds outputs.
    """

    def __init__(self, output_dir: Path, manifest: dict):
        self.output_dir = output_dir
        self._manifest = manifest

    @classmethod
    def open(cls, output_dir: str | os.PathLike, *, identity: dict, overwrite: bool = False) -> "ShardStore":
        """Start or resume the run ``identity`` names in ``output_dir`` (made if absent).

        A directory holding another run's predictions (its manifest's identity differs) is refused with a
        ConfigurationError naming each differing key; ``overwrite=True`` deletes our files there first (never
        other files). Temporary files a killed writer left are removed: call it before any writer starts.
        """
        identity = _as_json(identity)
        d = Path(output_dir)
        if d.exists() and not d.is_dir():
            raise ConfigurationError(f"output_dir={str(d)!r} is a file; pass a directory (made if absent)")
        d.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(d):
            if is_temp(entry.name) or overwrite and OURS.fullmatch(entry.name):
                Path(entry.path).unlink(missing_ok=True)
        manifest = read_manifest(d)
        if manifest is None:
            if shard_files(d):
                raise ConfigurationError(f"{d} holds prediction shards but no {MANIFEST}: it cannot tell which run "
                                         f"wrote them; pass overwrite=True to delete them and start over")
            n = identity.get("n_items") if isinstance(identity, dict) else None
            manifest = {"format": FORMAT, "version": VERSION, "identity": identity,
                        "n_items": n if isinstance(n, int) else None, "complete": False, "failed": [],
                        "created": _now(), "layout": LAYOUT}
            store = cls(d, manifest)
            store._save()
            return store
        differences = _differences(manifest.get("identity"), identity)
        if differences:
            raise ConfigurationError(
                f"{d} holds the predictions of another run ({'; '.join(differences)}): use another output_dir, or "
                f"pass overwrite=True to delete its predictions and start over")
        return cls(d, manifest)

    @property
    def failed(self) -> list[dict]:
        """The failures recorded (``on_error="skip"``): ``{"start", "stop"}`` or ``{"indices"}``, and ``"error"``."""
        return [dict(e) for e in self._manifest["failed"]]

    def done_mask(self) -> torch.Tensor:
        """Bool, True where an item's output is on disk (read from the shard files present).

        Its length is the run's ``n_items``, or without one (an iterable input) one past the last item on disk.
        An unreadable shard (a damaged file) is deleted with a warning: its items are computed again.
        """
        found, unreadable = scan_shards(self.output_dir)
        for name in unreadable:
            log.warning("%s: shard %s cannot be read; deleting it, its items will be computed again",
                        self.output_dir, name)
            (self.output_dir / name).unlink(missing_ok=True)
        if unreadable and self._manifest["complete"]:
            self._manifest["complete"] = False
            self._save()
        n = self._manifest["n_items"]
        last = max((int(idx.max()) for _, idx, _ in found if len(idx)), default=-1)
        if n is not None and last >= n:
            raise PredictionsError(f"{self.output_dir}: a shard holds item {last}, but the run has {n} items")
        mask = torch.zeros(n if n is not None else last + 1, dtype=torch.bool)
        for _, idx, _ in found:
            mask[idx] = True
        return mask

    def done_count(self) -> int:
        """How many items have their output on disk."""
        return int(self.done_mask().sum())

    def record_failure(self, indices: Sequence[int], error: str) -> None:
        """Record that ``indices`` failed with ``error`` (type, message and traceback text), in the manifest."""
        self._manifest["failed"].append(_failure_entry(indices, str(error)))
        self._save()

    def clear_failures(self) -> None:
        """Forget the recorded failures: a rerun computes those items again."""
        if self._manifest["failed"]:
            self._manifest["failed"] = []
            self._manifest["complete"] = False  # until those items are computed
            self._save()

    def finish(self, n_items: int):
        """Mark the run complete with ``n_items`` items (each on disk or recorded as failed); its Predictions."""
        n_items = int(n_items)
        known = self._manifest["n_items"]
        if known is not None and known != n_items:
            raise PredictionsError(f"{self.output_dir} holds the predictions of {known} items, this run's input had "
                                   f"{n_items}: other data; use another output_dir, or pass overwrite=True to delete "
                                   f"its predictions and start over")
        self._manifest["n_items"] = n_items
        found, unreadable = scan_shards(self.output_dir)
        shard_of = torch.full((n_items,), -1, dtype=torch.int32)
        _check_one_structure(self.output_dir, found)
        for number, (_, idx, _) in enumerate(found):
            if len(idx) and int(idx.max()) >= n_items:
                raise PredictionsError(f"{self.output_dir}: a shard holds item {int(idx.max())}, this run's input had "
                                       f"{n_items} items: other data; use another output_dir, or pass overwrite=True "
                                       f"to delete its predictions and start over")
            shard_of[idx] = number
        covered = shard_of >= 0
        for entry in self._manifest["failed"]:
            covered[torch.as_tensor(list(failed_items(entry)), dtype=torch.long)] = True
        if unreadable or not covered.all():
            missing = int((~covered).sum())
            raise PredictionsError(f"{self.output_dir}: {missing} of {n_items} items have neither an output on disk "
                                   f"nor a recorded failure (unreadable shards: {unreadable or 'none'}); run the "
                                   f"same call again to compute them")
        write_index(self.output_dir, [name for name, _, _ in found], shard_of)
        self._manifest["complete"] = True
        self._save()
        return Predictions.open(self.output_dir)

    def _save(self) -> None:
        self._manifest["updated"] = _now()
        text = (json.dumps(self._manifest, indent=2) + "\n").encode()
        atomic_write(self.output_dir / MANIFEST, lambda f: f.write(text))


def _check_one_structure(output_dir: Path, found: list[tuple[str, torch.Tensor, str]]) -> None:
    """Every shard's outputs are nested alike, or a PredictionsError: items must not read back in two forms.

    They differ when the model's outputs changed from batch to batch: a ``list`` as long as a batch is read as one
    output per item, so a list of several batched outputs is split per item only for the batches of its length;
    or when a resumed run's model returns another structure than the run that wrote the first shards.
    """
    shards: dict[str, list[str]] = {}
    for name, _, structure in found:
        shards.setdefault(structure, []).append(name)
    if len(shards) > 1:
        forms = "; ".join(f"{structure} in {len(names)} shard(s) such as {names[0]}"
                          for structure, names in shards.items())
        raise PredictionsError(f"{output_dir}: the items' outputs are nested in {len(shards)} ways ({forms}): the "
                               f"model's outputs changed from batch to batch or from run to run (a list as long as "
                               f"its batch is read as one output per item: return several batched outputs as a tuple "
                               f"or a dict); pass overwrite=True to delete these predictions and start over")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
