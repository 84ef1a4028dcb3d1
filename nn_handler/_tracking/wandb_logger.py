"""WandbLogger: a run's values, settings and end in Weights & Biases, online or offline.

Private: :mod:`nn_handler.loggers` is the public face (the class's docstring is the documentation).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Mapping

from .._checks import check_choice, check_number, invalid
from ..callbacks import TrainerView
from ..errors import PREEMPTED_EXIT_CODE, MissingExtraError
from .run import FINISHED, PREEMPTED, TrackerLogger
from .values import HParam

log = logging.getLogger("nn_handler.loggers")


class WandbLogger(TrackerLogger):
    """Log a run to Weights & Biases: the History per epoch, the step's values and learning rates per step.

    Rank 0 alone logs, with the names and steps of every logger of
    ``nn_handler`` (every step is the global optimizer step, W&B's ``step``):

    - ``epoch/<column>``: every number of an epoch's History row at the
      epoch's last step (none for the part of an epoch that ``max_steps`` or
      ``max_time`` stopped: the run that completes it logs the whole epoch).
    - ``step/train_loss``, ``step/train_<key>`` for every other value the step
      returns (each the mean of the step's micro-batches) and
      ``step/lr_group<i>`` at steps N, 2N, ... (``N = log_every_n_steps``),
      read at those steps only (no device sync at the others).
    - The run's config, once per run: the handler's settings and ``hparams``.
    - The end: ``run.finish()`` with exit code 0 (finished), 1 (failed: the
      exception's type in the summary's ``failure``) or
      :data:`~nn_handler.PREEMPTED_EXIT_CODE` after ``mark_preempting()``
      (preempted); the summary's ``end_state`` says which.

    The run id is in the callback's checkpoint state: a resumed handler
    continues the same W&B run (``resume="allow"``) from the checkpoint's step.
    ``mode="offline"`` writes the run under ``dir`` with no network (upload it
    later with ``wandb sync <dir>/wandb/offline-run-*``). A W&B that cannot be
    reached never stops training: ``wandb.init`` gives up after
    ``init_timeout_s`` and the run is then written offline (one warning says
    so); what W&B has not uploaded when training ends stays in the run's local
    files after ``end_timeout_s`` (W&B's ``finish_timeout``), for ``wandb sync``.

    Args:
        project: The W&B project (None: W&B's default).
        dir: Where W&B writes its files (None: W&B's default, the current directory).
        mode: ``"online"``, ``"offline"``, ``"disabled"`` or None (W&B's default, ``WANDB_MODE``).
        hparams: Hyperparameters (str -> bool, int, float or str), in the run's config.
        log_every_n_steps: Per-step values every this many optimizer steps (>= 1).
        init_timeout_s: How long starting the run may wait for W&B before going offline.
        end_timeout_s: How long the end of ``train()`` waits for W&B's uploads (offline, the end is waited for).

    Raises:
        MissingExtraError: wandb is not installed (``pip install 'nn_handler[wandb]'``).
        ConfigurationError: A bad argument.
    """

    def __init__(self, project: str | None = None, dir: str | os.PathLike | None = None, mode: str | None = None,
                 hparams: Mapping[str, HParam] | None = None, log_every_n_steps: int = 50, *,
                 init_timeout_s: float = 20.0, end_timeout_s: float = 10.0):
        try:
            import wandb  # noqa: F401 - here, so that a missing extra shows when the logger is made
        except ImportError as exc:
            raise MissingExtraError("WandbLogger needs wandb, which is not installed; install the wandb extra: "
                                    "pip install 'nn_handler[wandb]'") from exc
        super().__init__(hparams, log_every_n_steps)
        if project is not None and (not isinstance(project, str) or not project):
            raise invalid("project", "a non-empty str or None", project)
        if mode is not None:
            check_choice("mode", mode, ("online", "offline", "disabled"))
        self.project, self.dir, self.mode = project, None if dir is None else os.fspath(dir), mode
        self.init_timeout_s = check_number("init_timeout_s", init_timeout_s, unit="seconds")
        self.end_timeout_s = check_number("end_timeout_s", end_timeout_s, unit="seconds")
        self._run: Any = None
        self._failing = False  # a log call failed: warned once

    def _open(self, run_id: str | None, handler: TrainerView) -> None:
        import wandb

        self.run_id = run_id or uuid.uuid4().hex[:12]  # W&B's run ids: letters and digits
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        offline = (self.mode or os.environ.get("WANDB_MODE")) in ("offline", "dryrun")
        # finish_timeout bounds the end's uploads; offline, the end only writes local files, and is waited for
        # (a bound there can cut the run's last records).
        settings = wandb.Settings(init_timeout=self.init_timeout_s, finish_timeout=0 if offline else self.end_timeout_s,
                                  console="off")  # W&B leaves the training's output alone
        kwargs = dict(project=self.project, dir=self.dir, mode=self.mode, id=self.run_id, resume="allow",
                      reinit="create_new", settings=settings)
        try:
            self._run = wandb.init(**kwargs)
        except Exception as exc:  # noqa: BLE001 - W&B unreachable: the run is written offline instead
            if self.mode == "offline":
                log.warning("W&B could not start run %s (%s: %s); training goes on without it", self.run_id,
                            type(exc).__name__, exc)
                self._run = None
                return
            log.warning("W&B could not be reached to start run %s (%s: %s); the run is written offline under "
                        "%s: upload it later with `wandb sync`", self.run_id, type(exc).__name__, exc,
                        self.dir or os.getcwd())
            try:
                self._run = wandb.init(**{**kwargs, "mode": "offline"})
            except Exception:  # noqa: BLE001
                self._run = None

    def _log(self, step: int, values: dict[str, float]) -> None:
        self._call(lambda run: run.log(values, step=step))

    def _params(self, params: dict[str, HParam]) -> None:
        self._call(lambda run: run.config.update(params, allow_val_change=True))

    def _end(self, state: str, failure: str | None) -> None:
        def end(run: Any) -> None:
            run.summary["end_state"] = state
            if failure is not None:
                run.summary["failure"] = failure
            if state == PREEMPTED:
                run.mark_preempting()
            run.finish(exit_code=0 if state == FINISHED else PREEMPTED_EXIT_CODE if state == PREEMPTED else 1)

        self._call(end)
        self._run = None

    def _call(self, fn: Any) -> None:
        if self._run is None:
            return
        try:
            fn(self._run)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure never reaches training
            if not self._failing:
                log.warning("W&B run %s: could not log (%s: %s); training goes on", self.run_id,
                            type(exc).__name__, exc)
            self._failing = True
