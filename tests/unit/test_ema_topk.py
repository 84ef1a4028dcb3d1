"""EMA's average in checkpoints and swapped in, ModelCheckpoint(save_top_k=), the epoch line, step validation."""

from __future__ import annotations

import logging
import os
import types

import pytest
import torch
from torch import nn

from nn_handler import Callback, ConfigurationError, EarlyStopping, ModelCheckpoint, NNHandler
from scripts.handler_case import make_data, make_model, mae


def EMA(**kwargs):  # imported on use: each test fails on its own where the callback is missing
    from nn_handler.callbacks import EMA

    return EMA(**kwargs)


def make(callbacks=(), val=True, **kwargs):
    X, y = make_data(40)
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05},
                        metrics={"mae": mae}, callbacks=list(callbacks), device="cpu", seed=0, **kwargs)
    handler.set_train_loader((X, y), batch_size=8)
    if val:
        handler.set_val_loader(make_data(16, seed=1), batch_size=8)
    return handler


# ----------------------------------------------------------------------------- EMA

def test_ema_swapped_evaluates_and_exports_the_average_and_restores_the_weights(tmp_path):
    ema = EMA(decay=0.9)
    handler = make([ema])
    handler.train(2, progress=False)
    trained = [p.detach().clone() for p in handler.module.parameters()]
    averaged = [p.detach().clone() for p in ema.module.module.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(trained, averaged))
    X = make_data(16, seed=1)[0]
    with ema.swapped(handler):
        assert all(torch.equal(p, a) for p, a in zip(handler.module.parameters(), averaged))
        val_loss = handler.evaluate()["loss"]
        predicted = handler.predict(X)
        handler.export_model(tmp_path / "ema.pt")
    assert all(torch.equal(p, t) for p, t in zip(handler.module.parameters(), trained))  # back after the block
    assert torch.allclose(predicted, ema.module(X).detach())
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in ema.module.module.state_dict().items())
    assert val_loss != handler.evaluate()["loss"]


def test_ema_average_is_in_checkpoints_and_restored_before_training(tmp_path):
    ema = EMA(decay=0.9)
    handler = make([ema])
    handler.train(1, progress=False)
    handler.save_checkpoint(tmp_path / "a.ckpt")
    payload = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert int(payload["callbacks"]["EMA"]["average"]["n_averaged"]) == 5
    saved = [p.detach().clone() for p in ema.module.parameters()]
    restored = EMA(decay=0.9)
    other = make([restored])
    other.load_checkpoint(tmp_path / "a.ckpt")  # before the model's average exists: kept until train() starts
    restored.on_train_begin(other)
    assert all(torch.equal(a, b) for a, b in zip(restored.module.parameters(), saved))
    other.train(2, progress=False)
    assert int(restored.module.n_averaged) == 10


def test_ema_loaded_from_a_checkpoint_is_usable_without_training(tmp_path):
    ema = EMA(decay=0.9)
    handler = make([ema])
    handler.train(2, progress=False)
    handler.save_checkpoint(tmp_path / "final.ckpt")
    X = make_data(16, seed=1)[0]
    with ema.swapped(handler):
        expected_loss, expected = handler.evaluate()["loss"], handler.predict(X)
    for resume in (False, True):
        loaded = EMA(decay=0.9)
        fresh = make([loaded])
        if resume:
            fresh.load_checkpoint(tmp_path / "final.ckpt")
        else:  # the average restored by the callback's own load_state_dict, no handler load
            fresh.load_checkpoint(tmp_path / "final.ckpt", resume=False)
            loaded.load_state_dict(torch.load(tmp_path / "final.ckpt", weights_only=True)["callbacks"]["EMA"])
        if resume:
            assert loaded.module is not None and int(loaded.module.n_averaged) == 10
        with loaded.swapped(fresh):
            assert fresh.evaluate()["loss"] == expected_loss
            assert torch.equal(fresh.predict(X), expected)
            fresh.export_model(tmp_path / "ema.pt")
        assert all(torch.equal(torch.load(tmp_path / "ema.pt", weights_only=True)[k], v)
                   for k, v in ema.module.module.state_dict().items())
        assert all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), handler.module.parameters()))
    assert fresh.train(2, progress=False) is fresh.history  # a finished run: nothing to do, the average stays
    assert int(loaded.module.n_averaged) == 10


def test_ema_without_an_average_says_how_to_get_one():
    with pytest.raises(RuntimeError, match="train with this callback, or load a checkpoint"):
        with EMA().swapped(make()):
            pass


