"""strategy="fsdp" on 2 spawned gloo ranks: equal to one process, sharded checkpoints that reshard, export, AMP.

The reference for every 2-rank run is the same handler in this (single,
group-less) process with the global batch: 2 ranks of 8 unshuffled samples
see together what one process sees in a batch of 16, and FSDP's gradient
reduce-scatter averages them as one process's mean loss does.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from nn_handler.checkpoint import SHARDED_META, list_run_checkpoints
from helpers import check_ranks
from nn_handler.testing import run_distributed
from scripts.handler_case import make_model

TIMEOUT = 150
N, N_VAL, PER_RANK, EPOCHS, ACCUM = 160, 37, 8, 4, 2  # 160 / 16 / 2 = 5 optimizer steps an epoch, 20 in all


def build(batch, strategy="fsdp", **kwargs):
    """The case: SGD with momentum, StepLR, clipping, accumulation, a metric, uneven validation data."""
    from nn_handler import NNHandler
    from scripts.handler_case import mae, make_data

    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05, "momentum": 0.9},
                        scheduler=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 2, "gamma": 0.5},
                        metrics={"mae": mae}, grad_accum_steps=ACCUM, clip_grad_norm=0.5, device="cpu",
                        strategy=strategy, **kwargs)
    handler.set_train_loader(make_data(N), batch_size=batch, shuffle=False)
    # 37 samples in batches of 9: rank 1's third batch is padding alone, which a sharded forward must still run.
    handler.set_val_loader(make_data(N_VAL, seed=1), batch_size=9)
    return handler


def outcome(handler):
    from scripts.handler_case import make_data

    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in handler.module.state_dict().items()}
    return {"history": handler.history.state_dict(), "steps": handler.global_step,
            "weights": torch.cat([t.detach().flatten() for t in full.values()]),
            "predict": handler.predict(make_data(N_VAL, seed=1)[0], batch_size=PER_RANK),
            "eval": handler.evaluate(make_data(N_VAL, seed=1))}


def assert_close(a, b, exact=False):
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    assert a["steps"] == b["steps"] == EPOCHS * N // (2 * PER_RANK * ACCUM)
    torch.testing.assert_close(a["weights"], b["weights"], **tol)
    torch.testing.assert_close(a["predict"], b["predict"], **tol)
    for key in ("train_loss", "val_loss", "train_mae", "val_mae", "lr"):
        torch.testing.assert_close(torch.tensor(a["history"][key]), torch.tensor(b["history"][key]),
                                   **tol, msg=key)
    assert a["eval"] == pytest.approx(b["eval"], rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def single():
    """The same training in one process: strategy="fsdp" without a group trains the plain model."""
    handler = build(2 * PER_RANK)
    assert type(handler.model) is nn.Sequential and handler.model is handler.module
    handler.train(EPOCHS, progress=False)
    return outcome(handler)


def _training_and_checkpoints(rank, root):
    from torch.distributed.fsdp import FSDPModule

    root = Path(root)
    done = build(PER_RANK, checkpoint_dir=root / "straight")
    # Sharded in place: the children that hold parameters, then the root; the Tanh is not.
    assert isinstance(done.model, FSDPModule) and done.model is done.module
    assert [isinstance(m, FSDPModule) for m in done.module] == [True, False, True]
    assert type(done.module[0].weight).__name__ == "DTensor"
    done.train(EPOCHS, progress=False)
    done.export_model(root / "export.pt")
    straight = outcome(done)
    # Weights alone into a sharded model: the exported file, and a checkpoint directory with resume=False.
    from_file, from_dir = build(PER_RANK), build(PER_RANK)
    from_file.load_model(root / "export.pt")
    assert from_dir.load_checkpoint(root / "straight" / "epoch-0004.ckpt", resume=False) == EPOCHS
    loaded = [outcome(h)["weights"] for h in (from_file, from_dir)]

    # Stopped after 2 epochs, then a new handler (a rerun of the script) continues with resume="auto".
    build(PER_RANK, checkpoint_dir=root / "split").train(2, progress=False)
    if rank == 0:
        shutil.copytree(root / "split", root / "for_one_rank")
    resumed = build(PER_RANK, checkpoint_dir=root / "split", resume="auto")
    resumed.train(EPOCHS, progress=False)

    # A DDP checkpoint file continues under FSDP, and a sharded FSDP directory under DDP.
    build(PER_RANK, "ddp", checkpoint_dir=root / "ddp").train(2, progress=False)
    ddp_to_fsdp = build(PER_RANK, resume=root / "ddp" / "epoch-0002.ckpt")
    ddp_to_fsdp.train(EPOCHS, progress=False)
    fsdp_to_ddp = build(PER_RANK, "ddp", resume=root / "for_one_rank" / "epoch-0002.ckpt")
    fsdp_to_ddp.train(EPOCHS, progress=False)
    return {"straight": straight, "resumed": outcome(resumed), "ddp_to_fsdp": outcome(ddp_to_fsdp),
            "fsdp_to_ddp": outcome(fsdp_to_ddp), "loaded": loaded}


def test_fsdp_trains_checkpoints_reshards_and_exports(tmp_path, single):
    results = check_ranks(run_distributed(_training_and_checkpoints, 2, args=(str(tmp_path),), timeout=TIMEOUT))
    straight = results[0]["straight"]
    assert_close(straight, single)  # 2 sharded ranks == 1 plain process, 20 steps
    assert_close(results[0]["resumed"], straight, exact=True)  # same world size: bit-identical
    assert_close(results[0]["ddp_to_fsdp"], straight)
    assert_close(results[0]["fsdp_to_ddp"], straight)
    assert_close(results[1]["straight"], straight, exact=True)  # every rank reports the same
    for weights in results[0]["loaded"]:
        torch.testing.assert_close(weights, straight["weights"], rtol=0, atol=0)

    # Checkpoints are directories (one shard file per rank, the metadata last), pruned to keep_last=2.
    ckpts = list_run_checkpoints(tmp_path / "straight")
    assert [p.name for p in ckpts] == ["epoch-0003.ckpt", "epoch-0004.ckpt"]
    assert sorted(os.listdir(ckpts[-1])) == [".metadata", "__0_0.distcp", "__1_0.distcp", SHARDED_META]
    assert sorted(os.listdir(tmp_path / "straight")) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]  # no temp dir

    # export_model: one consolidated file that the plain model loads without nn_handler.
    plain = make_model(seed=5)
    plain.load_state_dict(torch.load(tmp_path / "export.pt", weights_only=True))
    torch.testing.assert_close(torch.cat([t.flatten() for t in plain.state_dict().values()]), straight["weights"],
                               rtol=0, atol=0)

    # Saved on 2 ranks, resumed on 1 (this process, no group): the same run to 1e-5.
    one = build(2 * PER_RANK, checkpoint_dir=tmp_path / "for_one_rank", resume="auto")
    one.train(EPOCHS, progress=False)
    assert_close(outcome(one), straight)


def _preempted_mid_epoch(rank, root):
    from nn_handler import TrainingPreempted
    from scripts.scale_case import AtStep, sigterm_to

    straight = build(PER_RANK)
    straight.train(EPOCHS, progress=False)
    # SIGTERM to rank 1 after step 7 (epoch 2, 4 of its 10 batches): every rank stops there, sharded.
    first = build(PER_RANK, checkpoint_dir=root, preemption_check_every=1,
                  callbacks=[AtStep(7, sigterm_to(os.getpid), rank=1, accum=ACCUM)])
    try:
        first.train(EPOCHS, progress=False)
    except TrainingPreempted as exc:
        stopped = (Path(exc.checkpoint).name, exc.epoch, exc.batches)
    resumed = build(PER_RANK, checkpoint_dir=root, resume="auto")
    resumed.train(EPOCHS, progress=False)
    return {"stopped": stopped, "straight": outcome(straight), "resumed": outcome(resumed)}


def test_a_preemption_mid_epoch_writes_a_sharded_checkpoint_that_resumes_exactly(tmp_path):
    results = check_ranks(run_distributed(_preempted_mid_epoch, 2, args=(str(tmp_path),), timeout=TIMEOUT))
    for r in results:
        assert r["stopped"] == ("epoch-0002-batch-000004.ckpt", 2, 4)
        assert_close(r["resumed"], r["straight"], exact=True)


def _killed_mid_save(rank, root):
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    from nn_handler import Callback

    class KillDuringSecondSave(Callback):
        def on_save_checkpoint(self, handler, payload):
            # Rank 0: the rank that would clean up after a failed write dies with the job.
            if payload["epoch"] == 2 and rank == 0:
                write = FileSystemWriter.write_data

                def write_then_die(self, *args, **kwargs):
                    result = write(self, *args, **kwargs)  # this rank's shard is on disk, the rest is not
                    os.kill(os.getpid(), signal.SIGKILL)
                    return result

                FileSystemWriter.write_data = write_then_die

    build(PER_RANK, checkpoint_dir=root, callbacks=[KillDuringSecondSave()]).train(EPOCHS, progress=False)


def test_a_kill_during_a_sharded_save_leaves_the_previous_checkpoint_newest(tmp_path):
    results = run_distributed(_killed_mid_save, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    assert all(isinstance(r, BaseException) for r in results)
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith(".epoch-0002.ckpt.tmp.")]
    assert len(leftovers) == 1 and SHARDED_META not in os.listdir(tmp_path / leftovers[0])
    assert [p.name for p in list_run_checkpoints(tmp_path)] == ["epoch-0001.ckpt"]

    handler = build(2 * PER_RANK, checkpoint_dir=tmp_path, resume="auto")
    handler.train(2, progress=False)
    assert handler.history["epoch"] == [1, 2] and handler.global_step == 10
    assert sorted(os.listdir(tmp_path)) == ["epoch-0001.ckpt", "epoch-0002.ckpt"]  # the leftover is gone


def _amp_and_policy(rank):
    from torch.distributed.fsdp import FSDPModule

    from nn_handler import NNHandler
    from scripts.handler_case import make_data

    dtypes = []
    model = make_model()
    model[0].register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    handler = NNHandler(model, torch.optim.Adam, nn.MSELoss(), optimizer_kwargs={"lr": 0.01}, device="cpu",
                        strategy="fsdp", amp=True, fsdp_wrap={nn.Linear}, fsdp_kwargs={"reshard_after_forward": False})
    handler.set_train_loader(make_data(N), batch_size=PER_RANK)
    handler.train(3, progress=False)
    linear_sharded = [isinstance(m, FSDPModule) for m in handler.module]
    return {"loss": handler.history["train_loss"], "dtypes": sorted({str(d) for d in dtypes}),
            "param_dtype": str(handler.module[0].weight.dtype), "sharded": linear_sharded}


def test_amp_trains_in_bf16_on_cpu_with_a_wrap_policy():
    results = check_ranks(run_distributed(_amp_and_policy, 2, timeout=TIMEOUT))
    for r in results:
        assert r["dtypes"] == ["torch.bfloat16"]  # forward in bf16 ...
        assert r["param_dtype"] == "torch.float32"  # ... over fp32 sharded parameters
        assert r["sharded"] == [True, False, True]
        assert all(torch.isfinite(torch.tensor(r["loss"]))) and r["loss"][-1] < r["loss"][0]
    assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_on_one_gpu_rank_trains_with_amp_and_exports(tmp_path):
    def body(rank, path):
        from nn_handler import NNHandler
        from scripts.handler_case import make_data

        handler = NNHandler(make_model(), torch.optim.Adam, nn.MSELoss(), optimizer_kwargs={"lr": 0.01},
                            strategy="fsdp", amp=True, checkpoint_dir=path)
        handler.set_train_loader(make_data(N), batch_size=PER_RANK)
        handler.train(2, progress=False)
        handler.export_model(Path(path) / "export.pt")
        return handler.history["train_loss"]

    loss = check_ranks(run_distributed(body, 1, args=(str(tmp_path),), timeout=TIMEOUT, backend="nccl"))[0]
    assert loss[-1] < loss[0]
    make_model().load_state_dict(torch.load(tmp_path / "export.pt", weights_only=True))


# ----------------------------------------------------------------------------- buffers: rank 0's, as under DDP
def bn_model(seed=0):
    from scripts.handler_case import IN

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def _bn_handler(strategy, **kwargs):
    from nn_handler import NNHandler
    from scripts.handler_case import make_data

    kwargs.setdefault("device", "cpu")
    handler = NNHandler(bn_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05, "momentum": 0.9},
                        strategy=strategy, **kwargs)
    handler.set_train_loader(make_data(64), batch_size=PER_RANK, shuffle=False)  # the ranks' batches differ
    handler.set_val_loader(make_data(N_VAL, seed=1), batch_size=9)
    return handler


def _batchnorm(rank, root):
    from scripts.handler_case import make_data

    Xv, yv = make_data(N_VAL, seed=1)
    out = {}
    for strategy in ("fsdp", "ddp"):
        straight = _bn_handler(strategy)
        straight.train(4, progress=False)
        straight.export_model(Path(root) / f"{strategy}.pt")
        _bn_handler(strategy, checkpoint_dir=Path(root) / strategy).train(2, progress=False)
        resumed = _bn_handler(strategy, checkpoint_dir=Path(root) / strategy, resume="auto")
        resumed.train(4, progress=False)
        out[strategy] = {"val_loss": straight.history["val_loss"], "resumed": resumed.history["val_loss"],
                         "predict": straight.predict(Xv), "eval": straight.evaluate((Xv, yv))["loss"],
                         "resumed_predict": resumed.predict(Xv)}
    return out


def test_buffers_are_rank_0s_in_evaluation_prediction_and_checkpoints(tmp_path):
    from scripts.handler_case import make_data

    results = check_ranks(run_distributed(_batchnorm, 2, args=(str(tmp_path),), timeout=TIMEOUT))
    Xv, yv = make_data(N_VAL, seed=1)
    for strategy in ("fsdp", "ddp"):
        plain = bn_model(seed=3)
        plain.load_state_dict(torch.load(tmp_path / f"{strategy}.pt", weights_only=True))
        with torch.no_grad():
            expected = plain.eval()(Xv)
        for r in results:
            mine = r[strategy]
            # 2 ranks predict and evaluate as the exported model does in this one process.
            torch.testing.assert_close(mine["predict"], expected, rtol=1e-5, atol=1e-6)
            assert mine["eval"] == pytest.approx(nn.functional.mse_loss(expected, yv).item(), rel=1e-5)
            assert mine["val_loss"][-1] == pytest.approx(mine["eval"], rel=1e-6)
            # The checkpoint holds rank 0's buffers: the resumed run is the uninterrupted one, bit for bit.
            assert mine["resumed"] == mine["val_loss"]
            torch.testing.assert_close(mine["resumed_predict"], mine["predict"], rtol=0, atol=0)
    # FSDP follows DDP's rule, so it gives DDP's numbers.
    fsdp, ddp = (torch.tensor(results[0][s]["val_loss"]) for s in ("fsdp", "ddp"))
    torch.testing.assert_close(fsdp, ddp, rtol=1e-5, atol=1e-6)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_buffers_are_broadcast_on_a_gpu_and_predict_equals_the_export(tmp_path):
    def body(rank, root):
        from scripts.handler_case import make_data

        handler = _bn_handler("fsdp", device="auto")  # the rank's GPU, under NCCL
        handler.train(2, progress=False)
        handler.export_model(Path(root) / "export.pt")
        return handler.predict(make_data(N_VAL, seed=1)[0])

    from scripts.handler_case import make_data

    predicted = check_ranks(run_distributed(body, 1, args=(str(tmp_path),), timeout=TIMEOUT, backend="nccl"))[0]
    plain = bn_model(seed=3)
    plain.load_state_dict(torch.load(tmp_path / "export.pt", weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(predicted, plain.eval()(make_data(N_VAL, seed=1)[0]), rtol=1e-4, atol=1e-5)

# ----------------------------------------------------------------------------- tied weights
class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as language models do."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(12, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 12, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))


def _tied(rank, root):
    from nn_handler import NNHandler

    tokens = torch.arange(64) % 12
    out = {}
    for strategy in ("fsdp", "ddp"):
        handler = NNHandler(Tied(), torch.optim.SGD, nn.CrossEntropyLoss(), optimizer_kwargs={"lr": 0.5},
                            device="cpu", strategy=strategy)
        handler.set_train_loader((tokens, (tokens + 1) % 12), batch_size=PER_RANK, shuffle=False)
        handler.train(3, progress=False)
        handler.export_model(Path(root) / f"{strategy}.pt")
        out[strategy] = {"tied": handler.module.emb.weight is handler.module.out.weight,
                         "loss": handler.history["train_loss"]}
    # A policy naming the embedding alone: it shares its weight with the output layer, so the root shards both.
    logger, records = logging.getLogger("nn_handler._training.sharding"), []
    logger.addHandler(Catch(records))
    logger.setLevel(logging.INFO)
    policy = NNHandler(Tied(), device="cpu", strategy="fsdp", fsdp_wrap={nn.Embedding}).module
    out["policy"] = {"tied": policy.emb.weight is policy.out.weight, "log": "\n".join(records)}
    return out


class Catch(logging.Handler):
    def __init__(self, records):
        super().__init__()
        self.records = records

    def emit(self, record):
        self.records.append(record.getMessage())


def test_tied_weights_stay_tied_and_train_as_under_ddp(tmp_path):
    results = check_ranks(run_distributed(_tied, 2, args=(str(tmp_path),), timeout=TIMEOUT))
    fsdp, ddp = (torch.load(tmp_path / f"{s}.pt", weights_only=True) for s in ("fsdp", "ddp"))
    for r in results:
        assert r["fsdp"]["tied"] and r["ddp"]["tied"]
        assert r["policy"]["tied"] and "has no submodule" not in r["policy"]["log"]
        assert "Embedding share parameters with modules outside them (tied weights)" in r["policy"]["log"]
        torch.testing.assert_close(torch.tensor(r["fsdp"]["loss"]), torch.tensor(r["ddp"]["loss"]),
                                   rtol=1e-5, atol=1e-6)
    assert results[0]["ddp"]["loss"][-1] < results[0]["ddp"]["loss"][0]
    assert fsdp.keys() == ddp.keys()
    torch.testing.assert_close(fsdp["out.weight"], fsdp["emb.weight"], rtol=0, atol=0)
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], rtol=1e-5, atol=1e-6, msg=key)


# ----------------------------------------------------------------------------- uneven evaluation data
class Stream(torch.utils.data.IterableDataset):
    """The first ``n`` validation samples, one at a time: no sampler, so each rank's stream is its own."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        from scripts.handler_case import make_data

        return zip(*make_data(self.n, seed=1))


