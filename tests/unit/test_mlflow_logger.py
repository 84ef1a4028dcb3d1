"""MLflowLogger against a real MLflow: a ``sqlite:///`` store, and an ``mlflow server`` this module starts.

The server (SQLite backend in a temporary directory, 127.0.0.1, a free port)
is shared by the module's tests and stopped by its process group; the last
test kills it mid-run. Runs are read back with ``mlflow.MlflowClient``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import kill_group, needs
from nn_handler import TrainingPreempted
from nn_handler.loggers import MLflowLogger
from scripts.scale_case import AtStep, raise_value_error, sigterm_to
from scripts.tracker_case import Outputs, learning_series, make_run

pytestmark = [needs("mlflow", "the mlflow extra is not installed: pip install 'nn_handler[mlflow]'"),
              pytest.mark.slow]  # MLflow's first use of a store migrates its tables (seconds); the server starts

EVERY = 2
SERVER_START_S = 240  # the server's readiness deadline: two Python processes importing MLflow, on a loaded machine


def MlflowClient(uri: str):
    """``mlflow.MlflowClient(uri)``, imported on first use (see ``helpers.needs``)."""
    import mlflow

    return mlflow.MlflowClient(uri)


def metric_series(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value), ...]}`` of every metric of a run, in step order."""
    keys = client.get_run(run_id).data.metrics
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in keys}


def assert_the_run_is_the_history(series, history, outputs, every=EVERY):
    steps_per_epoch = 12
    for key in ("epoch", "train_loss", "train_mae", "val_loss", "val_mae", "lr"):
        assert series[f"epoch/{key}"] == [(steps_per_epoch * (e + 1), pytest.approx(v, rel=1e-6))
                                          for e, v in enumerate(history[key])], key
    for key in ("train_loss", "train_mae"):
        assert series[f"step/{key}"] == [(s, pytest.approx(v[key], rel=1e-6))
                                         for s, v in sorted(outputs.steps.items()) if s % every == 0], key
    assert [s for s, _ in series["step/lr_group0"]] == [s for s, _ in series["step/train_loss"]]


