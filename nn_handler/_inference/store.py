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

import ctypes
import json
import logging
import os
import re
import secrets
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from safetensors import safe_open

from ..errors import ConfigurationError, PredictionsError

__all__ = ["write_shard", "ShardStore", "read_manifest", "scan_shards", "read_index", "shard_name", "unflatten",
           "MANIFEST", "INDEX", "INDICES_KEY", "FORMAT", "VERSION"]

log = logging.getLogger(__name__)

FORMAT = "nn_handler.predictions"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.safetensors"
INDICES_KEY = "__indices__"
_SHARD = re.compile(r"shard-(\d{12})-(\d+)\.safetensors")
_TMP_MARK = ".tmp."
_OURS = re.compile(r"(shard-\d{12}-\d+\.safetensors|manifest\.json|index\.safetensors)")

LAYOUT = {
    "shards": "shard-<first item, 12 digits>-<item count>.safetensors, one per finished batch, written atomically",
    "indices": "each shard's int64 tensor '__indices__': the input positions of its items",
    "keys": "'<i>' for item i's output when it is a tensor; '<i>/<path>' for each tensor inside a tuple, list or "
            "dict output ('<i>/0', '<i>/pooled', '<i>/hidden/2'), at the item's own (trimmed) shape",
    "structure": "each shard's metadata 'structure': the outputs' nesting as JSON: \"tensor\", \"none\", "
                 "{\"tuple\": [...]}, {\"list\": [...]}, {\"dict\": {\"<key>\": ...}}",
    "index": "index.safetensors, written on completion: 'shard_of' (int32 per item, -1 for none) into the shards "
             "named by 'shard_first' and 'shard_count'",
    "read": "safetensors.torch.load_file(path), or safetensors.safe_open(path, 'pt') for single items; "
            "nn_handler.Predictions.open(dir) gives the items in input order",
}


# ----------------------------------------------------------------------------- a shard
def shard_name(indices: Sequence[int]) -> str:
    """The file name of the shard holding ``indices``: a rerun of the same batch gets the same name.

    Example:
        >>> shard_name([40, 12, 33])
        'shard-000000000012-3.safetensors'
    """
    return f"shard-{min(indices):012d}-{len(indices)}.safetensors"


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


def unflatten(structure: Any, key: str, get: Callable[[str], torch.Tensor]) -> Any:
    """The output stored under ``key`` with ``structure`` (see :func:`write_shard`), its tensors read by ``get``.

    Example:
        >>> import torch
        >>> unflatten({"dict": {"a": "tensor", "b": {"tuple": ["none"]}}}, "3", lambda k: k)
        {'a': '3/a', 'b': (None,)}
    """
    if structure == "tensor":
        return get(key)
    if structure == "none":
        return None
    (kind, children), = structure.items()
    if kind == "dict":
        return {k: unflatten(v, f"{key}/{k}", get) for k, v in children.items()}
    values = [unflatten(v, f"{key}/{i}", get) for i, v in enumerate(children)]
    return values if kind == "list" else tuple(values)


# The safetensors format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header size, a JSON
# header (each tensor's dtype, shape and byte range; "__metadata__": str -> str), then the tensors' bytes.
# Written here because safetensors.torch.save needs numpy, which nn_handler does not; read with safetensors.
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write contiguous CPU ``tensors`` and ``metadata`` to the binary file ``f`` as a safetensors file."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian: this machine is not")
    for key, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"{key!r} is a {t.dtype} tensor; outputs are stored as one of "
                            f"{sorted(str(d).removeprefix('torch.') for d in _DTYPES)}")
    # Widest items first: every tensor starts aligned to its item size (the header is padded to 8 bytes).
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key in order:
        t = tensors[key]
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for key in order:
        t = tensors[key]
        size = t.numel() * t.element_size()
        if size:  # the tensor's own bytes, without a copy (t stays alive in `tensors` meanwhile)
            f.write((ctypes.c_char * size).from_address(t.data_ptr()))


