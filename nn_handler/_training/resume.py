"""What a checkpoint holds, how it is written from rank 0, and how a run starts and resumes.

A run owns the files of ``checkpoint_dir`` that carry its id. At the first
``train()``, rank 0 alone lists the directory and decides (:func:`start_run`):
which file to resume from, whether another run's files refuse the directory
or are deleted (``overwrite``); every rank then loads the chosen file itself,
and every rank raises if one of them fails.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..checkpoint import (
    FORMAT,
    atomic_save,
    capture_rng_state,
    load_payload,
    prune_run_checkpoints,
    read_run_info,
    remove_checkpoint,
    remove_stale_temp_files,
    restore_rng_state,
    run_checkpoint_name,
    run_info,
    scan_run_checkpoints,
)
from ..errors import CheckpointError, CheckpointMismatchError, ConfigurationError, RankFailedError
from ..utils._collectives import agree_on_failure, check_collective_allowed, gather, run_on_ranks, side_group
from . import sharded_checkpoint
from .buffers import sync_buffers
from .config import TrainingConfig
from .data import sampler_generator
from .parts import MODEL, OPTIMIZER, Parts
from .report import resumed_line, say
from .sharding import full_model_state
from .sharded_checkpoint import plain_keys
from .state import TrainingState

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- writing
def state_dict(parts: Parts, state: TrainingState, rng_states: list | None = None) -> dict[str, Any]:
    """Everything a resume needs to continue exactly, as plain tensors and values."""
    generator = sampler_generator(parts.train_loader)
    return {
        "format": FORMAT,
        "run": {"id": state.run_id, "seq": None},  # seq: the write number in checkpoint_dir
        **trained_state(parts),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        **state.state_dict(),
        "rng": rng_states if rng_states is not None else [capture_rng_state()],
        "world_size": parts.world_size,
        "sampler_generator": generator.get_state() if generator is not None else None,
        "callbacks": {key: cb.state_dict() for key, cb in _callback_keys(parts.callbacks)},
        "torch_version": str(torch.__version__),  # TorchVersion is not a plain str
    }


def trained_state(parts: Parts) -> dict[str, Any]:
    """The models', optimizers' and schedulers' states and classes (another class's state loads without a word
    and fails at the first step): by name, or, for one model and at most one optimizer, as ``model``,
    ``optimizer``, ``scheduler`` (the layout of the checkpoints before names)."""
    states = {"models": {name: plain_keys(m.state_dict()) for name, m in parts.modules.items()},
              "optimizers": {name: o.state_dict() for name, o in parts.optimizers.items()},
              "schedulers": {name: s.state_dict() for name, s in parts.schedulers.items()},
              "optimizer_classes": {name: class_name(o) for name, o in parts.optimizers.items()},
              "scheduler_classes": {name: class_name(s) for name, s in parts.schedulers.items()}}
    if parts.named:
        return states
    return {"model": states["models"][MODEL], "optimizer": states["optimizers"].get(OPTIMIZER),
            "scheduler": states["schedulers"].get(OPTIMIZER),
            "optimizer_class": states["optimizer_classes"].get(OPTIMIZER),
            "scheduler_class": states["scheduler_classes"].get(OPTIMIZER)}


def named_states(payload: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A checkpoint's models, optimizers and schedulers (and their classes) by name, whichever layout it has."""
    if "models" in payload:
        return {key: dict(payload.get(key) or {}) for key in
                ("models", "optimizers", "schedulers", "optimizer_classes", "scheduler_classes")}
    alone = {key: ({} if payload.get(key) is None else {OPTIMIZER: payload[key]}) for key in
             ("optimizer", "scheduler", "optimizer_class", "scheduler_class")}
    return {"models": {MODEL: payload["model"]}, "optimizers": alone["optimizer"], "schedulers": alone["scheduler"],
            "optimizer_classes": alone["optimizer_class"], "scheduler_classes": alone["scheduler_class"]}


