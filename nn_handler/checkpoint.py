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
import shutil
import uuid
import zipfile
from dataclasses import dataclass
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
    "UNNAMED_RUN",
    "run_info",
    "read_run_info",
    "RunCheckpoint",
    "scan_run_checkpoints",
    "list_run_checkpoints",
    "prune_run_checkpoints",
    "remove_stale_temp_files",
]

log = logging.getLogger(__name__)

#: Written into every handler checkpoint, so a foreign file is named as such.
FORMAT = "nn_handler.checkpoint/1"
_TMP_MARK = ".tmp."
TMP_MARK = _TMP_MARK
#: In a sharded checkpoint directory (``strategy="fsdp"``): everything but the weights, written last.
SHARDED_META = "nn_handler.pt"


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
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
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


def load_payload(path: str | os.PathLike, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """Load a file written by :func:`atomic_save` (or ``torch.save``) with ``weights_only=True``.

    Args:
        path: The file.
        map_location: Where tensors go; CPU by default, so a GPU checkpoint
            loads anywhere.
        mmap: Map the tensors' bytes instead of reading them (for a look at
            the small values of a large file); ignored for the pre-1.6 format.

    Returns:
        The saved object.

    Raises:
        CheckpointError: The file does not exist, is not a ``torch.save`` file
            (text, another program's archive), is truncated or corrupt, or
            holds objects other than tensors and plain Python values. The
            message names the file.

    Example:
        >>> load_payload("/nonexistent/x.ckpt")
        Traceback (most recent call last):
        ...
        nn_handler.errors.CheckpointError: no checkpoint at /nonexistent/x.ckpt
    """
    path = Path(path)
    if path.is_dir():  # a sharded checkpoint: its metadata file (the weights are DCP's files beside it)
        path = path / SHARDED_META
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    size = path.stat().st_size
    is_zip = _check_torch_file(path, size)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and is_zip)
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
    except MemoryError:
        raise
    except Exception as exc:
        # torch's legacy loader fails on bytes it cannot parse with whatever it
        # hit first (KeyError, IndexError, struct.error, ...): all mean "not a
        # file torch.save wrote in full".
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        detail = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({size} bytes; was its write interrupted?): {detail}"
        ) from exc


_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = 0x80  # the first byte of torch's pre-1.6 format, a pickle of protocol 2 or later


def _check_torch_file(path: Path, size: int) -> bool:
    """Refuse, naming ``path``, what is plainly not a torch.save file; True for a zip archive torch can read."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from exc
    if not head:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated (0 bytes; was its write interrupted?): "
                              f"the file is empty")
    if head.startswith(_ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError):
            # The central directory is at the end: a zip cut short has none.
            raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({size} bytes; was its write "
                                  f"interrupted?): an incomplete zip archive") from None
        if not any(n.endswith("/data.pkl") for n in names):
            raise CheckpointError(f"{path} is not a torch.save file: it is a zip archive of "
                                  f"{_names(sorted(names), 4)}; was another file saved under this name?")
        return True
    if head[0] != _PICKLE_PROTO:
        text = _as_text(head)
        if text is not None:
            line = text.splitlines()[0] if text.strip() else text
            raise CheckpointError(f"{path} is not a torch.save file: it holds text ({line[:60]!r}); "
                                  f"was a log or a CSV file saved under this name?")
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({size} bytes; was its write "
                              f"interrupted?): not a torch.save file")
    return False


def _as_text(head: bytes) -> str | None:
    # The last bytes read may end inside a UTF-8 character.
    for cut in range(4):
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return text if all(c.isprintable() or c in "\t\r\n" for c in text) else None
    return None


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
    check_weights(model, state_dict, source=source)
    model.load_state_dict(state_dict, strict=True)


def check_weights(model: nn.Module, state_dict: Mapping[str, Any], *, source: str = "checkpoint") -> None:
    """Raise :class:`~nn_handler.CheckpointMismatchError` naming every key of ``state_dict`` that does not fit ``model``."""
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

    Temporary files of an interrupted :func:`atomic_save` are skipped. A
    sharded checkpoint (a directory, ``strategy="fsdp"``) counts once its
    metadata file :data:`SHARDED_META` is in it.

    Example:
        >>> list_checkpoints("/nonexistent")
        []
    """
    d = Path(dirpath)
    if not d.is_dir():
        return []
    found = [p for p in d.glob(pattern) if (p.is_file() or (p / SHARDED_META).is_file()) and not is_temp_file(p)]
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


