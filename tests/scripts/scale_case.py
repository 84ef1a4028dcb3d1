"""The training case of the scaling tests, and the faults they inject into it.

Imported by the in-process tests (as ``scripts.scale_case``) and by
``scale_train.py`` next to it (as ``scale_case``), so a torchrun, srun or
in-process run trains exactly the same thing. Everything a resume must
restore is in it: dropout, shuffling, gradient accumulation, Adam, a
scheduler, a metric, a callback with state, and a last batch that is short.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

try:  # run as a script: tests/scripts is on sys.path
    from handler_case import make_data, make_model, mae, weights_hash, weights_hash_of
except ImportError:  # imported by the tests as scripts.scale_case
    from scripts.handler_case import make_data, make_model, mae, weights_hash, weights_hash_of
from nn_handler import Callback, EarlyStopping, ModelCheckpoint, NNHandler
from nn_handler.checkpoint import list_run_checkpoints, load_payload

EPOCHS = 4
HISTORY_KEYS = ("train_loss", "train_mae", "val_loss", "val_mae", "lr")


def build(checkpoint_dir=None, resume=None, callbacks=(), check_every=None, **kwargs) -> NNHandler:
    """The handler, with data: 90 samples in batches of 8, 2 micro-batches per step.

    ``kwargs`` go to ``NNHandler`` (``overwrite``, ``keep_last``).

    One process: 12 batches (6 steps) an epoch; two ranks: 6 batches (3 steps) each.
    """
    X, y = make_data(90)
    Xv, yv = make_data(21, seed=1)
    handler = NNHandler(
        make_model(dropout=0.3), torch.optim.Adam, nn.MSELoss(), optimizer_kwargs={"lr": 0.01},
        scheduler=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 1, "gamma": 0.7},
        metrics={"mae": mae}, callbacks=[EarlyStopping("val_loss", patience=10), *callbacks],
        grad_accum_steps=2, seed=7, device="cpu", checkpoint_dir=checkpoint_dir, resume=resume,
        preemption_check_every=check_every, **kwargs,
    )
    handler.set_train_loader((X, y), batch_size=8)
    handler.set_val_loader((Xv, yv), batch_size=8)
    return handler


def build_deciding(best_dir, checkpoint_dir=None, resume=None, callbacks=(), check_every=None) -> NNHandler:
    """:func:`build` with callbacks that decide from each epoch's values, on data whose first half is easy.

    Samples in order of the size of their target (no shuffle): a part of an
    epoch has a lower ``train_loss`` than the whole, so any callback that took
    a part for the whole would decide otherwise than an uninterrupted run.
    """
    X, y = make_data(90)
    order = y.abs().flatten().argsort()
    handler = build(checkpoint_dir, resume, check_every=check_every, callbacks=[
        EarlyStopping("train_loss", patience=1, min_delta=0.5),
        ModelCheckpoint(best_dir, monitor="train_loss", save_best_only=True, save_last=False), *callbacks])
    handler.set_train_loader((X[order], y[order]), batch_size=8, shuffle=False)
    return handler


def decisions(handler: NNHandler) -> dict:
    """What the deciding callbacks of :func:`build_deciding` hold, and the best checkpoint they wrote."""
    stopper, keeper = handler.callbacks[1], handler.callbacks[2]
    best = load_payload(keeper.best_path) if keeper.best_path else None
    return {"stopper": stopper.state_dict(), "keeper": {**keeper.state_dict(), "best_path": None},
            "best": best and (best["epoch"], best["global_step"], best["history"]["train_loss"],
                              weights_hash_of(best["model"]))}


def outcome(handler: NNHandler, checkpoint_dir=None) -> dict:
    """:func:`summary` and :func:`decisions` of a :func:`build_deciding` run, and its newest checkpoint's stop mark."""
    stopped = None
    if checkpoint_dir is not None:
        stopped = load_payload(list_run_checkpoints(checkpoint_dir)[-1])["stopped"]
    return {**summary(handler), **decisions(handler), "stop_training": handler.stop_training, "stopped": stopped}


def summary(handler: NNHandler) -> dict:
    """What two runs must agree on: the weights (hashed, bit for bit), the step count and the History."""
    return {"rank": handler.rank, "world_size": handler.world_size, "hash": weights_hash(handler.module),
            "epoch": handler.epoch, "global_step": handler.global_step,
            **{k: handler.history[k] for k in HISTORY_KEYS}}


class AtStep(Callback):
    """Run ``action(handler)`` on ``rank`` right after optimizer step ``step`` (counted over the whole run).

    Only at the micro-batch that completed that step: a run resumed from a
    checkpoint written at that step starts past it and does not act again.
    """

    def __init__(self, step: int, action, rank: int = 0, accum: int = 2):
        self.step, self.action, self.rank, self.accum = step, action, rank, accum

    def on_batch_end(self, handler, i, loss):
        if handler.rank == self.rank and handler.global_step == self.step and (i + 1) % self.accum == 0:
            self.action(handler)


def hard_exit_on_first_attempt(handler) -> None:
    """Die without cleanup, as a crashed or OOM-killed rank does, on torchrun's first attempt only."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os._exit(13)


def sigterm_to(pid_of):
    """An action that sends SIGTERM to ``pid_of()`` (this process, or the launcher that started it)."""
    return lambda handler: os.kill(pid_of(), signal.SIGTERM)


def raise_value_error(handler) -> None:
    raise ValueError(f"bad batch injected on rank {handler.rank} at step {handler.global_step}")