def save(parts: Parts, state: TrainingState, path, partial: dict[str, Any] | None = None, stopped: bool = False,
         seq: int | None = None) -> None:
    """Gather every rank's random state (and mid-epoch part), then write the checkpoint from rank 0."""
    check_collective_allowed("NNHandler.save_checkpoint")  # a gather: refused where not every rank is
    sync_buffers(parts, "NNHandler.save_checkpoint")  # a sharded checkpoint would hold whichever rank's DCP keeps
    mine = (capture_rng_state(), partial)
    everyone = [mine]
    if parts.in_group:
        # Each rank resumes with its own random streams, and mid-epoch with
        # its own shard's losses so far.
        everyone = gather(side_group(), mine)  # not all_gather_object: it needs numpy
    payload = state_dict(parts, state, [rng for rng, _ in everyone])
    payload["run"]["seq"] = seq
    payload["stopped"] = bool(stopped)
    if partial is not None:
        payload["partial"] = {"batches": partial["batches"],
                              "ranks": [{k: v for k, v in p.items() if k != "batches"} for _, p in everyone]}
    for cb in parts.callbacks:
        cb.on_save_checkpoint(parts.view, payload)
    if parts.strategy == "fsdp":
        sharded_checkpoint.write(parts, payload, path)
    else:
        write_on_main(parts, payload, path, "checkpoint")


def save_run_checkpoint(parts: Parts, config: TrainingConfig, state: TrainingState,
                        partial: dict[str, Any] | None = None) -> Path:
    """Write the next checkpoint of ``checkpoint_dir`` (mid-epoch with ``partial``) and drop old ones."""
    state.run_seq += 1
    if partial is None:
        path = config.checkpoint_dir / run_checkpoint_name(state.epoch)
        save(parts, state, path, stopped=state.stop_training, seq=state.run_seq)
    else:
        path = config.checkpoint_dir / run_checkpoint_name(state.epoch + 1, partial["batches"])
        save(parts, state, path, partial, seq=state.run_seq)
    # In an on_rank exchange: the others wait for it however long the deletion takes (no stall), and
    # every rank raises if it fails.
    on_main(parts, functools.partial(prune_run_checkpoints, config.checkpoint_dir, config.keep_last,
                                     run_id=state.run_id),
            f"the pruning of checkpoint_dir {config.checkpoint_dir}",
            lambda err: CheckpointError(f"rank 0 could not prune {config.checkpoint_dir}; see rank 0's error"))
    return path


def on_main(parts: Parts, fn: Callable[[], Any], what: str,
            peer_error: Callable[[RankFailedError], BaseException], broadcast: bool = False) -> Any:
    """Run ``fn()`` on rank 0 alone; when it fails there, every rank raises (the others ``peer_error``)."""
    if not parts.in_group:
        return fn() if parts.is_main_process else None  # a handler told use_distributed=False decides alone
    return run_on_ranks(side_group(), fn, what=what, broadcast=broadcast, peer_error=peer_error)


def export_model(parts: Parts, path) -> None:
    """The whole model's ``state_dict`` as one file from rank 0 (a sharded model's gathered first); on every rank.

    With several models (or optimizers): one file of ``{name: state_dict}``.
    """
    check_collective_allowed("NNHandler.export_model")  # the gather of a sharded model hangs where not every rank is
    weights = {name: plain_keys(full_model_state(module)) for name, module in parts.modules.items()}
    write_on_main(parts, weights if parts.named else weights[MODEL], path, "model")


