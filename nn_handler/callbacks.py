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

import contextlib
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Literal

from ._callback import Callback, TrainerView
from ._checks import check_bool, check_choice, check_int, check_number, invalid
from ._tracking.csv_files import StepCSV, write_history
from ._tracking.values import StepSeries
from .checkpoint import run_checkpoint_name
from .errors import ConfigurationError
from .utils.ddp import is_main_process

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "CSVLogger", "EMA", "TrainerView"]

log = logging.getLogger(__name__)
Mode = Literal["min", "max"]


class _Monitor:
    """Tracks the best value of one History key."""

    def __init__(self, monitor: str, mode: Mode, min_delta: float = 0.0):
        check_choice("mode", mode, ("min", "max"))
        if not isinstance(monitor, str) or not monitor:
            raise invalid("monitor", "a History key such as 'val_loss'", monitor)
        check_number("min_delta", min_delta, strict=False)
        self.monitor, self.mode, self.min_delta = monitor, mode, float(min_delta)
        self.best: float | None = None

    def value(self, logs: dict[str, Any], who: str, handler: Any = None) -> float | None:
        """The monitored value of an epoch's row; None for an epoch that was not validated (``validate_every``)."""
        value = logs.get(self.monitor)
        if value is None and self.monitor.startswith("val_") and "val_loss" not in logs \
                and getattr(handler, "val_loader", None) is not None:
            return None  # train(validate_every=k): this epoch has no validation values to decide from
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
    nothing: the whole epoch decides once it is complete. With
    ``train(validate_every=k)`` and a ``val_`` monitor, only validated epochs
    count (``patience`` is in validations).

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
        value = self._monitor.value(logs, "EarlyStopping", handler)
        if value is None:  # not validated this epoch: neither better nor worse
            return
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

    Files in ``dirpath``: ``epoch-NNNN.ckpt`` (the names ``checkpoint_dir`` uses) every ``every_n_epochs`` epochs
    (with ``save_top_k=k``, only the ``k`` best by ``monitor``, the others
    deleted; with ``save_best_only``, ``best.ckpt`` instead, only when
    ``monitor`` improved) and ``last.ckpt`` after every epoch when ``save_last``. Each
    write is atomic; each file resumes training with
    :meth:`NNHandler.load_checkpoint`. Where ``max_steps`` or ``max_time``
    stops an epoch part-way, only ``last.ckpt`` is written (it resumes at the
    next batch): the epoch's file and "best" wait for the whole epoch. With
    ``train(validate_every=k)`` and a ``val_`` monitor, ``save_top_k`` and
    ``save_best_only`` rank and save on the validated epochs; the others
    write ``last.ckpt`` only.

    Args:
        dirpath: Directory for the files (created when needed).
        monitor: History key that decides "best".
        mode: ``"min"`` or ``"max"`` for ``monitor``.
        save_best_only: Keep one ``best.ckpt`` instead of one file per epoch.
        save_last: Also write ``last.ckpt`` every epoch.
        every_n_epochs: Consider saving every this many epochs (>= 1).
        save_top_k: Keep the ``k`` best epoch files (>= 1): an epoch's file is
            written when fewer than ``k`` are kept or its value beats the worst
            kept, which is then deleted (rank 0 deletes). On a tie the earlier
            epoch ranks better, so a value equal to the worst kept is not
            saved; NaN never is. The list of kept files is in the callback's
            checkpoint state, so a resumed run goes on pruning them (files it
            does not list are never touched). None (default): every file is
            kept. ``save_best_only`` is the one-file form, under the name ``best.ckpt``.

    Example:
        >>> ModelCheckpoint("ckpts", every_n_epochs=0)
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: every_n_epochs must be an int >= 1, got 0
    """

    def __init__(self, dirpath: str | os.PathLike, monitor: str = "val_loss", mode: Mode = "min",
                 save_best_only: bool = False, save_last: bool = True, every_n_epochs: int = 1,
                 save_top_k: int | None = None):
        check_int("every_n_epochs", every_n_epochs, minimum=1)
        check_int("save_top_k", save_top_k, minimum=1, allow_none=True)
        if save_top_k is not None and save_best_only:
            raise ConfigurationError("save_best_only=True keeps one best.ckpt and save_top_k keeps the k best epoch "
                                     "files: choose one (save_top_k=1 keeps one epoch-NNNN.ckpt)")
        self.dirpath = Path(dirpath)
        self._monitor = _Monitor(monitor, mode)
        self.save_best_only, self.save_last, self.every_n_epochs = save_best_only, save_last, every_n_epochs
        self.save_top_k = save_top_k
        self.best_path: str | None = None
        self.kept: list[tuple[str, float, int]] = []  # with save_top_k: (path, value, epoch), best first

    @property
    def best(self) -> float | None:
        """The best monitored value among the saved checkpoints."""
        return self._monitor.best

    def on_train_begin(self, handler):
        run_dir = getattr(handler, "checkpoint_dir", None)
        if run_dir is not None and not self.save_best_only and Path(run_dir).resolve() == self.dirpath.resolve():
            # Both would write epoch-NNNN.ckpt there, and each prunes: the run would delete the best files,
            # save_top_k the newest one that a resume needs.
            raise ConfigurationError(
                f"ModelCheckpoint's dirpath is the handler's checkpoint_dir ({run_dir}): both write epoch-NNNN.ckpt "
                f"files there and each deletes the other's; give ModelCheckpoint a directory of its own "
                f"(e.g. {Path(run_dir) / 'best'}), or save_best_only=True (best.ckpt and last.ckpt share it safely)")

    def on_epoch_end(self, handler, epoch, logs):
        if epoch % self.every_n_epochs == 0 and not getattr(handler, "partial_epoch", False):
            self._save_epoch(handler, epoch, logs)
        if self.save_last:
            handler.save_checkpoint(self.dirpath / "last.ckpt")

    def _save_epoch(self, handler: TrainerView, epoch: int, logs: dict[str, Any]) -> None:
        path = str(self.dirpath / run_checkpoint_name(epoch))
        if self.save_top_k is None and not self.save_best_only:  # every epoch's file; "best" where there is a value
            value = logs.get(self._monitor.monitor)
            if value is not None and self._monitor.improved(float(value)):
                self._monitor.best, self.best_path = float(value), path
            handler.save_checkpoint(path)
            return
        value = self._monitor.value(logs, "ModelCheckpoint", handler)
        if value is None:
            return  # not validated (train(validate_every=k)): ranked on the epochs that have the value
        if self.save_top_k is not None:
            self._save_top_k(handler, epoch, value)
        elif self._monitor.improved(value):
            self._monitor.best = value
            self.best_path = str(self.dirpath / "best.ckpt")
            handler.save_checkpoint(self.best_path)

    def _rank(self, value: float, epoch: int) -> tuple:
        """Sort key, best first: NaN last, then by value, then the earlier epoch."""
        nan = math.isnan(value)
        return (nan, 0.0 if nan else (value if self._monitor.mode == "min" else -value), epoch)

    def _save_top_k(self, handler: TrainerView, epoch: int, value: float) -> None:
        if math.isnan(value):
            return
        path = str(self.dirpath / run_checkpoint_name(epoch))
        # A rerun epoch replaces its own entry, also one of nn_handler <= 0.1's epoch=NNNN.ckpt names.
        kept = [entry for entry in self.kept if entry[2] != epoch]
        ranked = sorted(kept + [(path, value, epoch)], key=lambda e: self._rank(e[1], e[2]))
        if ranked.index((path, value, epoch)) >= self.save_top_k:
            return  # not among the k best: nothing written, nothing deleted
        dropped = ranked[self.save_top_k:] + [e for e in self.kept if e[2] == epoch and e[0] != path]
        # The list is updated before the write, so the checkpoint holds the list it belongs to.
        self.kept = ranked[:self.save_top_k]
        self._monitor.best, self.best_path = self.kept[0][1], self.kept[0][0]
        handler.save_checkpoint(path)
        if handler.is_main_process:
            for old, _, _ in dropped:
                _remove(Path(old))

    def state_dict(self):
        return {"best": self._monitor.best, "best_path": self.best_path, "kept": [list(e) for e in self.kept]}

    def load_state_dict(self, state):
        self._monitor.best, self.best_path = state["best"], state["best_path"]
        self.kept = [(str(p), float(v), int(e)) for p, v, e in state.get("kept", [])]  # absent before save_top_k


def _remove(path: Path) -> None:
    """Delete a checkpoint: a file, or the directory of a ``strategy="fsdp"`` run."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class CSVLogger(Callback):
    """Write the History to a CSV file after every epoch, and the values of every ``log_every_n_steps``-th step.

    ``path``: one row per epoch, one column per History key. The whole file
    is rewritten from the History each time (atomically), so columns that
    appear later and rows restored by a resume are always in place.
    ``steps_path`` (by default ``<path>`` with ``_steps`` before its suffix):
    one row per logged step, ``step`` then ``train_loss``, ``train_<key>``
    for every other value the training step returns (each the mean of the
    step's micro-batches) and ``lr_group<i>``, as every logger of
    ``nn_handler`` logs them; a resumed run drops the rows past the step it
    resumed from, so each step is in the file once. Written by rank 0 only.

    Args:
        path: The CSV file of the epochs.
        log_every_n_steps: A row in ``steps_path`` every this many optimizer steps (>= 1).
        steps_path: The CSV file of the steps.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> class H: history = [{"epoch": 1, "train_loss": 0.5}]
        >>> CSVLogger(p).on_epoch_end(H(), 1, {})
        >>> open(p).read().splitlines()
        ['epoch,train_loss', '1,0.5']
    """

    def __init__(self, path: str | os.PathLike, log_every_n_steps: int = 50,
                 steps_path: str | os.PathLike | None = None):
        self.path = Path(path)
        self.steps_path = Path(steps_path) if steps_path is not None else self.path.with_name(
            f"{self.path.stem}_steps{self.path.suffix or '.csv'}")
        self._series = StepSeries(log_every_n_steps)
        self._steps: StepCSV | None = None

    def on_train_begin(self, handler):
        if handler.is_main_process:
            self._steps = self._steps or StepCSV(self.steps_path)
            self._steps.open(handler.global_step)

    def on_epoch_begin(self, handler, epoch):
        self._series.epoch_begin(handler.global_step)

    def on_batch_end(self, handler, step, loss, outputs=None):
        if self._steps is not None:
            values = self._series.batch_end(handler.global_step, loss, outputs, handler)
            if values is not None:
                self._steps.write(handler.global_step, values)

    def on_train_end(self, handler):
        if self._steps is not None:
            self._steps.close()

    def on_exception(self, handler, exception):
        self.on_train_end(handler)

    def on_epoch_end(self, handler, epoch, logs):
        if is_main_process():
            write_history(self.path, handler.history)


