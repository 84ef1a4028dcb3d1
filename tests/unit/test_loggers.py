"""TensorBoardLogger: its event files, read back with TensorBoard's EventAccumulator, equal the History."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from nn_handler.callbacks import Callback
from nn_handler.errors import ConfigurationError, MissingExtraError
from scripts.handler_case import make_data, make_handler, make_model
from scripts.tracker_case import EVERY, TwoLosses, train_two_losses

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from nn_handler.loggers import TensorBoardLogger  # noqa: E402

BATCH = 8  # 96 samples: 12 batches, 12 optimizer steps an epoch


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` as TensorBoard shows them (all points, later files' purges applied)."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class BatchLosses(Callback):
    """Every micro-batch's loss with the global step after it."""

    def __init__(self):
        self.seen = []

    def on_batch_end(self, handler, step, loss):
        self.seen.append((handler.global_step, loss.item()))


def step_means(seen, every):
    """The mean loss of each optimizer step's micro-batches, every ``every`` steps: what step/train_loss holds."""
    # A micro-batch before an update sees the previous step: group them by the update that follows.
    groups, pending = {}, []
    last = 0
    for step, loss in seen:
        pending.append(loss)
        if step != last:
            groups[step], pending, last = pending, [], step
    return [(s, sum(v) / len(v)) for s, v in groups.items() if s % every == 0]


def make(callbacks, grad_accum=1, **kwargs):
    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    handler = make_handler(make_model(dropout=0.2), seed=5, grad_accum_steps=grad_accum, callbacks=callbacks,
                           **kwargs)
    handler.set_train_loader(TensorDataset(X, y), batch_size=BATCH, shuffle=True)
    handler.set_val_loader(TensorDataset(Xv, yv), batch_size=BATCH)
    return handler


LEARNING = ("epoch", "train_loss", "train_mae", "val_loss", "val_mae", "lr")  # the same in a straight run


def assert_epoch_curves_equal_history(scalars, history, steps, keys=None):
    for key in keys or history.keys():
        assert f"epoch/{key}" in scalars, key
        assert [s for s, _ in scalars[f"epoch/{key}"]] == steps, key
        assert [v for _, v in scalars[f"epoch/{key}"]] == pytest.approx(history[key], rel=1e-6), key


@pytest.mark.parametrize("grad_accum,every", [(1, 1), (2, 3)])
def test_the_event_files_hold_the_history_the_step_losses_and_the_learning_rates(tmp_path, grad_accum, every):
    losses = BatchLosses()
    handler = make([TensorBoardLogger(tmp_path / "tb", log_every_n_steps=every), losses], grad_accum=grad_accum)
    history = handler.train(3, progress=False)
    scalars = read_scalars(tmp_path / "tb")

    steps_per_epoch = 12 // grad_accum
    assert_epoch_curves_equal_history(scalars, history, [steps_per_epoch * e for e in (1, 2, 3)])
    expected = step_means(losses.seen, every)
    assert [s for s, _ in scalars["step/train_loss"]] == [s for s, _ in expected]
    assert [v for _, v in scalars["step/train_loss"]] == pytest.approx([v for _, v in expected], rel=1e-6)
    # StepLR(2, 0.5) steps after each epoch: the lr of each logged step is that of its epoch.
    lrs = scalars["step/lr_group0"]
    assert [s for s, _ in lrs] == [s for s, _ in expected]
    assert [v for _, v in lrs] == pytest.approx([history["lr"][(s - 1) // steps_per_epoch] for s, _ in lrs])
    assert not any(tag.startswith("part_epoch/") for tag in scalars)


def assert_curves_of_a_straight_run(got, handler, straight, want):
    """The step losses and the epoch curves of a continued or resumed run are those of the straight run."""
    assert got["step/train_loss"] == [(s, pytest.approx(v, rel=1e-5)) for s, v in want["step/train_loss"]]
    assert_epoch_curves_equal_history(got, handler.history, [12, 24, 36])
    assert_epoch_curves_equal_history(got, straight.history, [12, 24, 36], LEARNING)


def _straight(tmp_path):
    losses = BatchLosses()
    handler = make([TensorBoardLogger(tmp_path / "straight", log_every_n_steps=1), losses])
    handler.train(3, progress=False)
    return handler, read_scalars(tmp_path / "straight")


def test_a_run_stopped_at_max_steps_and_continued_draws_the_curves_of_a_straight_run(tmp_path):
    straight, want = _straight(tmp_path)

    logger = TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1)
    handler = make([logger])
    handler.train(3, max_steps=17, progress=False)
    part_row = handler.history.last()
    handler.train(3, progress=False)
    got = read_scalars(tmp_path / "tb")

    assert_curves_of_a_straight_run(got, handler, straight, want)
    # The part-epoch is logged once, as a part, at the step where it stopped: no second epoch-2 point.
    assert got["part_epoch/epoch"] == [(17, 2.0)]
    assert got["part_epoch/train_loss"] == [(17, pytest.approx(part_row["train_loss"], rel=1e-6))]


def test_a_resumed_run_continues_the_curves_and_drops_what_a_crashed_run_logged_past_its_checkpoint(tmp_path):
    straight, want = _straight(tmp_path)

    first = make([TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1)])
    first.train(3, max_steps=17, progress=False)
    first.save_checkpoint(tmp_path / "at17.ckpt")
    first.train(3, max_steps=30, progress=False)  # logged steps 18..30 and epoch 2, then "crashed"
    # Event files are read in the order of their names, which start with the second they were made.
    time.sleep(1.1)
    resumed = make([TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1)])
    resumed.load_checkpoint(tmp_path / "at17.ckpt")
    resumed.train(3, progress=False)
    got = read_scalars(tmp_path / "tb")

    assert_curves_of_a_straight_run(got, resumed, straight, want)
    assert [s for s, _ in got["part_epoch/epoch"]] == [17]