def test_ema_refuses_bad_decay_and_sharded_models():
    with pytest.raises(ConfigurationError, match=r"decay must be a number in \(0, 1\), got 1"):
        EMA(decay=1)
    from torch.distributed.fsdp import FSDPModule

    block = nn.Linear(2, 1)
    block.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})  # what fully_shard does to a module
    view = types.SimpleNamespace(module=nn.Sequential(block))
    with pytest.raises(ConfigurationError, match="strategy='fsdp'"):
        EMA().on_train_begin(view)


class _WeightsAfterEachBatch(Callback):
    def __init__(self, name):
        self.name, self.seen = name, []

    def on_batch_end(self, handler, step, loss):
        self.seen.append([p.detach().clone() for p in handler.models[self.name].parameters()])


def _average(seen, decay):
    """The EMA of the weights seen after each training step, the first copied."""
    average = seen[0]
    for weights in seen[1:]:
        average = [decay * a + (1 - decay) * w for a, w in zip(average, weights)]
    return average


def _backbone_then_head(ctx, batch):
    x, y = batch
    loss = nn.functional.mse_loss(ctx.model(x), y)
    ctx.backward(loss)
    ctx.step("backbone")
    ctx.step("head")
    return loss


def test_ema_updates_once_per_training_step_however_many_optimizers_stepped():
    model = make_model()
    optimizers = {"backbone": torch.optim.SGD(model[0].parameters(), lr=0.05),
                  "head": torch.optim.SGD(model[2].parameters(), lr=0.2)}
    ema, weights = EMA(decay=0.9), _WeightsAfterEachBatch("model")
    handler = NNHandler(model, optimizers, training_step=_backbone_then_head, callbacks=[weights, ema], device="cpu")
    handler.set_train_loader(make_data(32), batch_size=8, shuffle=False)
    handler.train(1, progress=False)
    assert len(weights.seen) == handler.global_step == 4
    for got, want in zip(ema.module.module.parameters(), _average(weights.seen, 0.9)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert int(ema.module.n_averaged) == 4


def test_ema_of_one_model_of_several_by_name():
    from scripts import gan_case as gan

    ema, weights = EMA(decay=0.8, model="G"), _WeightsAfterEachBatch("G")
    handler = gan.make_handler(n=32, callbacks=[weights, ema])
    handler.train(1, progress=False)
    for got, want in zip(ema.module.module.parameters(), _average(weights.seen, 0.8)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    trained = gan.flat(handler.models["G"])
    with ema.swapped(handler):  # G holds the average, D is untouched
        torch.testing.assert_close(gan.flat(handler.models["G"]), gan.flat(ema.module.module), rtol=0, atol=0)
    assert torch.equal(gan.flat(handler.models["G"]), trained)
    with pytest.raises(ConfigurationError, match=r"EMA\(model='E'\): no model of that name; this handler's are "
                                                 r"'G', 'D'"):
        EMA(model="E").on_train_begin(handler)
    with pytest.raises(ConfigurationError, match=r"EMA: this handler has 2 models \('G', 'D'\): name the one to "
                                                 r"average, EMA\(decay, model='G'\)"):
        EMA().on_train_begin(handler)


# ----------------------------------------------------------------------------- ModelCheckpoint(save_top_k=)

class FakeHandler:
    partial_epoch, is_main_process = False, True

    def save_checkpoint(self, path):
        open(path, "w").close()


def run_top_k(cb, values, start=1):
    handler = FakeHandler()
    for epoch, value in enumerate(values, start=start):
        cb.on_epoch_end(handler, epoch, {"val_loss": value})


def files(directory):
    return sorted(p for p in os.listdir(directory) if p.startswith("epoch-"))


def test_save_top_k_keeps_the_k_best_and_deletes_the_rest(tmp_path):
    cb = ModelCheckpoint(tmp_path, save_top_k=2, save_last=False)
    tmp_path.mkdir(exist_ok=True)
    run_top_k(cb, [3.0, 1.0, 2.0, 0.5, 2.5, float("nan")])
    assert files(tmp_path) == ["epoch-0002.ckpt", "epoch-0004.ckpt"]
    assert cb.best == 0.5 and cb.best_path.endswith("epoch-0004.ckpt")
    maximize = ModelCheckpoint(tmp_path / "max", mode="max", save_top_k=1, save_last=False)
    (tmp_path / "max").mkdir()
    run_top_k(maximize, [1.0, 3.0, 2.0])
    assert files(tmp_path / "max") == ["epoch-0002.ckpt"]


def test_save_top_k_ties_keep_the_earlier_epoch(tmp_path):
    cb = ModelCheckpoint(tmp_path, save_top_k=2, save_last=False)
    run_top_k(cb, [1.0, 1.0, 1.0, 0.9])
    # Epoch 3 tied the worst kept (epoch 2, later than epoch 1): not saved; 0.9 then drops epoch 2.
    assert files(tmp_path) == ["epoch-0001.ckpt", "epoch-0004.ckpt"]


def test_save_top_k_goes_on_pruning_after_a_resume(tmp_path):
    cb = ModelCheckpoint(tmp_path, save_top_k=2, save_last=False)
    run_top_k(cb, [3.0, 2.0])
    resumed = ModelCheckpoint(tmp_path, save_top_k=2, save_last=False)
    resumed.load_state_dict(cb.state_dict())
    run_top_k(resumed, [1.0, 2.5], start=3)
    assert files(tmp_path) == ["epoch-0002.ckpt", "epoch-0003.ckpt"]  # epoch 1's file, from before, deleted


def test_save_top_k_with_a_real_run_and_its_checkpoint_state(tmp_path):
    cb = ModelCheckpoint(tmp_path, save_top_k=2)
    handler = make([cb])
    handler.train(4, progress=False)
    losses = handler.history["val_loss"]
    best = sorted(range(1, 5), key=lambda e: losses[e - 1])[:2]
    assert files(tmp_path) == sorted(f"epoch-{e:04d}.ckpt" for e in best)
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]["ModelCheckpoint"]
    assert sorted(int(e) for _, _, e in state["kept"]) == sorted(best)


def test_validate_every_ranks_and_stops_on_the_validated_epochs_and_keeps_last_on_the_others(tmp_path):
    top, best = ModelCheckpoint(tmp_path / "top", save_top_k=1), ModelCheckpoint(tmp_path / "best", save_best_only=True)
    handler = make([top, best])
    handler.train(5, validate_every=2, progress=False)
    validated = {e: v for e, v in zip(handler.history["epoch"], handler.history["val_loss"]) if v is not None}
    assert sorted(validated) == [2, 4]
    winner = min(validated, key=validated.get)
    assert files(tmp_path / "top") == [f"epoch-{winner:04d}.ckpt"]
    assert sorted(os.listdir(tmp_path / "best")) == ["best.ckpt", "last.ckpt"]
    assert best.best == top.best == validated[winner]
    for directory in ("top", "best"):  # last.ckpt after every epoch, the unvalidated 5th included
        assert torch.load(tmp_path / directory / "last.ckpt", weights_only=True)["epoch"] == 5
    # This validation set's loss goes up: epoch 4 is the first validation without improvement.
    assert validated[4] > validated[2]
    stopper = EarlyStopping("val_loss", patience=1)
    make([stopper]).train(8, validate_every=2, progress=False)
    assert stopper.stopped_epoch == 4 and stopper.best == pytest.approx(validated[2])


def test_a_val_monitor_without_a_validation_loader_is_still_refused(tmp_path):
    with pytest.raises(ValueError, match="set a validation loader"):
        make([ModelCheckpoint(tmp_path, save_top_k=1)], val=False).train(2, validate_every=2, progress=False)


def test_model_checkpoint_names_its_files_as_checkpoint_dir_does(tmp_path):
    from nn_handler.checkpoint import list_run_checkpoints, run_checkpoint_key

    handler = make([ModelCheckpoint(tmp_path / "every")], checkpoint_dir=tmp_path / "run", keep_last=5)
    handler.train(3, progress=False)
    names = ["epoch-0001.ckpt", "epoch-0002.ckpt", "epoch-0003.ckpt"]
    assert files(tmp_path / "every") == sorted(os.listdir(tmp_path / "run")) == names
    assert [run_checkpoint_key(name) for name in files(tmp_path / "every")] == [(1, 0), (2, 0), (3, 0)]
    # A save_best_only callback shares the run's directory: resume="auto" continues the run's newest file.
    for epochs in (2, 3):
        shared = make([ModelCheckpoint(tmp_path / "shared", save_best_only=True)], checkpoint_dir=tmp_path / "shared",
                      resume="auto")
        shared.train(epochs, progress=False)
    assert shared.history["epoch"] == [1, 2, 3] and shared.global_step == 15
    assert sorted(os.listdir(tmp_path / "shared")) == ["best.ckpt", "epoch-0002.ckpt", "epoch-0003.ckpt", "last.ckpt"]
    assert [p.name for p in list_run_checkpoints(tmp_path / "shared")] == ["epoch-0002.ckpt", "epoch-0003.ckpt"]


def test_model_checkpoint_epoch_files_in_the_runs_own_directory_are_refused_before_training(tmp_path):
    handler = make([ModelCheckpoint(tmp_path, save_top_k=2)], checkpoint_dir=tmp_path)
    with pytest.raises(ConfigurationError, match=r"dirpath is the handler's checkpoint_dir .*directory of its own"):
        handler.train(2, progress=False)
    assert handler.global_step == 0 and os.listdir(tmp_path) == []


def test_save_top_k_resumed_from_a_list_with_the_old_names_goes_on_pruning_it(tmp_path):
    old = [str(tmp_path / f"epoch={e:04d}.ckpt") for e in (1, 2, 3)]  # nn_handler <= 0.1's names
    for path in old:
        open(path, "w").close()
    cb = ModelCheckpoint(tmp_path, save_top_k=2, save_last=False)
    cb.load_state_dict({"best": 1.0, "best_path": old[0], "kept": [[old[0], 1.0, 1], [old[2], 3.0, 3]]})
    run_top_k(cb, [0.5, 2.0], start=3)  # epoch 3 again (resumed from epoch 2's checkpoint), then epoch 4
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003.ckpt", "epoch=0001.ckpt", "epoch=0002.ckpt"]
    assert [e for _, _, e in cb.kept] == [3, 1]


def test_save_top_k_checks_its_arguments():
    with pytest.raises(ConfigurationError, match="save_top_k must be an int >= 1 or None, got 0"):
        ModelCheckpoint("d", save_top_k=0)
    with pytest.raises(ConfigurationError, match="choose one"):
        ModelCheckpoint("d", save_top_k=2, save_best_only=True)


# ----------------------------------------------------------------------------- the epoch line

def test_off_a_terminal_each_epoch_prints_and_logs_one_line(capsys, caplog):
    handler = make(scheduler=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 1, "gamma": 0.5})
    with caplog.at_level(logging.INFO, logger="nn_handler"):
        handler.train(2, progress=True)  # pytest captures stderr: not a terminal
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("epoch ") and "train_loss=" in line]
    assert len(lines) == 2, err
    assert lines[1].startswith("epoch 2/2: train_loss=") and "val_loss=" in lines[1] and "val_mae=" in lines[1]
    assert "lr=0.025" in lines[1] and lines[1].endswith("s") and " time=" in lines[1]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")] == lines