class EMA(Callback):
    """An exponential moving average of the model's weights, updated once per training step.

    After each training step ``ema = decay * ema + (1 - decay) * weights``
    (the first copies the weights), once however many optimizers stepped in
    it (a backbone and a head at their own LRs, a GAN's two), after all of
    them, with torch's ``AveragedModel`` and
    ``get_ema_multi_avg_fn``. The average is in checkpoints (the callback's
    state) and restored on resume, so a resumed run's average equals the
    uninterrupted run's; after :meth:`NNHandler.load_checkpoint` (of the
    last or the best checkpoint, say) the average is usable at once, to
    evaluate, predict or export without training more. Under DDP every rank keeps the same average (its
    weights are the same); ``strategy="fsdp"`` is refused (each rank holds
    only shards of the weights).

    Args:
        decay: Weight of the old average, in (0, 1).
        use_buffers: Average the buffers too (BatchNorm's running statistics),
            so the averaged model needs no pass over the data; False keeps the
            live model's buffers when the average is swapped in.
        model: With several models, the name of the one to average (a GAN's
            ``"G"``, a student beside its frozen teacher).

    Attributes:
        module: The ``torch.optim.swa_utils.AveragedModel`` (None before
            training starts or a checkpoint is loaded); ``ema.module(x)`` runs the averaged model,
            ``ema.module.module`` is the averaged copy of the model itself.

    Example:
        >>> import torch
        >>> from nn_handler import NNHandler
        >>> X, y = torch.randn(32, 3), torch.randn(32, 1)
        >>> ema = EMA(decay=0.9)
        >>> handler = NNHandler(torch.nn.Linear(3, 1), torch.optim.SGD, torch.nn.MSELoss(),
        ...                     optimizer_kwargs={"lr": 0.1}, callbacks=[ema])
        >>> handler.set_train_loader((X, y), batch_size=8)
        >>> _ = handler.train(2, progress=False)
        >>> with ema.swapped(handler):          # evaluate, predict or export the averaged weights
        ...     averaged = handler.predict(X)
        >>> torch.allclose(averaged, ema.module(X).detach())
        True
    """

    def __init__(self, decay: float = 0.999, use_buffers: bool = True, model: str | None = None):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise invalid("decay", "a number in (0, 1)", decay, "e.g. 0.999: an average over ~1/(1-decay) steps")
        if model is not None and not isinstance(model, str):
            raise invalid("model", "a model's name (a str) or None", model)
        self.decay, self.use_buffers, self.model = float(decay), check_bool("use_buffers", use_buffers), model
        self.module: Any = None
        self._loaded: dict[str, Any] | None = None  # a checkpoint's average, loaded before the model is known
        self._stepped = False  # an optimizer stepped in the training step in progress

    def on_train_begin(self, handler):
        _refuse_sharded(self._averaged(handler))
        self._build(handler)
        self._stepped = False

    def on_load_checkpoint(self, handler, payload):
        # Usable at once: loading the final or best checkpoint to evaluate or export its average is the common
        # use, and training more to reach it would change it. A sharded model is refused when training starts.
        if self._loaded is not None and not _is_sharded(self._averaged(handler)):
            self._build(handler)

    def _averaged(self, handler: TrainerView) -> Any:
        """The model averaged: the one, or the one named ``model``."""
        if self.model is None:
            try:
                return handler.module
            except AttributeError:
                names = ", ".join(map(repr, handler.models))
                raise ConfigurationError(f"EMA: this handler has {len(handler.models)} models ({names}): name the "
                                         f"one to average, EMA(decay, model={next(iter(handler.models))!r})") from None
        if self.model not in handler.models:
            raise ConfigurationError(f"EMA(model={self.model!r}): no model of that name; this handler's are "
                                     f"{', '.join(map(repr, handler.models))}")
        return handler.models[self.model]

    def _build(self, handler: TrainerView) -> None:
        """The ``AveragedModel`` over ``handler``'s model, holding a loaded average if there is one."""
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        if self.module is None:
            self.module = AveragedModel(self._averaged(handler), multi_avg_fn=get_ema_multi_avg_fn(self.decay),
                                        use_buffers=self.use_buffers)
        if self._loaded is not None:
            self.module.load_state_dict(self._loaded)
            self._loaded = None

    def on_optimizer_step(self, handler, step):
        self._stepped = True  # averaged once the training step is over, after every optimizer in it

    def on_batch_end(self, handler, step, loss):
        if self._stepped:
            self._stepped = False
            self.module.update_parameters(self._averaged(handler))

    def on_epoch_end(self, handler, epoch, logs):
        self.on_batch_end(handler, -1, None)  # an unsized loader's last group, stepped after its last batch

    @contextlib.contextmanager
    def swapped(self, handler: TrainerView) -> Iterator[TrainerView]:
        """Within the block, ``handler``'s model holds the averaged weights; the trained ones are back after it.

        Call it on every rank under DDP (no collective: every rank copies its
        own average). Inside, ``evaluate``, ``predict`` and ``export_model``
        use the average.
        """
        if self.module is None and self._loaded is not None:
            self._build(handler)  # an average restored with load_state_dict alone
        if self.module is None:
            raise RuntimeError("EMA has no average yet: train with this callback, or load a checkpoint that holds "
                               "its average (NNHandler.load_checkpoint with this callback attached)")
        live = self._averaged(handler)
        saved = {k: v.detach().clone() for k, v in live.state_dict().items()}
        averaged = self.module.module.state_dict()
        if not self.use_buffers:  # only the parameters are averaged
            names = {name for name, _ in live.named_parameters()}
            averaged = {k: (averaged[k] if k in names else v) for k, v in saved.items()}
        live.load_state_dict(averaged)  # copies in place: DDP's and the optimizer's references stay valid
        try:
            yield handler
        finally:
            live.load_state_dict(saved)

    def state_dict(self):
        if self.module is None:
            return {"average": self._loaded}
        return {"average": dict(self.module.state_dict())}

    def load_state_dict(self, state):
        average = state.get("average")
        if average is not None and self.module is not None:
            self.module.load_state_dict(average)
        else:
            self._loaded = average


def _is_sharded(module: Any) -> bool:
    # Where torch's FSDP was never imported, nothing was sharded (importing it here would cost half a second).
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in module.modules())


def _refuse_sharded(module: Any) -> None:
    if _is_sharded(module):
        raise ConfigurationError("EMA keeps a whole copy of the weights and strategy='fsdp' holds shards of them "
                                 "on each rank: use EMA with strategy='ddp' (or one process)")
