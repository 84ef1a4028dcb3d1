"""Hooks into :class:`~nn_handler.NNHandler` training, and the built-in callbacks.

Every hook runs on every rank, in the order the callbacks were given, with
the same arguments: the History is reduced over all ranks before the epoch
hooks run, so decisions taken from it (stop, save) agree everywhere. Hooks
that touch files (:class:`CSVLogger`) write from rank 0 only; a callback that
saves a checkpoint calls :meth:`NNHandler.save_checkpoint` on every rank (it
gathers the ranks' random states and writes from rank 0).

Example:
    >>> class PrintEpoch(Callback):
    ...     def on_epoch_end(self, handler, epoch, logs):
    ...         print(epoch, round(logs["train_loss"], 2))
    >>> cb = PrintEpoch()
    >>> cb.on_epoch_end(None, 1, {"train_loss": 0.4567})
    1 0.46
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from ._checks import check_choice, check_int, check_number, invalid
from .utils.ddp import is_main_process

if TYPE_CHECKING:
    import torch

    from .history import History

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "CSVLogger", "TrainerView"]

log = logging.getLogger(__name__)
Mode = Literal["min", "max"]


@runtime_checkable
class TrainerView(Protocol):
    """What a callback may use of the trainer that calls it; :class:`~nn_handler.NNHandler` is one.

    Hooks are typed against this view, not against the trainer's class, so
    that this module never imports :mod:`nn_handler.handler` (which imports
    this one). The attributes are those documented on ``NNHandler``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    history: History
    epoch: int
    global_step: int
    stop_training: bool
    partial_epoch: bool  # the epoch ends part-way (max_steps, max_time): its values are not the epoch's
    distributed: bool
    rank: int
    world_size: int
    device: torch.device

    @property
    def module(self) -> torch.nn.Module:
        """The model without its DDP wrapper."""

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (and in a single process)."""

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write a full training checkpoint (call it on every rank)."""

    def save_model(self, path: str | os.PathLike) -> None:
        """Write the model's weights."""


