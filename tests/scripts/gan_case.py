"""A small GAN (two models, two optimizers) in NNHandler with its own step, and the same training hand-written.

Imported by the step tests (as ``scripts.gan_case``). The hand-written loop
is PyTorch's DCGAN recipe with one GradScaler for both optimizers, updated
after every optimizer step (``scaler.step(opt); scaler.update()``, as Lightning,
Fabric and Accelerate do). It sees what ``world_size`` DDP ranks see together: unshuffled
shards of ``batch_size`` per rank make, step by step, the global batch of
``batch_size * world_size`` consecutive samples, and DDP's gradient average
over equal shards is the gradient of the global batch's mean loss.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

NOISE, DATA, HIDDEN = 4, 3, 16
LR_G, LR_D = 0.05, 0.1


def make_models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    G = nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DATA))
    D = nn.Sequential(nn.Linear(DATA, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    return G, D


def make_data(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real samples, noise)``: the noise is data too, so every run (and rank split) draws the same."""
    g = torch.Generator().manual_seed(seed)
    real = torch.randn(n, DATA, generator=g) * 0.5 + torch.tensor([1.0, -1.0, 0.5])
    return real, torch.randn(n, NOISE, generator=g)


def make_optimizers(G: nn.Module, D: nn.Module) -> dict[str, torch.optim.Optimizer]:
    return {"G": torch.optim.Adam(G.parameters(), lr=LR_G, betas=(0.5, 0.999)),
            "D": torch.optim.SGD(D.parameters(), lr=LR_D, momentum=0.9)}


_bce = nn.BCEWithLogitsLoss()


def gan_step(ctx, batch):
    """The issue's GAN step, as a user writes it."""
    real, z = batch
    G, D = ctx.models["G"], ctx.models["D"]
    ones = torch.ones(real.size(0), 1, device=real.device)
    with ctx.autocast():
        fake = G(z)
        loss_d = _bce(D(real), ones) + _bce(D(fake.detach()), torch.zeros_like(ones))
    ctx.backward(loss_d)
    ctx.step("D")
    with ctx.autocast():
        loss_g = _bce(D(fake), ones)
    ctx.backward(loss_g)
    ctx.step("G")
    return {"loss": loss_d + loss_g, "d": loss_d, "g": loss_g}


def gan_validation(ctx, batch):
    real, z = batch
    ones = torch.ones(real.size(0), 1, device=real.device)
    with ctx.autocast():
        fake = ctx.models["G"](z)
        loss_d = _bce(ctx.models["D"](real), ones) + _bce(ctx.models["D"](fake), torch.zeros_like(ones))
    return {"loss": loss_d, "d_real": torch.sigmoid(ctx.models["D"](real)).mean()}


def make_handler(amp=False, batch_size: int = 8, n: int = 64, step=gan_step, **kwargs):
    from nn_handler import NNHandler

    G, D = make_models()
    handler = NNHandler({"G": G, "D": D}, make_optimizers(G, D), training_step=step, amp=amp, device="cpu",
                        **kwargs)
    handler.set_train_loader(make_data(n), batch_size=batch_size, shuffle=False)
    return handler


def reference(amp=False, epochs: int = 2, batch_size: int = 8, n: int = 64, world_size: int = 1, accum: int = 1):
    """The hand-written loop: ``(G, D, History-like {"train_loss", "train_d", "train_g"} per epoch)``.

    With ``accum`` > 1, as a hand-written loop accumulates: every gradient zeroed at a group's start, each loss
    divided by ``accum``, each optimizer stepped after its loss's backward on the group's last micro-batch.
    """
    G, D = make_models()
    opts = make_optimizers(G, D)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    scaler = torch.amp.GradScaler("cpu") if amp == "fp16" else None
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
    real_all, z_all = make_data(n)
    step = batch_size * world_size

    def backward_and_step(loss, name, last):
        loss = loss / accum if accum > 1 else loss
        (scaler.scale(loss) if scaler else loss).backward()
        if last:
            if scaler:
                scaler.step(opts[name])
                scaler.update()
            else:
                opts[name].step()
            opts[name].zero_grad(set_to_none=True)

    history = {"train_loss": [], "train_d": [], "train_g": []}
    for _ in range(epochs):
        sums, count = torch.zeros(3, dtype=torch.float64), 0
        for i, start in enumerate(range(0, n, step)):
            real, z = real_all[start:start + step], z_all[start:start + step]
            if i % accum == 0:
                opts["D"].zero_grad(set_to_none=True)
                opts["G"].zero_grad(set_to_none=True)
            last = (i + 1) % accum == 0 or start + step >= n
            ones = torch.ones(real.size(0), 1)
            with autocast():
                fake = G(z)
                loss_d = _bce(D(real), ones) + _bce(D(fake.detach()), torch.zeros_like(ones))
            backward_and_step(loss_d, "D", last)
            with autocast():
                loss_g = _bce(D(fake), ones)
            backward_and_step(loss_g, "G", last)
            values = torch.stack([loss_d + loss_g, loss_d, loss_g]).detach().to(torch.float64)
            sums += values * real.size(0)
            count += real.size(0)
        for key, value in zip(history, (sums / count).tolist()):
            history[key].append(value)
    return G, D, history


def flat(*modules: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for m in modules for t in m.state_dict().values()])