#: The run of checkpoints written before nn_handler recorded runs in them.
UNNAMED_RUN = "unnamed"


def run_info(payload: Mapping[str, Any]) -> tuple[str, int | None]:
    """``(run id, write number)`` of a handler checkpoint's payload.

    ``NNHandler`` writes both into every file of its ``checkpoint_dir``: the
    run id names the run (a rerun that resumes keeps it), the write number
    counts the directory's writes (1, 2, ...). Older files have neither:
    ``(UNNAMED_RUN, None)``.

    Example:
        >>> run_info({"run": {"id": "3f2a", "seq": 7}}), run_info({})
        (('3f2a', 7), ('unnamed', None))
    """
    run = payload.get("run")
    if not isinstance(run, Mapping) or not isinstance(run.get("id"), str):
        return UNNAMED_RUN, None
    seq = run.get("seq")
    return run["id"], seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def read_run_info(path: str | os.PathLike) -> tuple[str, int | None]:
    """:func:`run_info` of a checkpoint file, without reading its tensors.

    Raises:
        CheckpointError: The file cannot be read, or is not an nn_handler checkpoint.
    """
    payload = load_payload(path, mmap=True)  # the pickle alone: cheap even for a large file
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an nn_handler checkpoint")
    return run_info(payload)


@dataclass(frozen=True)
class RunCheckpoint:
    """A file of a run directory, as :func:`scan_run_checkpoints` found it.

    Attributes:
        path: The file.
        run_id: The run that wrote it (``None``: the file cannot be read).
        seq: Its place in the directory's write order (``None``: written
            before nn_handler numbered writes, or unreadable).
        error: Why the file cannot be read, else ``None``.
    """

    path: Path
    run_id: str | None
    seq: int | None
    error: str | None = None


def _write_order(entry: RunCheckpoint):
    # Numbered files in the order they were written; the older files without
    # a number come before them, by training progress as they always were.
    return (entry.seq is not None, entry.seq or 0, run_checkpoint_key(entry.path), entry.path.name)


def scan_run_checkpoints(dirpath: str | os.PathLike) -> list[RunCheckpoint]:
    """The checkpoints of a run directory with their run and write number, oldest write first.

    Only names made by :func:`run_checkpoint_name` count (other files, such as
    :class:`~nn_handler.ModelCheckpoint`'s, are left out), and temporary files
    of an interrupted write never do. Write numbers, not epoch numbers or
    modification times, give the order: a run resumed from an earlier
    checkpoint writes lower epoch numbers after higher ones, and copies or
    clock skew between the nodes of a shared file system change mtimes.

    Example:
        >>> scan_run_checkpoints("/nonexistent")
        []
    """
    found = []
    for path in list_checkpoints(dirpath):
        if run_checkpoint_key(path) is None:
            continue
        try:
            run_id, seq = read_run_info(path)
        except CheckpointError as exc:
            found.append(RunCheckpoint(path, None, None, str(exc)))
        else:
            found.append(RunCheckpoint(path, run_id, seq))
    return sorted(found, key=_write_order)


def list_run_checkpoints(dirpath: str | os.PathLike) -> list[Path]:
    """The checkpoints of a run directory, oldest write first (see :func:`scan_run_checkpoints`).

    Example:
        >>> list_run_checkpoints("/nonexistent")
        []
    """
    return [entry.path for entry in scan_run_checkpoints(dirpath)]


def prune_run_checkpoints(dirpath: str | os.PathLike, keep_last: int, *, run_id: str) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints that run ``run_id`` wrote; returns the deleted paths.

    Another run's files, and files that cannot be read, are never touched. A
    file that cannot be deleted is logged and kept: losing old checkpoints
    late is better than failing a training run over it.
    """
    own = [entry.path for entry in scan_run_checkpoints(dirpath) if entry.run_id == run_id]
    removed = []
    for path in own[:-keep_last] if keep_last > 0 else []:
        try:
            remove_checkpoint(path)
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
                remove_checkpoint(path)
                removed.append(path)
            except OSError as exc:
                log.warning("could not delete the stale temporary file %s: %s", path, exc)
    return removed


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file, or a sharded checkpoint's directory (or an interrupted write of either)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