class Callback:
    """Base class: override the hooks you need; all default to doing nothing.

    ``epoch`` arguments count from 1, as the History's ``epoch`` column.
    ``logs`` is the epoch's History row (plain floats, identical on every
    rank). A callback with state to keep across a resume returns it from
    :meth:`state_dict` (tensors and plain Python values only).

    When ``max_steps`` or ``max_time`` stops training inside an epoch, that
    part of the epoch still ends with ``on_validation_end`` and
    ``on_epoch_end``, with ``handler.partial_epoch`` True: its values cover
    only the batches trained so far, and the run that continues the epoch
    calls the hooks again for the whole of it. A callback that decides
    something from the values (stop, keep a best) returns at once for a
    part, as the built-in ones do; a logger may record it.

    Example:
        >>> class CountBatches(Callback):
        ...     def __init__(self):
        ...         self.n = 0
        ...     def on_batch_end(self, handler, step, loss):
        ...         self.n += 1
    """

    def on_train_begin(self, handler: TrainerView) -> None:
        """Before the first epoch of a :meth:`~NNHandler.train` call."""

    def on_train_end(self, handler: TrainerView) -> None:
        """After the last epoch (also after an early stop); not called when training raised."""

    def on_epoch_begin(self, handler: TrainerView, epoch: int) -> None:
        """Before the first batch of ``epoch``."""

    def on_epoch_end(self, handler: TrainerView, epoch: int, logs: dict[str, Any]) -> None:
        """After validation, the scheduler step and the History update of ``epoch`` (or of its part)."""

    def on_batch_begin(self, handler: TrainerView, step: int) -> None:
        """Before batch ``step`` (from 0 within the epoch) is moved to the device."""

    def on_batch_end(self, handler: TrainerView, step: int, loss: "torch.Tensor") -> None:
        """After batch ``step``; ``loss`` is this rank's detached loss tensor.

        Calling ``loss.item()`` here waits for the GPU on every batch; keep it
        for debugging. With ``grad_accum_steps`` > 1 this runs per micro-batch;
        the two hooks below run once per optimizer step.
        """

    def on_before_optimizer_step(self, handler: TrainerView, step: int) -> None:
        """Before optimizer step ``step`` (the global step it becomes, from 1): the gradients are final.

        Accumulated, all-reduced under DDP (this rank's shards under FSDP),
        unscaled under fp16 and clipped (``clip_grad_norm``): what the
        optimizer is about to apply, e.g. for a gradient-norm logger.
        """

    def on_optimizer_step(self, handler: TrainerView, step: int) -> None:
        """After optimizer step ``step`` (``handler.global_step == step``), before a per-step scheduler steps.

        The weights are updated and the LR is still the one this step used.
        A step the fp16 scaler skipped (inf/NaN gradients) counts.
        """

    def on_validation_end(self, handler: TrainerView, epoch: int, logs: dict[str, float]) -> None:
        """After validation of ``epoch``; ``logs`` has ``val_loss`` and ``val_<metric>``."""

    def on_save_checkpoint(self, handler: TrainerView, payload: dict[str, Any]) -> None:
        """Before a checkpoint is written; may add entries to ``payload`` (plain values only)."""

    def on_load_checkpoint(self, handler: TrainerView, payload: dict[str, Any]) -> None:
        """After a checkpoint was loaded with ``resume=True``."""

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints and restored by :meth:`load_state_dict`."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class _Monitor:
    """Tracks the best value of one History key."""

    def __init__(self, monitor: str, mode: Mode, min_delta: float = 0.0):
        check_choice("mode", mode, ("min", "max"))
        if not isinstance(monitor, str) or not monitor:
            raise invalid("monitor", "a History key such as 'val_loss'", monitor)
        check_number("min_delta", min_delta, strict=False)
        self.monitor, self.mode, self.min_delta = monitor, mode, float(min_delta)
        self.best: float | None = None

    def value(self, logs: dict[str, Any], who: str) -> float:
        value = logs.get(self.monitor)
        if value is None:
            hint = " (set a validation loader with set_val_loader)" if self.monitor.startswith("val_") else ""
            raise ValueError(
                f"{who} monitors {self.monitor!r}, which this epoch's History row does not have{hint}; "
                f"available: {', '.join(k for k, v in logs.items() if v is not None)}"
            )
        return float(value)

    def improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


