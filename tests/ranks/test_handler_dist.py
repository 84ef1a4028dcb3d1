"""NNHandler on 2 spawned gloo ranks: equal to a hand-written loop, predict, stop together, no hangs, resume."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import check_ranks
from nn_handler.testing import run_distributed
from scripts.handler_case import make_data, reference_train, resume_case, weights

EPOCHS, BATCH = 3, 8
TIMEOUT = 150


def _train_body(rank, grad_accum):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import nn_handler._training.loop as training_loop
    from scripts.handler_case import make_data, make_handler, make_model, weights

    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    bars = []
    real_bar = training_loop.EpochBar  # count the epochs' bars (this rank's process is ours alone)
    training_loop.EpochBar = lambda *a, **k: bars.append(a) or real_bar(*a, **k)
    handler = make_handler(make_model(), grad_accum_steps=grad_accum)
    assert isinstance(handler.model, DistributedDataParallel) and handler.world_size == 2
    calls = {"n": 0}

    def counting_allreduce(state, bucket):
        calls["n"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    handler.model.register_comm_hook(None, counting_allreduce)
    # A ready-made DataLoader is rebuilt with a DistributedSampler, keeping its settings.
    handler.set_train_loader(DataLoader(TensorDataset(X, y), batch_size=BATCH, shuffle=True))
    assert isinstance(handler.train_loader.sampler, DistributedSampler)
    assert handler.train_loader.batch_size == BATCH
    handler.set_val_loader(TensorDataset(Xv, yv), batch_size=BATCH)
    history = handler.train(EPOCHS, progress=True)
    return {"history": history.state_dict(), "weights": weights(handler.module), "allreduce_calls": calls["n"],
            "bars": len(bars), "eval": handler.evaluate()}


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_two_ranks_match_a_hand_written_loop(grad_accum):
    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    ref_model, ref_history = reference_train(X, y, Xv, yv, epochs=EPOCHS, batch_size=BATCH, world_size=2,
                                             grad_accum=grad_accum)
    results = check_ranks(run_distributed(_train_body, nprocs=2, args=(grad_accum,), timeout=TIMEOUT))
    r0, r1 = results
    assert r0["history"] == r1["history"]  # identical on every rank, bit for bit
    for key, values in ref_history.items():
        assert r0["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    assert r0["weights"] == pytest.approx(weights(ref_model), abs=1e-5)
    assert r0["weights"] == r1["weights"]
    assert r0["eval"] == r1["eval"] and r0["eval"]["loss"] == pytest.approx(ref_history["val_loss"][-1], rel=1e-5)
    # 96 samples, 2 ranks, batch 8: 6 micro-steps per epoch; one bucket for this small model.
    assert r0["allreduce_calls"] == EPOCHS * -(-6 // grad_accum)  # no all-reduce on non-final micro-steps
    assert (r0["bars"], r1["bars"]) == (EPOCHS, 0)  # progress bar on the main process only


def _predict_body(rank):
    from torch.utils.data import DataLoader, TensorDataset

    from nn_handler import NNHandler

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    X = torch.arange(21.0).reshape(7, 3)  # 7 samples on 2 ranks: DistributedSampler pads one
    handler = NNHandler(model, loss_fn=nn.MSELoss())
    from nn_handler import ConfigurationError

    # The DDP knobs pass through prepare_model; SyncBatchNorm is refused on CPU with the reason.
    knobs = NNHandler(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)), torch.optim.SGD,
                      nn.MSELoss(), optimizer_kwargs={"lr": 0.1},
                      ddp_kwargs={"bucket_cap_mb": 1, "find_unused_parameters": True})
    knobs.set_train_loader((X, torch.zeros(7, 2)), batch_size=2)
    knobs.train(1, progress=False)
    try:
        NNHandler(nn.BatchNorm1d(3), sync_batchnorm=True)
        sync_bn = "accepted"
    except ConfigurationError as exc:
        sync_bn = str(exc)
    return {
        "knobs": (knobs.model.find_unused_parameters, knobs.model.bucket_bytes_cap, sync_bn),
        "tensor": handler.predict(X, batch_size=2),
        "loader": handler.predict(DataLoader(TensorDataset(X, torch.zeros(7)), batch_size=3, shuffle=True)),
        "expected": model(X).detach(),
        "eval": handler.evaluate(TensorDataset(X, torch.zeros(7, 2))),
        "expected_eval": nn.functional.mse_loss(model(X), torch.zeros(7, 2)).item(),
    }


def test_predict_returns_each_sample_once_in_input_order_with_an_odd_dataset():
    for r in check_ranks(run_distributed(_predict_body, nprocs=2, timeout=TIMEOUT)):
        assert r["knobs"][:2] == (True, 2**20)
        assert r["knobs"][2].startswith("sync_batchnorm=True needs CUDA devices")
        assert r["tensor"].shape == (7, 2) and torch.allclose(r["tensor"], r["expected"])
        assert torch.allclose(r["loader"], r["expected"])
        # The padded duplicate is not counted either.
        assert r["eval"]["loss"] == pytest.approx(r["expected_eval"], rel=1e-6)


def _stop_body(rank):
    import logging

    from nn_handler import Callback, EarlyStopping
    from scripts.handler_case import make_data, make_handler

    class OnlyRankOneStops(Callback):
        def on_epoch_end(self, handler, epoch, logs):
            if handler.rank == 1 and epoch == 2:
                handler.stop_training = True

    class Scripted(Callback):  # a monitored value that stops improving after epoch 2
        def on_epoch_end(self, handler, epoch, logs):
            logs["score"] = [3.0, 1.0, 2.0, 2.0, 2.0, 0.5][epoch - 1]

    X, y = make_data(32)
    one = make_handler(callbacks=[OnlyRankOneStops()])
    one.set_train_loader((X, y), batch_size=8)
    stopper = EarlyStopping("score", patience=2)
    two = make_handler(callbacks=[Scripted(), stopper])
    two.set_train_loader((X, y), batch_size=8)
    stopped = len(one.train(10, progress=False)), len(two.train(10, progress=False)), stopper.stopped_epoch
    said = []
    log = logging.getLogger("nn_handler._training.loop")
    log.addHandler(catch := logging.Handler())
    catch.emit = lambda record: said.append(record.getMessage())
    try:
        two.train(4, progress=False)  # already at epoch 4
    finally:
        log.removeHandler(catch)
    return stopped, said


def test_every_rank_stops_at_the_same_epoch_and_rank_zero_alone_says_nothing_is_left_to_do():
    results = check_ranks(run_distributed(_stop_body, nprocs=2, timeout=TIMEOUT))
    assert [stopped for stopped, _ in results] == [(2, 4, 4), (2, 4, 4)]
    [line] = results[0][1]
    assert line.startswith("train(): already at epoch 4, global step ") and line.endswith(": nothing to do")
    assert results[1][1] == []  # one line per run, as the resume line, not one per rank


def _nonfinite_body(rank, check_every):
    import torch.distributed as dist

    from nn_handler import NonFiniteLossError
    from scripts.handler_case import make_data, make_handler

    X, y = make_data(64)
    handler = make_handler(finite_check_every=check_every)
    handler.set_train_loader((X, y), batch_size=8)
    mse = nn.MSELoss()
    steps = {"n": 0}

    def loss_fn(out, target):  # rank 1 alone goes bad at its 6th batch (epoch 2, step 1)
        steps["n"] += 1
        loss = mse(out, target)
        return loss * float("nan") if dist.get_rank() == 1 and steps["n"] == 6 else loss

    handler.set_loss_fn(loss_fn)
    try:
        handler.train(3, progress=False)
    except NonFiniteLossError as exc:
        return exc.epoch, exc.step, exc.ranks, str(exc), handler.epoch
    return "no error"


@pytest.mark.parametrize("check_every", [None, 2])
def test_non_finite_loss_on_one_rank_raises_on_every_rank(check_every):
    results = check_ranks(run_distributed(_nonfinite_body, nprocs=2, args=(check_every,), timeout=TIMEOUT))
    for epoch, step, ranks, message, done in results:
        assert (epoch, step, ranks, done) == (2, 1, (1,), 1)
        assert "loss is nan at epoch 2, step 1 on rank 1" in message


def _save_fails_body(rank, path):
    from nn_handler import CheckpointError
    from scripts.handler_case import make_handler

    try:
        make_handler().save_checkpoint(path)
    except CheckpointError as exc:
        cause = exc.__cause__
        return "CheckpointError", str(exc), None if cause is None else (type(cause).__name__, str(cause),
                                                                         str(cause.__cause__))
    except OSError as exc:
        return "OSError", type(exc).__name__, exc.__cause__
    return "saved", "", None


def test_a_failed_write_on_rank_zero_reaches_every_rank(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r0, r1 = check_ranks(run_distributed(_save_fails_body, nprocs=2, args=(str(blocker / "a.ckpt"),), timeout=TIMEOUT))
    assert r0[0] == "OSError"
    assert r1[:2] == ("CheckpointError",
                      f"rank 0 could not write the checkpoint {blocker / 'a.ckpt'}; see rank 0's error")
    # "see rank 0's error": it is the cause, with rank 0's traceback.
    name, text, remote = r1[2]
    assert name == f"RankFailedError[{r0[1]}]"  # also rank 0's OSError subclass
    assert text.startswith(f"the write of the checkpoint {blocker / 'a.ckpt'} failed on rank 0 (cpu, pid ")
    assert "atomic_save" in remote and "atomic_save" not in text  # rank 0's traceback: its cause, once


def _resume_body(rank, phase, path):
    return resume_case(phase, path)


@pytest.mark.slow
def test_two_rank_resume_in_new_processes_is_bit_identical(tmp_path):
    ckpt = str(tmp_path / "mid.ckpt")
    straight = check_ranks(run_distributed(_resume_body, nprocs=2, args=("straight", ckpt), timeout=TIMEOUT))
    first = check_ranks(run_distributed(_resume_body, nprocs=2, args=("first", ckpt), timeout=TIMEOUT))
    second = check_ranks(run_distributed(_resume_body, nprocs=2, args=("second", ckpt), timeout=TIMEOUT))
    assert straight[0]["hash"] == straight[1]["hash"]
    for rank in (0, 1):
        assert first[rank]["epoch"] == 2 and second[rank]["epoch"] == 4
        assert second[rank]["hash"] == straight[rank]["hash"]
        for key in ("train_loss", "val_loss", "lr", "global_step", "wait", "best"):
            assert second[rank][key] == straight[rank][key], key


def _stall_setting_body(rank):
    from torch import nn

    from nn_handler import NNHandler
    from nn_handler.utils import _stall

    before = _stall.current().timeout  # run_distributed's group has its watchdog (env or 300 s)
    NNHandler(nn.Linear(2, 1), stall_timeout=7)
    retuned = _stall.current().timeout
    NNHandler(nn.Linear(2, 1))  # "env": leaves the group's setting alone
    kept = _stall.current().timeout
    NNHandler(nn.Linear(2, 1), stall_timeout=None)
    return before, retuned, kept, _stall.current()


@pytest.mark.timeout(TIMEOUT + 30)
def test_nnhandler_stall_timeout_keyword_wins_on_an_existing_group(monkeypatch):
    monkeypatch.setenv("NN_HANDLER_STALL_TIMEOUT", "40")
    for before, retuned, kept, after in check_ranks(run_distributed(_stall_setting_body, nprocs=2, timeout=TIMEOUT)):
        assert (before, retuned, kept, after) == (40.0, 7, 7, None)


def _buffers_setting(rank):
    from nn_handler import NNHandler

    out = {}
    for broadcast in (True, False):
        for validate in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
            handler = NNHandler(model, torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, device="cpu",
                                ddp_kwargs={"broadcast_buffers": broadcast})
            handler.set_train_loader(make_data(64), batch_size=8, shuffle=False)  # the ranks' batches differ
            if validate:
                handler.set_val_loader(make_data(16, seed=1), batch_size=8)
            handler.train(3, progress=False)
            out[broadcast, validate] = {k: v.detach().clone() for k, v in handler.module.state_dict().items()
                                        if broadcast is False or "running" not in k}
            # (With broadcast_buffers=True a rank's buffers are rank 0's after validation, its own without.)
            handler.close()
    return out


def test_validation_follows_broadcast_buffers_false_and_leaves_training_as_without_it():
    # Validation copied rank 0's buffers onto every rank whatever the setting: with broadcast_buffers=False
    # the weights then depended on whether a validation loader was set (2.7e-2 apart).
    results = check_ranks(run_distributed(_buffers_setting, 2, timeout=TIMEOUT))
    for r in results:
        for broadcast in (True, False):
            for key, value in r[broadcast, False].items():
                torch.testing.assert_close(r[broadcast, True][key], value, rtol=0, atol=0, msg=f"{broadcast} {key}")
    # False is followed: each rank keeps the running statistics of its own batches.
    assert not torch.equal(results[0][False, True]["1.running_mean"], results[1][False, True]["1.running_mean"])
