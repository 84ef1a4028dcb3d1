"""Per-step schedules, optimizer-step hooks and EMA on 2 gloo ranks, against a hand-written loop (issue 38)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import check_ranks
from nn_handler.testing import run_distributed
from scripts.handler_case import LR, MOMENTUM, make_data, make_model

TIMEOUT, N, BATCH, EPOCHS, DECAY = 150, 48, 4, 2, 0.8  # 6 micro-batches a rank an epoch


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.8 ** max(0, s - 3))


def _body(rank, directory):
    import os

    from nn_handler import Callback, ModelCheckpoint, NNHandler
    from nn_handler.callbacks import EMA

    class Steps(Callback):
        def __init__(self):
            self.lrs, self.steps = [], []

        def on_optimizer_step(self, handler, step):
            self.lrs.append(handler.optimizer.param_groups[0]["lr"])
            self.steps.append(step)

    X, y = make_data(N)
    out = {}
    for accum in (1, 2):
        log, ema = Steps(), EMA(decay=DECAY)
        handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(),
                            optimizer_kwargs={"lr": LR, "momentum": MOMENTUM}, scheduler_interval="step",
                            grad_accum_steps=accum, callbacks=[log, ema], device="cpu")
        handler.set_scheduler(warmup(handler.optimizer))
        handler.set_train_loader((X, y), batch_size=BATCH)
        handler.train(EPOCHS, progress=False)
        out[accum] = {"lrs": log.lrs, "steps": log.steps,
                      "weights": [p.detach().clone() for p in handler.module.parameters()],
                      "ema": [p.detach().clone() for p in ema.module.module.parameters()]}
    # Validation every 4 optimizer steps and the 2 best epoch files, kept by rank 0.
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": LR}, device="cpu",
                        callbacks=[ModelCheckpoint(directory, save_top_k=2, save_last=False)])
    handler.set_train_loader((X, y), batch_size=BATCH)
    handler.set_val_loader(make_data(10, seed=1), batch_size=BATCH)
    handler.train(4, validate_every_n_steps=4, progress=False)
    out["history"] = handler.history.state_dict()
    handler.close()
    out["files"] = sorted(os.listdir(directory))
    return out


def _reference(accum):
    """Each rank's gradients accumulated over its micro-batches, then averaged over the 2 ranks, as DDP does."""
    X, y = make_data(N)
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    sched, mse, lrs, ema = warmup(opt), nn.MSELoss(), [], None
    samplers = [DistributedSampler(TensorDataset(X, y), num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1)]
    for epoch in range(EPOCHS):
        for s in samplers:
            s.set_epoch(epoch)
        shards = [list(DataLoader(TensorDataset(X, y), batch_size=BATCH, sampler=s)) for s in samplers]
        groups = [range(i, min(i + accum, len(shards[0]))) for i in range(0, len(shards[0]), accum)]
        for group in groups:
            grads = []
            for shard in shards:
                for i in group:
                    (mse(model(shard[i][0]), shard[i][1]) / accum).backward()
                grads.append([p.grad / 2 for p in params])  # DDP divides by the world size, then sums
                opt.zero_grad()
            for p, g0, g1 in zip(params, *grads):
                p.grad = g0 + g1
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
            weights = [p.detach().clone() for p in params]
            ema = weights if ema is None else [e + (1 - DECAY) * (w - e) for e, w in zip(ema, weights)]
            sched.step()
    return lrs, params, ema


def test_two_ranks_per_step_schedule_and_ema_match_a_hand_written_loop(tmp_path):
    results = check_ranks(run_distributed(_body, nprocs=2, args=(str(tmp_path),), timeout=TIMEOUT))
    for accum in (1, 2):
        lrs, weights, ema = _reference(accum)
        r0, r1 = results[0][accum], results[1][accum]
        assert r0["steps"] == r1["steps"] == list(range(1, len(lrs) + 1))  # the global optimizer step, per step
        assert r0["lrs"] == r1["lrs"] == pytest.approx(lrs, abs=1e-12)
        for mine, ref in ((r0["weights"], weights), (r0["ema"], ema)):
            assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(mine, ref)), accum
        assert all(torch.equal(a, b) for a, b in zip(r0["ema"], r1["ema"]))  # the same average on every rank
    # validate_every_n_steps and save_top_k, from the same run: the same History on both ranks.
    history = results[0]["history"]
    assert history == results[1]["history"]
    assert history["step"] == [4, 6, 8, 12, 16, 18, 20, 24]  # 6 steps an epoch; 12 and 24 end their epochs
    epoch_rows = [(v, e) for e, s, v in zip(history["epoch"], history["step"], history["val_loss"]) if s % 6 == 0]
    kept = sorted(f"epoch-{e:04d}.ckpt" for _, e in sorted(epoch_rows)[:2])
    assert results[0]["files"] == kept