def load_model(parts: Parts, path) -> None:
    """:meth:`NNHandler.load_model`: weights from a ``state_dict`` file (by name, with several models), a
    checkpoint file or a checkpoint directory."""
    sharded_checkpoint.check_every_rank_runs(parts, "NNHandler.load_model", sharded_only=True)  # a collective
    payload = load_payload(path)
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        payload = checked_payload(payload, path)
    elif not isinstance(payload, Mapping):
        raise CheckpointError(f"{path} holds a {type(payload).__name__}, not a state_dict")
    elif not parts.named:
        payload = {"model": payload}
    elif set(payload) == set(parts.models) and all(isinstance(v, Mapping) for v in payload.values()):
        payload = {"models": payload}
    else:
        raise CheckpointMismatchError(f"{path} is not a file of models by name ({', '.join(map(repr, parts.models))},"
                                      f" as export_model writes it); a single model's state_dict loads into one "
                                      f"of them: handler.models[name].load_state_dict(torch.load(path))")
    saved = named_states(payload)
    _check_names(parts, saved, path, resume=False)
    sharded_checkpoint.load(parts, saved, payload.get("sharded") is not None, path, resume=False)


def write_on_main(parts: Parts, payload: Any, path, what: str) -> None:
    # Every rank raises when the write fails, so none waits forever.
    on_main(parts, functools.partial(atomic_save, payload, path), f"the write of the {what} {path}",
            lambda err: CheckpointError(f"rank 0 could not write the {what} {path}; see rank 0's error"))
    if parts.is_main_process:
        log.info("saved %s %s", what, path)


# ----------------------------------------------------------------------------- starting a run
def start_run(parts: Parts, config: TrainingConfig, state: TrainingState) -> None:
    """Before the first epoch: load what ``resume`` names, and claim ``checkpoint_dir`` for this run.

    Rank 0 alone lists the directory and decides (ranks that listed it
    themselves could see different files while rank 0 is still writing);
    every rank then loads the file it chose, or raises its refusal.
    """
    loaded: dict[str, Any] = {}  # the payload rank 0 already read: only the plan travels
    directory = config.checkpoint_dir

    def plan_on_main() -> dict[str, Any]:
        try:
            loaded["payload"], plan = _plan_run(config, state)
        except ConfigurationError as exc:  # a refusal, which every rank raises alike
            return {"refused": str(exc)}
        return plan

    def unread(err: RankFailedError) -> CheckpointError:
        failure = err.failures[0]
        return CheckpointError(f"rank 0 could not read checkpoint_dir {directory}: "
                               f"{failure.exc_type.rpartition('.')[2]}: {failure.message}")

    plan = on_main(parts, plan_on_main, f"the resume plan for checkpoint_dir {directory}", unread, broadcast=True)
    if "refused" in plan:
        raise ConfigurationError(plan["refused"])
    if plan["path"] is not None:
        _resume_from(parts, state, Path(plan["path"]), loaded.get("payload"), plan["why"])
    state.run_seq = max(state.run_seq, plan["seq"])
    if plan["delete"]:  # rank 0 deletes in an on_rank exchange, as pruning does; when it fails, every rank raises
        on_main(parts, functools.partial(_delete_others, directory, plan["delete"]),
                f"deleting another run's checkpoints from {directory}",
                lambda err: CheckpointError(f"rank 0 could not delete another run's checkpoints from {directory} "
                                            f"(overwrite=True); see rank 0's error"))


def _delete_others(directory: Path, names: list[str]) -> None:
    for name in names:
        try:
            remove_checkpoint(directory / name)  # a file, or a sharded checkpoint's directory
        except FileNotFoundError:
            pass
    log.warning("overwrite=True: deleted the checkpoints of another run from %s: %s", directory, ", ".join(names))


