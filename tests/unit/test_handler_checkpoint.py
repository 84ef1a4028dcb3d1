"""Checkpoints: atomic writes (also when killed mid-write), weights_only payloads, clear load errors, exact resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import nn_handler.checkpoint as ckpt_mod
from helpers import REPO, parse_results, run_command
from nn_handler import NNHandler
from nn_handler.callbacks import EarlyStopping
from nn_handler.checkpoint import atomic_save, is_temp_file, list_checkpoints, load_payload
from nn_handler.errors import CheckpointError, CheckpointMismatchError
from scripts.handler_case import make_data, make_handler, make_model, weights

SCRIPT = "tests/scripts/train_resume.py"


def _trained(tmp_path=None, epochs=2, **kwargs):
    X, y = make_data(32)
    handler = make_handler(**kwargs)
    handler.set_train_loader((X, y), batch_size=8)
    handler.train(epochs, progress=False)
    return handler


def test_checkpoint_payload_is_plain_and_loads_with_weights_only(tmp_path):
    handler = _trained(callbacks=[EarlyStopping("train_loss", patience=5)])
    handler.save_checkpoint(tmp_path / "a.ckpt")
    payload = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert payload["format"] == "nn_handler.checkpoint/1"
    assert payload["epoch"] == 2 and payload["global_step"] == 8
    assert set(payload["model"]) == set(handler.module.state_dict())
    assert payload["optimizer"]["state"] and payload["scheduler"]["last_epoch"] == 2
    assert payload["history"]["train_loss"] == handler.history["train_loss"]
    assert len(payload["rng"]) == 1 and payload["callbacks"]["EarlyStopping"]["wait"] == 0
    assert os.listdir(tmp_path) == ["a.ckpt"]  # no temporary file left behind


def test_load_checkpoint_restores_the_training_state(tmp_path):
    handler = _trained()
    handler.save_checkpoint(tmp_path / "a.ckpt")
    fresh = make_handler(make_model(seed=3))
    assert fresh.load_checkpoint(tmp_path / "a.ckpt") == 2
    assert weights(fresh.module) == weights(handler.module)
    assert fresh.epoch == 2 and fresh.global_step == 8 and fresh.history == handler.history
    assert fresh.scheduler.last_epoch == 2
    only_weights = make_handler(make_model(seed=3))
    only_weights.load_checkpoint(tmp_path / "a.ckpt", resume=False)
    assert weights(only_weights.module) == weights(handler.module) and only_weights.epoch == 0


def test_save_model_and_load_model(tmp_path):
    handler = _trained(epochs=1)
    handler.save_model(tmp_path / "w.pt")
    assert set(torch.load(tmp_path / "w.pt", weights_only=True)) == set(handler.module.state_dict())
    other = make_handler(make_model(seed=5))
    other.load_model(tmp_path / "w.pt")
    assert weights(other.module) == weights(handler.module)
    handler.save_checkpoint(tmp_path / "full.ckpt")
    third = make_handler(make_model(seed=6))
    third.load_model(tmp_path / "full.ckpt")  # the model part of a full checkpoint
    assert weights(third.module) == weights(handler.module)


def test_checkpoint_from_another_model_names_the_keys(tmp_path):
    _trained(epochs=1).save_checkpoint(tmp_path / "a.ckpt")
    other = NNHandler(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1), nn.Linear(1, 1)))
    with pytest.raises(CheckpointMismatchError) as info:
        other.load_checkpoint(tmp_path / "a.ckpt")
    msg = str(info.value)
    assert "a.ckpt does not fit Sequential" in msg
    assert "missing from the checkpoint: 3.bias, 3.weight" in msg
    assert "shapes differ: 0.bias (checkpoint (16,), model (32,))" in msg
    assert info.value.missing == ("3.bias", "3.weight")
    assert [m[0] for m in info.value.mismatched] == ["0.bias", "0.weight", "2.weight"]


def test_weights_saved_from_a_ddp_wrapper_get_a_hint(tmp_path):
    model = make_model()
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "w.pt")
    with pytest.raises(CheckpointMismatchError, match=r"not in the model: module\.0\.bias.*saved from a DDP"):
        NNHandler(make_model()).load_model(tmp_path / "w.pt")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_or_truncated_checkpoint(tmp_path, damage):
    path = tmp_path / "a.ckpt"
    _trained(epochs=1).save_checkpoint(path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(4096), "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=r"a\.ckpt is corrupt or truncated \(\d+ bytes; was its write interrupted\?\)"):
        make_handler().load_checkpoint(path)


def test_missing_file_and_foreign_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*nope\.ckpt"):
        make_handler().load_checkpoint(tmp_path / "nope.ckpt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match=r"is not an nn_handler checkpoint \(found \['weights'\]\).*load_model"):
        make_handler().load_checkpoint(tmp_path / "foreign.pt")
    torch.save({"obj": nn.Linear(1, 1)}, tmp_path / "pickled.pt")  # a pickled class, refused by weights_only
    with pytest.raises(CheckpointError, match=r"refuses .*only tensors and plain Python values.*Unsupported global"):
        make_handler().load_checkpoint(tmp_path / "pickled.pt")


def test_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "a.ckpt"
    handler = _trained(epochs=1)
    handler.save_checkpoint(path)
    before = path.read_bytes()

    def half_then_fail(obj, f):
        f.write(b"x" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        handler.save_checkpoint(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["a.ckpt"]


_KILL_CHILD = """
import os, sys, time
import torch
sys.path.insert(0, "tests")
from scripts.handler_case import make_data, make_handler
handler = make_handler()
handler.load_checkpoint(sys.argv[1])
X, y = make_data(32)
handler.set_train_loader((X, y), batch_size=8)
handler.train(3, progress=False)
def stuck(fd):  # every byte is in the temp file, the rename has not happened: die here
    print("IN_FSYNC", flush=True)
    time.sleep(300)
