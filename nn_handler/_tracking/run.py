"""A tracker's run, from rank 0: opened once, continued across ``train()`` calls and resumes, ended with its state.

:class:`TrackerLogger` is the callback side every tracker shares; a tracker
(:mod:`.mlflow_logger`, :mod:`.wandb_logger`) fills in how a run is opened,
how values, parameters and the end are recorded. What it does:

- Rank 0 alone logs; the other ranks' hooks return at once (the History is
  already reduced over the ranks, the per-step values are rank 0's own).
- The run id is the callback's checkpoint state: a handler that resumes from
  a checkpoint (``resume="auto"``, ``load_checkpoint``) continues the same run,
  and logs from the checkpoint's step on, so the run's series equals that of
  a run never stopped.
- Per step, every ``log_every_n_steps`` steps, ``step/<name>`` (:mod:`.values`);
  per completed epoch, ``epoch/<column>`` at its last step; the handler's
  settings and the ``hparams`` once per run.
- The end: ``finished`` after ``train()`` returns, ``failed`` (the exception's
  type in the ``failure`` tag) when it raises, ``preempted`` on
  :class:`~nn_handler.TrainingPreempted`.

Private: :mod:`nn_handler.loggers` is the public face.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..callbacks import Callback, TrainerView
from ..errors import TrainingPreempted
from .values import HParam, StepSeries, checked_hparams, epoch_values, settings_of

FINISHED, FAILED, PREEMPTED = "finished", "failed", "preempted"


class TrackerLogger(Callback):
    """The callback side of a tracker's run; subclasses implement the ``_open``, ``_log``, ``_params`` and ``_end``."""

    def __init__(self, hparams: Mapping[str, HParam] | None, log_every_n_steps: int):
        self.hparams = checked_hparams(hparams)
        self._series = StepSeries(log_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self.run_id: str | None = None  # the tracker's run: kept in checkpoints, continued by a resume
        self._params_logged = False
        self._open_run = False

    # --------------------------------------------------------------------- what a tracker implements
    def _open(self, run_id: str | None, handler: TrainerView) -> None:
        """Start a run (``run_id`` None) or continue run ``run_id``; set ``self.run_id``."""
        raise NotImplementedError

    def _log(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` (names with their ``step/`` or ``epoch/`` prefix) at global step ``step``."""
        raise NotImplementedError

    def _params(self, params: dict[str, HParam]) -> None:
        """Record the run's parameters (once per run)."""
        raise NotImplementedError

    def _end(self, state: str, failure: str | None) -> None:
        """Mark the run ``finished``, ``failed`` (``failure``: the exception's type) or ``preempted``; close it."""
        raise NotImplementedError

    def flush(self) -> None:
        """Send what is gathered now, and wait for it (for a server, at most ``end_timeout_s``)."""

    # --------------------------------------------------------------------- hooks
    def on_train_begin(self, handler: TrainerView) -> None:
        if not handler.is_main_process or self._open_run:
            return
        self._open(self.run_id, handler)
        self._open_run = True
        if not self._params_logged:
            self._params({**settings_of(handler), **self.hparams})
            self._params_logged = True

    def on_epoch_begin(self, handler: TrainerView, epoch: int) -> None:
        self._series.epoch_begin(handler.global_step)

    def on_batch_end(self, handler: TrainerView, step: int, loss: Any, outputs: Any = None) -> None:
        if not self._open_run:
            return
        values = self._series.batch_end(handler.global_step, loss, outputs, handler)
        if values is not None:
            self._log(handler.global_step, {f"step/{name}": v for name, v in values.items()})

    def on_epoch_end(self, handler: TrainerView, epoch: int, logs: dict[str, Any]) -> None:
        if not self._open_run:
            return
        values = epoch_values(handler, epoch, logs)
        if values is not None:
            self._log(handler.global_step, {f"epoch/{name}": v for name, v in values.items()})

    def on_train_end(self, handler: TrainerView) -> None:
        self._close(FINISHED, None)

    def on_exception(self, handler: TrainerView, exception: BaseException) -> None:
        if isinstance(exception, TrainingPreempted):
            self._close(PREEMPTED, None)
        else:
            self._close(FAILED, type(exception).__name__)

    def _close(self, state: str, failure: str | None) -> None:
        if self._open_run:
            self._open_run = False
            self._end(state, failure)

    # --------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "params_logged": self._params_logged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("run_id") is not None:  # written by rank 0, the rank that logs
            if self._open_run and state["run_id"] != self.run_id:
                self._close(FINISHED, None)  # another run's checkpoint loaded into this handler: that run goes on
            self.run_id = state["run_id"]
            self._params_logged = bool(state.get("params_logged", True))
