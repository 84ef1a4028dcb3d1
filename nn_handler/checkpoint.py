"""Checkpoint files: atomic writes, payloads that load with ``weights_only=True``, clear errors.

A checkpoint is a plain ``dict`` of tensors and Python values (no pickled
classes), written by :func:`atomic_save` so that a crash, a SIGKILL or a full
disk in the middle of a save leaves the previous file untouched: the bytes go
to a temporary file in the same directory, are flushed to disk, and only then
renamed over the destination (``os.replace`` is atomic on POSIX and Windows).
Temporary files start with ``.`` and contain ``.tmp.``, so a directory scan
for the newest checkpoint (:func:`list_checkpoints`) never picks one.

Example:
    >>> import tempfile, os, torch
    >>> from nn_handler.checkpoint import atomic_save, load_payload
    >>> d = tempfile.mkdtemp()
    >>> atomic_save({"w": torch.ones(2), "epoch": 3}, os.path.join(d, "a.ckpt"))
    >>> load_payload(os.path.join(d, "a.ckpt"))["epoch"]
    3
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import uuid
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .errors import CheckpointError, CheckpointMismatchError

__all__ = [
    "FORMAT",
    "atomic_save",
    "load_payload",
    "load_weights",
    "state_dict_diff",
    "capture_rng_state",
    "restore_rng_state",
    "list_checkpoints",
    "is_temp_file",
    "run_checkpoint_name",
    "run_checkpoint_key",
    "list_run_checkpoints",
    "prune_run_checkpoints",
    "remove_stale_temp_files",
]

log = logging.getLogger(__name__)

#: Written into every handler checkpoint, so a foreign file is named as such.
FORMAT = "nn_handler.checkpoint/1"
_TMP_MARK = ".tmp."


def is_temp_file(path: str | os.PathLike) -> bool:
    """True for the temporary files :func:`atomic_save` writes before renaming.

    Example:
        >>> is_temp_file(".last.ckpt.tmp.42.ab12")
        True
        >>> is_temp_file("last.ckpt")
        False
    """
    name = Path(path).name
    return name.startswith(".") and _TMP_MARK in name


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """Write ``obj`` with ``torch.save`` so that ``path`` is either the old file or the complete new one.

    Args:
        obj: What to save; plain tensors and Python values keep it loadable
            with ``torch.load(weights_only=True)``.
        path: Destination. Its directory is created if needed.

    Raises:
        OSError: The directory is not writable, the disk is full, ... (the
            temporary file is removed; ``path`` is unchanged).

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "sub", "x.pt")
        >>> atomic_save({"a": 1}, p)
        >>> os.path.exists(p)
        True
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory as the destination: os.replace is only atomic within one
    # file system, and a temp dir elsewhere may be another mount.
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            # Without fsync the rename can reach the disk before the data: a
            # power cut would then leave an empty file under the final name.
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform (Windows).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_payload(path: str | os.PathLike, *, map_location: Any = "cpu") -> Any:
    """Load a file written by :func:`atomic_save` (or ``torch.save``) with ``weights_only=True``.

    Args:
        path: The file.
        map_location: Where tensors go; CPU by default, so a GPU checkpoint
            loads anywhere.

    Returns:
        The saved object.

    Raises:
        CheckpointError: The file does not exist, is truncated or corrupt, or
            holds objects other than tensors and plain Python values.

    Example:
        >>> load_payload("/nonexistent/x.ckpt")
        Traceback (most recent call last):
        ...
        nn_handler.errors.CheckpointError: no checkpoint at /nonexistent/x.ckpt
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    size = path.stat().st_size
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc):  # random bytes read as an old-style pickle
            raise CheckpointError(
                f"checkpoint {path} is corrupt or truncated ({size} bytes; was its write interrupted?): "
                f"not a torch.save file"
            ) from exc
        # weights_only refuses arbitrary classes; say so instead of torch's long hint.
        lines = [ln for ln in str(exc).splitlines() if "Unsupported global" in ln] or str(exc).splitlines() or [""]
        first = lines[0].replace("WeightsUnpickler error:", "").strip()
        raise CheckpointError(
            f"checkpoint {path} holds objects that torch.load(weights_only=True) refuses "
            f"(only tensors and plain Python values are allowed): {first}"
        ) from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({size} bytes; was its write interrupted?): {first}"
        ) from exc


def state_dict_diff(
    expected: Mapping[str, torch.Tensor], given: Mapping[str, Any]
) -> tuple[list[str], list[str], list[tuple[str, tuple, tuple]]]:
    """Compare a model's state dict with one from a file.

    Returns:
        ``(missing, unexpected, mismatched)``: keys only in ``expected``, keys
        only in ``given``, and ``(key, given shape, expected shape)`` for
        shared keys whose shapes differ.

    Example:
        >>> import torch
        >>> state_dict_diff({"a": torch.zeros(2), "b": torch.zeros(1)}, {"a": torch.zeros(3), "c": 1})
        (['b'], ['c'], [('a', (3,), (2,))])
    """
    missing = sorted(k for k in expected if k not in given)
    unexpected = sorted(k for k in given if k not in expected)
    mismatched = []
    for key in sorted(k for k in expected if k in given):
        mine, theirs = expected[key], given[key]
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.shape != theirs.shape:
            mismatched.append((key, tuple(theirs.shape), tuple(mine.shape)))
    return missing, unexpected, mismatched


def _names(keys, limit: int = 8) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_weights(model: nn.Module, state_dict: Mapping[str, Any], *, source: str = "checkpoint") -> None:
    """Load ``state_dict`` into ``model`` strictly, naming every key that does not fit.

    Args:
        model: The (unwrapped) model.
        state_dict: Weights, e.g. from :func:`load_payload`.
        source: How to call the origin in the error message (a path).

    Raises:
        CheckpointMismatchError: Missing or unexpected keys, or shapes that differ.

    Example:
        >>> import torch.nn as nn
        >>> load_weights(nn.Linear(2, 2), nn.Linear(3, 2).state_dict(), source="other.pt")
        Traceback (most recent call last):
        ...
        nn_handler.errors.CheckpointMismatchError: other.pt does not fit Linear: shapes differ: weight (checkpoint (2, 3), model (2, 2))
    """
    missing, unexpected, mismatched = state_dict_diff(model.state_dict(), state_dict)
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_names(missing)}")
        if unexpected:
            parts.append(f"not in the model: {_names(unexpected)}")
        if mismatched:
            parts.append("shapes differ: " + _names(f"{k} (checkpoint {a}, model {b})" for k, a, b in mismatched))
        hint = ""
        if unexpected and all(k.startswith("module.") for k in unexpected):
            hint = " (the keys start with 'module.': the file was saved from a DDP/DataParallel wrapper)"
        raise CheckpointMismatchError(
            f"{source} does not fit {type(model).__name__}: " + "; ".join(parts) + hint,
            missing, unexpected, mismatched,
        )
    model.load_state_dict(state_dict, strict=True)


def capture_rng_state() -> dict[str, Any]:
    """Every random generator training touches, as tensors and plain values.

    Covers torch's CPU generator, every CUDA device's generator, Python's
    ``random`` and, when installed, NumPy's global generator.

    Example:
        >>> import torch
        >>> state = capture_rng_state(); a = torch.rand(1)
        >>> restore_rng_state(state); bool(torch.rand(1) == a)
        True
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # A NumPy array would need an allow-listed unpickler; a tensor does not.
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned (parts that do not apply here are skipped)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("checkpoint has RNG states for %d CUDA devices, this machine has %d; not restored",
                        len(cuda), torch.cuda.device_count())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached"]))