def atomic_write(path: Path, write: Callable) -> None:
    """``path`` is either absent (or its old version) or holds all that ``write(file)`` wrote: a temporary, renamed."""
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            # Without fsync the rename can reach the disk before the data (a power cut: an empty file).
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- a directory
def _is_temp(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name and _OURS.fullmatch(name[1:name.index(_TMP_MARK)]) is not None


def _shard_files(output_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(output_dir) if _SHARD.fullmatch(e.name))


def scan_shards(output_dir: str | os.PathLike) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """``([(shard name, its item indices)], [names of unreadable shards])``: reads each shard's index list only."""
    found, unreadable = [], []
    for name in _shard_files(Path(output_dir)):
        try:
            with safe_open(str(Path(output_dir) / name), framework="pt") as f:
                # A copy: the tensor safetensors returns keeps the whole file's bytes alive (all shards' outputs
                # held at once in the caller otherwise).
                found.append((name, f.get_tensor(INDICES_KEY).clone()))
        except Exception:  # a truncated or foreign file: safetensors raises its own error types
            unreadable.append(name)
    return found, unreadable


def read_manifest(output_dir: str | os.PathLike) -> dict | None:
    """``output_dir``'s manifest, None where there is none; a clear error for a file that is not ours."""
    path = Path(output_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise PredictionsError(f"{path} cannot be read ({e}); delete the directory, or pass overwrite=True, to "
                               f"start over") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigurationError(f"{path} is not the manifest of nn_handler predictions (no \"format\": "
                                 f"\"{FORMAT}\"); choose another output_dir")
    if manifest.get("version", 0) > VERSION:
        raise ConfigurationError(f"{path} was written by a newer nn_handler (format version {manifest['version']}, "
                                 f"this one reads {VERSION}); upgrade nn_handler to read it")
    return manifest


def read_index(output_dir: Path, n_items: int) -> tuple[list[str], torch.Tensor] | None:
    """``(shard names, shard_of)`` from ``index.safetensors`` when it matches the shard files there, else None."""
    try:
        with safe_open(str(output_dir / INDEX), framework="pt") as f:
            shard_of = f.get_tensor("shard_of")
            firsts, counts = f.get_tensor("shard_first").tolist(), f.get_tensor("shard_count").tolist()
        names = [f"shard-{first:012d}-{count}.safetensors" for first, count in zip(firsts, counts)]
    except Exception:  # absent, or unreadable: the shards themselves are read instead
        return None
    if len(shard_of) != n_items or sorted(names) != _shard_files(output_dir):
        return None
    return names, shard_of


def _write_index(output_dir: Path, names: list[str], shard_of: torch.Tensor) -> None:
    parts = [_SHARD.fullmatch(n).groups() for n in names]
    tensors = {"shard_of": shard_of.to(torch.int32),
               "shard_first": torch.tensor([int(a) for a, _ in parts], dtype=torch.int64),
               "shard_count": torch.tensor([int(b) for _, b in parts], dtype=torch.int64)}
    metadata = {"format": FORMAT, "version": str(VERSION)}
    atomic_write(output_dir / INDEX, lambda f: write_safetensors(f, tensors, metadata))


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


def failed_items(entry: dict) -> range | list[int]:
    """The items of a manifest's ``failed`` entry."""
    return range(entry["start"], entry["stop"]) if "start" in entry else entry["indices"]


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
            if _is_temp(entry.name) or overwrite and _OURS.fullmatch(entry.name):
                Path(entry.path).unlink(missing_ok=True)
        manifest = read_manifest(d)
        if manifest is None:
            if _shard_files(d):
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
        last = max((int(idx.max()) for _, idx in found if len(idx)), default=-1)
        if n is not None and last >= n:
            raise PredictionsError(f"{self.output_dir}: a shard holds item {last}, but the run has {n} items")
        mask = torch.zeros(n if n is not None else last + 1, dtype=torch.bool)
        for _, idx in found:
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
        for number, (_, idx) in enumerate(found):
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
        _write_index(self.output_dir, [name for name, _ in found], shard_of)
        self._manifest["complete"] = True
        self._save()
        from .reader import Predictions  # the reader builds on this module
        return Predictions.open(self.output_dir)

    def _save(self) -> None:
        self._manifest["updated"] = _now()
        text = (json.dumps(self._manifest, indent=2) + "\n").encode()
        atomic_write(self.output_dir / MANIFEST, lambda f: f.write(text))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
