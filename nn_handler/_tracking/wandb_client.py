"""W&B's side of a :class:`~nn_handler.loggers.WandbLogger` run, in the tracker's own process (:mod:`.child`).

Imports W&B, not torch: this runs in a fresh interpreter that only sends.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import PREEMPTED_EXIT_CODE
from .sender import Record

log = logging.getLogger("nn_handler.loggers")


class WandbRun:
    """Starts or continues W&B run ``run_id`` and hands it its records (``send``); picklable.

    A W&B that cannot be reached makes the run offline (one warning); a call
    that fails is dropped (it would fail again), with one warning.
    """

    def __init__(self, project: str | None, dir: str | None, mode: str | None, run_id: str,
                 init_timeout_s: float, end_timeout_s: float):
        self.project, self.dir, self.mode, self.run_id = project, dir, mode, run_id
        self.init_timeout_s, self.end_timeout_s = init_timeout_s, end_timeout_s
        self._run: Any = None
        self._failing = False

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def prepare(self) -> None:
        import wandb  # noqa: F401  (seconds of import, before any bound on sending starts)

    def send(self, records: list[Record]) -> None:
        while records:
            record = records[0]
            kind = record["kind"]
            if kind == "open":
                self._open()
            elif kind == "metrics":
                self._call(lambda run: run.log(record["values"], step=record["step"]))
            elif kind == "params":
                self._call(lambda run: run.config.update(record["values"], allow_val_change=True))
            else:
                self._call(lambda run: _finish(run, record["state"], record["failure"]))
                self._run = None
            del records[0]

    def close(self) -> None:
        import wandb

        wandb.teardown()  # W&B's service has written the run's files before this process says it is done

    def _open(self) -> None:
        import wandb

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
    if state == "preempted":
        run.mark_preempting()
    run.finish(exit_code=0 if state == "finished" else PREEMPTED_EXIT_CODE if state == "preempted" else 1)
