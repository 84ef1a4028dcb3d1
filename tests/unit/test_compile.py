"""compile=True: torch.compile in place, plain keys, and checkpoints that compiled and plain handlers share.

Inductor compiles for the CPU here; one handler compiles once (about 20 s),
so the compiled cases share it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from nn_handler.checkpoint import load_payload
from nn_handler.errors import ConfigurationError
from scripts.handler_case import make_data, make_handler, make_model, weights

TOL = {"rel": 1e-5, "abs": 1e-6}  # inductor's kernels sum in another order than eager's


def _handler(**kwargs):
    handler = make_handler(seed=4, **kwargs)
    handler.set_train_loader(make_data(64), batch_size=8, shuffle=False)
    return handler


@pytest.mark.parametrize("kwargs, message", [
    ({"compile": "yes"}, r"compile must be True or False, got 'yes'"),
    ({"compile_kwargs": {"mode": "max-autotune"}}, r"compile_kwargs apply with compile=True"),
    ({"compile": True, "compile_kwargs": {"model": 1, "modee": 2}},
     r"unknown compile_kwargs \['modee', 'model'\]; torch.compile takes .*fullgraph"),
    ({"compile": True, "compile_kwargs": ["inductor"]}, r"compile_kwargs must be a dict of torch.compile keywords"),
])
def test_bad_compile_settings_are_refused_early(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        make_handler(**kwargs)


@pytest.mark.slow
def test_a_compiled_model_given_without_compile_is_trained_plain_with_a_warning(caplog):
    model = make_model()
    with caplog.at_level(logging.WARNING):
        handler = make_handler(torch.compile(model))
    assert handler.module is model and "pass compile=True" in caplog.text


def test_a_checkpoint_of_a_model_compiled_elsewhere_loads(tmp_path):
    plain = _handler()
    plain.train(1, progress=False)
    payload = plain.state_dict()
    payload["model"] = {f"_orig_mod.{k}": v for k, v in payload["model"].items()}  # torch.compile(model).state_dict()
    torch.save(payload, tmp_path / "compiled.ckpt")
    other = _handler()
    assert other.load_checkpoint(tmp_path / "compiled.ckpt") == 1
    assert weights(other.module) == weights(plain.module)


@pytest.mark.slow
def test_compiled_and_plain_handlers_train_alike_and_load_each_others_checkpoints(tmp_path):
    plain = _handler(checkpoint_dir=tmp_path / "plain")
    plain.train(1, progress=False)
    plain_1 = weights(plain.module)
    plain.train(2, progress=False)
    plain_2, plain_loss = weights(plain.module), plain.history["train_loss"]

    compiled = _handler(compile=True, checkpoint_dir=tmp_path / "compiled")
    assert type(compiled.module) is type(make_model())  # compiled in place: the model keeps its class ...
    compiled.train(1, progress=False)
    assert compiled.module._compiled_call_impl is not None
    assert weights(compiled.module) == pytest.approx(plain_1, **TOL)
    for keys in (compiled.state_dict()["model"], load_payload(tmp_path / "compiled" / "epoch-0001.ckpt")["model"]):
        assert list(keys) == list(make_model().state_dict())  # ... and its keys: no "_orig_mod."
    compiled.export_model(tmp_path / "export.pt")
    make_model().load_state_dict(torch.load(tmp_path / "export.pt", weights_only=True))

    # compiled -> plain: the compiled run's checkpoint continues in a plain handler
    continued = _handler()
    continued.load_checkpoint(tmp_path / "compiled" / "epoch-0001.ckpt")
    continued.train(2, progress=False)
    assert weights(continued.module) == pytest.approx(plain_2, **TOL)
    # plain -> compiled
    compiled.load_checkpoint(tmp_path / "plain" / "epoch-0001.ckpt")
    compiled.train(2, progress=False)
    assert weights(compiled.module) == pytest.approx(plain_2, **TOL)
    assert compiled.history["train_loss"] == pytest.approx(plain_loss, **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_training_on_cuda_in_fp16_keeps_plain_keys(tmp_path):
    from torch import nn

    from nn_handler import NNHandler

    handler = NNHandler(make_model(), torch.optim.AdamW, nn.MSELoss(), device="cuda", amp="fp16", compile=True,
                        checkpoint_dir=tmp_path)
    handler.set_train_loader(make_data(256), batch_size=32, pin_memory=True)
    history = handler.train(3, progress=False)
    assert history["train_loss"][-1] < history["train_loss"][0] and handler.scaler is not None
    assert list(load_payload(tmp_path / "epoch-0003.ckpt")["model"]) == list(make_model().state_dict())
    plain = NNHandler(make_model(), torch.optim.AdamW, nn.MSELoss(), device="cuda")  # fp32: the scale is dropped
    assert plain.load_checkpoint(tmp_path / "epoch-0003.ckpt") == 3 and plain.scaler is None
