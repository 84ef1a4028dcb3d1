"""NNHandler in one process: equal to a hand-written loop, callbacks, AMP, predict, logging, progress, plots."""

from __future__ import annotations

import csv
import logging
import math
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nn_handler import NNHandler
from nn_handler.callbacks import Callback, CSVLogger, EarlyStopping, ModelCheckpoint
from nn_handler.errors import MissingExtraError
from scripts.handler_case import mae, make_data, make_handler, make_model, reference_train, weights

EPOCHS, BATCH = 3, 8


@pytest.fixture
def data():
    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)  # 37: the last validation batch is short
    return X, y, Xv, yv


@pytest.mark.parametrize("grad_accum", [1, 5])  # 12 batches: 5 leaves a short last group
def test_same_history_and_weights_as_hand_written_loop(data, grad_accum):
    X, y, Xv, yv = data
    ref_model, ref_history = reference_train(X, y, Xv, yv, epochs=EPOCHS, batch_size=BATCH, grad_accum=grad_accum)

    handler = make_handler(make_model(), grad_accum_steps=grad_accum)
    handler.set_train_loader(TensorDataset(X, y), batch_size=BATCH)
    handler.set_val_loader(TensorDataset(Xv, yv), batch_size=BATCH)
    history = handler.train(EPOCHS, progress=False)

    for key, values in ref_history.items():
        assert history[key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    assert weights(handler.module) == pytest.approx(weights(ref_model), abs=1e-6)
    assert history["epoch"] == [1, 2, 3]
    assert history["lr"] == pytest.approx([0.05, 0.05, 0.025])  # StepLR(2, 0.5), the lr used in each epoch
    batches = math.ceil(96 / BATCH)
    assert handler.global_step == EPOCHS * math.ceil(batches / grad_accum)
    for row in history:
        assert row["epoch_time"] > 0 and row["samples_per_sec"] > 0 and row["peak_mem_mb_rank0"] > 0


def test_max_steps_stops_mid_epoch_and_the_next_call_continues_as_if_never_stopped(data, tmp_path):
    X, y, Xv, yv = data
    ends = []

    class Ends(Callback):
        def on_validation_end(self, handler, epoch, logs):
            ends.append(("val", epoch, handler.partial_epoch))

        def on_epoch_end(self, handler, epoch, logs):
            ends.append((epoch, handler.epoch, handler.global_step, handler.partial_epoch))

    def run(*calls):
        handler = make_handler(make_model(dropout=0.2), seed=5, callbacks=[Ends()])
        handler.set_train_loader(TensorDataset(X, y), batch_size=BATCH)  # 12 steps an epoch
        handler.set_val_loader(TensorDataset(Xv, yv), batch_size=BATCH)
        for kwargs in calls:
            handler.train(progress=False, **kwargs)
        return handler

    straight = run({"epochs": 3})
    ends.clear()
    stopped = run({"epochs": 3, "max_steps": 17})
    assert (stopped.global_step, stopped.epoch, stopped.history["epoch"]) == (17, 1, [1, 2])
    # The hooks saw the partial epoch, and were told so.
    assert ends == [("val", 1, False), (1, 1, 12, False), ("val", 2, True), (2, 1, 17, True)]
    assert stopped.partial_epoch
    assert stopped.history["lr"] == [0.05, 0.05]  # the scheduler did not step for it
    assert stopped.history["val_loss"][1] is not None
    stopped.train(3, max_steps=30, progress=False)  # the step limit counts from the start of training
    assert (stopped.global_step, stopped.epoch) == (30, 2)
    stopped.save_checkpoint(tmp_path / "mid.ckpt")  # a stopped run's own checkpoint continues mid-epoch too
    stopped.train(3, progress=False)
    loaded = run()
    loaded.load_checkpoint(tmp_path / "mid.ckpt")
    loaded.train(3, progress=False)
    for handler in (stopped, loaded):
        assert weights(handler.module) == weights(straight.module)
        for key in ("epoch", "train_loss", "train_mae", "val_loss", "val_mae", "lr"):
            assert handler.history[key] == straight.history[key], key


def test_max_steps_at_an_epoch_end_and_nothing_left_to_do(data, caplog):
    X, y, _, _ = data
    handler = make_handler()
    handler.set_train_loader(TensorDataset(X, y), batch_size=BATCH)
    handler.train(max_steps=24, progress=False)
    assert (handler.global_step, handler.epoch, handler.history["epoch"]) == (24, 2, [1, 2])
    with caplog.at_level(logging.WARNING, logger="nn_handler"):
        handler.train(max_steps=10, progress=False)
    assert handler.global_step == 24 and "global step 24: nothing to do" in caplog.text


def test_max_time_stops_training_without_an_epoch_limit(data):
    X, y, _, _ = data
    handler = make_handler()
    handler.set_train_loader(TensorDataset(X, y), batch_size=BATCH)
    loss_fn = handler.loss_fn

    def slow(out, target):
        import time
        time.sleep(0.05)  # 12 steps: 0.6 s an epoch, past max_time
        return loss_fn(out, target)

    handler.set_loss_fn(slow)
    handler.train(max_time=0.3, progress=False)
    assert 0 < handler.global_step < 12 and handler.epoch == 0 and handler.history["epoch"] == [1]


def test_train_counts_epochs_from_the_start_and_continues(data):
    X, y, _, _ = data
    handler = make_handler()
    handler.set_train_loader((X, y), batch_size=BATCH)
    handler.train(2, progress=False)
    assert handler.train(2, progress=False)["epoch"] == [1, 2]  # already done: nothing runs
    assert handler.train(3, progress=False)["epoch"] == [1, 2, 3]


def test_amp_autocasts_to_bfloat16_on_cpu(data):
    X, y, _, _ = data
    model = make_model()
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    handler = make_handler(model, amp=True)
    handler.set_train_loader((X, y), batch_size=BATCH)
    history = handler.train(2, progress=False)
    assert set(seen) == {torch.bfloat16}
    assert handler.scaler is None  # bf16 needs no loss scaling
    assert history["train_loss"][1] < history["train_loss"][0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_clip_grad_norm_bounds_each_update(data):
    X, y, _, _ = data
    model = nn.Linear(6, 1)
    handler = NNHandler(model, torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 1.0}, clip_grad_norm=1e-3)
    handler.set_train_loader((X * 100, y * 100), batch_size=96, shuffle=False)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    handler.train(1, progress=False)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (after - before).norm().item() == pytest.approx(1e-3, rel=1e-3)  # lr 1 * clipped norm


def test_predict_returns_outputs_in_input_order():
    model = nn.Linear(3, 2)
    X = torch.randn(11, 3)
    handler = NNHandler(model)
    expected = model(X).detach()
    assert torch.allclose(handler.predict(X, batch_size=4), expected)
    loader = DataLoader(TensorDataset(X, torch.zeros(11)), batch_size=5, shuffle=True)
    assert torch.allclose(handler.predict(loader), expected)  # shuffling is turned off, order kept


def test_evaluate_weights_every_sample_once(data):
    _, _, Xv, yv = data
    model = make_model()
    handler = make_handler(model)
    result = handler.evaluate(TensorDataset(Xv, yv))
    with torch.no_grad():
        assert result["loss"] == pytest.approx(nn.functional.mse_loss(model(Xv), yv).item(), rel=1e-6)
        assert result["mae"] == pytest.approx((model(Xv) - yv).abs().mean().item(), rel=1e-6)


def test_early_stopping_stops_at_the_patience_limit(data):
    X, y, _, _ = data

    class Fixed(Callback):  # feed EarlyStopping a scripted value through the History row
        def on_epoch_end(self, handler, epoch, logs):
            logs["score"] = [1.0, 0.5, 0.6, 0.7, 0.4][epoch - 1]

    stopper = EarlyStopping("score", patience=2)
    handler = make_handler(callbacks=[Fixed(), stopper])
    handler.set_train_loader((X, y), batch_size=BATCH)
    history = handler.train(10, progress=False)
    assert len(history) == 4 and stopper.stopped_epoch == 4 and handler.stop_training


def test_early_stopping_names_a_missing_key(data):
    X, y, _, _ = data
    handler = make_handler(callbacks=[EarlyStopping("val_loss")])
    handler.set_train_loader((X, y), batch_size=BATCH)
    with pytest.raises(ValueError, match="monitors 'val_loss'.*set_val_loader.*available: epoch, train_loss"):
        handler.train(1, progress=False)


def test_csv_logger_and_model_checkpoint(tmp_path, data):
    X, y, Xv, yv = data
    handler = make_handler(callbacks=[CSVLogger(tmp_path / "log.csv"),
                                      ModelCheckpoint(tmp_path / "ckpt", monitor="val_loss", every_n_epochs=2)])
    handler.set_train_loader((X, y), batch_size=BATCH)
    handler.set_val_loader((Xv, yv), batch_size=BATCH)
    history = handler.train(4, progress=False)
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert list(rows[0]) == history.keys()
    assert [float(r["val_loss"]) for r in rows] == pytest.approx(history["val_loss"])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch-0002.ckpt", "epoch-0004.ckpt", "last.ckpt"]


def test_model_checkpoint_save_best_only(tmp_path, data):
    X, y, Xv, yv = data
    cb = ModelCheckpoint(tmp_path, monitor="val_loss", save_best_only=True, save_last=False)
    handler = make_handler(callbacks=[cb])
    handler.set_train_loader((X, y), batch_size=BATCH)
    handler.set_val_loader((Xv, yv), batch_size=BATCH)
    history = handler.train(3, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["best.ckpt"]
    assert cb.best == min(history["val_loss"])


def test_callback_hooks_run_in_order(data):
    X, y, Xv, yv = data
    calls = []

    class Recorder(Callback):
        def on_train_begin(self, handler):
            calls.append("train_begin")

        def on_epoch_begin(self, handler, epoch):
            calls.append(f"epoch_begin{epoch}")

        def on_batch_end(self, handler, step, loss):
            assert loss.dim() == 0 and not loss.requires_grad
            calls.append("batch")

        def on_validation_end(self, handler, epoch, logs):
            calls.append(f"val{epoch}:{sorted(logs)}")

        def on_epoch_end(self, handler, epoch, logs):
            calls.append(f"epoch_end{epoch}")

        def on_train_end(self, handler):
            calls.append("train_end")

    handler = make_handler(callbacks=[Recorder()])
    handler.set_train_loader((X[:16], y[:16]), batch_size=BATCH)
    handler.set_val_loader((Xv, yv), batch_size=BATCH)
    handler.train(1, progress=False)
    assert calls == ["train_begin", "epoch_begin1", "batch", "batch", "val1:['val_loss', 'val_mae']",
                     "epoch_end1", "train_end"]


def test_callbacks_see_the_handler_through_the_trainer_view(data):
    from nn_handler.callbacks import TrainerView

    seen = []

    class Typed(Callback):
        def on_epoch_end(self, handler: TrainerView, epoch: int, logs: dict) -> None:
            seen.append(isinstance(handler, TrainerView))

    handler = make_handler(callbacks=[Typed()])
    handler.set_train_loader((data[0][:16], data[1][:16]), batch_size=BATCH)
    handler.train(1, progress=False)
    assert seen == [True]  # the handler has every attribute and method the view promises
    # What the built-in and the documented callbacks use of the trainer is in the view.
    members = set(dir(TrainerView)) | set(TrainerView.__annotations__)
    assert {"stop_training", "history", "save_checkpoint", "global_step", "module", "epoch"} <= members


def test_progress_bar_on_main_process(capsys, data):
    X, y, _, _ = data
    handler = make_handler()
    handler.set_train_loader((X, y), batch_size=BATCH)
    handler.train(1, progress=True)
    assert "epoch 1/1" in capsys.readouterr().err
    handler.train(2, progress=False)
    assert "epoch 2/2" not in capsys.readouterr().err


def test_logs_through_nn_handler_logger_without_handlers(caplog, data):
    X, y, _, _ = data
    handler = make_handler()
    handler.set_train_loader((X, y), batch_size=BATCH)
    with caplog.at_level(logging.INFO, logger="nn_handler"):
        handler.train(1, progress=False)
    assert any(r.name.startswith("nn_handler") and "epoch 1/1" in r.getMessage() for r in caplog.records)
    assert logging.getLogger("nn_handler").handlers == []
    assert logging.getLogger("nn_handler.handler").handlers == []


def test_plot_history_writes_a_png(tmp_path, data):
    pytest.importorskip("matplotlib")
    X, y, Xv, yv = data
    handler = make_handler()
    handler.set_train_loader((X, y), batch_size=BATCH)
    handler.set_val_loader((Xv, yv), batch_size=BATCH)
    handler.train(2, progress=False)
    handler.plot_history(tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_history_without_matplotlib_names_the_extra(tmp_path, monkeypatch, data):
    X, y, _, _ = data
    handler = make_handler()
    handler.set_train_loader((X, y), batch_size=BATCH)
    handler.train(1, progress=False)
    for name in ("matplotlib", "matplotlib.figure"):  # None in sys.modules makes the import raise ImportError
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtraError, match=r"pip install 'nn_handler\[plot\]'"):
        handler.plot_history(tmp_path / "h.png")
    assert issubclass(MissingExtraError, ImportError)


def test_plot_history_before_training_is_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="History is empty"):
        make_handler().plot_history(tmp_path / "h.png")


@pytest.mark.gpu
def test_amp_fp16_on_cuda_uses_float16_with_a_grad_scaler(data):
    X, y, _, _ = data
    model = make_model()
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    handler = NNHandler(model, torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, amp="fp16",
                        device="cuda", clip_grad_norm=1.0)
    handler.set_train_loader((X, y), batch_size=BATCH)
    history = handler.train(3, progress=False)
    assert set(seen) == {torch.float16} and handler.scaler is not None
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history["peak_mem_mb_rank0"][0] > 0
    assert handler.predict(X).device.type == "cpu"


@pytest.mark.slow
def test_predict_data_parallel_matches_predict_in_order():
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    handler = NNHandler(model)
    X, y = torch.randn(23, 3), torch.randn(23, 2)
    expected = handler.predict(X, batch_size=5)
    # (inputs, targets) samples: only the inputs reach the model, as in predict()
    got = handler.predict(TensorDataset(X, y), batch_size=5, data_parallel=True, device_ids=["cpu", "cpu"])
    assert torch.allclose(got, expected, atol=1e-6) and got.shape == (23, 2)
    assert torch.allclose(handler.predict((X, y), data_parallel=True, device_ids=["cpu"]), expected, atol=1e-6)


@pytest.mark.gpu
def test_non_finite_loss_on_cuda_is_caught_at_epoch_end_without_per_step_sync(data):
    from nn_handler.errors import NonFiniteLossError

    X, y, _, _ = data
    y = y.clone()
    y[BATCH * 2] = float("nan")  # third batch, unshuffled (a shuffled loader put it in batch 10)
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, device="cuda")
    handler.set_train_loader((X, y), batch_size=BATCH, shuffle=False)
    with pytest.raises(NonFiniteLossError, match="step 2"):
        handler.train(1, progress=False)


