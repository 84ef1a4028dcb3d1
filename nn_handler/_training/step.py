"""One optimizer step, built from explicit parts: autocast, the scaled backward, unscale, clip, step.

PyTorch-Ignite's ``supervised_training_step_amp`` is the model: the step
knows the model, loss, optimizer, scaler and clipping it was built with, and
nothing of the loop around it (epochs, hooks, accumulation boundaries).

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigurationError
from . import batches as B
from .precision import Precision


class Step:
    """The forward/backward of a micro-batch and the optimizer step of an accumulation group.

    Args:
        model: The model as trained (DDP-wrapped when distributed).
        module: The model itself (its trainable parameters are clipped).
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``, or None: the output's own ``loss`` (:mod:`.batches`).
        optimizer: The optimizer.
        scaler: A ``GradScaler`` (fp16) or None.
        precision: The autocast dtype (or none).
        clip_grad_norm: Clip the gradients' total norm to this before each step, or None.
        accumulate: Micro-batches per optimizer step; the loss is divided by it.
    """

    def __init__(self, model: nn.Module, module: nn.Module, loss_fn: Callable | None, optimizer: torch.optim.Optimizer,
                 scaler: Any, precision: Precision, clip_grad_norm: float | None, accumulate: int):
        self.model, self.module, self.loss_fn, self.optimizer = model, module, loss_fn, optimizer
        self.scaler, self.precision = scaler, precision
        self.clip_grad_norm, self.accumulate = clip_grad_norm, accumulate

    def forward(self, inputs: Any, targets: Any) -> tuple[Any, torch.Tensor]:
        """``(outputs, loss)`` of a micro-batch under autocast; the loss checked to be a scalar."""
        with self.precision.autocast():
            outputs = B.call(self.model, inputs)
            loss = B.loss_of(outputs, targets, self.loss_fn)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigurationError(
                f"{'loss_fn' if self.loss_fn is not None else 'the model'} must return a scalar tensor "
                f"(mean over the batch), got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        return outputs, loss

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss`` divided by the accumulation count (scaled under fp16)."""
        scaled = loss / self.accumulate if self.accumulate > 1 else loss
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()

    def optimizer_step(self, before: Callable[[], None] | None = None) -> None:
        """Unscale, clip, ``before()`` (the gradients as the optimizer will use them), step, update the scaler, zero."""
        if self.scaler is not None and (self.clip_grad_norm is not None or before is not None):
            self.scaler.unscale_(self.optimizer)  # clip (and show the hook) the true gradients, not the scaled ones
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self._trainable(), self.clip_grad_norm)
        if before is not None:
            before()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update on inf/NaN gradients
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _trainable(self) -> list[nn.Parameter]:
        # Read at each step: a callback may freeze or unfreeze layers between steps.
        return [p for p in self.module.parameters() if p.requires_grad]
