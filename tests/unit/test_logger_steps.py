"""Every value a training step returns, per step, in TensorBoardLogger and CSVLogger; the on_exception hook."""

from __future__ import annotations

import csv
import sys

import pytest

from nn_handler.callbacks import Callback, CSVLogger
from scripts.tracker_case import EVERY, TwoLosses, train_two_losses


def test_csv_logger_writes_every_value_the_step_returns_per_step_and_a_resume_drops_what_follows_it(tmp_path):
    step = TwoLosses()
    logger = CSVLogger(tmp_path / "log.csv", log_every_n_steps=EVERY)
    train_two_losses([logger], step)
    with open(tmp_path / "log_steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    want = step.step_means(EVERY)
    assert [int(r["step"]) for r in rows] == list(want)
    for row, (s, values) in zip(rows, want.items()):
        for name, value in values.items():
            assert float(row[name]) == pytest.approx(value, rel=1e-6), (s, name)
        assert float(row["lr_group0"]) == 0.05
    assert (tmp_path / "log.csv").read_text().splitlines()[0].startswith("epoch,train_loss")

    # A run that starts again at step 6 (a resume from a checkpoint written there) keeps steps 3 and 6 only,
    # then appends its own.
    again = CSVLogger(tmp_path / "log.csv", log_every_n_steps=EVERY)

    class At6:
        is_main_process, global_step = True, 6

    again.on_train_begin(At6())
    again.on_train_end(At6())
    with open(tmp_path / "log_steps.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [3, 6]


class Ends(Callback):
    def __init__(self):
        self.seen = []

    def on_train_end(self, handler):
        self.seen.append("end")

    def on_exception(self, handler, exception):
        self.seen.append(exception)


def test_callbacks_hear_of_the_exception_that_ends_training():
    step = TwoLosses()

    def failing(ctx, batch):
        if len(step.seen) == 5:
            raise ValueError("bad batch")
        return step(ctx, batch)

    ends = Ends()
    with pytest.raises(ValueError, match="bad batch"):
        train_two_losses([ends], failing)
    [exc] = ends.seen  # no on_train_end
    assert isinstance(exc, ValueError) and str(exc) == "bad batch"

    ok = Ends()
    train_two_losses([ok], TwoLosses(), epochs=1)
    assert ok.seen == ["end"]


def test_an_on_exception_hook_that_raises_does_not_hide_the_training_error(caplog):
    class Broken(Callback):
        def on_exception(self, handler, exception):
            raise RuntimeError("hook broke")

    def failing(ctx, batch):
        raise ValueError("bad batch")

    ends = Ends()
    with pytest.raises(ValueError, match="bad batch"):
        train_two_losses([Broken(), ends], failing)
    assert len(ends.seen) == 1  # the next callback still heard of it
    assert "Broken.on_exception raised" in caplog.text


@pytest.mark.parametrize("name,module,extra", [("MLflowLogger", "mlflow", "mlflow"), ("WandbLogger", "wandb", "wandb")])
def test_a_tracker_without_its_extra_names_the_extra_when_created(monkeypatch, name, module, extra):
    from nn_handler import loggers
    from nn_handler.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` raises ImportError
    with pytest.raises(MissingExtraError, match=rf"pip install 'nn_handler\[{extra}\]'"):
        getattr(loggers, name)()


@pytest.mark.slow  # imports MLflow or W&B (seconds)
@pytest.mark.parametrize("name,kwargs,message", [
    ("MLflowLogger", {"log_every_n_steps": 0}, "log_every_n_steps must be an int >= 1, got 0"),
    ("MLflowLogger", {"experiment_name": ""}, "experiment_name must be a non-empty str"),
    ("MLflowLogger", {"send_every_s": -1}, "send_every_s must be a number of seconds >= 0"),
    ("MLflowLogger", {"hparams": {"layers": [2, 3]}}, r"hparams\['layers'\] must be a bool, int, float or str"),
    ("WandbLogger", {"mode": "offline=True"}, "mode must be one of"),
    ("WandbLogger", {"hparams": {1: 2}}, "hparams must be a mapping with str keys"),
    ("WandbLogger", {"send_every_s": -1}, "send_every_s must be a number of seconds >= 0"),
])
def test_a_tracker_refuses_bad_arguments_when_created(name, kwargs, message):
    from nn_handler import loggers
    from nn_handler.errors import ConfigurationError

    pytest.importorskip({"MLflowLogger": "mlflow", "WandbLogger": "wandb"}[name])
    with pytest.raises(ConfigurationError, match=message):
        getattr(loggers, name)(**kwargs)


def test_a_step_that_is_not_logged_is_not_taken_apart_and_a_logged_one_is_the_mean_of_its_micro_batches():
    # Per step on the training thread, a logger does no more than keep the step's micro-batches: the values
    # are detached and read at the logged steps only (here 2 and 4, two micro-batches a step).
    from nn_handler._tracking.values import StepSeries

    detached = []

    class Loss(float):
        def detach(self):
            detached.append(float(self))
            return self

    class Trainer:
        optimizers: dict = {}

    series, logged = StepSeries(every=2), {}
    series.epoch_begin(0)
    outputs: dict = {}  # one dict the step fills anew at each micro-batch
    for micro in range(8):
        step = micro // 2 + 1
        outputs.update(loss=Loss(micro), d=10.0 * micro)
        values = series.batch_end(step if micro % 2 else step - 1, Loss(micro), outputs, Trainer)
        if values is not None:
            logged[step] = values
    assert logged == {2: {"train_loss": 2.5, "train_d": 25.0}, 4: {"train_loss": 6.5, "train_d": 65.0}}
    assert sorted(detached) == [2.0, 3.0, 6.0, 7.0]


def test_the_sender_gathers_what_comes_within_its_interval_into_one_send():
    import threading

    from nn_handler._tracking.sender import Sender

    calls, first_sent = [], threading.Event()

    def send(records):
        calls.append(list(records))
        records.clear()
        first_sent.set()

    sender = Sender(send, "test", every_s=60.0)
    sender.put({"n": 1})  # the first record goes at once (a run's start)
    assert first_sent.wait(30)
    sender.put({"n": 2})
    sender.put({"n": 3})
    assert sender.close(timeout_s=30.0, fallback=None) == []  # close sends at once what gathered
    assert calls == [[{"n": 1}], [{"n": 2}, {"n": 3}]]