class EarlyStopping(Callback):
    """Stop training when a monitored History value stops improving.

    The monitored value is reduced over all ranks before this runs, and the
    handler agrees on the stop flag across ranks, so every rank stops after
    the same epoch. Part of an epoch (``handler.partial_epoch``) counts for
    nothing: the whole epoch decides once it is complete.

    Args:
        monitor: History key, e.g. ``"val_loss"``, ``"train_loss"``, ``"val_acc"``.
        patience: Epochs without improvement before stopping (>= 0).
        mode: ``"min"`` when lower is better, ``"max"`` when higher is.
        min_delta: The smallest change that counts as an improvement.

    Raises:
        ValueError: A bad argument; or, during training, a ``monitor`` key
            the History does not have (the message lists those it has).

    Example:
        >>> stopper = EarlyStopping("val_loss", patience=1)
        >>> class H: stop_training = False
        >>> h = H()
        >>> for epoch, loss in enumerate([1.0, 0.5, 0.6], start=1):
        ...     stopper.on_epoch_end(h, epoch, {"val_loss": loss})
        >>> h.stop_training, stopper.stopped_epoch
        (True, 3)
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, mode: Mode = "min", min_delta: float = 0.0):
        check_int("patience", patience, minimum=0)
        self._monitor = _Monitor(monitor, mode, min_delta)
        self.patience = patience
        self.wait = 0
        self.stopped_epoch: int | None = None

    @property
    def best(self) -> float | None:
        """The best value seen so far."""
        return self._monitor.best

    def on_epoch_end(self, handler, epoch, logs):
        if getattr(handler, "partial_epoch", False):
            return
        value = self._monitor.value(logs, "EarlyStopping")
        if self._monitor.improved(value):
            self._monitor.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            handler.stop_training = True
            log.info("early stopping after epoch %d: %s did not improve on %.6g for %d epochs",
                     epoch, self._monitor.monitor, self._monitor.best, self.wait)

    def state_dict(self):
        return {"best": self._monitor.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state):
        self._monitor.best, self.wait, self.stopped_epoch = state["best"], state["wait"], state["stopped_epoch"]


class ModelCheckpoint(Callback):
    """Save full training checkpoints while training.

    Files in ``dirpath``: ``epoch=NNNN.ckpt`` every ``every_n_epochs`` epochs
    (with ``save_best_only``, ``best.ckpt`` instead, only when ``monitor``
    improved) and ``last.ckpt`` after every epoch when ``save_last``. Each
    write is atomic; each file resumes training with
    :meth:`NNHandler.load_checkpoint`. Where ``max_steps`` or ``max_time``
    stops an epoch part-way, only ``last.ckpt`` is written (it resumes at the
    next batch): the epoch's file and "best" wait for the whole epoch.

    Args:
        dirpath: Directory for the files (created when needed).
        monitor: History key that decides "best".
        mode: ``"min"`` or ``"max"`` for ``monitor``.
        save_best_only: Keep one ``best.ckpt`` instead of one file per epoch.
        save_last: Also write ``last.ckpt`` every epoch.
        every_n_epochs: Consider saving every this many epochs (>= 1).

    Example:
        >>> ModelCheckpoint("ckpts", every_n_epochs=0)
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: every_n_epochs must be an int >= 1, got 0
    """

    def __init__(self, dirpath: str | os.PathLike, monitor: str = "val_loss", mode: Mode = "min",
                 save_best_only: bool = False, save_last: bool = True, every_n_epochs: int = 1):
        check_int("every_n_epochs", every_n_epochs, minimum=1)
        self.dirpath = Path(dirpath)
        self._monitor = _Monitor(monitor, mode)
        self.save_best_only, self.save_last, self.every_n_epochs = save_best_only, save_last, every_n_epochs
        self.best_path: str | None = None

    @property
    def best(self) -> float | None:
        """The best monitored value among the saved checkpoints."""
        return self._monitor.best

    def on_epoch_end(self, handler, epoch, logs):
        if epoch % self.every_n_epochs == 0 and not getattr(handler, "partial_epoch", False):
            if self.save_best_only:
                value = self._monitor.value(logs, "ModelCheckpoint")
                if self._monitor.improved(value):
                    self._monitor.best = value
                    self.best_path = str(self.dirpath / "best.ckpt")
                    handler.save_checkpoint(self.best_path)
            else:
                value = logs.get(self._monitor.monitor)
                path = str(self.dirpath / f"epoch={epoch:04d}.ckpt")
                if value is not None and self._monitor.improved(float(value)):
                    self._monitor.best, self.best_path = float(value), path
                handler.save_checkpoint(path)
        if self.save_last:
            handler.save_checkpoint(self.dirpath / "last.ckpt")

    def state_dict(self):
        return {"best": self._monitor.best, "best_path": self.best_path}

    def load_state_dict(self, state):
        self._monitor.best, self.best_path = state["best"], state["best_path"]


class CSVLogger(Callback):
    """Write the History to a CSV file after every epoch: one row per epoch, one column per key.

    The whole file is rewritten from the History each time (atomically), so
    columns that appear later and rows restored by a resume are always in
    place. Written by rank 0 only.

    Args:
        path: The CSV file.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> class H: history = [{"epoch": 1, "train_loss": 0.5}]
        >>> CSVLogger(p).on_epoch_end(H(), 1, {})
        >>> open(p).read().splitlines()
        ['epoch,train_loss', '1,0.5']
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_epoch_end(self, handler, epoch, logs):
        if not is_main_process():
            return
        rows = list(handler.history)
        columns: list[str] = []
        for row in rows:
            columns.extend(k for k in row if k not in columns)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp.{os.getpid()}")
        tmp.write_text(buf.getvalue())
        os.replace(tmp, self.path)  # readers never see a half-written file
