"""MLflow's side of an :class:`~nn_handler.loggers.MLflowLogger` run, in the tracker's own process (:mod:`.child`).

Imports MLflow, not torch: this runs in a fresh interpreter that only sends.
"""

from __future__ import annotations

from typing import Any

from .sender import Record

STATUS = {"finished": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}
_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics (and 100 parameters) a call


class MlflowRun:
    """Opens or continues run ``run_id`` (None: a new run) and sends its records (``send``); picklable."""

    def __init__(self, tracking_uri: str | None, experiment_name: str, run_name: str | None, run_id: str | None):
        self.tracking_uri, self.experiment_name, self.run_name = tracking_uri, experiment_name, run_name
        self.run_id = run_id
        self._client: Any = None
        self._opened = False  # the run is open on the server for this train() call

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def prepare(self) -> None:
        import mlflow  # noqa: F401  (seconds of import, before any bound on sending starts)

    def send(self, records: list[Record]) -> None:
        """Send ``records`` in order, removing each from the list once MLflow has it."""
        while records:
            kind = records[0]["kind"]
            if kind == "open":
                self._start_run()
                del records[0]
            elif kind == "end":
                self._end_run(records[0])
                del records[0]
            else:  # metrics and parameters, as many as one call takes
                n, metrics, params = 0, [], []
                while n < len(records) and records[n]["kind"] in ("metrics", "params"):
                    record = records[n]
                    full = (params if record["kind"] == "params" else len(metrics) + len(record["values"]) > _BATCH)
                    if n and full:
                        break
                    metrics += _metrics(record)
                    params += _params(record)
                    n += 1
                self._client.log_batch(self.run_id, metrics=metrics, params=params, synchronous=True)
                del records[:n]

    def _start_run(self) -> None:
        if self._opened:
            return
        from mlflow import MlflowClient

        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        client = self._client
        if self.run_id is None:
            experiment = client.get_experiment_by_name(self.experiment_name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(self.experiment_name))
            run = client.create_run(experiment_id, run_name=self.run_name, tags={"end_state": "running"})
            self.run_id = run.info.run_id
        else:  # continued: by another train() call, or a resumed process
            client.update_run(self.run_id, status="RUNNING")
            client.set_tag(self.run_id, "end_state", "running")
        self._opened = True

    def _end_run(self, record: Record) -> None:
        client = self._client
        client.set_tag(self.run_id, "end_state", record["state"])
        if record["failure"] is not None:
            client.set_tag(self.run_id, "failure", record["failure"])
        client.set_terminated(self.run_id, STATUS[record["state"]], end_time=record["time_ms"])


def _metrics(record: Record) -> list:
    from mlflow.entities import Metric

    if record["kind"] != "metrics":
        return []
    return [Metric(key, value, record["time_ms"], record["step"]) for key, value in record["values"].items()]


def _params(record: Record) -> list:
    from mlflow.entities import Param

    return [Param(k, v) for k, v in record["values"].items()] if record["kind"] == "params" else []
