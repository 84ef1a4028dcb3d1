"""A training step that returns several values, and the runs the logger tests compare (tests/unit/test_logger*.py,
test_trackers.py)."""

from __future__ import annotations

import torch
from torch import nn

from nn_handler import NNHandler
from scripts.handler_case import make_data, make_model

EVERY = 3  # log every 3rd step; 96 samples in batches of 8, 2 micro-batches a step: 6 steps an epoch


class TwoLosses:
    """A step that returns the loss and two more values, and records them per micro-batch (on the host)."""

    def __init__(self):
        self.seen: list[dict[str, float]] = []

    def __call__(self, ctx, batch):
        x, y = batch
        out = ctx.model(x)
        loss = nn.functional.mse_loss(out, y)
        ctx.backward(loss)
        ctx.step()
        d, g = loss.detach() * 2, (out - y).abs().mean().detach()
        self.seen.append({"train_loss": loss.item(), "train_d": d.item(), "train_g": g.item()})
        return {"loss": loss, "d": d, "g": g}

    def step_means(self, every):
        """``{step: {name: mean over the step's micro-batches}}`` of every ``every``-th step."""
        pairs = [self.seen[i:i + 2] for i in range(0, len(self.seen), 2)]
        return {s: {k: (a[k] + b[k]) / 2 for k in a} for s, (a, b) in enumerate(pairs, start=1) if s % every == 0}


def train_two_losses(callbacks, step, epochs=2, **kwargs):
    X, y = make_data(96)
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, device="cpu",
                        grad_accum_steps=2, training_step=step, callbacks=callbacks, **kwargs)
    handler.set_train_loader((X, y), batch_size=8)
    handler.train(epochs, progress=False)
    return handler
