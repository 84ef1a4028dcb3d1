"""Sharded checkpoints (``strategy="fsdp"``): a directory written by every rank with ``torch.distributed.checkpoint``.

Layout of ``epoch-0003.ckpt/``: DCP's files (``.metadata``, one
``__<rank>_0.distcp`` per rank) holding ``{"model": ..., "optimizer": ...}``
(by parameter name, so they load on any number of ranks, sharded or not),
and :data:`~nn_handler.checkpoint.SHARDED_META`: everything else a resume
needs (scheduler, epoch, step, History, RNG states, callbacks, run id), as
the checkpoint builder of :mod:`nn_handler._training.resume` made it, with
the weights left out.

The commit is atomic: every rank writes into a temporary directory beside
the destination (a name :func:`~nn_handler.checkpoint.is_temp_file`
recognizes), rank 0 writes the metadata file last and renames the
directory into place. A process killed mid-save leaves a temporary
directory, never a directory under a checkpoint's name, so the previous
checkpoint stays the newest; ``resume="auto"`` deletes the leftover.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from ..checkpoint import (FORMAT, SHARDED_META, TMP_MARK, atomic_save, check_weights, fsync_dir, load_payload,
                          load_weights)
from ..errors import CheckpointError
from ..utils._collectives import check_collective_allowed, run_on_ranks, side_group
from . import sharding as SH
from .parts import Parts


def write(parts: Parts, payload: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``payload`` as a sharded checkpoint directory at ``path``; call it on every rank."""
    path = Path(path)
    tmp = _on_main(parts, functools.partial(_make_temp_dir, path), f"creating a directory beside {path}",
                   broadcast=True)
    module, optimizer = parts.module, parts.optimizer
    if optimizer is not None:
        model_state, optimizer_state = get_state_dict(module, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(module)}
    try:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp, no_dist=not parts.in_group)
    except BaseException:
        if parts.is_main_process:  # DCP raised on every rank: nothing writes into it any more
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = dict(payload)
    meta["model"] = {}
    if meta.get("optimizer") is not None:  # the param groups alone: resume checks their sizes before loading
        meta["optimizer"] = {"state": {}, "param_groups": meta["optimizer"]["param_groups"]}
    meta["sharded"] = {"world_size": parts.world_size, "optimizer": optimizer is not None}
    _on_main(parts, functools.partial(_commit, Path(tmp), path, meta), f"the commit of the checkpoint {path}")


def _on_main(parts: Parts, fn, what: str, broadcast: bool = False) -> Any:
    """``fn()`` on rank 0 alone; when it fails there, every rank raises."""
    if not parts.in_group:
        return fn()
    return run_on_ranks(side_group(), fn, what=what, broadcast=broadcast, peer_error=lambda err: CheckpointError(
        f"rank 0 failed at {what}; see rank 0's error"))