def _uneven_evaluation(rank):
    from torch.utils.data import DataLoader

    from nn_handler import ConfigurationError

    handler = build(PER_RANK)
    errors = []
    uneven = DataLoader(Stream(3 * PER_RANK if rank == 0 else 2 * PER_RANK), batch_size=PER_RANK)
    for call in (lambda: handler.evaluate(uneven), lambda: handler.predict(uneven),
                 lambda: (handler.set_val_loader(uneven), handler.train(1, progress=False))):
        try:
            call()
            errors.append(None)
        except ConfigurationError as exc:
            errors.append(str(exc))
    even = handler.evaluate(DataLoader(Stream(2 * PER_RANK), batch_size=PER_RANK))
    return {"errors": errors, "even": even}


def test_uneven_evaluation_data_is_a_clear_error_on_every_rank():
    results = check_ranks(run_distributed(_uneven_evaluation, 2, timeout=TIMEOUT))
    for r in results:
        assert all(e is not None for e in r["errors"]), r["errors"]
        for e in r["errors"]:
            assert "evaluation data gave the ranks different numbers of batches: rank 1 ran out after 2 batches, " \
                   "rank 0 had more; under strategy='fsdp' every rank runs the sharded forward" in e
    assert results[0]["even"] == results[1]["even"] and results[0]["even"]["loss"] > 0