def _plan_run(config: TrainingConfig, state: TrainingState) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Rank 0's part of :func:`start_run`: ``(payload already loaded or None, plan for every rank)``.

    Raises:
        ConfigurationError: ``checkpoint_dir`` holds checkpoints of a run
            other than the one this handler continues, and not ``overwrite``.
    """
    directory, resume = config.checkpoint_dir, config.resume
    if resume == "auto":
        # Nothing writes into the directory yet, so temporary files are
        # leftovers of a write that a crash interrupted.
        remove_stale_temp_files(directory)
    found = scan_run_checkpoints(directory) if directory is not None else []
    payload, path, why, run_id, damaged = None, None, "", state.run_id, set()
    if resume == "auto":
        # Newest by write number, not by epoch: a run resumed from an
        # earlier checkpoint writes lower epochs after higher ones.
        for entry in reversed(found):
            try:
                if entry.error is not None:
                    raise CheckpointError(entry.error)
                payload = checked_payload(load_payload(entry.path), entry.path)
            except CheckpointError as exc:
                log.warning("not resuming from %s: %s", entry.path, exc)
                damaged.add(entry.path)
                continue
            path, run_id = entry.path, entry.run_id
            why = (f", the newest of the {len(found)} checkpoints in {directory} by write order" if len(found) > 1
                   else f", the only checkpoint in {directory}")
            break
        else:
            say(f"nn_handler: resume='auto': no checkpoint in {directory} yet, training starts from the beginning", log)
    elif resume is not None:
        path = Path(resume)
        if found:
            try:
                run_id = read_run_info(path)[0]
            except CheckpointError:
                run_id = None  # not loadable: the load reports why, on every rank
    # Unreadable files belong to no run: neither refused nor deleted (the
    # next write of that name replaces them).
    others = [e.path.name for e in found
              if e.error is None and e.path not in damaged and run_id is not None and e.run_id != run_id]
    if others and not config.overwrite:
        raise ConfigurationError(_refusal(config, others, path))
    return payload, {"path": None if path is None else str(path), "why": why,
                     "delete": others if config.overwrite else [],
                     "seq": max((e.seq for e in found if e.seq is not None), default=0)}


def _refusal(config: TrainingConfig, others: list[str], resumed: Path | None) -> str:
    files = ", ".join(others[:6]) + (f", ... ({len(others) - 6} more)" if len(others) > 6 else "")
    if resumed is None:
        return (f"checkpoint_dir {config.checkpoint_dir} holds checkpoints of another run ({files}), and this "
                f"run would write its own among them: pass resume='auto' to continue that run, overwrite=True "
                f"to delete them and start a new run, or use another checkpoint_dir to keep both")
    remedy = ("move them away or use another checkpoint_dir" if config.resume == "auto" else
              "pass overwrite=True to delete them, or use another checkpoint_dir")
    return (f"checkpoint_dir {config.checkpoint_dir} holds checkpoints of another run than the one resumed from "
            f"{resumed} ({files}), and this run would write its own among them: {remedy}")


def _resume_from(parts: Parts, state: TrainingState, path: Path, payload: dict[str, Any] | None,
                 why: str = "") -> None:
    """Load ``path`` on every rank (rank 0 may have loaded it already); every rank raises if one fails."""
    error = None
    try:
        if payload is None:
            payload = checked_payload(load_payload(path), path)
        restore(parts, state, payload, path)
    except BaseException as exc:  # reported to every rank below, so none trains on alone
        error = exc
    if not parts.in_group:
        if error is not None:
            raise error
    else:
        try:
            agree_on_failure(side_group(), f"loading {path}", error, peer_error=lambda err: CheckpointError(
                f"another rank could not load {path} (see its error); every rank reads the checkpoint "
                f"itself, so it must be on a file system that all nodes share"))
        finally:
            error = None  # no frame <-> traceback cycle
    state.finished_early = bool(payload.get("stopped", False))
    if parts.is_main_process:
        partial = state.resume_partial
        say(resumed_line(path, why, state.epoch, state.global_step, partial and partial["batches"],
                         state.finished_early), log)


# ----------------------------------------------------------------------------- loading
def restore(parts: Parts, state: TrainingState, payload: dict[str, Any], path, resume: bool = True) -> int:
    """Load ``payload`` into the parts and the state; returns the epochs it had completed.

    Everything that can refuse the file does so before anything changes: a
    refused load leaves the handler as it was.
    """
    sharded_checkpoint.check_every_rank_runs(parts, "NNHandler.load_checkpoint", sharded_only=True)
    saved = named_states(payload)
    _check_names(parts, saved, path, resume)
    if resume:
        _check_resumable(parts, saved, path)
    # Any strategy's weights, any layout.
    optimizers_loaded = sharded_checkpoint.load(parts, saved, payload.get("sharded") is not None, path, resume)
    if not resume:
        return int(payload["epoch"])
    _restore_scaler(parts, payload["scaler"], path)
    for what, targets in (("optimizer", parts.optimizers), ("scheduler", parts.schedulers)):
        if what == "optimizer" and optimizers_loaded:
            continue  # with the weights, from a sharded checkpoint
        for name, part in saved[f"{what}s"].items():
            if part is not None and name in targets:
                targets[name].load_state_dict(part)
            elif part is not None:
                log.warning("%s holds %s state but this handler has no %s; it is not restored", path,
                            what if name == OPTIMIZER else f"{what} {name!r}", what)
    state.load_state_dict(payload)
    state.run_id = run_info(payload)[0]  # continuing that run: its files in checkpoint_dir are ours
    rngs = payload["rng"]
    if len(rngs) != parts.world_size:
        log.warning("%s was written by %d ranks, this run has %d; random streams will differ from an "
                    "uninterrupted run", path, len(rngs), parts.world_size)
    restore_rng_state(rngs[parts.rank % len(rngs)])
    generator = sampler_generator(parts.train_loader)
    if payload.get("sampler_generator") is not None and generator is not None:
        generator.set_state(payload["sampler_generator"])
    states = payload.get("callbacks", {})
    for key, cb in _callback_keys(parts.callbacks):
        if key in states:
            cb.load_state_dict(states[key])
        cb.on_load_checkpoint(parts.view, payload)
    state.resume_partial = None
    partial = payload.get("partial")
    if partial is not None and len(partial["ranks"]) != parts.world_size:
        log.warning("%s was written %d batches into epoch %d by %d ranks and this run has %d, so their shards "
                    "differ: epoch %d starts over from its first batch, from the weights of the checkpoint",
                    path, partial["batches"], state.epoch + 1, len(partial["ranks"]), parts.world_size,
                    state.epoch + 1)
        state.drop_partial_row()  # that part's History row goes with it
    elif partial is not None:
        state.resume_partial = {"batches": int(partial["batches"]), "rng": rngs[parts.rank],
                                **partial["ranks"][parts.rank]}
    return state.epoch


def _restore_scaler(parts: Parts, saved: Mapping[str, Any] | None, path) -> None:
    """The loss scale follows the precision of the handler that loads, not of the one that wrote.

    fp16 -> fp16 continues the saved scale. fp16 -> bf16 or full precision
    drops it (nothing is scaled there). bf16 or full precision -> fp16 starts
    a fresh scaler, which finds its scale in the first few steps (a step whose
    gradients overflow is skipped, as at the start of any fp16 run).
    """
    if saved is not None and parts.scaler is not None:
        parts.scaler.load_state_dict(saved)
    elif saved is not None:
        log.info("%s was trained with fp16 loss scaling; this handler runs %s and needs none: the scale is dropped",
                 path, parts.precision.name)
    elif parts.scaler is not None:
        # What the message says: the scale this handler reached before the load belongs to other weights.
        parts.scaler.load_state_dict(parts.precision.make_scaler().state_dict())
        log.info("%s holds no loss scale (not trained in fp16): this fp16 handler starts a fresh GradScaler", path)


def _check_names(parts: Parts, saved: dict[str, dict[str, Any]], path, resume: bool) -> None:
    """Refuse a checkpoint whose models (with ``resume``, optimizers) are not this handler's, by name."""
    checks = [("models", parts.models)] + ([("optimizers", parts.optimizers)] if resume else [])
    for what, mine in checks:
        theirs = [name for name, state in saved[what].items() if state is not None]
        if theirs and mine and set(theirs) != set(mine):
            raise CheckpointMismatchError(
                f"{path} holds the {what} {', '.join(map(repr, theirs))} and this handler has "
                f"{', '.join(map(repr, mine))}: build the handler with the {what} of the run that wrote it, by the "
                f"same names" + (", or load the weights alone with load_checkpoint(path, resume=False)"
                                 if what == "optimizers" else ""))