def _make_temp_dir(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    return str(tmp)


def _commit(tmp: Path, path: Path, meta: dict[str, Any]) -> None:
    # The metadata file last: a directory without it was never complete.
    atomic_save(meta, tmp / SHARDED_META)
    old = None
    if path.exists():  # a directory cannot be renamed over a non-empty one: move the old aside first
        old = path.with_name(f".{path.name}{TMP_MARK}old.{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is None:
        return
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


_COMPILED = "_orig_mod."  # what torch.compile's wrapper (OptimizedModule) puts in front of its module's keys


def plain_keys(weights: Mapping[str, Any]) -> dict[str, Any]:
    """``weights`` with torch.compile's ``_orig_mod.`` taken out of every key: the keys of the plain model.

    NNHandler compiles in place, so its own weights have plain keys; this
    also reads the ``state_dict`` of a model compiled elsewhere.

    Example:
        >>> list(plain_keys({"_orig_mod.0.weight": 1, "head._orig_mod.bias": 2}))
        ['0.weight', 'head.bias']
    """
    return {key.replace(_COMPILED, ""): value for key, value in weights.items()}


def load(parts: Parts, payload: Mapping[str, Any], path: str | os.PathLike, resume: bool) -> bool:
    """Load the weights of ``payload`` (and with ``resume`` the optimizer) into ``parts``; call it on every rank.

    Handles every pairing of checkpoint and model: a sharded directory into a
    sharded or a plain model (any number of ranks), a single file into a
    sharded model, a single file into a plain one.

    Returns:
        True when the optimizer state was loaded here too.

    Raises:
        CheckpointMismatchError: The weights do not fit the model (keys named).
        CheckpointError: DCP could not read the directory.
    """
    with_optimizer = resume and parts.optimizer is not None and payload.get("optimizer") is not None
    if payload.get("sharded") is not None:
        _load_directory(parts, Path(path), with_optimizer)
        return with_optimizer
    if SH.is_sharded(parts.module):
        SH.load_full_state(parts.module, plain_keys(payload["model"]),
                           parts.optimizer if with_optimizer else None,
                           payload["optimizer"] if with_optimizer else None, source=str(path))
        return with_optimizer
    load_weights(parts.module, plain_keys(payload["model"]), source=str(path))
    return False


def check_complete(path: str | os.PathLike) -> None:
    """Raise a CheckpointError naming the directory when a file DCP's metadata lists is missing or too short.

    Costs a read of ``.metadata`` and a ``stat`` per shard file: what a
    partial copy or an interrupted transfer leaves is found before a load
    starts (DCP itself would fail halfway, on some ranks).
    """
    path = Path(path)
    try:
        storage = _read_metadata(path).storage_data
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"the sharded checkpoint {path} has no readable DCP metadata (.metadata): "
                              f"{type(exc).__name__}: {exc}") from exc
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < size:
            problems.append(f"{name} is truncated ({file.stat().st_size} of {size} bytes)")
    if problems:
        raise CheckpointError(f"the sharded checkpoint {path} is incomplete: {'; '.join(problems)} (was it copied "
                              f"in part, or changed after it was written?)")


def _read_metadata(path: Path):
    return dcp.FileSystemReader(str(path)).read_metadata()


def _load_directory(parts: Parts, path: Path, with_optimizer: bool) -> None:
    module = parts.module
    check_complete(path)
    # Names and shapes from DCP's metadata first: a checkpoint that does not
    # fit is refused by name before anything is loaded.
    saved = _read_metadata(path).state_dict_metadata
    shapes = {k[len("model."):]: torch.empty(tuple(getattr(v, "size", ())), device="meta")
              for k, v in saved.items() if k.startswith("model.")}
    check_weights(module, shapes, source=str(path))
    if with_optimizer:
        model_state, optimizer_state = get_state_dict(module, parts.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(module)}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=not parts.in_group)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"could not load the sharded checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    if with_optimizer:
        set_state_dict(module, parts.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(module, state["model"])


def check_every_rank_runs(parts: Parts, what: str, sharded_only: bool = False) -> None:
    """Refuse at once, inside ``on_rank`` or ``main_process_first``, a call whose collectives need every rank.

    Without this it would wait for the other ranks until the stall watchdog
    ends it. ``sharded_only``: only a sharded (FSDP) model's call needs them.
    """
    if parts.in_group and (not sharded_only or SH.is_sharded(parts.module)):
        check_collective_allowed(what)


def load_model(parts: Parts, path: str | os.PathLike) -> None:
    """:meth:`NNHandler.load_model`: weights from a ``state_dict`` file, a checkpoint file or a checkpoint directory."""
    check_every_rank_runs(parts, "NNHandler.load_model", sharded_only=True)  # a sharded load is a collective
    payload = load_payload(path)
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        load(parts, payload, path, resume=False)
        return
    if not isinstance(payload, Mapping):
        raise CheckpointError(f"{path} holds a {type(payload).__name__}, not a state_dict")
    load(parts, {"model": payload}, path, resume=False)


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns that it "assumes the intent is to load in a single process"
    # when there is no group: exactly the case of a run on one process.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
