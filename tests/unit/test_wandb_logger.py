"""WandbLogger in W&B's offline mode (no network): the run's files read back record by record."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from helpers import needs
from nn_handler import PREEMPTED_EXIT_CODE
from nn_handler.loggers import WandbLogger
from scripts.scale_case import AtStep, raise_value_error
from scripts.tracker_case import (
    Outputs,
    learning_series,
    make_run,
    wandb_history,
    wandb_records,
    wandb_updates,
)

pytestmark = [needs("wandb", "the wandb extra is not installed: pip install 'nn_handler[wandb]'"), pytest.mark.slow,
              pytest.mark.timeout(240)]  # every run starts W&B's service process

EVERY = 2


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # nothing of the user's W&B settings
    monkeypatch.chdir(tmp_path)
    yield
    import wandb

    wandb.teardown()  # W&B's service process lives until the process ends, or until this


def run_dirs(root: Path) -> list[Path]:
    """The offline run directories under ``root``, oldest first, once W&B has written them out.

    ``run.finish()`` returns before W&B's service process has written the run's last records; it writes
    them all before it exits (at the end of the process, or at ``wandb.teardown()``).
    """
    import wandb

    wandb.teardown()
    return sorted((root / "wandb").glob("offline-run-*"))


def exit_code(run_dir: Path) -> int:
    [code] = [r.exit.exit_code for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "exit"]
    return code


def test_an_offline_run_holds_the_history_the_step_values_and_the_config_and_continues_across_a_resume(tmp_path):
    outputs = Outputs()
    straight = WandbLogger(project="unit", dir=tmp_path / "straight", mode="offline", log_every_n_steps=EVERY,
                           hparams={"width": 16})
    history = make_run([straight, outputs]).train(3, progress=False)
    [only] = run_dirs(tmp_path / "straight")
    want = wandb_history([only])
    for key in ("epoch", "train_loss", "train_mae", "val_loss", "val_mae", "lr"):
        assert want[f"epoch/{key}"] == [(12 * (e + 1), pytest.approx(v, rel=1e-6)) for e, v in enumerate(history[key])]
    for key in ("train_loss", "train_mae"):
        assert want[f"step/{key}"] == [(s, pytest.approx(v[key], rel=1e-6))
                                       for s, v in sorted(outputs.steps.items()) if s % EVERY == 0], key
    config = wandb_updates(only, "config")
    assert config["width"] == 16 and config["optimizer"] == "SGD" and config["batch_size"] == 8
    assert wandb_updates(only, "summary")["end_state"] == "finished" and exit_code(only) == 0

    # Stopped at step 17 (part-way through epoch 2), then resumed by a new handler from checkpoint_dir.
    first = WandbLogger(project="unit", dir=tmp_path / "resumed", mode="offline", log_every_n_steps=EVERY)
    make_run([first], checkpoint_dir=tmp_path / "ck", resume="auto").train(3, max_steps=17, progress=False)
    second = WandbLogger(project="unit", dir=tmp_path / "resumed", mode="offline", log_every_n_steps=EVERY)
    make_run([second], checkpoint_dir=tmp_path / "ck", resume="auto").train(3, progress=False)
    assert second.run_id == first.run_id
    parts = run_dirs(tmp_path / "resumed")
    # One run, in two sittings (wandb adds "-1" to a sitting's directory when both started in the same second).
    assert len(parts) == 2 and all(re.fullmatch(rf"offline-run-\d+_\d+-{first.run_id}(-\d+)?", p.name) for p in parts)
    got = wandb_history(parts)
    assert learning_series(got).keys() == learning_series(want).keys()
    for key, points in learning_series(want).items():
        assert got[key] == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], key


def test_a_run_that_raises_ends_failed_with_the_exception_s_type(tmp_path):
    logger = WandbLogger(project="unit", dir=tmp_path, mode="offline")
    with pytest.raises(ValueError):
        make_run([logger, AtStep(5, raise_value_error, accum=1)]).train(2, progress=False)
    [run_dir] = run_dirs(tmp_path)
    summary = wandb_updates(run_dir, "summary")
    assert (summary["end_state"], summary["failure"]) == ("failed", "ValueError")
    assert exit_code(run_dir) == 1
    assert PREEMPTED_EXIT_CODE != 1  # a preemption ends the run with its own code (and mark_preempting)


def test_only_rank_0_logs(tmp_path):
    logger = WandbLogger(project="unit", dir=tmp_path, mode="offline")

    class NotMain:
        is_main_process, global_step, epoch, optimizers = False, 0, 0, {}

    logger.on_train_begin(NotMain())
    logger.on_batch_end(NotMain(), 0, 1.0, None)
    logger.on_train_end(NotMain())
    assert logger.run_id is None and not (tmp_path / "wandb").exists()
    assert os.listdir(tmp_path) == []


def test_w_and_b_runs_in_a_process_of_its_own_that_ends_with_training(tmp_path, monkeypatch):
    import wandb
    from helpers import child_commands
    from wandb.sdk.wandb_run import Run

    from nn_handler.callbacks import Callback

    calls, children = [], []

    def spy(name):
        def call(*args, **kwargs):
            calls.append(name)  # in this, the training process
        return call

    monkeypatch.setattr(Run, "log", spy("log"))
    monkeypatch.setattr(wandb, "init", spy("init"))

    class Children(Callback):
        def on_batch_end(self, handler, step, loss):
            children.extend(child_commands())

    logger = WandbLogger(project="unit", dir=tmp_path, mode="offline", log_every_n_steps=1)
    make_run([logger, Children()]).train(1, progress=False)
    assert calls == []  # W&B's client never ran here
    tracker = "nn_handler._tracking.child"  # (the test process may have other children: warm worker pools)
    assert any(tracker in c for c in children)  # it ran in a child
    assert [c for c in child_commands() if tracker in c] == []  # which ended with train()
    [run_dir] = run_dirs(tmp_path)
    assert [s for s, _ in wandb_history([run_dir])["step/train_loss"]] == list(range(1, 13))


KILLED_MID_RUN = """
import os, signal, sys
from nn_handler.loggers import WandbLogger
from scripts.scale_case import AtStep
from scripts.tracker_case import make_run

logger = WandbLogger(project="unit", dir=sys.argv[1], mode="offline", log_every_n_steps=1)

def kill(handler):
    logger.flush()  # steps 1..8 are in W&B's hands
    print("TRACKER", logger._sender._process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

make_run([logger, AtStep(8, kill, accum=1)]).train(3, progress=False)
"""


def test_a_killed_training_process_s_run_ends_failed_not_finished_and_its_process_exits(tmp_path):
    import signal
    import sys

    from helpers import REPO, run_command, wait_gone

    (tmp_path / "train.py").write_text(KILLED_MID_RUN)
    # The tracker's process writes to the same stderr: the output ends only when it has exited too.
    result = run_command([sys.executable, str(tmp_path / "train.py"), str(tmp_path)], timeout=150,
                         env={"PYTHONPATH": str(REPO / "tests")}, cwd=tmp_path)
    assert result.returncode == -signal.SIGKILL, result.stdout
    [pid] = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("TRACKER")]
    assert wait_gone([pid]) == []  # it had closed its output already: exiting on its own
    [run_dir] = run_dirs(tmp_path)
    assert [s for s, _ in wandb_history([run_dir])["step/train_loss"]] == list(range(1, 9))
    summary = wandb_updates(run_dir, "summary")
    assert (summary["end_state"], summary["failure"], exit_code(run_dir)) == ("failed", "TrainingProcessLost", 1)
