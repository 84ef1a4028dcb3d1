"""The built-in step functions, and what the loop does with a step function at each micro-batch.

A step is ``fn(ctx, batch)`` with a :class:`~.context.StepContext`. The
built-in :class:`TrainingStep` is one such function, built from explicit
parts as PyTorch-Ignite's ``supervised_training_step_amp`` is (the loss
function and the metrics): it splits the batch, calls the model under
autocast, takes the loss, ``ctx.backward(loss)``, ``ctx.step()``. A user's
``training_step`` takes its place. :class:`ValidationStep` is the built-in
validation, under ``torch.no_grad()``.

:class:`MicroBatches` is the loop's side of a step function: per micro-batch
it zeroes the gradients at the start of an accumulation group, pauses the
models' gradient synchronisation off the group's end, calls the step, checks
what it returned, and at the group's end updates the fp16 scaler once and
counts the training step.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..errors import ConfigurationError
from . import batches as B
from . import metrics as M
from .config import TrainingConfig
from .context import StepContext
from .parts import Parts
from .precision import Precision
from .schedule import OptimizerSteps
from .sharding import can_pause_sync, gradient_sync_paused

StepFn = Callable[[StepContext, Any], Any]


class TrainingStep:
    """The built-in training step: ``loss_fn(model(inputs), targets)`` (or the model's own loss), backward, step.

    Returns the loss, or with ``metrics`` a mapping of the loss and each
    metric of the outputs (History ``train_<name>``).
    """

    def __init__(self, loss_fn: Callable | None, metrics: Mapping[str, Callable]):
        self.loss_fn, self.metrics = loss_fn, dict(metrics)

    def __call__(self, ctx: StepContext, batch: Any) -> Any:
        inputs, targets = B.split(batch)
        B.check_targets(inputs, targets, self.loss_fn, "training")
        with ctx.autocast():
            outputs = B.call(ctx.model, inputs)
            loss = B.loss_of(outputs, targets, self.loss_fn)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigurationError(
                f"{'loss_fn' if self.loss_fn is not None else 'the model'} must return a scalar tensor "
                f"(mean over the batch), got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        ctx.backward(loss)
        ctx.step()
        if ctx._real_rows is not None:  # DistributedSampler padding: trained on, as DDP must; not in the History
            ctx._counted_loss, outputs, targets = M.real_part(outputs, targets, loss.detach(), ctx._real_rows,
                                                              B.size_of(inputs, targets), self.loss_fn)
        if not self.metrics:
            return loss
        with torch.no_grad():
            out = B.outputs_of(outputs)
            return {"loss": loss, **{name: fn(out, targets) for name, fn in self.metrics.items()}}


class ValidationStep:
    """The built-in validation step: the loss (``loss_fn``, or the model's own) and each metric of the outputs."""

    def __init__(self, loss_fn: Callable | None, metrics: Mapping[str, Callable], precision: Precision):
        self.loss_fn, self.metrics, self.precision = loss_fn, dict(metrics), precision

    def __call__(self, ctx: StepContext, batch: Any) -> Any:
        inputs, targets = B.split(batch)
        B.check_targets(inputs, targets, self.loss_fn, "validation")
        with ctx.autocast():
            outputs = self.precision.convert_output(B.call(ctx.model, inputs))
            loss = B.loss_of(outputs, targets, self.loss_fn)
            if not self.metrics:
                return loss
            return {"loss": loss, **{name: fn(outputs, targets) for name, fn in self.metrics.items()}}


class StepValues:
    """Reads what a step returned: the loss and the other values, under the keys the first call returned.

    Args:
        what: ``"training_step"`` or ``"validation_step"`` (named in errors).
        names: The value keys when known beforehand (the built-in steps' metrics); else learned from the first call.

    Example:
        >>> import torch
        >>> values = StepValues("training_step")
        >>> values.read({"loss": torch.tensor(1.0), "acc": 0.5}), values.names
        ((tensor(1.), [0.5]), ['acc'])
        >>> values.read(torch.ones(3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: training_step must return the loss (a scalar tensor) ... shape (3,)
    """

    def __init__(self, what: str, names: list[str] | None = None):
        self.what, self.names = what, names

    def read(self, result: Any) -> tuple[torch.Tensor, list]:
        """``(detached loss, [value per name])`` of a step's return."""
        if isinstance(result, torch.Tensor) and result.dim() == 0:
            if self.names:
                self._changed([])
            self.names = []
            return result.detach(), []
        if not isinstance(result, Mapping) or "loss" not in result:
            self._refuse(result)
        loss = result["loss"]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            self._refuse(loss, "'loss' of ")
        names = [k for k in result if k != "loss"]
        if self.names is None:
            bad = [k for k in names if not isinstance(k, str)]
            if bad:
                raise ConfigurationError(f"{self.what} returned keys that are not strings ({bad!r}); "
                                         f"History columns need names")
            self.names = names
        elif names != self.names and set(names) != set(self.names):
            self._changed(names)
        return loss.detach(), [self._scalar(name, result[name]) for name in self.names]

    def _changed(self, names: list) -> None:
        raise ConfigurationError(f"{self.what} returned {['loss', *self.names]} first and {['loss', *names]} now: "
                                 f"return the same keys at every batch")

    def _scalar(self, name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigurationError(f"{self.what}'s {name!r} must be a scalar (a 0-dim tensor or a number), "
                                         f"got a tensor of shape {tuple(value.shape)}")
            return value.detach()
        if not isinstance(value, (bool, str)):
            try:
                return float(value)  # a Python or NumPy number
            except (TypeError, ValueError):
                pass
        raise ConfigurationError(f"{self.what}'s {name!r} must be a scalar (a 0-dim tensor or a number), "
                                 f"got a {type(value).__name__}")

    def _refuse(self, value: Any, where: str = "") -> None:
        if isinstance(value, torch.Tensor):
            got = f"a tensor of shape {tuple(value.shape)}"
        elif isinstance(value, Mapping):
            got = f"a mapping without 'loss' (keys: {', '.join(map(str, value))})"
        else:
            got = "None (does the step end with `return loss`?)" if value is None else f"a {type(value).__name__}"
        raise ConfigurationError(f"{self.what} must return the loss (a scalar tensor) or a mapping with a 'loss' "
                                 f"key ({{'loss': loss, 'd': loss_d, ...}}), got {where}{got}")


class MicroBatches:
    """Calls a training step function once per micro-batch, and keeps the accumulation groups around it.

    Args:
        fn: The step function.
        ctx: The context it gets (its epoch set by the loop).
        values: Reads what ``fn`` returns.
        state: The run's state (``global_step``).
    """

    def __init__(self, fn: StepFn, ctx: StepContext, values: StepValues, state: Any):
        self.fn, self.ctx, self.values, self.state = fn, ctx, values, state
        # Built once per epoch: a group's zeroing asks each optimizer's
        # parameters whether they hold a gradient (cheaper than zero_grad).
        self._params = {name: [p for g in opt.param_groups for p in g["params"]]
                        for name, opt in ctx.optimizers.items()}
        self._pausable = [m for m in ctx.models.values() if can_pause_sync(m)]
        self._starts_group = True
        self.returned: Any = None  # what fn returned for the last micro-batch (on_batch_end's outputs)

    @classmethod
    def for_training(cls, parts: Parts, config: TrainingConfig, state: Any, hooks: OptimizerSteps, epoch: int,
                     check_each_step: bool) -> "MicroBatches":
        """The training step of ``parts`` (the built-in one unless the handler was given one) for an epoch."""
        ctx = StepContext(parts.models, parts.optimizers, parts.precision, parts.device, scaler=parts.scaler,
                          accumulate=config.grad_accum_steps, clip_grad_norm=config.clip_grad_norm, hooks=hooks,
                          check_each_step=check_each_step)
        ctx.epoch = epoch
        if config.training_step is not None:
            return cls(config.training_step, ctx, StepValues("training_step"), state)
        return cls(TrainingStep(parts.loss_fn, config.metrics), ctx, StepValues("the step", list(config.metrics)),
                   state)

    def run(self, batch: Any, index: int, ends_group: bool, pause_sync: bool,
            real_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list]:
        """The step on micro-batch ``batch`` (number ``index`` of the epoch): ``(loss, counted loss, values)``,
        detached: the loss trained on, and the one the History counts.

        ``ends_group``: the optimizers step now. ``pause_sync``: off the
        group's end, the models keep their gradients on this rank.
        ``real_rows``: the batch's real samples when the rest is ``DistributedSampler`` padding (the built-in
        step then counts the loss over those rows; a user's step's loss is its own, over the whole batch).
        """
        ctx = self.ctx
        ctx._real_rows, ctx._counted_loss = real_rows, None
        if self._starts_group:
            self._zero_grads()
            self._starts_group = False
        ctx._batch_index, ctx.is_last_micro_batch, ctx.global_step = index, ends_group, self.state.global_step
        ctx._asked.clear()
        ctx._retained = False
        if pause_sync and not ends_group and self._pausable:
            with contextlib.ExitStack() as paused:
                for model in self._pausable:
                    paused.enter_context(gradient_sync_paused(model))
                result = self.fn(ctx, batch)
        else:
            result = self.fn(ctx, batch)
        if ends_group:
            self.end_group()
        self.returned = result
        loss, values = self.values.read(result)
        return loss, loss if ctx._counted_loss is None else ctx._counted_loss, values

    def end_group(self, step_asked: bool = False) -> int:
        """Close the accumulation group: its optimizer steps (``step_asked``: those the last micro-batch asked
        for, when an unsized loader ended inside the group), one fp16 scaler update, the training step counted."""
        ctx = self.ctx
        if step_asked:
            ctx.global_step = self.state.global_step
            for name in dict.fromkeys(ctx._asked):
                ctx._take_step(name, ctx.optimizers[name])
        if ctx._scaler_stepped:
            ctx._scaler.update()  # once per training step, after every optimizer that stepped
            ctx._scaler_stepped.clear()
        self.state.global_step = ctx.global_step + 1
        self._starts_group = True
        return self.state.global_step

    def _zero_grads(self) -> None:
        for name, params in self._params.items():
            for p in params:  # a plain loop: no generator per step
                if p.grad is not None:
                    self.ctx.optimizers[name].zero_grad(set_to_none=True)
                    break



def trained_models(parts: Parts) -> list[nn.Module]:
    """The models an optimizer trains (set to train mode each epoch); a frozen one, a teacher, keeps its mode."""
    optimized = {id(p) for optimizer in parts.optimizers.values() for g in optimizer.param_groups for p in g["params"]}
    return [model for model in parts.models.values() if any(id(p) in optimized for p in model.parameters())]