def _check_resumable(parts: Parts, saved: dict[str, dict[str, Any]], path) -> None:
    """Refuse optimizer or scheduler state that this handler's cannot take (torch would fail at the first step)."""
    for what, targets in (("optimizer", parts.optimizers), ("scheduler", parts.schedulers)):
        for name, target in targets.items():
            theirs, mine = saved[f"{what}_classes"].get(name), class_name(target)
            if saved[f"{what}s"].get(name) is not None and theirs is not None and theirs != mine:
                label = what if name == OPTIMIZER else f"{what} {name!r}"
                raise CheckpointMismatchError(
                    f"{path} holds the state of a {theirs} {label}; this handler's is {mine}: build the handler "
                    f"with the same {what} class to resume, or load the weights alone with "
                    f"load_checkpoint(path, resume=False)"
                )
    for name, optimizer in parts.optimizers.items():
        state = saved["optimizers"].get(name)
        if state is None:
            continue
        saved_sizes = [len(g["params"]) for g in state["param_groups"]]
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        if saved_sizes != sizes:
            label = "optimizer" if name == OPTIMIZER else f"optimizer {name!r}"
            raise CheckpointMismatchError(
                f"{path} holds {label} state for {len(saved_sizes)} parameter group(s) of {saved_sizes} "
                f"parameters; this handler's {label} has {len(sizes)} of {sizes}: build the optimizer as "
                f"the run that wrote it did, or load the weights alone with load_checkpoint(path, resume=False)"
            )


