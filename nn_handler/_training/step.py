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
what it returned, and at the group's end counts the training step. While the
step function runs, an optimizer stepped by hand is refused
(:meth:`MicroBatches.refusing_steps_by_hand`); a group in which no optimizer
stepped, or one that asked an optimizer to step on an earlier micro-batch but
not on the last, is said once (a warning naming the optimizer).

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
from collections.abc import Mapping  # not typing's: isinstance with it runs through Python at every step
from typing import Any, Callable, Iterator

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
_GRAD = operator.attrgetter("grad")
_NONE = itertools.repeat(None)
log = logging.getLogger(__name__)


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
    """Reads what a step returned: the loss, and the other values by key (a key may come with some batches only).

    Args:
        what: ``"training_step"`` or ``"validation_step"`` (named in errors).
        names: The value keys when known beforehand (the built-in steps' metrics, the same on every rank).

    Attributes:
        names: Every key returned so far besides ``"loss"``, in the order first seen (None before the first call).
        fixed: The keys were known beforehand.

    Example:
        >>> import torch
        >>> values = StepValues("training_step")
        >>> values.read({"loss": torch.tensor(1.0), "d": 0.5}), values.names
        ((tensor(1.), {'d': 0.5}), ['d'])
        >>> values.read({"loss": torch.tensor(2.0), "g": 1.0})[1], values.names   # a generator step's loss
        ({'g': 1.0}, ['d', 'g'])
        >>> values.read(torch.ones(3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: training_step must return the loss (a scalar tensor) ... shape (3,)
    """

    def __init__(self, what: str, names: list[str] | None = None):
        self.what, self.names, self.fixed = what, names, names is not None
        self._known = set(names or ())

    def read(self, result: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(detached loss, {key: value})`` of a step's return."""
        if self.names is None:
            self.names = []
        if isinstance(result, torch.Tensor) and result.dim() == 0:
            return result.detach(), {}
        if not (type(result) is dict or isinstance(result, Mapping)) or "loss" not in result:
            self._refuse(result)
        loss = result["loss"]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            self._refuse(loss, "'loss' of ")
        # A scalar tensor (the common value) is detached here; anything else is checked by _scalar.
        values = {name: value.detach() if type(value) is torch.Tensor and value.numel() == 1
                  else self._scalar(name, value) for name, value in result.items() if name != "loss"}
        if not self._known.issuperset(values):
            self._learn([k for k in values if k not in self._known])
        return loss.detach(), values

    def _learn(self, names: list) -> None:
        bad = [k for k in names if not isinstance(k, str)]
        if bad:
            raise ConfigurationError(f"{self.what} returned keys that are not strings ({bad!r}); "
                                     f"History columns need names")
        self.names.extend(names)
        self._known.update(names)

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
        warned: What was said once in this ``train()`` call; None: say nothing (a rank other than 0).
    """

    def __init__(self, fn: StepFn, ctx: StepContext, values: StepValues, state: Any, warned: set | None = None):
        self.fn, self.ctx, self.values, self.state, self.warned = fn, ctx, values, state, warned
        self._asked_in_group: set[str] = set()  # the optimizers asked to step on the group's earlier micro-batches
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
        warned = hooks.warned if parts.is_main_process else None
        if config.training_step is not None:
            return cls(config.training_step, ctx, StepValues("training_step"), state, warned)
        return cls(TrainingStep(parts.loss_fn, config.metrics), ctx, StepValues("the step", list(config.metrics)),
                   state, warned)

    def run(self, batch: Any, index: int, ends_group: bool, pause_sync: bool,
            real_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
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
            ctx._backward_in_group = False
        ctx._batch_index, ctx.is_last_micro_batch, ctx.global_step = index, ends_group, self.state.global_step
        ctx._asked.clear()
        ctx._retained = False
        ctx._in_step_fn = True
        try:
            if pause_sync and not ends_group and self._pausable:
                with contextlib.ExitStack() as paused:
                    for model in self._pausable:
                        paused.enter_context(gradient_sync_paused(model))
                    result = self.fn(ctx, batch)
            else:
                result = self.fn(ctx, batch)
        finally:
            ctx._in_step_fn = False
        if ends_group:
            self.end_group()
        elif ctx._asked:
            self._asked_in_group.update(ctx._asked)
        self.returned = result
        loss, values = self.values.read(result)
        return loss, loss if ctx._counted_loss is None else ctx._counted_loss, values

    @contextlib.contextmanager
    def refusing_steps_by_hand(self) -> Iterator["MicroBatches"]:
        """Within the block, an optimizer stepped by hand while the step function runs raises, on every rank.

        torch's optimizer step pre-hooks, one per optimizer for the epoch: a
        flag read per optimizer step, nothing per micro-batch. Outside the
        step function (a callback, after ``train()``) the optimizers are the
        user's own.
        """
        handles = [opt.register_step_pre_hook(self.ctx._refuse_step_by_hand) for opt in self.ctx.optimizers.values()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def end_group(self, step_asked: bool = False) -> int:
        """Close the accumulation group: its optimizer steps (``step_asked``: those the last micro-batch asked
        for, when an unsized loader ended inside the group), the per-step schedulers, the training step counted."""
        ctx = self.ctx
        if step_asked:
            ctx.global_step = self.state.global_step
            for name in dict.fromkeys(ctx._asked):
                ctx._take_step(name, ctx.optimizers[name])
        if not ctx._asked or self._asked_in_group:
            self._say_what_did_not_step()
        if ctx._hooks is not None:
            ctx._hooks.training_step_done()  # the per-step schedulers
        self.state.global_step = ctx.global_step + 1
        self._starts_group = True
        return self.state.global_step

    def _say_what_did_not_step(self) -> None:
        """A warning, once per ``train()``: no optimizer stepped in this group, or one asked too early did not."""
        asked, earlier, self._asked_in_group = set(self.ctx._asked), self._asked_in_group, set()
        if self.warned is None:
            return
        n, names = self.ctx.global_step + 1, list(self.ctx.optimizers)
        if not asked and not earlier and ("none",) not in self.warned:
            self.warned.add(("none",))
            log.warning("training step %d called no ctx.step(): %s did not step, so the step trained nothing (its "
                        "gradients are zeroed when the next one starts) and global_step still counted it; call "
                        "ctx.step(name) after ctx.backward(loss) (said once)", n,
                        ", ".join(f"optimizer {name!r}" for name in names))
        for name in (name for name in names if name in earlier and name not in asked):
            if ("too early", name) not in self.warned:
                self.warned.add(("too early", name))
                log.warning("training step %d: ctx.step(%r) was called on an earlier micro-batch of its accumulation "
                            "group but not on the last, where an optimizer steps: optimizer %r did not step, and the "
                            "gradients it accumulated are zeroed when the next group starts; call ctx.step(%r) on "
                            "every micro-batch (it steps on the group's last) (said once)", n, name, name, name)

    def _zero_grads(self) -> None:
        for name, params in self._params.items():
            # Whether any parameter holds a gradient, read in C (map, any), not in a Python loop: at every step.
            if any(map(operator.is_not, map(_GRAD, params), _NONE)):
                self.ctx.optimizers[name].zero_grad(set_to_none=True)



def trained_models(parts: Parts) -> list[nn.Module]:
    """The models an optimizer trains (set to train mode each epoch); a frozen one, a teacher, keeps its mode."""
    optimized = {id(p) for optimizer in parts.optimizers.values() for g in optimizer.param_groups for p in g["params"]}
    return [model for model in parts.models.values() if any(id(p) in optimized for p in model.parameters())]
