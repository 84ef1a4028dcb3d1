"""What a careful user found in the training features, one test each (each failed before its fix)."""

from __future__ import annotations

import logging

import pytest
import torch

from nn_handler.errors import ConfigurationError
from scripts.handler_case import make_data, make_handler, make_model, weights


def _trained(epochs=1, **kwargs):
    handler = make_handler(seed=0, **kwargs)
    handler.set_train_loader(make_data(32), batch_size=8, shuffle=False)
    handler.train(epochs, progress=False)
    return handler


def test_load_model_takes_the_keys_of_a_model_compiled_elsewhere(tmp_path):
    # torch.save(torch.compile(m).state_dict()): load_checkpoint took these keys, load_model refused them.
    source = _trained()
    torch.save({f"_orig_mod.{k}": v for k, v in source.module.state_dict().items()}, tmp_path / "compiled.pt")
    target = make_handler(make_model(seed=7))
    target.load_model(tmp_path / "compiled.pt")
    torch.testing.assert_close(weights(target.module), weights(source.module), rtol=0, atol=0)


def test_an_fp16_handler_loading_a_bf16_checkpoint_starts_the_fresh_scaler_it_announces(tmp_path, caplog):
    _trained(amp="bf16").save_checkpoint(tmp_path / "bf16.ckpt")
    fp16 = _trained(amp="fp16")
    fp16.scaler.update(8192.0)  # where overflows had brought its scale
    with caplog.at_level(logging.INFO, logger="nn_handler"):
        fp16.load_checkpoint(tmp_path / "bf16.ckpt")
    assert "starts a fresh GradScaler" in caplog.text
    assert fp16.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale() == 65536.0


# 9: the process's 10th and 11th event files, named ...9 and ...10 within one second: by name the second sorts first.
@pytest.mark.parametrize("files_before", [0, 9])
def test_a_logger_continued_after_load_checkpoint_draws_each_epoch_once(tmp_path, monkeypatch, files_before):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    from nn_handler.loggers import TensorBoardLogger

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(files_before))

    handler = _trained(2, callbacks=[TensorBoardLogger(tmp_path / "tb", log_every_n_steps=1)])
    handler.save_checkpoint(tmp_path / "epoch2.ckpt")
    handler.train(4, progress=False)
    handler.load_checkpoint(tmp_path / "epoch2.ckpt")
    handler.train(4, progress=False)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    points = acc.Scalars("epoch/train_loss")
    assert [p.step for p in points] == [4, 8, 12, 16]  # was [4, 8, 12, 16, 12, 16]
    assert [p.value for p in points] == pytest.approx(handler.history["train_loss"], rel=1e-6)
    assert [p.step for p in acc.Scalars("step/train_loss")] == list(range(1, 17))


def test_a_logger_with_an_unwritable_log_dir_fails_when_it_is_made(tmp_path):
    pytest.importorskip("tensorboard")
    from nn_handler.loggers import TensorBoardLogger

    (tmp_path / "a_file").write_text("")
    # In the constructor, which every rank runs (it failed at rank 0's on_train_begin with the raw OS error).
    with pytest.raises(ConfigurationError, match=r"TensorBoardLogger cannot write to log_dir '.*a_file/runs': "
                                                 r"Not a directory .*pass a directory this process can create"):
        TensorBoardLogger(tmp_path / "a_file" / "runs")
    TensorBoardLogger(tmp_path / "new" / "runs")  # a directory still to be made is fine ...
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # ... and nothing is left behind