class NoLabels(nn.Module):
    """A model whose forward takes the inputs by name and no ``labels``."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        return self.net(x)


def test_a_model_without_a_labels_parameter_gets_the_batch_without_them_and_trains_as_the_hand_written_loop():
    X, y = make_data(40)
    Xv, yv = make_data(12, seed=1)
    samples = [{"x": a, "labels": b} for a, b in zip(X, y)]
    handler = NNHandler(NoLabels(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, device="cpu")
    handler.set_train_loader(samples, batch_size=8, shuffle=False)
    handler.set_val_loader([{"x": a, "labels": b} for a, b in zip(Xv, yv)], batch_size=8)
    history = handler.train(2, progress=False)
    model = NoLabels()
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.05), []
    for _ in range(2):
        for i in range(0, 40, 8):
            loss = nn.functional.mse_loss(model(X[i:i + 8]), y[i:i + 8])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert history["train_loss"] == pytest.approx([sum(losses[:5]) / 5, sum(losses[5:]) / 5], rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(handler.module.parameters(), model.parameters()))
    with torch.no_grad():
        assert handler.evaluate()["loss"] == pytest.approx(nn.functional.mse_loss(model(Xv), yv).item(), rel=1e-6)
        assert torch.equal(handler.predict([{"x": a, "labels": b} for a, b in zip(Xv, yv)]), model(Xv))


def test_a_distributed_samplers_padding_is_trained_on_but_not_counted_in_the_history():
    X, y = make_data(13)
    data = TensorDataset(X, y)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)  # 6 real + 1 padding
    rows = list(sampler)
    assert rows == [1, 3, 5, 7, 9, 11, 0]
    class Losses(Callback):
        def __init__(self):
            self.trained = []

        def on_batch_end(self, handler, step, loss):
            self.trained.append(float(loss))

    model, losses = make_model(), Losses()
    handler = NNHandler(model, torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.0}, metrics={"mae": mae},
                        device="cpu", callbacks=[losses])
    handler.train_loader = DataLoader(data, batch_size=4, sampler=sampler)
    history = handler.train(1, progress=False)
    with torch.no_grad():
        real = rows[:6]
        assert history["train_loss"][0] == pytest.approx(nn.functional.mse_loss(model(X[real]), y[real]).item())
        assert history["train_mae"][0] == pytest.approx(mae(model(X[real]), y[real]).item(), rel=1e-6)
        # The hooks see the loss that was trained on: the whole last batch, padding included.
        assert losses.trained[-1] == pytest.approx(nn.functional.mse_loss(model(X[rows[4:]]), y[rows[4:]]).item())


@pytest.mark.parametrize("drop_last", [False, True])
def test_tensors_are_batched_by_index_with_a_tensor_datasets_order_history_and_resume(tmp_path, drop_last):
    X, y = make_data(44)  # batches of 8: 5 full ones and one of 4 (dropped with drop_last)
    runs = {}
    for kind in ("tuple", "dataloader", "stopped", "resumed"):
        handler = make_handler(seed=0, checkpoint_dir=tmp_path / kind if kind != "resumed" else tmp_path / "stopped",
                               resume="auto" if kind == "resumed" else None)
        data = DataLoader(TensorDataset(X, y), batch_size=8, shuffle=True, drop_last=drop_last) \
            if kind == "dataloader" else (X, y)
        handler.set_train_loader(data, **({} if kind == "dataloader" else
                                          {"batch_size": 8, "shuffle": True, "drop_last": drop_last}))
        handler.set_val_loader((X[:12], y[:12]), batch_size=8)
        handler.train(3, max_steps=8 if kind == "stopped" else None, progress=False)
        runs[kind] = handler
    assert type(runs["tuple"].train_loader.dataset).__name__ == "IndexedTensors"  # one gather a batch
    assert type(runs["dataloader"].train_loader.dataset) is TensorDataset  # a user's DataLoader as given
    for kind in ("dataloader", "resumed"):  # bit-identical: the same batches, in the same order
        assert weights(runs[kind].model) == weights(runs["tuple"].model), kind
        for key in ("train_loss", "train_mae", "val_loss", "val_mae"):
            assert runs[kind].history[key] == runs["tuple"].history[key], (kind, key)
    assert torch.equal(runs["tuple"].predict(X), runs["dataloader"].predict(DataLoader(TensorDataset(X), 8)))
