"""train(max_steps=, max_time=) and uneven data on 2 spawned gloo ranks."""

from __future__ import annotations

import pytest

from helpers import check_ranks
from nn_handler.testing import run_distributed

TIMEOUT = 150


def _uneven_body(rank, counts):
    import torch.distributed as dist
    from torch.utils.data import DataLoader, IterableDataset

    from nn_handler import ConfigurationError
    from scripts.handler_case import make_data, make_handler

    X, y = make_data(4 * max(counts))

    class Shard(IterableDataset):
        def __iter__(self):
            n = 4 * counts[dist.get_rank()]
            return iter(zip(X[:n], y[:n]))

    handler = make_handler()
    handler.set_train_loader(DataLoader(Shard(), batch_size=4))
    try:
        handler.train(2, progress=False)
    except ConfigurationError as exc:
        return "error", str(exc), handler.global_step
    return "trained", "", handler.global_step


@pytest.mark.parametrize("counts, short, long", [([5, 3], 1, 0), ([13, 21], 0, 1)])  # 21: past two windows
def test_uneven_iterable_shards_raise_a_clear_error_on_every_rank(counts, short, long):
    results = check_ranks(run_distributed(_uneven_body, nprocs=2, args=(counts,), timeout=TIMEOUT))
    n = min(counts)
    for kind, message, steps in results:
        assert kind == "error", message
        assert steps == n  # the batches every rank had were trained
        assert f"rank {short} ran out after {n} batches, rank {long} had more" in message
        assert "in epoch 1" in message


def test_even_iterable_shards_train():
    results = check_ranks(run_distributed(_uneven_body, nprocs=2, args=([8, 8],), timeout=TIMEOUT))  # a window exactly
    assert [r[0] for r in results] == ["trained", "trained"]
    assert [r[2] for r in results] == [16, 16]


def _sized_uneven_body(rank):
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Subset

    from torch.utils.data import TensorDataset

    from nn_handler import ConfigurationError
    from scripts.handler_case import make_data, make_handler

    X, y = make_data(40)
    # A ready-made sharding NNHandler keeps (a loader over this rank's own
    # subset, sequential): rank 0 gets 5 batches, rank 1 gets 3.
    mine = Subset(TensorDataset(X, y), range(0, 20) if dist.get_rank() == 0 else range(20, 32))
    handler = make_handler()
    handler.train_loader = DataLoader(mine, batch_size=4)
    try:
        handler.train(1, progress=False)
    except ConfigurationError as exc:
        return str(exc), handler.global_step
    return "trained", handler.global_step


def test_uneven_sized_shards_raise_before_the_epoch_on_every_rank():
    for message, steps in check_ranks(run_distributed(_sized_uneven_body, nprocs=2, timeout=TIMEOUT)):
        assert steps == 0
        assert "different numbers of batches in epoch 1 (rank 0: 5, rank 1: 3)" in message


def _max_steps_body(rank, max_steps, ckpt_dir, max_time):
    import time

    from scripts.handler_case import make_data, make_handler, make_model, weights

    X, y = make_data(96)  # 2 ranks, batch 8: 6 steps an epoch
    Xv, yv = make_data(37, seed=1)
    seen = []

    from nn_handler import Callback

    class Rows(Callback):
        def on_epoch_end(self, handler, epoch, logs):
            seen.append((epoch, handler.epoch, handler.global_step))

    handler = make_handler(make_model(dropout=0.2), seed=3, callbacks=[Rows()], checkpoint_dir=ckpt_dir,
                           resume="auto" if ckpt_dir else None)
    handler.set_train_loader((X, y), batch_size=8)
    handler.set_val_loader((Xv, yv), batch_size=8)
    if max_time is not None:
        loss_fn = handler.loss_fn

        def slow_loss(out, target):  # rank 0's clock runs out first; rank 1's never would
            time.sleep(0.01)
            return loss_fn(out, target)

        handler.set_loss_fn(slow_loss)
        handler.train(max_time=max_time[rank], progress=False)
    else:
        handler.train(4, max_steps=max_steps, progress=False)
    h = handler.history
    return {"step": handler.global_step, "done": handler.epoch, "seen": seen, "weights": weights(handler.module),
            **{k: h[k] for k in ("epoch", "train_loss", "train_mae", "val_loss", "lr")}}


def test_max_steps_stops_every_rank_at_exactly_that_step():
    results = check_ranks(run_distributed(_max_steps_body, nprocs=2, args=(8, None, None), timeout=TIMEOUT))
    for r in results:
        assert r["step"] == 8 and r["done"] == 1
        assert r["seen"] == [(1, 1, 6), (2, 1, 8)]  # the partial epoch 2 reaches on_epoch_end
        assert r["epoch"] == [1, 2] and r["val_loss"][1] is not None
    assert results[0]["weights"] == results[1]["weights"]


def test_max_time_stops_every_rank_at_the_same_step():
    results = check_ranks(run_distributed(_max_steps_body, nprocs=2, args=(None, None, (0.5, 1000.0)), timeout=TIMEOUT))
    assert results[0]["step"] == results[1]["step"] > 0
    assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.slow
def test_a_run_stopped_at_max_steps_resumes_mid_epoch_and_matches_the_uninterrupted_run(tmp_path):
    straight = check_ranks(run_distributed(_max_steps_body, nprocs=2, args=(None, None, None), timeout=TIMEOUT))
    ckpt = str(tmp_path / "ckpt")
    first = check_ranks(run_distributed(_max_steps_body, nprocs=2, args=(9, ckpt, None), timeout=TIMEOUT))
    assert [r["step"] for r in first] == [9, 9]
    second = check_ranks(run_distributed(_max_steps_body, nprocs=2, args=(None, ckpt, None), timeout=TIMEOUT))
    for rank in (0, 1):
        assert second[rank]["step"] == straight[rank]["step"] == 24
        assert second[rank]["weights"] == straight[rank]["weights"]
        for key in ("epoch", "train_loss", "train_mae", "val_loss", "lr"):
            assert second[rank][key] == straight[rank][key], key
    # The resumed run saw epoch 2 end once more, now complete.
    assert second[0]["seen"] == [(2, 2, 12), (3, 3, 18), (4, 4, 24)]
