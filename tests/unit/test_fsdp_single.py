"""strategy="fsdp" in one process (no group): bad input, the plain model, checkpoint directories, export, policies."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

from nn_handler import NNHandler
from nn_handler._training.precision import Precision
from nn_handler._training.sharding import wrap_targets
from nn_handler.checkpoint import SHARDED_META, list_run_checkpoints, load_payload
from nn_handler.errors import CheckpointError, CheckpointMismatchError, ConfigurationError
from scripts.handler_case import make_data, make_handler, make_model


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "zero3"}, r"strategy must be one of 'auto', 'ddp', 'fsdp', got 'zero3'"),
    ({"strategy": "fsdp", "fsdp_wrap": nn.Linear(2, 2)}, r"fsdp_wrap must be a set of torch.nn.Module subclasses"),
    ({"strategy": "fsdp", "fsdp_wrap": {"Linear"}}, r"fsdp_wrap must be a set of torch.nn.Module subclasses"),
    ({"strategy": "fsdp", "fsdp_wrap": {int}}, r"fsdp_wrap must be a set of torch.nn.Module subclasses"),
    ({"strategy": "fsdp", "fsdp_wrap": set()}, r"fsdp_wrap must be a set of torch.nn.Module subclasses"),
    ({"fsdp_wrap": {nn.Linear}}, r"fsdp_wrap applies to strategy='fsdp' only .*'ddp'"),
    ({"strategy": "ddp", "fsdp_kwargs": {"reshard_after_forward": False}}, r"fsdp_kwargs applies to strategy='fsdp'"),
    ({"strategy": "fsdp", "ddp_kwargs": {"static_graph": True}}, r"ddp_kwargs applies to strategy='ddp'"),
    ({"strategy": "fsdp", "sync_batchnorm": True}, r"sync_batchnorm=True applies to strategy='ddp'"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"offload": True}}, r"unknown fsdp_kwargs \['offload'\]"),
    ({"strategy": "fsdp", "fsdp_kwargs": [("cpu_offload", True)]}, r"fsdp_kwargs must be a dict"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"reshard_after_forward": "yes"}},
     r"fsdp_kwargs\['reshard_after_forward'\] must be an int >= 1, got 'yes'"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"cpu_offload": 1}}, r"fsdp_kwargs\['cpu_offload'\] must be True or False"),
    ({"strategy": "fsdp", "fsdp_kwargs": {"cpu_offload": True}}, r"cpu_offload'\]=True .* this run is on cpu"),
])
def test_bad_strategy_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        NNHandler(make_model(), device="cpu", **kwargs)



class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(5, 3), nn.Linear(3, 3), nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight


def test_modules_sharing_a_parameter_with_others_are_left_to_the_group_around_them(caplog):
    model = Tied()
    with caplog.at_level("INFO", logger="nn_handler._training.sharding"):
        assert wrap_targets(model, ()) == [model.mid]
        assert wrap_targets(model, (nn.Embedding, nn.Linear)) == [model.mid]
    assert "Embedding, Linear share parameters with modules outside them (tied weights)" in caplog.text
    outer = nn.Sequential(model)  # both holders inside one target: it is sharded on its own, tie included
    assert wrap_targets(outer, ()) == [model]

def test_auto_is_ddp_and_fsdp_accepts_a_single_class():
    assert NNHandler(make_model(), device="cpu").strategy == "ddp"
    handler = NNHandler(make_model(), device="cpu", strategy="fsdp", fsdp_wrap=nn.Linear)
    assert handler.strategy == "fsdp" and handler.config.fsdp_wrap == (nn.Linear,)


def test_wrap_policy_default_is_the_children_with_parameters_and_classes_go_innermost_first():
    model = nn.Sequential(Block(), nn.ReLU(), nn.Sequential(Block(), nn.Linear(2, 1)))
    assert wrap_targets(model, ()) == [model[0], model[2]]
    # Every instance at any depth, each after its own descendants.
    targets = wrap_targets(model, (Block, nn.Linear))
    assert set(map(id, targets)) == {id(m) for m in (model[0], model[0].inner, model[2][0], model[2][0].inner,
                                                     model[2][1])}
    assert targets.index(model[0].inner) < targets.index(model[0])
    assert targets.index(model[2][0].inner) < targets.index(model[2][0])


@pytest.mark.parametrize("amp, dtype", [(True, torch.bfloat16), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_follows_amp(amp, dtype):
    policy = Precision.resolve(amp, torch.device("cpu")).fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32)
    assert Precision.resolve(False, torch.device("cpu")).fsdp_policy().param_dtype is None


def test_one_process_trains_the_plain_model_and_writes_directories_that_resume(tmp_path):
    X, y = make_data(64)
    first = make_handler(strategy="fsdp", checkpoint_dir=tmp_path, seed=3)
    assert first.model is first.module and type(first.module) is nn.Sequential
    first.set_train_loader((X, y), batch_size=8)
    first.train(2, progress=False)
    ckpt = tmp_path / "epoch-0002.ckpt"
    assert ckpt.is_dir() and (ckpt / SHARDED_META).is_file() and (ckpt / ".metadata").is_file()
    meta = load_payload(ckpt)  # the metadata: plain values, loadable with weights_only
    assert meta["epoch"] == 2 and meta["model"] == {} and meta["sharded"] == {"world_size": 1, "optimizer": True}
    assert meta["global_step"] == 16 and meta["scheduler"]["last_epoch"] == 2 and len(meta["rng"]) == 1
    assert meta["history"]["epoch"] == [1, 2] and meta["run"]["seq"] == 2

    straight = make_handler(strategy="fsdp", seed=3)
    straight.set_train_loader((X, y), batch_size=8)
    straight.train(4, progress=False)

    resumed = make_handler(strategy="fsdp", checkpoint_dir=tmp_path, resume="auto", seed=3)
    resumed.set_train_loader((X, y), batch_size=8)
    resumed.train(4, progress=False)
    assert resumed.history["train_loss"] == straight.history["train_loss"]
    for a, b in zip(resumed.module.parameters(), straight.module.parameters()):
        assert torch.equal(a, b)
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0003.ckpt", "epoch-0004.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]  # old directories pruned

    # The weights of a directory load alone too; export_model writes one plain file.
    other = make_handler(make_model(seed=9), strategy="fsdp")
    other.load_model(tmp_path / "epoch-0004.ckpt")
    other.export_model(tmp_path / "w.pt")
    plain = make_model(seed=7)
    plain.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    for a, b in zip(plain.parameters(), straight.module.parameters()):
        assert torch.equal(a, b)


def test_save_checkpoint_replaces_a_directory_and_loads_back(tmp_path):
    X, y = make_data(32)
    handler = make_handler(strategy="fsdp")
    handler.set_train_loader((X, y), batch_size=8)
    path = tmp_path / "mine.ckpt"
    handler.train(1, progress=False)
    handler.save_checkpoint(path)
    handler.train(2, progress=False)
    handler.save_checkpoint(path)  # over the first: the whole directory is replaced
    assert sorted(os.listdir(tmp_path)) == ["mine.ckpt"]
    fresh = make_handler(make_model(seed=4), strategy="fsdp")
    assert fresh.load_checkpoint(path) == 2 and fresh.global_step == handler.global_step
    for a, b in zip(fresh.module.parameters(), handler.module.parameters()):
        assert torch.equal(a, b)


def test_a_directory_of_another_model_is_refused_by_name_before_loading(tmp_path):
    handler = make_handler(strategy="fsdp")
    handler.save_checkpoint(tmp_path / "c.ckpt")
    wide = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
    before = [p.clone() for p in wide.parameters()]
    other = make_handler(wide, strategy="fsdp")
    with pytest.raises(CheckpointMismatchError, match=r"c.ckpt does not fit Sequential: shapes differ: 0.bias"):
        other.load_checkpoint(tmp_path / "c.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, wide.parameters()))


def test_an_unfinished_directory_is_not_a_checkpoint(tmp_path):
    handler = make_handler(strategy="fsdp")
    (tmp_path / "epoch-0001.ckpt").mkdir()  # no metadata file: never completed
    assert list_run_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*epoch-0001.ckpt/nn_handler.pt"):
        handler.load_checkpoint(tmp_path / "epoch-0001.ckpt")


def test_a_failed_sharded_write_leaves_the_previous_checkpoint_and_no_temp_dir(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    handler = make_handler(strategy="fsdp")
    path = tmp_path / "c.ckpt"
    handler.save_checkpoint(path)
    before = sorted(os.listdir(path))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        handler.save_checkpoint(path)
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"] and sorted(os.listdir(path)) == before
    assert make_handler(strategy="fsdp").load_checkpoint(path) == 0


def _train_into(directory, epochs, **kwargs):
    X, y = make_data(32)
    handler = make_handler(strategy="fsdp", checkpoint_dir=directory, keep_last=5, **kwargs)
    handler.set_train_loader((X, y), batch_size=8, shuffle=False)
    handler.train(epochs, progress=False)
    return handler


def test_overwrite_deletes_another_runs_checkpoint_directories(tmp_path):
    _train_into(tmp_path, 2)  # another run: two sharded directories
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0001.ckpt", "epoch-0002.ckpt"]
    mine = _train_into(tmp_path, 1, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["epoch-0001.ckpt"]
    assert load_payload(tmp_path / "epoch-0001.ckpt")["run"]["id"] == mine._state.run_id


def _damage(path, how):
    shard = path / "__0_0.distcp"
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    else:  # the right size, wrong bytes: only DCP's own read finds out
        shard.write_bytes(b"\0" * shard.stat().st_size)


@pytest.mark.parametrize("how, problem", [("missing", r"incomplete: __0_0.distcp is missing"),
                                          ("truncated", r"incomplete: __0_0.distcp is truncated \(\d+ of \d+ bytes\)"),
                                          ("zeroed", r"could not load the sharded checkpoint .*epoch-0002.ckpt: "
                                                     r"CheckpointException")])
def test_a_damaged_shard_is_skipped_by_auto_and_refused_by_load_checkpoint(tmp_path, caplog, how, problem):
    straight = _train_into(tmp_path / "straight", 3)
    _train_into(tmp_path / "run", 2)
    _damage(tmp_path / "run" / "epoch-0002.ckpt", how)
    # A CheckpointError naming the directory and what is wrong (DCP's own CheckpointException is a BaseException).
    with pytest.raises(CheckpointError, match=problem):
        make_handler(strategy="fsdp").load_checkpoint(tmp_path / "run" / "epoch-0002.ckpt")
    if how == "zeroed":  # found only by loading it, which resume="auto" reports as a failed resume
        return
    with caplog.at_level("WARNING"):
        resumed = _train_into(tmp_path / "run", 3, resume="auto")  # from epoch 1, the complete older one
    assert re.search(r"not resuming from .*epoch-0002.ckpt: the sharded checkpoint .*epoch-0002.ckpt is " + problem,
                     caplog.text)
    assert resumed.history["epoch"] == [1, 2, 3] and resumed.global_step == straight.global_step
    for a, b in zip(resumed.module.parameters(), straight.module.parameters()):
        assert torch.equal(a, b)
