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
from .sender import Record, Sender
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

    The values, the config and the end go to W&B from a thread of the
    logger's own, gathered every ``send_every_s`` seconds: a ``run.log`` costs
    the process far more between training steps, with its code gone cold,
    than the same calls back to back (the run's end goes at once).

    Args:
        project: The W&B project (None: W&B's default).
        dir: Where W&B writes its files (None: W&B's default, the current directory).
        mode: ``"online"``, ``"offline"``, ``"disabled"`` or None (W&B's default, ``WANDB_MODE``).
        hparams: Hyperparameters (str -> bool, int, float or str), in the run's config.
        log_every_n_steps: Per-step values every this many optimizer steps (>= 1).
        init_timeout_s: How long starting the run may wait for W&B before going offline.
        end_timeout_s: How long the end of ``train()`` waits for W&B's uploads (offline, the end is waited for).
        send_every_s: Seconds at least between two sends to W&B: the steps logged meanwhile go together.

    Raises:
        MissingExtraError: wandb is not installed (``pip install 'nn_handler[wandb]'``).
        ConfigurationError: A bad argument.
    """

    def __init__(self, project: str | None = None, dir: str | os.PathLike | None = None, mode: str | None = None,
                 hparams: Mapping[str, HParam] | None = None, log_every_n_steps: int = 50, *,
                 init_timeout_s: float = 20.0, end_timeout_s: float = 10.0, send_every_s: float = 5.0):
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
        self.send_every_s = check_number("send_every_s", send_every_s, strict=False, unit="seconds")
        self._run: Any = None
        self._sender: Sender | None = None
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

    # --------------------------------------------------------------------- the callback's side (training thread)
    def _log(self, step: int, values: dict[str, float]) -> None:
        self._put({"kind": "metrics", "step": step, "values": values})

    def _params(self, params: dict[str, HParam]) -> None:
        self._put({"kind": "params", "values": params})

    def _end(self, state: str, failure: str | None) -> None:
        self._put({"kind": "end", "state": state, "failure": failure})
        if self._sender is not None:
            # Not bounded here: the end's uploads are, by W&B's finish_timeout (the other calls are local).
            self._sender.close(None, fallback=None)
            self._sender = None

    def flush(self) -> None:
        if self._sender is not None:
            self._sender.flush(None)  # hands the values to W&B's local service: no network

    def _put(self, record: Record) -> None:
        if self._run is None:
            return
        if self._sender is None:
            self._sender = Sender(self._send, f"W&B run {self.run_id}", every_s=self.send_every_s)
        self._sender.put(record)

    # --------------------------------------------------------------------- the sender thread's side
    def _send(self, records: list[Record]) -> None:
        """Hand ``records`` to W&B in order; one that fails is dropped (it would fail again), with a warning."""
        while records:
            record = records[0]
            if record["kind"] == "metrics":
                self._call(lambda run: run.log(record["values"], step=record["step"]))
            elif record["kind"] == "params":
                self._call(lambda run: run.config.update(record["values"], allow_val_change=True))
            else:
                self._call(lambda run: _finish(run, record["state"], record["failure"]))
                self._run = None
            del records[0]

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


def _finish(run: Any, state: str, failure: str | None) -> None:
    run.summary["end_state"] = state
    if failure is not None:
        run.summary["failure"] = failure
    if state == PREEMPTED:
        run.mark_preempting()
    run.finish(exit_code=0 if state == FINISHED else PREEMPTED_EXIT_CODE if state == PREEMPTED else 1)