# ----------------------------------------------------------------------------- overwrite and damaged directories
def _overwrite(rank, root):
    import nn_handler.checkpoint as C

    root = Path(root)
    build(PER_RANK, checkpoint_dir=root / "a").train(1, progress=False)  # another run's directory
    mine = build(PER_RANK, checkpoint_dir=root / "a", overwrite=True)
    mine.train(2, progress=False)
    runs = {C.read_run_info(p)[0] for p in C.list_run_checkpoints(root / "a")}
    # A deletion that fails on rank 0 fails every rank, at once.
    build(PER_RANK, checkpoint_dir=root / "b").train(1, progress=False)
    if rank == 0:
        def refuse(path, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(path))

        C.shutil.rmtree = refuse
    try:
        build(PER_RANK, checkpoint_dir=root / "b", overwrite=True).train(1, progress=False)
        failure = None
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    return {"names": sorted(os.listdir(root / "a")), "runs": runs, "mine": mine._state.run_id, "failure": failure}


def test_overwrite_deletes_sharded_checkpoints_and_every_rank_gets_the_same_outcome(tmp_path):
    results = check_ranks(run_distributed(_overwrite, 2, args=(str(tmp_path),), timeout=TIMEOUT))
    for r in results:
        assert r["names"] == ["epoch-0001.ckpt", "epoch-0002.ckpt"] and r["runs"] == {results[0]["mine"]}
    assert results[0]["failure"].startswith("PermissionError") and "Permission denied" in results[0]["failure"]
    assert results[1]["failure"].startswith("CheckpointError: rank 0 could not delete another run's checkpoints")


