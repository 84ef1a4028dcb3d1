"""nn_handler._checks: one grammar for argument checks, and every call site speaking it (no processes)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

from nn_handler import _checks
from nn_handler._checks import check_bool, check_choice, check_int, check_number, invalid
from nn_handler.errors import ConfigurationError, NNHandlerError
from scripts.handler_case import make_handler


# ----------------------------------------------------------------------------- the helpers
@pytest.mark.parametrize("value", [1, 7, 10**12])
def test_check_int_returns_what_it_accepts(value):
    assert check_int("n", value, minimum=1) is value


@pytest.mark.parametrize("value", [0, -3, 1.0, 2.5, True, False, "2", None, [1]])
def test_check_int_rejects_with_one_grammar(value):
    with pytest.raises(ConfigurationError) as info:
        check_int("grad_accum_steps", value, minimum=1)
    assert str(info.value) == f"grad_accum_steps must be an int >= 1, got {value!r}"
    assert isinstance(info.value, ValueError) and isinstance(info.value, NNHandlerError)


def test_check_int_without_minimum_and_with_none():
    assert check_int("seed", -5) == -5
    assert check_int("every", None, minimum=1, allow_none=True) is None
    with pytest.raises(ConfigurationError, match=r"^seed must be an int, got '5'$"):
        check_int("seed", "5")
    with pytest.raises(ConfigurationError, match=r"^every must be an int >= 1 or None, got 0$"):
        check_int("every", 0, minimum=1, allow_none=True)


@pytest.mark.parametrize("value", [0.5, 1, 1e9])
def test_check_number_accepts_ints_and_floats(value):
    assert check_number("timeout", value) == value


@pytest.mark.parametrize("value", [0, -1.5, math.nan, True, "3", None])
def test_check_number_strict_bound(value):
    with pytest.raises(ConfigurationError) as info:
        check_number("timeout", value, unit="seconds")
    assert str(info.value) == f"timeout must be a number of seconds > 0, got {value!r}"


def test_check_number_inclusive_bound_and_none():
    assert check_number("keep_alive", 0, strict=False) == 0
    assert check_number("timeout", None, allow_none=True) is None
    with pytest.raises(ConfigurationError, match=r"^min_delta must be a number >= 0, got -0.1$"):
        check_number("min_delta", -0.1, strict=False)
    with pytest.raises(ConfigurationError, match=r"^clip_grad_norm must be a number > 0 or None, got 'x'$"):
        check_number("clip_grad_norm", "x", allow_none=True)


def test_check_choice():
    assert check_choice("mode", "min", ("min", "max")) == "min"
    assert check_choice("backend", None, ["gloo"], allow_none=True) is None
    with pytest.raises(ConfigurationError, match=r"^mode must be one of 'min', 'max', got 'avg'$"):
        check_choice("mode", "avg", ("min", "max"))
    with pytest.raises(ConfigurationError) as info:
        check_choice("backend", ["tcp"], ("gloo", "nccl"), allow_none=True, hint="None picks one")
    assert str(info.value) == "backend must be one of 'gloo', 'nccl' or None, got ['tcp']; None picks one"


def test_check_bool():
    assert check_bool("flag", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(ConfigurationError, match=rf"^flag must be True or False, got {bad!r}$"):
            check_bool("flag", bad)


def test_errors_survive_pickling():
    err = invalid("keep_last", "an int >= 1", 0)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is ConfigurationError and str(again) == "keep_last must be an int >= 1, got 0"


def test_module_exports_only_the_helpers():
    assert set(_checks.__all__) == {"invalid", "check_int", "check_number", "check_choice", "check_bool"}


# ----------------------------------------------------------------------------- every call site
def _callbacks(**kwargs):
    from nn_handler.callbacks import EarlyStopping
    return lambda: EarlyStopping(**kwargs)


def _executor(**kwargs):
    from nn_handler.utils.ddp_decorators import ParallelExecutor
    return lambda: ParallelExecutor(**kwargs)


def _decorator(**kwargs):
    from nn_handler.utils.ddp_decorators import parallelize_on_gpus
    return lambda: parallelize_on_gpus(**kwargs)


def _launch(nprocs):
    from nn_handler.utils._workers import launch as _launch
    return lambda: _launch.launch(print, (), {}, nprocs, None)


def _predict(**kwargs):
    from nn_handler.utils.parallel import parallel_predict
    return lambda: parallel_predict(nn.Linear(2, 1), torch.zeros(4, 2), device_ids=["cpu"], **kwargs)


def _ddp_timeout(timeout):
    from nn_handler.utils.ddp import _check_timeout
    return lambda: _check_timeout(timeout)


def _parallel(name, *args, **kwargs):
    from nn_handler.utils import parallel
    return lambda: getattr(parallel, name)(*args, **kwargs)


def _model_checkpoint(tmp="ckpts", **kwargs):
    from nn_handler.callbacks import ModelCheckpoint
    return lambda: ModelCheckpoint(tmp, **kwargs)


SITES = [
    (_callbacks(patience=-1), "patience must be an int >= 0, got -1"),
    (_callbacks(min_delta=-1), "min_delta must be a number >= 0, got -1"),
    (_callbacks(mode="avg"), "mode must be one of 'min', 'max', got 'avg'"),
    (_callbacks(monitor=""), "monitor must be a History key such as 'val_loss', got ''"),
    (_model_checkpoint(every_n_epochs=0), "every_n_epochs must be an int >= 1, got 0"),
    (_executor(num_gpus=0), "num_gpus must be an int >= 1 or None, got 0"),
    (_executor(num_gpus="2"), "num_gpus must be an int >= 1 or None, got '2'"),
    (_executor(device_ids=["cpu"], timeout=0), "timeout must be a number of seconds > 0 or None, got 0"),
    (_decorator(keep_alive=-1), "keep_alive must be a number of seconds >= 0, got -1"),
    (_decorator(num_gpus=0), "num_gpus must be an int >= 1 or None, got 0"),
    (_launch(0), "nprocs must be an int >= 1, got 0"),
    (_predict(batch_size=0), "batch_size must be an int >= 1 or None, got 0"),
    (_predict(batch_size=2, num_workers=-1), "num_workers must be an int >= 0, got -1"),
    (_ddp_timeout(0), "timeout must be a timedelta or a number of seconds > 0, got 0"),
    (_parallel("get_recommended_batch_size", 0), "base_batch_size must be an int >= 1, got 0"),
    (_parallel("parallelize_if_available", nn.Linear(1, 1), min_gpus=0), "min_gpus must be an int >= 1, got 0"),
    (_parallel("MultiGPUConfig", bucket_cap_mb=0), "bucket_cap_mb must be a number of MiB > 0, got 0"),
    (_parallel("MultiGPUConfig", mode="hybrid"),
     "mode must be one of 'auto', 'none', 'dataparallel', 'distributed', got 'hybrid'"),
    (_parallel("MultiGPUConfig", sync_bn=1), "sync_bn must be True or False, got 1"),
    (_parallel("MultiGPUConfig", backend="tcp"),
     "backend must be one of 'gloo', 'nccl', 'mpi', 'ucc', 'xccl' or None, got 'tcp'; "
     "None picks the backend for the device"),
    (_parallel("plan_device_map", {"a": 1}, ["cpu"], "auto"),
     "strategy must be one of 'balanced', 'sequential', got 'auto'"),
    (lambda: make_handler(grad_accum_steps=0), "grad_accum_steps must be an int >= 1, got 0"),
    (lambda: make_handler(clip_grad_norm="1"), "clip_grad_norm must be a number > 0 or None, got '1'"),
    (lambda: make_handler(overwrite="yes"), "overwrite must be True or False, got 'yes'"),
]


@pytest.mark.parametrize("call, message", SITES, ids=[m.split(" must")[0] + f"-{i}" for i, (_, m) in enumerate(SITES)])
def test_every_site_raises_configuration_error_in_one_grammar(call, message, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as info:
        call()
    assert str(info.value) == message