def test_only_the_main_process_writes(tmp_path, monkeypatch):
    logger = TensorBoardLogger(tmp_path / "tb")

    class NotMain:
        is_main_process, global_step, epoch, optimizer = False, 0, 0, None

    logger.on_train_begin(NotMain())
    logger.on_epoch_begin(NotMain(), 1)
    logger.on_batch_end(NotMain(), 0, torch.tensor(1.0))
    logger.on_epoch_end(NotMain(), 1, {"epoch": 1, "train_loss": 1.0})
    logger.on_train_end(NotMain())
    assert not (tmp_path / "tb").exists()


def test_hyperparameters_reach_the_hparams_tab(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    hparams = {"lr": 0.05, "optimizer": "sgd", "layers": 2}
    handler = make([TensorBoardLogger(tmp_path / "tb", hparams=hparams)])
    handler.train(1, progress=False)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    got = {k: v.string_value or v.number_value for k, v in start.session_start_info.hparams.items()}
    assert got == hparams
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {
        "epoch/train_loss", "epoch/val_loss", "epoch/train_mae", "epoch/val_mae"}


def test_without_tensorboard_the_logger_names_the_extra_when_created(monkeypatch):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith(("tensorboard.", "torch.utils.tensorboard"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'nn_handler\[tensorboard\]'"):
        TensorBoardLogger("runs")


@pytest.mark.parametrize("kwargs,message", [
    ({"log_every_n_steps": 0}, "log_every_n_steps must be an int >= 1, got 0"),
    ({"hparams": {"layers": [2, 3]}}, r"hparams\['layers'\] must be a bool, int, float or str"),
    ({"hparams": {1: 2}}, "hparams must be a mapping with str keys"),
    ({"hand_over_s": -1}, "hand_over_s must be a number of seconds >= 0, got -1"),
])
def test_bad_arguments_are_refused_when_the_logger_is_created(tmp_path, kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        TensorBoardLogger(tmp_path, **kwargs)


def test_a_run_resumed_with_resume_auto_from_a_mid_epoch_checkpoint_continues_the_curves(tmp_path):
    straight, want = _straight(tmp_path)

    make([TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1)], checkpoint_dir=tmp_path / "ck").train(
        3, max_steps=17, progress=False)  # the stop writes a mid-epoch checkpoint, as a preemption does
    time.sleep(1.1)  # a later process: a later event file
    resumed = make([TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1)], checkpoint_dir=tmp_path / "ck",
                   resume="auto")
    resumed.train(3, progress=False)
    got = read_scalars(tmp_path / "tb")

    assert_curves_of_a_straight_run(got, resumed, straight, want)
    assert [s for s, _ in got["part_epoch/epoch"]] == [17]


def test_a_per_step_schedule_s_epoch_lr_after_a_stop_a_resume_or_a_preemption_is_the_straight_run_s(tmp_path):
    import os

    from nn_handler import TrainingPreempted
    from scripts.scale_case import AtStep, sigterm_to

    def run(name, limits=(), resume=None, callbacks=()):
        handler = make([TensorBoardLogger(tmp_path / name, log_every_n_steps=100), *callbacks], scheduler=None,
                       scheduler_interval="step", checkpoint_dir=resume and tmp_path / f"{resume}.ckpts",
                       resume=resume and "auto")
        handler.set_scheduler(torch.optim.lr_scheduler.LambdaLR(handler.optimizer, lambda s: 0.95 ** s))
        for limit in limits:  # each a train() call
            handler.train(3, progress=False, **limit)
        return handler

    straight = run("straight", [{}])
    assert len(set(straight.history["lr"])) == 3  # the schedule moves the LR within each epoch
    continued = run("continued", [{"max_steps": 17}, {}])  # stopped 5 batches into epoch 2, then continued
    run("resumed", [{"max_steps": 17}], resume="resumed")
    resumed = run("resumed", [{}], resume="resumed")  # a new handler, from the mid-epoch checkpoint
    with pytest.raises(TrainingPreempted):
        run("preempted", [{}], resume="preempted", callbacks=[AtStep(17, sigterm_to(os.getpid), accum=1)])
    preempted = run("preempted", [{}], resume="preempted")
    want = read_scalars(tmp_path / "straight")["epoch/lr"]
    for handler, name in ((continued, "continued"), (resumed, "resumed"), (preempted, "preempted")):
        for key in LEARNING:
            assert handler.history[key] == straight.history[key], (name, key)
        assert read_scalars(tmp_path / name)["epoch/lr"] == want, name


def test_tensorboard_logs_every_value_the_step_returns_per_step(tmp_path):
    step = TwoLosses()
    train_two_losses([TensorBoardLogger(tmp_path / "tb", log_every_n_steps=EVERY)], step)
    scalars = read_scalars(tmp_path / "tb")
    want = step.step_means(EVERY)
    assert list(want) == [3, 6, 9, 12]
    for name in ("train_loss", "train_d", "train_g"):
        assert scalars[f"step/{name}"] == [(s, pytest.approx(v[name], rel=1e-6)) for s, v in want.items()], name
    assert [s for s, _ in scalars["step/lr_group0"]] == list(want)


class Timeline(Callback):
    """Marks each micro-batch's end in ``events`` (put it before the logger: its mark comes first)."""

    def __init__(self, events):
        self.events = events

    def on_batch_end(self, handler, step, loss):
        self.events.append(("batch", handler.global_step))


@pytest.mark.parametrize("hand_over_s", [0.0, 3600.0])
def test_step_values_reach_the_writer_in_bursts_and_a_crash_keeps_every_logged_step(tmp_path, monkeypatch,
                                                                                      hand_over_s):
    from torch.utils.tensorboard.writer import FileWriter

    from scripts.scale_case import AtStep, raise_value_error

    events = []
    add_summary = FileWriter.add_summary

    def spy(self, summary, global_step=None, walltime=None):
        if summary.value and summary.value[0].tag.startswith("step/"):
            events.append(("write", global_step))
        return add_summary(self, summary, global_step, walltime)

    monkeypatch.setattr(FileWriter, "add_summary", spy)
    logger = TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1, hand_over_s=hand_over_s)
    handler = make([Timeline(events), logger, AtStep(7, raise_value_error, accum=1)])
    with pytest.raises(ValueError, match="at step 7"):
        handler.train(2, progress=False)

    writes = [step for kind, step in events if kind == "write"]
    assert writes == list(range(1, 8))  # every logged step, the one that raised included, in order
    if hand_over_s:  # gathered for the whole run, handed over when it raised
        assert events == [("batch", s) for s in range(1, 8)] + [("write", s) for s in range(1, 8)]
    else:  # each at once
        assert events == [e for s in range(1, 8) for e in (("batch", s), ("write", s))]
    assert [s for s, _ in read_scalars(tmp_path / "tb")["step/train_loss"]] == list(range(1, 8))


def test_flush_writes_the_gathered_step_values_to_the_event_file_mid_epoch(tmp_path):
    logger = TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1, hand_over_s=3600.0)
    seen = {}

    class ReadAtStep5(Callback):
        def on_batch_end(self, handler, step, loss):
            if handler.global_step == 5:
                seen["before"] = read_scalars(tmp_path / "tb").get("step/train_loss", [])
                logger.flush()
                seen["after"] = [s for s, _ in read_scalars(tmp_path / "tb")["step/train_loss"]]

    make([logger, ReadAtStep5()]).train(1, progress=False)
    assert seen == {"before": [], "after": [1, 2, 3, 4, 5]}