def test_a_run_in_a_sqlite_store_holds_the_history_the_step_values_and_the_settings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where unsent records would go
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLflowLogger(uri, experiment_name="unit", run_name="first", hparams={"width": 16, "note": "a"},
                          log_every_n_steps=EVERY)
    outputs = Outputs()
    handler = make_run([logger, outputs])
    history = handler.train(3, progress=False)

    client = MlflowClient(uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.tags["end_state"] == "finished" and "failure" not in run.data.tags
    params = run.data.params
    assert params["width"] == "16" and params["note"] == "a"
    assert params["optimizer"] == "SGD" and params["batch_size"] == "8" and params["grad_accum_steps"] == "1"
    assert_the_run_is_the_history(metric_series(client, logger.run_id), history, outputs)
    assert not list(tmp_path.glob("mlflow-unsent-*"))


def test_a_run_that_raises_ends_failed_with_the_exception_s_type_and_a_preempted_one_killed_then_resumed(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)

    failing = MLflowLogger(uri, experiment_name="unit")
    with pytest.raises(ValueError):
        make_run([failing, AtStep(5, raise_value_error, accum=1)]).train(2, progress=False)
    run = client.get_run(failing.run_id)
    assert (run.info.status, run.data.tags["end_state"], run.data.tags["failure"]) == ("FAILED", "failed", "ValueError")

    preempted = MLflowLogger(uri, experiment_name="unit", log_every_n_steps=1)
    with pytest.raises(TrainingPreempted):
        make_run([preempted, AtStep(17, sigterm_to(os.getpid), accum=1)], checkpoint_dir=tmp_path / "ck",
                 resume="auto").train(3, progress=False)
    run = client.get_run(preempted.run_id)
    assert (run.info.status, run.data.tags["end_state"]) == ("KILLED", "preempted")

    resumed = MLflowLogger(uri, experiment_name="unit", log_every_n_steps=1)
    make_run([resumed], checkpoint_dir=tmp_path / "ck", resume="auto").train(3, progress=False)
    assert resumed.run_id == preempted.run_id  # the checkpoint's run, continued
    run = client.get_run(resumed.run_id)
    assert (run.info.status, run.data.tags["end_state"]) == ("FINISHED", "finished")
    steps = [s for s, _ in metric_series(client, resumed.run_id)["step/train_loss"]]
    assert steps == list(range(1, 37))  # each step once: none twice, none missing


# ----------------------------------------------------------------------------- a real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, root: Path):
        self.db = f"sqlite:///{root}/backend.db"  # read back without the server once it is killed
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runners: a lighter server
        self.log = open(root / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.db, "--default-artifact-root",
             str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait_ready(self, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)  # a poll of the health endpoint, not a wait for an event we could have
        pytest.fail(f"mlflow server not ready within {deadline_s}s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def kill(self) -> None:
        kill_group(self.proc)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        server.wait_ready(SERVER_START_S)
        yield server
    finally:
        server.kill()


@pytest.mark.timeout(SERVER_START_S + 180)
def test_a_run_stopped_at_max_steps_and_resumed_is_one_run_whose_series_equal_the_straight_run_s(server, tmp_path):
    client = MlflowClient(server.url)
    straight = MLflowLogger(server.url, experiment_name="resume", log_every_n_steps=EVERY)
    outputs = Outputs()
    history = make_run([straight, outputs]).train(3, progress=False)
    want = metric_series(client, straight.run_id)
    assert_the_run_is_the_history(want, history, outputs)

    first = MLflowLogger(server.url, experiment_name="resume", log_every_n_steps=EVERY)
    make_run([first], checkpoint_dir=tmp_path / "ck", resume="auto").train(3, max_steps=17, progress=False)
    assert client.get_run(first.run_id).data.tags["end_state"] == "finished"
    assert "epoch/epoch" in metric_series(client, first.run_id)  # epoch 1, not the part of epoch 2
    assert [s for s, _ in metric_series(client, first.run_id)["epoch/epoch"]] == [12]
    second = MLflowLogger(server.url, experiment_name="resume", log_every_n_steps=EVERY)  # a new process's
    make_run([second], checkpoint_dir=tmp_path / "ck", resume="auto").train(3, progress=False)

    assert second.run_id == first.run_id
    got = metric_series(client, second.run_id)
    assert learning_series(got).keys() == learning_series(want).keys()
    for key, points in learning_series(want).items():
        assert got[key] == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], key
    experiment = client.get_experiment_by_name("resume")
    assert len(client.search_runs([experiment.experiment_id])) == 2


@pytest.mark.timeout(120)
def test_a_server_down_at_start_costs_a_warning_and_the_records_go_to_the_fallback_file(tmp_path, caplog):
    down = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    # Within the 30 s: the tracker process's start (it imports MLflow before its bound on sending starts: about
    # 12 s here with three busy loops beside the test on 2 cores) and the 2 s it has to send once training ended.
    logger = MLflowLogger(down, experiment_name="down", log_every_n_steps=EVERY, fallback_dir=tmp_path,
                          end_timeout_s=2)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="nn_handler"):
        history = make_run([logger]).train(2, progress=False)
    assert time.monotonic() - start < 30
    assert len(history) == 2  # trained
    warnings = [r for r in caplog.records if r.name.startswith("nn_handler.loggers")]
    assert 1 <= len(warnings) <= 3, [r.getMessage() for r in warnings]
    [fallback] = tmp_path.glob("mlflow-unsent-*.jsonl")
    assert fallback.name in caplog.text
    import json

    records = [json.loads(line) for line in fallback.read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "metrics" and "step/train_loss" in r["values"]]
    assert steps == list(range(EVERY, 25, EVERY))
    assert records[-1]["kind"] == "end" and records[-1]["state"] == "finished"


@pytest.mark.timeout(SERVER_START_S + 120)
def test_a_server_killed_mid_run_never_stops_training(server, tmp_path, caplog):
    # Last in the module: it kills the shared server.
    logger = MLflowLogger(server.url, experiment_name="killed", log_every_n_steps=1, fallback_dir=tmp_path)
    killed = []

    def kill(handler):
        assert logger._sender.flush(60)  # the run and its first steps are on the server
        server.kill()
        killed.append(time.monotonic())

    with caplog.at_level(logging.WARNING, logger="nn_handler"):
        make_run([logger, AtStep(12, kill, accum=1)]).train(3, progress=False)
    assert time.monotonic() - killed[0] < 30
    assert "Retrying" not in caplog.text  # urllib3's warning per retry, dropped in the sender's thread
    warnings = [r for r in caplog.records if r.name.startswith("nn_handler.loggers")]
    assert 1 <= len(warnings) <= 3, [r.getMessage() for r in warnings]

    import json

    stored = [s for s, _ in metric_series(MlflowClient(server.db), logger.run_id)["step/train_loss"]]
    [fallback] = tmp_path.glob("mlflow-unsent-*.jsonl")
    unsent = [r["step"] for r in map(json.loads, fallback.read_text().splitlines())
              if r["kind"] == "metrics" and "step/train_loss" in r["values"]]
    assert stored[:1] == [1] and max(unsent) == 36
    assert sorted(set(stored) | set(unsent)) == list(range(1, 37))  # each step sent or written down


KILLED_MID_RUN = """
import os, signal, sys
from nn_handler.loggers import MLflowLogger
from scripts.scale_case import AtStep
from scripts.tracker_case import make_run

logger = MLflowLogger(sys.argv[1], experiment_name="sigkill", log_every_n_steps=1, fallback_dir=sys.argv[2])

def kill(handler):
    logger.flush()  # steps 1..8 are in the store
    print("TRACKER", logger._sender._process.pid, "RUN", logger.run_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

make_run([logger, AtStep(8, kill, accum=1)]).train(3, progress=False)
"""


@pytest.mark.timeout(180)
def test_the_tracker_process_ends_when_the_training_process_is_killed(tmp_path):
    from helpers import REPO, run_command, wait_gone

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "train.py").write_text(KILLED_MID_RUN)
    # The tracker's process writes to the same stderr: the output ends only when it has exited too.
    result = run_command([sys.executable, str(tmp_path / "train.py"), db, str(tmp_path)], timeout=150,
                         env={"PYTHONPATH": str(REPO / "tests")}, cwd=tmp_path)
    assert result.returncode == -signal.SIGKILL, result.stdout
    [(pid, run_id)] = [(int(line.split()[1]), line.split()[3]) for line in result.stdout.splitlines()
                       if line.startswith("TRACKER")]
    assert wait_gone([pid]) == []  # it had closed its output already: exiting on its own
    series = metric_series(MlflowClient(db), run_id)
    assert [s for s, _ in series["step/train_loss"]] == list(range(1, 9))
    run = MlflowClient(db).get_run(run_id)
    assert (run.info.status, run.data.tags["end_state"], run.data.tags["failure"]) == (
        "FAILED", "failed", "TrainingProcessLost")  # not left RUNNING, nor marked finished
    assert list(tmp_path.glob("mlflow-unsent-*")) == []


