"""The files of a predictions directory: their names, the shard format, atomic writes, reading the index back.

What :mod:`.store` writes and :mod:`.reader` reads, in one place below both (the layout is described in
:data:`LAYOUT`, which every manifest carries). Shards are safetensors files; nn_handler writes them itself because
``safetensors.torch.save`` needs numpy, which is no dependency; safetensors' own readers read them.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import safe_open

from ..errors import ConfigurationError, PredictionsError

FORMAT = "nn_handler.predictions"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.safetensors"
INDICES_KEY = "__indices__"
_SHARD = re.compile(r"shard-(\d{12})-(\d+)\.safetensors")
_TMP_MARK = ".tmp."
OURS = re.compile(r"(shard-\d{12}-\d+\.safetensors|manifest\.json|index\.safetensors)")

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
def is_temp(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name and OURS.fullmatch(name[1:name.index(_TMP_MARK)]) is not None


def shard_files(output_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(output_dir) if _SHARD.fullmatch(e.name))


def scan_shards(output_dir: str | os.PathLike) -> tuple[list[tuple[str, torch.Tensor, str]], list[str]]:
    """``([(shard name, its item indices, its outputs' structure as JSON text)], [names of unreadable shards])``:
    reads each shard's header and index list only."""
    found, unreadable = [], []
    for name in shard_files(Path(output_dir)):
        try:
            with safe_open(str(Path(output_dir) / name), framework="pt") as f:
                # A copy: the tensor safetensors returns keeps the whole file's bytes alive (all shards' outputs
                # held at once in the caller otherwise).
                found.append((name, f.get_tensor(INDICES_KEY).clone(), f.metadata()["structure"]))
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
    if len(shard_of) != n_items or sorted(names) != shard_files(output_dir):
        return None
    return names, shard_of


def write_index(output_dir: Path, names: list[str], shard_of: torch.Tensor) -> None:
    parts = [_SHARD.fullmatch(n).groups() for n in names]
    tensors = {"shard_of": shard_of.to(torch.int32),
               "shard_first": torch.tensor([int(a) for a, _ in parts], dtype=torch.int64),
               "shard_count": torch.tensor([int(b) for _, b in parts], dtype=torch.int64)}
    metadata = {"format": FORMAT, "version": str(VERSION)}
    atomic_write(output_dir / INDEX, lambda f: write_safetensors(f, tensors, metadata))




def failed_items(entry: dict) -> range | list[int]:
    """The items of a manifest's ``failed`` entry."""
    return range(entry["start"], entry["stop"]) if "start" in entry else entry["indices"]
