"""Every bad input and bad state NNHandler knows of raises a clear error (one process; no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nn_handler import NNHandler
from nn_handler.errors import ConfigurationError, NonFiniteLossError
from scripts.handler_case import make_data, make_handler, make_model


def _ready(handler, n=32, batch_size=8):
    X, y = make_data(n)
    handler.set_train_loader((X, y), batch_size=batch_size)
    return handler


def test_train_without_training_data():
    with pytest.raises(ConfigurationError, match=r"no training data: call set_train_loader"):
        make_handler().train(1, progress=False)


def test_train_without_loss_function():
    handler = _ready(NNHandler(make_model(), torch.optim.SGD, optimizer_kwargs={"lr": 0.1}))
    with pytest.raises(ConfigurationError, match=r"no loss function: pass loss_fn="):
        handler.train(1, progress=False)


def test_train_without_optimizer():
    handler = _ready(NNHandler(make_model(), loss_fn=nn.MSELoss()))
    with pytest.raises(ConfigurationError, match=r"no optimizer: pass optimizer="):
        handler.train(1, progress=False)


def test_empty_dataset():
    empty = TensorDataset(torch.zeros(0, 6), torch.zeros(0, 1))
    with pytest.raises(ConfigurationError, match=r"the given dataset is empty \(0 samples\)"):
        make_handler().set_train_loader(empty)
    handler = make_handler()
    handler.set_train_loader(DataLoader(empty, batch_size=4))  # a ready-made loader: found at train()
    with pytest.raises(ConfigurationError, match=r"the training dataset is empty \(0 samples\)"):
        handler.train(1, progress=False)


def test_empty_validation_dataset():
    handler = _ready(make_handler())
    handler.set_val_loader(DataLoader(TensorDataset(torch.zeros(0, 6), torch.zeros(0, 1))))
    with pytest.raises(ConfigurationError, match=r"validation dataset is empty"):
        handler.train(1, progress=False)


def test_loader_that_yields_no_batches():
    X, y = make_data(5)
    handler = make_handler()
    handler.set_train_loader(DataLoader(TensorDataset(X, y), batch_size=8, drop_last=True))
    with pytest.raises(ConfigurationError, match=r"yielded no batches.*drop_last=True"):
        handler.train(1, progress=False)


def test_model_without_parameters():
    with pytest.raises(ConfigurationError, match=r"Identity has no trainable parameters"):
        NNHandler(nn.Identity(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.1})
    handler = _ready(NNHandler(nn.Identity(), loss_fn=nn.MSELoss()))
    with pytest.raises(ConfigurationError, match=r"Identity has no trainable parameters, so there is nothing to train"):
        handler.train(1, progress=False)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_grad_accum_steps_below_one_or_not_an_int(bad):
    with pytest.raises(ConfigurationError, match=rf"grad_accum_steps must be an int >= 1, got {bad!r}"):
        make_handler(grad_accum_steps=bad)


@pytest.mark.parametrize("kwargs, message", [
    ({"clip_grad_norm": 0}, r"clip_grad_norm must be a number > 0 or None, got 0"),
    ({"ddp_kwargs": {"bucket_size": 3}}, r"unknown ddp_kwargs \['bucket_size'\]; allowed: find_unused_parameters"),
    ({"metrics": {"acc": 3}}, r"metric 'acc' must map a str to a callable"),
    ({"finite_check_every": 0}, r"finite_check_every must be an int >= 1"),
])
def test_bad_constructor_settings(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        make_handler(**kwargs)


def test_optimizer_built_for_another_model():
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match=r"holds none of the model's parameters"):
        NNHandler(make_model(), other, nn.MSELoss())


def test_bad_epochs_and_validate_every():
    handler = _ready(make_handler())
    with pytest.raises(ConfigurationError, match=r"epochs must be an int >= 1 or None, got 0"):
        handler.train(0)
    with pytest.raises(ConfigurationError, match=r"validate_every must be an int >= 1"):
        handler.train(1, validate_every=0)


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"train\(\) needs a limit: epochs, max_steps or max_time"),
    ({"epochs": 1.5}, r"epochs must be an int >= 1 or None, got 1.5"),
    ({"max_steps": 0}, r"max_steps must be an int >= 1 or None, got 0"),
    ({"max_steps": True}, r"max_steps must be an int >= 1 or None, got True"),
    ({"max_time": 0}, r"max_time must be a number of seconds > 0 or None, got 0"),
    ({"max_time": float("nan")}, r"max_time must be a number of seconds > 0 or None, got nan"),
    ({"max_time": "1h"}, r"max_time must be a number of seconds > 0 or None, got '1h'"),
])
def test_bad_step_and_time_limits(kwargs, message):
    handler = _ready(make_handler())
    with pytest.raises(ConfigurationError, match=message):
        handler.train(**kwargs)
    assert handler.global_step == 0


def test_loss_fn_that_does_not_return_a_scalar():
    handler = _ready(NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(reduction="none"),
                               optimizer_kwargs={"lr": 0.1}))
    with pytest.raises(ConfigurationError, match=r"loss_fn must return a scalar tensor.*got \(8, 1\)"):
        handler.train(1, progress=False)


def test_loader_kwargs_with_a_dataloader():
    X, y = make_data(8)
    with pytest.raises(ConfigurationError, match=r"loader settings \['batch_size'\] only apply to a Dataset"):
        make_handler().set_train_loader(DataLoader(TensorDataset(X, y)), batch_size=4)


def test_evaluate_without_data():
    with pytest.raises(ConfigurationError, match=r"evaluate\(\) needs data, or a validation loader"):
        make_handler().evaluate()


def test_non_finite_loss_names_epoch_and_step_before_the_bad_update():
    X, y = make_data(32)
    X[19, 0] = float("nan")  # sample 19: batch 2 of epoch 1 with batch size 8, no shuffling
    model = make_model()
    handler = make_handler(model)
    handler.set_train_loader((X, y), batch_size=8, shuffle=False)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at epoch 1, step 2") as info:
        handler.train(3, progress=False)
    assert (info.value.epoch, info.value.step) == (1, 2) and info.value.ranks == ()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the bad batch took no step
    assert handler.global_step == 2


def test_non_finite_loss_check_every_n_adds_to_the_per_batch_check_on_the_cpu():
    # The docstring: a finite_check_every adds a check; on the CPU the per-batch one stays (it replaced it:
    # the NaN of batch 2 was found after 4 optimizer steps, with the weights NaN).
    X, y = make_data(32)
    X[19, 0] = float("nan")
    model = make_model()
    handler = make_handler(model, finite_check_every=4)
    handler.set_train_loader((X, y), batch_size=8, shuffle=False)
    with pytest.raises(NonFiniteLossError, match=r"at epoch 1, step 2"):
        handler.train(1, progress=False)
    assert handler.global_step == 2  # stopped before the bad batch's step
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_finite_loss_checked_every_n_batches_where_a_read_is_not_free(monkeypatch):
    from nn_handler._training import readout

    monkeypatch.setattr(readout.HostReads, "for_device", classmethod(lambda cls, device: cls(free=False)))
    X, y = make_data(32)
    X[19, 0] = float("nan")
    handler = make_handler(finite_check_every=4)
    handler.set_train_loader((X, y), batch_size=8, shuffle=False)
    with pytest.raises(NonFiniteLossError, match=r"at epoch 1, step 2"):
        handler.train(1, progress=False)
    assert handler.global_step == 4  # found at the check after batch 4