def checked_payload(payload: Any, path) -> dict[str, Any]:
    """``payload`` if it is a complete nn_handler checkpoint, else a CheckpointError naming ``path``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = sorted(payload)[:6] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{path} is not an nn_handler checkpoint (found {found}); for a file of weights alone use load_model()"
        )
    # What restore reads, checked here, so that a damaged or hand-made file
    # is refused by name before anything is loaded (not a KeyError halfway).
    optional = (Mapping, type(None))
    kinds = ({"models": Mapping, "optimizers": Mapping, "schedulers": Mapping} if "models" in payload else
             {"model": Mapping, "optimizer": optional, "scheduler": optional})
    kinds.update({"scaler": optional, "epoch": int, "global_step": int, "history": Mapping, "rng": (list, tuple)})
    problems = [f"no {key!r}" if key not in payload else f"{key!r} is a {type(payload[key]).__name__}"
                for key, kind in kinds.items() if key not in payload or not isinstance(payload[key], kind)]
    if not problems and not payload["rng"]:
        problems.append("'rng' is empty")
    if not problems:
        saved = named_states(payload)
        problems += [f"model {name!r} is a {type(m).__name__}" for name, m in saved["models"].items()
                     if not isinstance(m, Mapping)]
        problems += [f"{'optimizer' if name == OPTIMIZER else f'optimizer {name!r}'} is not an optimizer state_dict"
                     for name, optimizer in saved["optimizers"].items() if not _is_optimizer_state(optimizer)]
    if problems:
        raise CheckpointError(f"{path} is not a complete nn_handler checkpoint ({', '.join(problems)}); "
                              f"was it changed after NNHandler.save_checkpoint wrote it?")
    if payload.get("sharded") is not None:
        sharded_checkpoint.check_complete(path)  # the metadata file is there; are the shards?
    return payload


def _is_optimizer_state(state: Any) -> bool:
    return state is None or (
        isinstance(state, Mapping) and isinstance(state.get("state"), Mapping)
        and isinstance(state.get("param_groups"), (list, tuple))
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in state["param_groups"]))


def class_name(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _callback_keys(callbacks: list):
    """``(key, callback)`` pairs: the class name, ``Name#2`` for the second of a class, and so on."""
    counts: dict[str, int] = {}
    for cb in callbacks:
        name = type(cb).__qualname__
        counts[name] = counts.get(name, 0) + 1
        yield (name if counts[name] == 1 else f"{name}#{counts[name]}"), cb