def test_without_a_bar_the_line_is_logged_only(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="nn_handler"):
        make().train(1, progress=False)
    assert "train_loss=" not in capsys.readouterr().err
    assert any("lr=0.05" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- validation every N steps

def test_validate_every_n_steps_adds_a_history_row_per_validation():
    seen = []

    class Seen(ModelCheckpoint.__mro__[1]):  # a plain Callback
        def on_validation_end(self, handler, epoch, logs):
            seen.append((epoch, logs.get("step")))

    handler = make([Seen()])
    handler.train(2, validate_every_n_steps=3, progress=False)  # 5 steps an epoch
    assert handler.history["step"] == [3, 5, 6, 9, 10]
    assert handler.history["epoch"] == [1, 1, 2, 2, 2]
    assert handler.history["train_loss"][0] is None and handler.history["val_loss"][0] is not None
    assert seen == [(1, 3), (1, None), (2, 6), (2, 9), (2, None)]
    assert handler.epoch == 2
    no_double = make()
    no_double.train(2, validate_every_n_steps=5, progress=False)  # at the epoch's end: validated once
    assert no_double.history["step"] == [5, 10]


def test_validate_every_n_steps_resumes_to_the_same_history(tmp_path):
    straight = make()
    straight.train(2, validate_every_n_steps=2, progress=False)
    first = make(checkpoint_dir=tmp_path, resume="auto")
    first.train(2, max_steps=7, validate_every_n_steps=2, progress=False)
    second = make(checkpoint_dir=tmp_path, resume="auto")
    second.train(2, validate_every_n_steps=2, progress=False)
    assert second.history["step"] == straight.history["step"] == [2, 4, 5, 6, 8, 10]
    assert second.history["val_loss"] == straight.history["val_loss"]
    assert second.history["train_loss"] == straight.history["train_loss"]


def test_validate_every_n_steps_is_checked():
    with pytest.raises(ConfigurationError, match="validate_every_n_steps must be an int >= 1 or None, got 0"):
        make().train(1, validate_every_n_steps=0)