os.fsync = stuck
handler.save_checkpoint(sys.argv[1])
"""


@pytest.mark.slow
def test_checkpoint_killed_mid_write_leaves_the_old_one_loadable(tmp_path):
    path = tmp_path / "last.ckpt"
    old = _trained(epochs=1)
    old.save_checkpoint(path)
    proc = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "IN_FSYNC" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "IN_FSYNC" in line, f"child never reached the write: {line}{proc.stdout.read()[-2000:]}"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert len(leftovers) == 1 and is_temp_file(leftovers[0])  # the interrupted write, under another name
    assert list_checkpoints(tmp_path) == [path]
    fresh = make_handler(make_model(seed=9))
    assert fresh.load_checkpoint(path) == 1
    assert weights(fresh.module) == weights(old.module)


def test_atomic_save_replaces_whole_files(tmp_path):
    path = tmp_path / "x.pt"
    atomic_save({"v": torch.zeros(3)}, path)
    atomic_save({"v": torch.ones(3)}, path)
    assert torch.equal(load_payload(path)["v"], torch.ones(3))


@pytest.mark.slow
def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    ckpt = str(tmp_path / "mid.ckpt")
    runs = {}
    for phase in ("straight", "first", "second"):
        result = run_command([sys.executable, SCRIPT, phase, ckpt], timeout=180)
        assert result.returncode == 0, result.stdout[-3000:]
        (runs[phase],) = parse_results(result.stdout)
    straight, first, second = runs["straight"], runs["first"], runs["second"]
    assert first["epoch"] == 2 and second["epoch"] == 4
    assert second["hash"] == straight["hash"]  # bit-identical weights
    for key in ("train_loss", "val_loss", "lr", "global_step", "wait", "best"):
        assert second[key] == straight[key], key
    assert second["train_loss"][:2] == first["train_loss"]


# ---------------------------------------------------------------- refused loads leave the handler as it was


def _state(handler):
    """What a refused load must not change: weights, optimizer and scheduler state, counters, History."""
    opt = handler.optimizer.state_dict()
    return {"weights": weights(handler.module),
            "optimizer": {"groups": opt["param_groups"],
                          "state": {k: {n: v.tolist() if torch.is_tensor(v) else v for n, v in s.items()}
                                    for k, s in opt["state"].items()}},
            "scheduler": handler.scheduler.state_dict() if handler.scheduler is not None else None,
            "epoch": handler.epoch, "global_step": handler.global_step, "history": handler.history.state_dict()}


def _write_bad_file(kind, path, good):
    if kind == "text log":
        path.write_text("epoch 1/10: train_loss=0.532 val_loss=0.611\nepoch 2/10: train_loss=0.421\n")
    elif kind == "csv":
        path.write_text("epoch,train_loss,val_loss\n1,0.532,0.611\n2,0.421,0.508\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "random bytes":
        path.write_bytes(b"\x13" + os.urandom(4095))
    elif kind == "truncated checkpoint":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "a plain tensor":
        torch.save(torch.ones(3), path)
    elif kind == "another program's dict":
        torch.save({"state_dict": make_model().state_dict(), "epoch": 3}, path)
    elif kind == "a zip that is not torch's":
        import zipfile

        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes.txt", "hello")
    elif kind == "an incomplete nn_handler checkpoint":
        payload = load_payload(good)
        del payload["optimizer"], payload["history"]
        torch.save(payload, path)
    else:
        raise AssertionError(kind)


BAD_FILES = ["text log", "csv", "empty", "random bytes", "truncated checkpoint", "a plain tensor",
             "another program's dict", "a zip that is not torch's", "an incomplete nn_handler checkpoint"]


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_file_that_is_not_a_complete_checkpoint_is_refused_by_name(tmp_path, kind):
    good = tmp_path / "good.ckpt"
    _trained(epochs=1).save_checkpoint(good)
    path = tmp_path / "run.ckpt"
    _write_bad_file(kind, path, good)
    handler = _trained(epochs=2)
    before = _state(handler)
    with pytest.raises(CheckpointError) as info:
        handler.load_checkpoint(path)
    assert str(path) in str(info.value)
    assert type(info.value) in (CheckpointError,)  # not a raw KeyError/IndexError dressed up, not a mismatch
    assert _state(handler) == before
    handler.train(3, progress=False)  # and it trains on
    assert handler.epoch == 3


def test_a_text_file_says_it_holds_text(tmp_path):
    path = tmp_path / "run.ckpt"
    path.write_text("epoch,train_loss\n1,0.5\n")
    with pytest.raises(CheckpointError,
                       match=r"run\.ckpt is not a torch\.save file: it holds text \('epoch,train_loss"):
        make_handler().load_checkpoint(path)


def test_an_optimizer_of_another_class_is_refused_naming_both(tmp_path):
    _trained(epochs=1).save_checkpoint(tmp_path / "sgd.ckpt")  # SGD with momentum
    X, y = make_data(32)
    adam = NNHandler(make_model(seed=4), torch.optim.Adam, nn.MSELoss(), optimizer_kwargs={"lr": 0.01},
                     scheduler=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 2}, device="cpu")
    adam.set_train_loader((X, y), batch_size=8)
    adam.train(1, progress=False)
    before = _state(adam)
    with pytest.raises(CheckpointMismatchError, match=r"sgd\.ckpt holds the state of a torch\.optim\.sgd\.SGD "
                                                      r"optimizer; this handler's is torch\.optim\.adam\.Adam"):
        adam.load_checkpoint(tmp_path / "sgd.ckpt")
    assert _state(adam) == before
    adam.train(2, progress=False)  # the next step works (it died with KeyError: 'betas')
    assert adam.epoch == 2
    adam.load_checkpoint(tmp_path / "sgd.ckpt", resume=False)  # the weights alone still load
    assert adam.epoch == 2


def test_a_scheduler_of_another_class_is_refused_naming_both(tmp_path):
    _trained(epochs=1).save_checkpoint(tmp_path / "a.ckpt")  # StepLR
    other = make_handler(make_model(seed=4), scheduler=torch.optim.lr_scheduler.ExponentialLR,
                         scheduler_kwargs={"gamma": 0.9})
    X, y = make_data(32)
    other.set_train_loader((X, y), batch_size=8)
    other.train(1, progress=False)
    before = _state(other)
    with pytest.raises(CheckpointMismatchError, match=r"a\.ckpt holds the state of a torch\.optim\.lr_scheduler\."
                                                      r"StepLR scheduler; this handler's is torch\.optim\."
                                                      r"lr_scheduler\.ExponentialLR"):
        other.load_checkpoint(tmp_path / "a.ckpt")
    assert _state(other) == before


def test_optimizer_groups_that_do_not_fit_are_refused_before_anything_changes(tmp_path):
    # Same class, another layout (one group per layer): torch would refuse only after the weights were loaded.
    _trained(epochs=1).save_checkpoint(tmp_path / "a.ckpt")
    model = make_model(seed=4)
    groups = NNHandler(model, torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}],
                                              lr=0.1, momentum=0.9), nn.MSELoss(), device="cpu")
    X, y = make_data(32)
    groups.set_train_loader((X, y), batch_size=8)
    groups.train(1, progress=False)
    before = _state(groups)
    with pytest.raises(CheckpointMismatchError, match=r"a\.ckpt holds optimizer state for 1 parameter group"):
        groups.load_checkpoint(tmp_path / "a.ckpt")
    assert _state(groups) == before


def test_a_resumed_run_says_on_stderr_which_file_epoch_and_step_it_continues_at(tmp_path, capsys):
    def run(**train):
        X, y = make_data(40)
        handler = make_handler(checkpoint_dir=tmp_path, resume="auto")
        handler.set_train_loader((X, y), batch_size=8)  # 5 batches an epoch
        handler.train(progress=False, **train)
        return capsys.readouterr().err  # a captured stream: off a terminal

    said = run(epochs=3, max_steps=8)
    assert f"resume='auto': no checkpoint in {tmp_path} yet, training starts from the beginning" in said
    said = run(epochs=3)
    assert (f"nn_handler: resuming from {tmp_path / 'epoch-0002-batch-000003.ckpt'}, the newest of the 2 "
            f"checkpoints in {tmp_path} by write order: epoch 2 continues after 3 batches, at global step 8") in said
    said = run(epochs=4)
    assert "epoch-0003.ckpt, the newest of the 2 checkpoints" in said
    assert "3 epochs complete, epoch 4 starts at global step 15" in said
