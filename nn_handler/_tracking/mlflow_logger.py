"""MLflowLogger: a run's values, settings and end in MLflow, sent from a process of its own.

Private: :mod:`nn_handler.loggers` is the public face (the class's docstring is the documentation).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from .._checks import check_number, invalid
from ..callbacks import TrainerView
from ..errors import MissingExtraError
from .child import ChildSender
from .mlflow_client import MlflowRun
from .run import TrackerLogger
from .values import HParam


class MLflowLogger(TrackerLogger):
    """Log a run to MLflow: the History per epoch, the step's values and learning rates per step, the settings.

    Rank 0 alone logs. What goes to the MLflow run (names and steps as in
    every logger of ``nn_handler``; every step is the global optimizer step):

    - ``epoch/<column>``: every number of an epoch's History row
      (``train_*``, ``val_*``, ``lr*``, ``epoch_time``, ...) at the epoch's
      last step; the part of an epoch that ``max_steps`` or ``max_time``
      stopped is not logged (the run that completes it logs the whole epoch).
    - ``step/train_loss`` and ``step/train_<key>`` for every other value the
      training step returns (each the mean of the step's micro-batches), and
      ``step/lr_group<i>``, at steps N, 2N, ... (``N = log_every_n_steps``).
      They are read at those steps only (no device sync at the others).
    - Parameters, once per run: the handler's settings (models, optimizers,
      batch size, ``grad_accum_steps``, ``amp``, world size, ...) and ``hparams``.
    - The end: status ``FINISHED``, ``FAILED`` (the exception's type in the
      ``failure`` tag) or ``KILLED`` for a preemption, with the ``end_state``
      tag ``finished``, ``failed`` or ``preempted``. A training process
      killed outright (SIGKILL, the OOM killer) ends it ``FAILED``, its
      ``failure`` ``TrainingProcessLost`` (not ``RUNNING`` for ever).

    The run id is in the callback's checkpoint state: a resumed handler
    (``resume="auto"``, ``load_checkpoint``) continues the same run from the
    checkpoint's step.

    A tracking server that is down never stops training: MLflow's client
    runs in a process of the logger's own, started at each ``train()`` and
    ended with it (:mod:`nn_handler._tracking.child`; training never waits on
    the network, MLflow's client may retry a request for minutes, and its
    Python never runs under the training process's GIL). The records
    gathered in ``send_every_s`` seconds go to MLflow in one call (the run's
    start and end go at once); one warning says when sending fails and one
    when it works again, and unsent records are kept and sent again every few
    seconds. When training ends, that process has ``end_timeout_s`` seconds
    to send the rest to a server (counted once it has imported MLflow: a run
    shorter than the import waits for it too); what is still unsent is written to
    ``<fallback_dir>/mlflow-unsent-<run id>-<pid>.jsonl``, one JSON record a
    line (``{"kind": "metrics", "step": ..., "values": {...}}``).

    Args:
        tracking_uri: ``http://host:port`` of a tracking server, a
            ``sqlite:///path.db`` store (no server), or None for MLflow's
            default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``).
            MLflow 3 refuses ``file:`` stores unless ``MLFLOW_ALLOW_FILE_STORE=true``.
        experiment_name: The experiment, created when missing.
        run_name: The run's name (MLflow makes one up when None).
        hparams: Hyperparameters (str -> bool, int, float or str), logged once as parameters.
        log_every_n_steps: Per-step values every this many optimizer steps (>= 1).
        fallback_dir: Where unsent records are written when training ends.
        end_timeout_s: How long the end of ``train()`` waits for records unsent to a server, once the
            tracker process has imported MLflow.
        send_every_s: Seconds at least between two sends to MLflow: the values of the steps logged
            meanwhile go in one call.

    Raises:
        MissingExtraError: MLflow is not installed (``pip install 'nn_handler[mlflow]'``).
        ConfigurationError: A bad argument.
    """

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "Default", run_name: str | None = None,
                 hparams: Mapping[str, HParam] | None = None, log_every_n_steps: int = 50, *,
                 fallback_dir: str | os.PathLike = ".", end_timeout_s: float = 10.0, send_every_s: float = 5.0):
        try:
            import mlflow  # noqa: F401 - here, so that a missing extra shows when the logger is made
        except ImportError as exc:
            raise MissingExtraError("MLflowLogger needs mlflow, which is not installed; install the mlflow extra: "
                                    "pip install 'nn_handler[mlflow]'") from exc
        super().__init__(hparams, log_every_n_steps)
        for name, value in (("tracking_uri", tracking_uri), ("run_name", run_name)):
            if value is not None and (not isinstance(value, str) or not value):
                raise invalid(name, "a non-empty str or None", value)
        if not isinstance(experiment_name, str) or not experiment_name:
            raise invalid("experiment_name", "a non-empty str", experiment_name)
        self.tracking_uri, self.experiment_name, self.run_name = tracking_uri, experiment_name, run_name
        self.fallback_dir = Path(fallback_dir)
        self.end_timeout_s = check_number("end_timeout_s", end_timeout_s, strict=False, unit="seconds")
        self.send_every_s = check_number("send_every_s", send_every_s, strict=False, unit="seconds")
        self._sender: ChildSender | None = None
        self._waited_for_id = False

    # --------------------------------------------------------------------- the callback's side (training thread)
    def _open(self, run_id: str | None, handler: TrainerView) -> None:
        self._waited_for_id = False
        run = MlflowRun(self.tracking_uri, self.experiment_name, self.run_name, run_id)
        fallback = self.fallback_dir.resolve() / f"mlflow-unsent-{{run_id}}-{os.getpid()}.jsonl"
        self._sender = ChildSender(run, f"MLflow at {self.tracking_uri or 'the default tracking URI'}",
                                   every_s=self.send_every_s, end_timeout_s=self.end_timeout_s, fallback=fallback)
        self._sender.put({"kind": "open"})

    def _log(self, step: int, values: dict[str, float]) -> None:
        self._sender.put({"kind": "metrics", "step": step, "time_ms": _now_ms(), "values": values})

    def _params(self, params: dict[str, HParam]) -> None:
        items = [(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # at most 100 parameters a call
            self._sender.put({"kind": "params", "values": dict(items[i:i + 100])})

    def _end(self, state: str, failure: str | None) -> None:
        self._sender.put({"kind": "end", "state": state, "failure": failure, "time_ms": _now_ms()})
        self._sender.close(self._wait_s())
        self.run_id = self._sender.state.get("run_id", self.run_id)
        self._sender = None

    def flush(self) -> None:
        if self._sender is not None:
            self._sender.flush(self._wait_s())
            self.run_id = self._sender.state.get("run_id", self.run_id)

    def _wait_s(self) -> float | None:
        """How long training waits for the sender: bounded for a server, not for a local store (no network)."""
        remote = (self.tracking_uri or _default_uri()).split(":", 1)[0] in ("http", "https", "databricks")
        return self.end_timeout_s if remote else None

    def state_dict(self) -> dict[str, Any]:
        if self._sender is not None and self.run_id is None and not self._waited_for_id:
            # The run being created: its id belongs in this checkpoint. Waited for once: a server that is down
            # does not slow down every checkpoint.
            self._waited_for_id = True
            self.flush()
        if self._sender is not None:
            self.run_id = self._sender.state.get("run_id", self.run_id)
        return super().state_dict()


def _default_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def _now_ms() -> int:
    return int(time.time() * 1000)
