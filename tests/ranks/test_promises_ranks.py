"""On 2 gloo ranks, in one launch: the History counts no DistributedSampler padding, a resumed run's History and
what it says, steps_per_epoch, predict() of padded batches and tuples, per-sample lists cut in evaluation.

Each against one process or a hand-written DDP loop: 13 samples on 2 ranks give rank 1 one padding sample.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from helpers import check_ranks
from nn_handler.testing import run_distributed
from scripts.handler_case import LR, mae, make_data, make_model
from scripts.promises_case import LENGTHS, Named, Tagger, named_samples, pad_each_batch, token_samples

TIMEOUT, N, BATCH, EPOCHS = 150, 13, 4, 2


def _named_handler(lr, **kwargs):
    from nn_handler import NNHandler

    handler = NNHandler(Named(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": lr}, metrics={"mae": mae},
                        device="cpu", **kwargs)
    handler.set_train_loader(named_samples(N), batch_size=BATCH)  # shuffled: seed 0
    handler.set_val_loader(named_samples(N, seed=1), batch_size=BATCH)
    return handler


def _scheduled_handler(**kwargs):
    from nn_handler import NNHandler

    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": LR}, seed=0,
                        grad_accum_steps=2, scheduler_interval="step", device="cpu", **kwargs)
    handler.set_train_loader(make_data(N), batch_size=1)  # 7 batches a rank: 4 optimizer steps an epoch
    handler.set_scheduler(torch.optim.lr_scheduler.LambdaLR(handler.optimizer, lambda s: 0.9 ** s))
    return handler


def _body(rank, root):
    import contextlib
    import io

    out = {}
    # The History's sums: padding trained on (the weights of a DDP loop), weighed 0 (every sample once).
    for lr in (0.0, LR):
        handler = _named_handler(lr)
        handler.train(EPOCHS, progress=False)
        out[lr] = {"history": {k: handler.history[k] for k in ("train_loss", "train_mae", "val_loss", "val_mae")},
                   "weights": [p.detach().clone() for p in handler.module.parameters()],
                   "eval": handler.evaluate(named_samples(N, seed=1))}
    # A per-step schedule stopped at max_steps 2 steps into epoch 2, resumed by a new handler.
    straight = _scheduled_handler()
    steps_per_epoch = straight.steps_per_epoch
    straight.train(3, progress=False)
    _scheduled_handler(checkpoint_dir=f"{root}/ckpt", resume="auto").train(3, max_steps=6, progress=False)
    resumed, said = _scheduled_handler(checkpoint_dir=f"{root}/ckpt", resume="auto"), io.StringIO()
    with contextlib.redirect_stderr(said):
        resumed.train(3, progress=False)
    out["schedule"] = {"steps_per_epoch": steps_per_epoch, "global_step": straight.global_step,
                       "straight": straight.history.state_dict(), "resumed": resumed.history.state_dict(),
                       "said": said.getvalue()}
    # predict() of batches a collate pads each to its longest, a tuple output, gathered from both ranks.
    tagger = _named_handler(0.0)
    tagger.set_model(Tagger())
    out["predict"] = tagger.predict(DataLoader(token_samples(), batch_size=3, collate_fn=pad_each_batch))
    return out


def _reference(lr):
    """A hand-written DDP loop: each rank's loss over its whole batch (padding included) for the gradients,
    averaged over the ranks; the History's sums over the real samples only."""
    data = named_samples(N)
    X, y = torch.stack([s["x"] for s in data]), torch.stack([s["labels"] for s in data])
    model = Named().net
    opt, mse = torch.optim.SGD(model.parameters(), lr=lr), nn.MSELoss()
    samplers = [DistributedSampler(range(N), num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1)]
    history = {"train_loss": [], "train_mae": []}
    for epoch in range(EPOCHS):
        shards = []
        for s in samplers:
            s.set_epoch(epoch)
            shards.append(list(s))
        real = [len(range(r, N, 2)) for r in (0, 1)]  # rank 1's last sample is the padding
        loss_sum = mae_sum = 0.0
        for start in range(0, len(shards[0]), BATCH):
            grads = []
            for r, shard in enumerate(shards):
                rows = shard[start:start + BATCH]
                out = model(X[rows])
                mse(out, y[rows]).backward()
                grads.append([p.grad / 2 for p in model.parameters()])
                opt.zero_grad()
                keep = max(0, min(len(rows), real[r] - start))
                loss_sum += mse(out[:keep], y[rows][:keep]).item() * keep
                mae_sum += mae(out[:keep], y[rows][:keep]).item() * keep
            for p, g0, g1 in zip(model.parameters(), *grads):
                p.grad = g0 + g1
            opt.step()
            opt.zero_grad()
        history["train_loss"].append(loss_sum / N)
        history["train_mae"].append(mae_sum / N)
    return history, list(model.parameters())


def test_two_ranks_keep_the_training_promises_of_one_process(tmp_path):
    results = check_ranks(run_distributed(_body, nprocs=2, args=(str(tmp_path),), timeout=TIMEOUT))
    tol = {"rel": 1e-6}
    # lr=0: the weights never move, so the History is the same as one process's, padding or not.
    one = _named_handler(0.0)
    one.train(EPOCHS, progress=False)
    for r in results:
        for key, values in r[0.0]["history"].items():
            assert values == pytest.approx(one.history[key], **tol), key
        assert r[0.0]["eval"] == pytest.approx(one.evaluate(named_samples(N, seed=1)), **tol)
    # lr>0: the weights of a DDP loop that trains on the padding, the History of its real samples.
    history, weights = _reference(LR)
    for r in results:
        for key in ("train_loss", "train_mae"):
            assert r[LR]["history"][key] == pytest.approx(history[key], **tol), key
        assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(r[LR]["weights"], weights))
    # The resumed run's History (its lr the epoch's first step's) is the straight run's; rank 0 says so.
    for r in results:
        s = r["schedule"]
        assert s["steps_per_epoch"] == 4 and s["global_step"] == 3 * 4
        assert s["resumed"]["lr"] == s["straight"]["lr"] == [LR, LR * 0.9 ** 4, LR * 0.9 ** 8]
        assert s["resumed"]["train_loss"] == pytest.approx(s["straight"]["train_loss"], rel=1e-6)
    assert "nn_handler: resuming from" in results[0]["schedule"]["said"]
    assert "epoch-0002-batch-000004.ckpt" in results[0]["schedule"]["said"]
    assert "epoch 2 continues after 4 batches, at global step 6" in results[0]["schedule"]["said"]
    assert results[1]["schedule"]["said"] == ""
    # predict(): every sample once, in order, padded to the longest of both ranks with -100.
    tagger = Tagger()
    with torch.no_grad():
        pad_score = float(tagger(torch.zeros(1, 1, dtype=torch.long))[0])  # what the collate's token 0 scores
    for r in results:
        scores, (hidden, first), loss = r["predict"]
        assert scores.shape == (7, 7) and hidden.shape == (7, 7, 2) and first.shape == (7, 1, 2) and loss is None
        for i, n in enumerate(LENGTHS):
            with torch.no_grad():
                alone = tagger(token_samples()[i]["input_ids"][None])
            assert torch.equal(scores[i, :n], alone[0][0]) and torch.equal(first[i], alone[1][1][0])
            assert all(v in (-100.0, pad_score) for v in scores[i, n:].tolist())
        assert torch.equal(scores, results[0]["predict"][0])
