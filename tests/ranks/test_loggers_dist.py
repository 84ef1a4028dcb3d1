"""TensorBoardLogger on 2 spawned gloo ranks: one writer (rank 0), its scalars equal the reduced History."""

from __future__ import annotations

import pytest

from nn_handler.testing import run_distributed

pytest.importorskip("tensorboard")

TIMEOUT = 150


def _train_body(rank, log_dir):
    from torch.utils.data import TensorDataset

    from nn_handler.callbacks import Callback
    from nn_handler.loggers import TensorBoardLogger
    from scripts.handler_case import make_data, make_handler, make_model

    class BatchLosses(Callback):
        def __init__(self):
            self.seen = []

        def on_batch_end(self, handler, step, loss):
            self.seen.append((handler.global_step, loss.item()))

    losses = BatchLosses()
    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    handler = make_handler(make_model(), callbacks=[TensorBoardLogger(log_dir, log_every_n_steps=2), losses])
    handler.set_train_loader(TensorDataset(X, y), batch_size=8)  # 6 steps an epoch on each of 2 ranks
    handler.set_val_loader(TensorDataset(Xv, yv), batch_size=8)
    history = handler.train(3, max_steps=15, progress=False)  # the third epoch stops part-way
    return {"history": history.state_dict(), "losses": losses.seen, "epoch": handler.epoch}


def test_two_ranks_write_one_event_file_whose_scalars_equal_the_history(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_distributed(_train_body, nprocs=2, args=(str(tmp_path / "tb"),), timeout=TIMEOUT)
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            pytest.fail(f"rank {rank} raised {r!r}\n{getattr(r, 'remote_traceback', '')}")
    assert results[0]["history"] == results[1]["history"]
    files = list((tmp_path / "tb").iterdir())
    assert len(files) == 1, files  # rank 1 wrote nothing

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    history, part = results[0]["history"], results[0]["epoch"]
    assert part == 2 and history["epoch"] == [1, 2, 3]
    for key, column in history.items():
        assert scalars[f"epoch/{key}"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in zip([6, 12], column[:2])]
        assert scalars[f"part_epoch/{key}"] == [(15, pytest.approx(column[2], rel=1e-6))]
    # The step curve is rank 0's own loss (no collective per step), every 2nd step.
    assert scalars["step/train_loss"] == [(s, pytest.approx(v, rel=1e-6))
                                          for s, v in results[0]["losses"] if s % 2 == 0]
    assert scalars["step/train_loss"] != [(s, pytest.approx(v, rel=1e-6))
                                          for s, v in results[1]["losses"] if s % 2 == 0]
