"""amp: one decision of the autocast dtype and the GradScaler, on every device; checkpoints across precisions."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from nn_handler import NNHandler
from nn_handler._training import precision as P
from nn_handler._training.precision import Precision
from nn_handler.errors import ConfigurationError
from scripts.handler_case import make_data, make_handler, make_model

CUDA = torch.device("cuda", 0)


@pytest.fixture
def cuda_bf16(monkeypatch):
    """What a CUDA GPU reports about bf16, without one: the decision reads it through bf16_supported."""
    def set_support(supported: bool):
        monkeypatch.setattr(P, "bf16_supported", lambda device: device.type == "cpu" or supported)
    return set_support


@pytest.mark.parametrize("supported, dtype", [(True, torch.bfloat16), (False, torch.float16)])
def test_amp_true_on_cuda_is_bf16_where_the_gpu_has_it_else_fp16_with_a_scaler(cuda_bf16, supported, dtype):
    cuda_bf16(supported)
    p = Precision.resolve(True, CUDA)
    assert (p.device_type, p.dtype, p.needs_scaler) == ("cuda", dtype, dtype == torch.float16)
    policy = p.fsdp_policy()  # FSDP's parameters follow the autocast dtype (no fp16 autocast over bf16 shards)
    assert (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32)


def test_explicit_dtypes_on_cuda(cuda_bf16):
    cuda_bf16(True)
    assert Precision.resolve("fp16", CUDA).dtype == torch.float16  # asked for: fp16 even where bf16 exists
    assert Precision.resolve("bf16", CUDA).needs_scaler is False
    cuda_bf16(False)
    with pytest.raises(ConfigurationError, match=r"amp='bf16': cuda:0 does not compute in bf16 natively.*amp='fp16'"):
        Precision.resolve("bf16", CUDA)


@pytest.mark.parametrize("amp, dtype, scaler", [(False, None, False), (True, torch.bfloat16, False),
                                                ("bf16", torch.bfloat16, False), ("fp16", torch.float16, True)])
def test_the_handler_asks_the_precision_for_its_scaler(amp, dtype, scaler):
    handler = make_handler(amp=amp)
    assert handler.precision.dtype == dtype and handler.amp == amp
    assert (handler.scaler is not None) == scaler


@pytest.mark.parametrize("amp", ["fp8", "bfloat16", 1, None, "True"])
def test_bad_amp_values_are_refused_early(amp):
    with pytest.raises(ConfigurationError, match=r"amp must be False, True, 'bf16' or 'fp16', got "):
        make_handler(amp=amp)


@pytest.mark.parametrize("amp, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_training_and_evaluation_autocast_to_the_chosen_dtype(amp, dtype):
    X, y = make_data(32)
    model = make_model()
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    handler = make_handler(model, amp=amp)
    handler.set_train_loader((X, y), batch_size=8)
    history = handler.train(2, progress=False)
    handler.evaluate((X, y))
    assert set(seen) == {dtype} and len(seen) > 2 * 4  # the evaluation too
    assert history["train_loss"][1] < history["train_loss"][0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _trained(amp, path=None):
    X, y = make_data(32)
    handler = make_handler(amp=amp, seed=1)
    handler.set_train_loader((X, y), batch_size=8)
    handler.train(1, progress=False)
    if path is not None:
        handler.save_checkpoint(path)
    return handler


def test_a_checkpoint_with_a_loss_scale_loads_into_a_bf16_handler_and_back(tmp_path, caplog):
    fp16 = _trained("fp16", tmp_path / "fp16.ckpt")
    fp16.scaler.update(1234.0)  # a scale no fresh scaler has, to see it travel
    fp16.save_checkpoint(tmp_path / "fp16.ckpt")
    _trained("bf16", tmp_path / "bf16.ckpt")

    with caplog.at_level(logging.INFO, logger="nn_handler"):
        bf16 = make_handler(amp="bf16")
        bf16.load_checkpoint(tmp_path / "fp16.ckpt")  # the weights and the run load; the scale is dropped
    assert bf16.scaler is None and bf16.epoch == 1
    assert torch.equal(bf16.module[0].weight, fp16.module[0].weight)
    assert "trained with fp16 loss scaling; this handler runs bf16 and needs none" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    again = make_handler(amp="fp16")
    again.load_checkpoint(tmp_path / "fp16.ckpt")  # fp16 -> fp16: the scale continues
    assert again.scaler.get_scale() == 1234.0
    fresh = make_handler(amp="fp16")
    fresh.load_checkpoint(tmp_path / "bf16.ckpt")  # bf16 -> fp16: a fresh scaler
    assert fresh.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale() and fresh.epoch == 1
    X, y = make_data(32)
    fresh.set_train_loader((X, y), batch_size=8)
    assert torch.isfinite(torch.tensor(fresh.train(2, progress=False)["train_loss"])).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_amp_true_on_this_gpu_follows_its_bf16_support():
    X, y = make_data(64)
    model = make_model()
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    handler = NNHandler(model, torch.optim.AdamW, nn.MSELoss(), amp=True, device="cuda")
    handler.set_train_loader((X, y), batch_size=8)
    history = handler.train(2, progress=False)
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert set(seen) == {torch.bfloat16 if native else torch.float16}
    assert (handler.scaler is None) == native
    assert history["train_loss"][1] < history["train_loss"][0]
