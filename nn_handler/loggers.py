"""Training curves where people look for them: TensorBoard, MLflow and Weights & Biases, as callbacks.

- :class:`TensorBoardLogger`: event files (``pip install 'nn_handler[tensorboard]'``;
  ``tensorboard --logdir runs`` serves them at http://localhost:6006).
- :class:`MLflowLogger`: an MLflow run (``pip install 'nn_handler[mlflow]'``).
- :class:`WandbLogger`: a Weights & Biases run (``pip install 'nn_handler[wandb]'``).
- :class:`~nn_handler.callbacks.CSVLogger` writes CSV files with the same values.

Every logger logs from rank 0 alone, with the same names at the same global
optimizer steps: ``epoch/<column>`` for every number of a completed epoch's
History row, at the epoch's last step; ``step/train_loss``, ``step/train_<key>``
(every value the training step returns, each the mean of the step's
micro-batches) and ``step/lr_group<i>`` at steps N, 2N, ... (``N =
log_every_n_steps``), read at those steps only.

Example:
    >>> import tempfile
    >>> from nn_handler.loggers import TensorBoardLogger
    >>> logger = TensorBoardLogger(tempfile.mkdtemp(), log_every_n_steps=10, hparams={"lr": 0.05})
    >>> logger.log_every_n_steps
    10
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from ._checks import check_number
from .callbacks import Callback, TrainerView
from ._tracking.mlflow_logger import MLflowLogger
from ._tracking.values import HParam, StepSeries, checked_hparams
from ._tracking.wandb_logger import WandbLogger
from .errors import ConfigurationError, MissingExtraError

__all__ = ["TensorBoardLogger", "MLflowLogger", "WandbLogger"]


class TensorBoardLogger(Callback):
    """Write a run's History, step losses, learning rates and hyperparameters as TensorBoard event files.

    Rank 0 alone writes (the History is already reduced over all ranks); the
    other ranks do nothing. Every scalar's step is the global optimizer step
    (:attr:`NNHandler.global_step`), so curves of different runs line up and a
    continued run (another ``train()`` call after a ``max_steps`` stop, a
    ``resume``, a preemption) goes on along the same curves. Tags:

    - ``epoch/<key>``: every History key of a completed epoch (``train_loss``,
      ``val_loss``, ``val_<metric>``, ``lr``, ``epoch_time``, ...), at the
      step where the epoch ended.
    - ``part_epoch/<key>``: the History row of an epoch that ``max_steps`` or
      ``max_time`` stopped part-way. The run that completes the epoch writes
      its ``epoch/<key>`` point later, so the ``epoch/`` curves have exactly
      one point per completed epoch.
    - ``step/train_loss`` and ``step/train_<key>`` for every other value the
      training step returns: rank 0's values, each the mean of the step's
      micro-batches, every ``log_every_n_steps`` optimizer steps (read on the
      host at those steps only), with ``step/lr_group<i>``, the learning rate
      of each param group (``step/lr_<optimizer>_group<i>`` with several).

    The step values gathered in the last ``hand_over_s`` seconds go to the
    writer together: TensorBoard's writer thread checksums every event in pure
    Python, and a thread woken for each one costs training far more than a
    burst now and then (the writer writes its file every 2 minutes and at
    every epoch's end; each epoch's end, train's end and :meth:`close` hand
    over what is gathered first).

    A writer that starts at a global step above 0 (a resumed run) marks that
    step in its file, and TensorBoard drops older points from that step on:
    a run that crashed after its last checkpoint leaves no duplicate points.

    Args:
        log_dir: The directory for the event files; use one per run.
        log_every_n_steps: Step losses every this many optimizer steps (>= 1).
        hparams: Hyperparameters (str -> bool, int, float or str) shown in
            TensorBoard's HParams tab, next to the run's ``epoch/`` losses and metrics.
        hand_over_s: Seconds at least between two hand-overs of step values to the writer.

    Raises:
        MissingExtraError: TensorBoard is not installed (``pip install 'nn_handler[tensorboard]'``).
        ConfigurationError: A bad argument.

    Example:
        >>> TensorBoardLogger("runs", hparams={"layers": [2, 3]})
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: hparams['layers'] must be a bool, int, float or str, got [2, 3]
    """

    def __init__(self, log_dir: str | os.PathLike, log_every_n_steps: int = 50,
                 hparams: Mapping[str, HParam] | None = None, hand_over_s: float = 5.0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MissingExtraError(
                "TensorBoardLogger needs tensorboard, which is not installed; install the tensorboard extra: "
                "pip install 'nn_handler[tensorboard]'"
            ) from exc
        series = StepSeries(log_every_n_steps)
        hparams = checked_hparams(hparams)
        self._summary_writer = SummaryWriter
        self.log_dir = Path(log_dir)
        _check_writable(self.log_dir)  # here, on every rank: not at rank 0's on_train_begin with the raw OS error
        self.log_every_n_steps = log_every_n_steps
        self.hparams = hparams
        self._writer: Any = None
        self._hparams_written = False
        self._series = series
        self._written_step = 0  # the highest global step written
        self.hand_over_s = check_number("hand_over_s", hand_over_s, strict=False, unit="seconds")
        self._gathered: list[tuple[int, dict[str, float]]] = []  # (global step, values) not yet handed over
        self._handed_over_at = time.monotonic()

    def on_train_begin(self, handler: TrainerView) -> None:
        if not handler.is_main_process:
            return
        if self._writer is not None and handler.global_step < self._written_step:
            self.close()  # a checkpoint loaded since: a new file purges the steps that follow it
        if self._writer is not None:
            return
        # One writer (one file) for the callback's life: another train() call
        # continues it. A writer opened on a resumed run purges the later steps
        # an earlier process may have logged past its last checkpoint.
        step = handler.global_step
        purge = step + 1 if step or self._written_step else None
        if purge is not None:
            _after_the_newest_file(self.log_dir)
        self._writer = self._summary_writer(os.fspath(self.log_dir), purge_step=purge)
        self._hparams_written = False

    def on_epoch_begin(self, handler: TrainerView, epoch: int) -> None:
        self._series.epoch_begin(handler.global_step)

    def on_batch_end(self, handler: TrainerView, step: int, loss: Any, outputs: Any = None) -> None:
        if self._writer is None:
            return
        values = self._series.batch_end(handler.global_step, loss, outputs, handler)
        if values is None:
            return
        self._gathered.append((handler.global_step, values))
        self._written_step = max(self._written_step, handler.global_step)
        if time.monotonic() - self._handed_over_at >= self.hand_over_s:
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the gathered step values to the writer: one event a step (add_scalar would make one a value)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        file_writer = self._writer._get_file_writer()
        for step, values in self._gathered:
            file_writer.add_summary(Summary(value=[Summary.Value(tag=f"step/{name}", simple_value=value)
                                                   for name, value in values.items()]), step)
        self._gathered.clear()
        self._handed_over_at = time.monotonic()

    def on_epoch_end(self, handler: TrainerView, epoch: int, logs: dict[str, Any]) -> None:
        if self._writer is None:
            return
        self._hand_over()
        # The trainer counts an epoch as done only when it completed; a part
        # (a max_steps or max_time stop) leaves handler.epoch behind ``epoch``.
        part = handler.epoch < epoch
        prefix = "part_epoch" if part else "epoch"
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{prefix}/{key}", value, handler.global_step)
        self._written_step = max(self._written_step, handler.global_step)
        if self.hparams and not self._hparams_written:
            self._write_hparams(logs)
        self._writer.flush()

    def on_train_end(self, handler: TrainerView) -> None:
        self.flush()

    def on_exception(self, handler: TrainerView, exception: BaseException) -> None:
        self.on_train_end(handler)  # what was logged up to the failure is on disk

    def flush(self) -> None:
        """Hand the gathered step values to the writer and write the event file to disk now."""
        if self._writer is not None:
            self._hand_over()
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a later ``train()`` opens a new one)."""
        if self._writer is not None:
            self._hand_over()
            self._writer.close()
            self._writer = None

    def _write_hparams(self, logs: Mapping[str, Any]) -> None:
        # Into this run's own file, not the sub-run SummaryWriter.add_hparams
        # makes: the HParams tab then shows this run's epoch/ curves beside them.
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"epoch/{k}": math.nan for k in logs if k.startswith(("train_", "val_"))}
        file_writer = self._writer._get_file_writer()
        for summary in hparams(self.hparams, metrics):
            file_writer.add_summary(summary)
        self._hparams_written = True