def _as_tuple(value):
    # random.setstate wants tuples all the way down; a round trip may give lists.
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def list_checkpoints(dirpath: str | os.PathLike, pattern: str = "*.ckpt") -> list[Path]:
    """Complete checkpoint files in ``dirpath``, oldest first (by modification time, then name).

    Temporary files of an interrupted :func:`atomic_save` are skipped.

    Example:
        >>> list_checkpoints("/nonexistent")
        []
    """
    d = Path(dirpath)
    if not d.is_dir():
        return []
    found = [p for p in d.glob(pattern) if p.is_file() and not is_temp_file(p)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


# ---------------------------------------------------------------- a run's checkpoint directory

_RUN_NAME = re.compile(r"^epoch-(\d+)(?:-batch-(\d+))?\.ckpt$")


def run_checkpoint_name(epoch: int, batches: int = 0) -> str:
    """File name of a checkpoint in an ``NNHandler(checkpoint_dir=...)`` directory.

    Args:
        epoch: After ``batches == 0``, the epochs complete; otherwise the epoch in progress (from 1).
        batches: Batches of that epoch already trained (a preemption mid-epoch).

    Example:
        >>> run_checkpoint_name(2), run_checkpoint_name(3, 5)
        ('epoch-0002.ckpt', 'epoch-0003-batch-000005.ckpt')
    """
    return f"epoch-{epoch:04d}.ckpt" if batches == 0 else f"epoch-{epoch:04d}-batch-{batches:06d}.ckpt"


def run_checkpoint_key(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(epochs complete, batches into the next epoch)`` from a name :func:`run_checkpoint_name` made, else ``None``.

    Orders a run's checkpoints by training progress: the file name says how far
    training was, where modification times can tie or lie (copied directories,
    clock skew between the nodes of a shared file system).

    Example:
        >>> run_checkpoint_key("epoch-0003-batch-000005.ckpt"), run_checkpoint_key("epoch-0003.ckpt")
        ((2, 5), (3, 0))
        >>> run_checkpoint_key("best.ckpt") is None
        True
    """
    match = _RUN_NAME.match(Path(path).name)
    if match is None:
        return None
    epoch, batches = int(match.group(1)), int(match.group(2) or 0)
    return (epoch - 1, batches) if batches else (epoch, 0)


def list_run_checkpoints(dirpath: str | os.PathLike) -> list[Path]:
    """The complete checkpoints of a run directory, oldest first by training progress.

    Only names made by :func:`run_checkpoint_name` count (other files, such as
    :class:`~nn_handler.ModelCheckpoint`'s, are left out), and temporary files
    of an interrupted write never do.

    Example:
        >>> list_run_checkpoints("/nonexistent")
        []
    """
    found = [(key, p) for p in list_checkpoints(dirpath) if (key := run_checkpoint_key(p)) is not None]
    return [p for _, p in sorted(found)]


def prune_run_checkpoints(dirpath: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` run checkpoints; returns the deleted paths.

    A file that cannot be deleted is logged and kept: losing old checkpoints
    late is better than failing a training run over it.
    """
    removed = []
    for path in list_run_checkpoints(dirpath)[:-keep_last] if keep_last > 0 else []:
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not delete the old checkpoint %s: %s", path, exc)
    return removed


def remove_stale_temp_files(dirpath: str | os.PathLike) -> list[Path]:
    """Delete temporary files that interrupted writes of run checkpoints left in ``dirpath``.

    Call it only when no write into the directory is in progress (before training starts).
    """
    d = Path(dirpath)
    if not d.is_dir():
        return []
    removed = []
    for path in d.iterdir():
        name = path.name
        if is_temp_file(path) and _RUN_NAME.match(name[1:name.index(_TMP_MARK)]):
            try:
                path.unlink()
                removed.append(path)
            except OSError as exc:
                log.warning("could not delete the stale temporary file %s: %s", path, exc)
    return removed