@pytest.mark.timeout(180)
def test_a_tracker_process_that_dies_never_stops_training_and_what_it_missed_is_written_down(tmp_path, caplog):
    import json

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLflowLogger(db, experiment_name="dies", log_every_n_steps=1, fallback_dir=tmp_path)

    def kill(handler):
        logger.flush()  # the run and steps 1..6 are in the store
        logger._sender._process.kill()
        logger._sender._process.wait()

    with caplog.at_level(logging.WARNING, logger="nn_handler"):
        history = make_run([logger, AtStep(6, kill, accum=1)]).train(3, progress=False)
    assert len(history) == 3  # trained to the end
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("nn_handler.loggers")]
    assert 1 <= len(warnings) <= 3, warnings
    stored = [s for s, _ in metric_series(MlflowClient(db), logger.run_id)["step/train_loss"]]
    [fallback] = tmp_path.glob(f"mlflow-unsent-{logger.run_id}-*.jsonl")
    records = [json.loads(line) for line in fallback.read_text().splitlines()]
    unsent = [r["step"] for r in records if r["kind"] == "metrics" and "step/train_loss" in r["values"]]
    assert stored == list(range(1, 7)) and unsent == list(range(7, 37))
    assert records[-1]["kind"] == "end" and records[-1]["state"] == "finished"