def _check_writable(log_dir: Path) -> None:
    """Raise a ConfigurationError unless this process can create event files in ``log_dir`` (nothing is left behind)."""
    existing = next((p for p in (log_dir, *log_dir.parents) if p.exists()), Path("."))
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fspath(existing))
        # A directory made and removed at once: the one test of "may create files here" that holds for root too.
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as exc:
        raise ConfigurationError(
            f"TensorBoardLogger cannot write to log_dir {os.fspath(log_dir)!r}: {exc.strerror or exc} "
            f"({exc.filename or existing}); pass a directory this process can create files in"
        ) from exc


def _after_the_newest_file(log_dir: Any) -> None:
    """Wait, if need be, until a new event file's name sorts after every one already in ``log_dir``.

    TensorBoard reads a run's files in name order, and a purge drops the later steps only of the files read
    before it. A name starts with the second the file was made, then a per-process counter compared as text
    (``...9`` after ``...10``): a file opened in the same second as the last may sort first, and the steps it
    purges would come back. Waiting for the next second (only a writer reopened within a second waits) makes
    the order that of the writes.
    """
    import glob
    import time

    names = [os.path.basename(p) for p in glob.glob(os.path.join(os.fspath(log_dir), "events.out.tfevents.*"))]
    seconds = [int(part) for part in (name.split(".")[3] for name in names) if part.isdigit()]
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(int(time.time()) + 1 - time.time())