def _damaged_shard(rank, root):
    from nn_handler import CheckpointError

    root = Path(root)
    build(PER_RANK, checkpoint_dir=root, keep_last=3).train(2, progress=False)
    if rank == 0:  # before the resume plan, which rank 0 makes for every rank
        (root / "epoch-0002.ckpt" / "__1_0.distcp").unlink()
        shutil.copytree(root / "epoch-0002.ckpt", root.parent / "damaged.ckpt")  # the resumed run replaces it
    resumed = build(PER_RANK, checkpoint_dir=root, keep_last=3, resume="auto")
    resumed.train(3, progress=False)
    straight = build(PER_RANK)
    straight.train(3, progress=False)
    try:
        build(PER_RANK).load_checkpoint(root.parent / "damaged.ckpt")
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"resumed": outcome(resumed), "straight": outcome(straight), "error": error}


def test_a_sharded_checkpoint_missing_a_shard_is_skipped_by_every_rank(tmp_path):
    results = check_ranks(run_distributed(_damaged_shard, 2, args=(str(tmp_path / "run"),), timeout=TIMEOUT))
    for r in results:
        assert r["error"] is not None and "damaged.ckpt is incomplete: __1_0.distcp is missing" in r["error"]
        for key in ("epoch", "train_loss", "val_loss", "train_mae", "val_mae", "lr"):  # resumed from epoch 1
            assert r["resumed"]["history"][key] == r["straight"]["history"][key], key
        torch.testing.assert_close(r["resumed"]["weights"], r["straight"]["weights"], rtol=0, atol=0)
