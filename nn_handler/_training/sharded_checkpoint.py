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
from torch import nn

from ..checkpoint import SHARDED_META, TMP_MARK, atomic_save, check_weights, fsync_dir, load_weights
from ..errors import CheckpointError
from ..utils._collectives import check_collective_allowed, run_on_ranks, side_group
from . import sharding as SH
from .parts import Parts


def _dcp():
    """torch.distributed.checkpoint with its state_dict helpers, imported at first use (it brings DTensor: see
    :mod:`.sharding`)."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (dcp.state_dict.get_state_dict, ...)

    return dcp


def write(parts: Parts, payload: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``payload`` as a sharded checkpoint directory at ``path``; call it on every rank."""
    path = Path(path)
    tmp = _on_main(parts, functools.partial(_make_temp_dir, path), f"creating a directory beside {path}",
                   broadcast=True)
    module, optimizers = _state_module(parts), list(parts.optimizers.values())
    if optimizers:
        model_state, optimizer_state = _dcp().state_dict.get_state_dict(module, optimizers)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": _dcp().state_dict.get_model_state_dict(module)}
    try:
        with _single_process_quiet():
            _dcp().save(state, checkpoint_id=tmp, no_dist=not parts.in_group)
    except BaseException:
        if parts.is_main_process:  # DCP raised on every rank: nothing writes into it any more
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = dict(payload)
    # The weights are DCP's; of the optimizers, the param groups alone: resume checks their sizes before loading.
    if "models" in meta:
        meta["models"] = {name: {} for name in meta["models"]}
        meta["optimizers"] = {name: _groups_only(o) for name, o in meta["optimizers"].items()}
    else:
        meta["model"], meta["optimizer"] = {}, _groups_only(meta.get("optimizer"))
    meta["sharded"] = {"world_size": parts.world_size, "optimizer": bool(optimizers)}
    _on_main(parts, functools.partial(_commit, Path(tmp), path, meta), f"the commit of the checkpoint {path}")


def _groups_only(optimizer_state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if optimizer_state is None else {"state": {}, "param_groups": optimizer_state["param_groups"]}


def _state_module(parts: Parts) -> nn.Module:
    """What DCP saves and loads: the one model (keys as in its ``state_dict``), or the models in one
    ``ModuleDict`` (keys ``<name>.<key>``), so that any optimizer, of whichever models, is found by name."""
    modules = parts.modules
    return nn.ModuleDict(modules) if parts.named else modules["model"]


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


def load(parts: Parts, saved: Mapping[str, Mapping[str, Any]], directory: bool, path: str | os.PathLike,
         resume: bool) -> bool:
    """Load the weights of ``saved`` (and with ``resume`` the optimizers) into ``parts``; call it on every rank.

    ``saved``: a checkpoint's states by name (``models``, ``optimizers``);
    ``directory``: it is a sharded checkpoint directory. Handles every
    pairing of checkpoint and model: a sharded directory into sharded or
    plain models (any number of ranks), a single file into sharded models,
    a single file into plain ones. Every model's weights are checked before
    any is loaded.

    Returns:
        True when the optimizers' states were loaded here too.

    Raises:
        CheckpointMismatchError: The weights do not fit the models (keys named).
        CheckpointError: DCP could not read the directory.
    """
    module = _state_module(parts)
    with_optimizer = resume and bool(parts.optimizers) and any(o is not None for o in saved["optimizers"].values())
    if directory:
        _load_directory(parts, module, Path(path), with_optimizer)
        return with_optimizer
    models = {name: plain_keys(weights) for name, weights in saved["models"].items()}
    weights = {f"{name}.{k}": v for name, w in models.items() for k, v in w.items()} if parts.named else models["model"]
    if not parts.sharded:
        load_weights(module, weights, source=str(path))
        return False
    optimizers = dict(parts.optimizers) if with_optimizer else {}
    SH.load_full_state(module, weights, list(optimizers.values()), [saved["optimizers"][n] for n in optimizers],
                       source=str(path))
    return with_optimizer


def check_complete(path: str | os.PathLike) -> None:
    """Raise a CheckpointError naming the directory when a file DCP's metadata lists is missing or too short.

    Costs a read of ``.metadata`` and a ``stat`` per shard file: what a
    partial copy or an interrupted transfer leaves is found before a load
    starts (DCP itself would fail halfway, on some ranks).
    """
    path = Path(path)
    try:
        storage = _read_metadata(path).storage_data
    except (Exception, _dcp().api.CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
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
    return _dcp().FileSystemReader(str(path)).read_metadata()


def _load_directory(parts: Parts, module: nn.Module, path: Path, with_optimizer: bool) -> None:
    check_complete(path)
    # Names and shapes from DCP's metadata first: a checkpoint that does not
    # fit is refused by name before anything is loaded.
    saved = _read_metadata(path).state_dict_metadata
    shapes = {k[len("model."):]: torch.empty(tuple(getattr(v, "size", ())), device="meta")
              for k, v in saved.items() if k.startswith("model.")}
    check_weights(module, shapes, source=str(path))
    optimizers = list(parts.optimizers.values())
    if with_optimizer:
        model_state, optimizer_state = _dcp().state_dict.get_state_dict(module, optimizers)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": _dcp().state_dict.get_model_state_dict(module)}
    try:
        with _single_process_quiet():
            _dcp().load(state, checkpoint_id=str(path), no_dist=not parts.in_group)
    except (Exception, _dcp().api.CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"could not load the sharded checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    if with_optimizer:
        _dcp().state_dict.set_state_dict(module, optimizers, model_state_dict=state["model"],
                                         optim_state_dict=state["optimizer"])
    else:
        _dcp().state_dict.set_model_state_dict(module, state["model"])


def check_every_rank_runs(parts: Parts, what: str, sharded_only: bool = False) -> None:
    """Refuse at once, inside ``on_rank`` or ``main_process_first``, a call whose collectives need every rank.

    Without this it would wait for the other ranks until the stall watchdog
    ends it. ``sharded_only``: only a sharded (FSDP) model's call needs them.
    """
    if parts.in_group and (not sharded_only or parts.sharded):
        check_collective_allowed(what)


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns that it "assumes the intent is to load in a single process"
    # when there is no group: exactly the case of a run on one process.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
