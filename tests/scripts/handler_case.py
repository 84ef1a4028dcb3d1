"""One small regression problem, NNHandler on it, and the same training as a plain hand-written loop.

Imported by the handler tests (as ``scripts.handler_case``) and by the
torchrun scripts next to it (as ``handler_case``). The reference loop sees
what the DDP ranks see: for ``world_size`` ranks it walks the
DistributedSampler shards of every rank side by side and averages their
losses, which is what DDP's gradient all-reduce computes.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

IN, HIDDEN = 6, 16
LR, MOMENTUM = 0.05, 0.9


def make_data(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, 1, generator=g)
    return X, X @ w + 0.1 * torch.randn(n, 1, generator=g)


def make_model(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(IN, HIDDEN), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(HIDDEN, 1))
    return nn.Sequential(*layers)


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs().mean()


def make_handler(model=None, *, grad_accum_steps=1, seed=None, **kwargs):
    from nn_handler import NNHandler

    model = model if model is not None else make_model()
    kwargs.setdefault("metrics", {"mae": mae})
    kwargs.setdefault("scheduler", torch.optim.lr_scheduler.StepLR)
    kwargs.setdefault("scheduler_kwargs", {"step_size": 2, "gamma": 0.5})
    return NNHandler(model, torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": LR, "momentum": MOMENTUM},
                     grad_accum_steps=grad_accum_steps, seed=seed, device="cpu", **kwargs)


def weights(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()]).tolist()


def weights_hash(model: nn.Module) -> str:
    return weights_hash_of(model.state_dict())


def weights_hash_of(state_dict: dict) -> str:
    h = hashlib.sha256()
    for key, tensor in state_dict.items():
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def reference_train(X, y, Xv, yv, *, epochs: int, batch_size: int, world_size: int = 1, grad_accum: int = 1,
                    seed: int = 0) -> tuple[nn.Module, dict[str, list[float]]]:
    """The hand-written loop: SGD with momentum, StepLR(2, 0.5), MSE, per-sample-weighted epoch means."""
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    mse = nn.MSELoss()
    data = TensorDataset(X, y)
    if world_size == 1:
        loaders = [DataLoader(data, batch_size=batch_size, shuffle=True)]
    else:
        samplers = [DistributedSampler(data, num_replicas=world_size, rank=r, shuffle=True, seed=seed)
                    for r in range(world_size)]
        loaders = [DataLoader(data, batch_size=batch_size, sampler=s) for s in samplers]
    history: dict[str, list[float]] = {"train_loss": [], "train_mae": [], "val_loss": [], "val_mae": []}
    for epoch in range(epochs):
        if world_size > 1:
            for s in samplers:
                s.set_epoch(epoch)
        model.train()
        loss_sum = mae_sum = count = 0.0
        batches = list(zip(*loaders))
        for i, per_rank in enumerate(batches):
            losses = []
            for xb, yb in per_rank:
                out = model(xb)
                loss = mse(out, yb)
                losses.append(loss)
                loss_sum += loss.item() * len(xb)
                mae_sum += mae(out.detach(), yb).item() * len(xb)
                count += len(xb)
            (sum(losses) / world_size / grad_accum).backward()
            if (i + 1) % grad_accum == 0 or i + 1 == len(batches):
                opt.step()
                opt.zero_grad()
        history["train_loss"].append(loss_sum / count)
        history["train_mae"].append(mae_sum / count)
        model.eval()
        loss_sum = mae_sum = count = 0.0
        with torch.no_grad():
            # Iterated like any hand-written validation loop (each DataLoader
            # iterator draws a seed from the global generator).
            for xb, yb in DataLoader(TensorDataset(Xv, yv), batch_size=batch_size):
                out = model(xb)
                loss_sum += mse(out, yb).item() * len(xb)
                mae_sum += mae(out, yb).item() * len(xb)
                count += len(xb)
        history["val_loss"].append(loss_sum / count)
        history["val_mae"].append(mae_sum / count)
        sched.step()
    return model, history


def resume_case(phase: str, ckpt: str, epochs: int = 4, split: int = 2) -> dict:
    """Dropout, Adam, StepLR, shuffling and validation: everything a resume must restore.

    ``straight`` trains ``epochs`` epochs; ``first`` trains ``split`` and saves
    ``ckpt``; ``second`` loads ``ckpt`` and trains up to ``epochs``. Call it in
    fresh processes: ``first`` then ``second`` must end where ``straight`` does.
    """
    from nn_handler import EarlyStopping, NNHandler

    X, y = make_data(90)  # 90: with 2 ranks and batch 8 the last batch is short
    Xv, yv = make_data(21, seed=1)
    stopper = EarlyStopping("val_loss", patience=10)
    handler = NNHandler(make_model(dropout=0.3), torch.optim.Adam, nn.MSELoss(), optimizer_kwargs={"lr": 0.01},
                        scheduler=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 1, "gamma": 0.7},
                        metrics={"mae": mae}, callbacks=[stopper], grad_accum_steps=2, seed=7, device="cpu")
    handler.set_train_loader((X, y), batch_size=8)
    handler.set_val_loader((Xv, yv), batch_size=8)
    # Draw from every generator once more, as user code between runs would.
    torch.rand(3), __import__("random").random()
    if phase == "second":
        handler.load_checkpoint(ckpt)
    handler.train(split if phase == "first" else epochs, progress=False)
    if phase == "first":
        handler.save_checkpoint(ckpt)
    return {"rank": handler.rank, "hash": weights_hash(handler.module), "epoch": handler.epoch,
            "global_step": handler.global_step, "train_loss": handler.history["train_loss"],
            "val_loss": handler.history["val_loss"], "lr": handler.history["lr"], "wait": stopper.wait,
            "best": stopper.best}
