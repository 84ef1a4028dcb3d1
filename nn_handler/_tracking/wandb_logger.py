"""WandbLogger: a run's values, settings and end in Weights & Biases, online or offline.

Private: :mod:`nn_handler.loggers` is the public face (the class's docstring is the documentation).
"""

from __future__ import annotations

import os
import uuid
from typing import Mapping

from .._checks import check_choice, check_number, invalid
from ..callbacks import TrainerView
from ..errors import MissingExtraError
from .child import ChildSender
from .run import TrackerLogger
from .values import HParam
from .wandb_client import WandbRun


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
      (preempted); the summary's ``end_state`` says which. A training
      process killed outright (SIGKILL, the OOM killer) ends it failed, its
      ``failure`` ``TrainingProcessLost``.

    The run id is in the callback's checkpoint state: a resumed handler
    continues the same W&B run (``resume="allow"``) from the checkpoint's step.
    ``mode="offline"`` writes the run under ``dir`` with no network (upload it
    later with ``wandb sync <dir>/wandb/offline-run-*``). A W&B that cannot be
    reached never stops training: ``wandb.init`` gives up after
    ``init_timeout_s`` and the run is then written offline (one warning says
    so); what W&B has not uploaded when training ends stays in the run's local
    files after ``end_timeout_s`` (W&B's ``finish_timeout``), for ``wandb sync``.

    W&B's client runs in a process of the logger's own, started at each
    ``train()`` and ended with it (:mod:`nn_handler._tracking.child`): a
    ``run.log`` costs a few hundred microseconds of Python, under the training
    process's GIL wherever it runs there. Training hands the values over; what
    gathered goes to that process every ``send_every_s`` seconds.

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
        self._sender: ChildSender | None = None

    def _open(self, run_id: str | None, handler: TrainerView) -> None:
        self.run_id = run_id or uuid.uuid4().hex[:12]  # W&B's run ids: letters and digits
        run = WandbRun(self.project, self.dir, self.mode, self.run_id, self.init_timeout_s, self.end_timeout_s)
        self._sender = ChildSender(run, f"W&B run {self.run_id}", every_s=self.send_every_s,
                                   end_timeout_s=self.end_timeout_s, fallback=None)
        self._sender.put({"kind": "open"})

    def _log(self, step: int, values: dict[str, float]) -> None:
        self._sender.put({"kind": "metrics", "step": step, "values": values})

    def _params(self, params: dict[str, HParam]) -> None:
        self._sender.put({"kind": "params", "values": params})

    def _end(self, state: str, failure: str | None) -> None:
        self._sender.put({"kind": "end", "state": state, "failure": failure})
        # Not bounded here: the end's uploads are, by W&B's finish_timeout (the rest is local).
        self._sender.close(None)
        self._sender = None

    def flush(self) -> None:
        if self._sender is not None:
            self._sender.flush(None)  # to W&B's local service: no network
