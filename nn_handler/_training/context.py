"""The step context: what a training or validation step function is handed, with each call, by the loop.

A step function is ``fn(ctx, batch)``; :class:`~nn_handler.NNHandler` calls
it once per micro-batch. The context gives it the models as trained (so a
call goes through DDP or FSDP), the run's autocast, and a ``backward`` and a
``step`` that do what the handler promises for its built-in step: the loss
scaled under fp16 and divided by ``grad_accum_steps``; the optimizer stepped
only at the end of an accumulation group, after unscaling, clipping and the
optimizer-step hooks. The built-in step (:mod:`.step`) is such a function.

Under fp16 the scaler is updated after every optimizer step (``scaler.step``
then ``scaler.update``, as Lightning, Fabric and Accelerate do), so every
backward is scaled and unscaled by the same scale however many times an
optimizer steps in a training step (a critic's inner loop), and a skipped
step's back-off reaches the next backward.

An optimizer stepped by hand (``optimizer.step()``) while the step function
runs is refused at once: off a group's last micro-batch it would step on
this rank's own gradients, and DDP's ranks would train apart. So is a
:meth:`step` in a group without any :meth:`backward` under fp16 or
accumulation (a plain ``loss.backward()``'s gradients, neither scaled nor
divided).

What the context does not do, and the loop around it does: zero every
optimizer's gradients at the start of an accumulation group, pause the
models' gradient synchronisation off the group's last micro-batch, watch for
optimizers stepped by hand while the step function runs, and count the step.

Public as :class:`nn_handler.StepContext`; the handler builds it.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigurationError, NonFiniteLossError
from ..utils._stall import current as current_watchdog
from ..utils._stall import watching
from .precision import Precision, update_scale

if TYPE_CHECKING:
    from .schedule import OptimizerSteps

__all__ = ["StepContext"]


class StepContext:
    """What a step function ``fn(ctx, batch)`` gets: the models as trained, ``autocast``, ``backward``, ``step``.

    ``NNHandler(..., training_step=fn)`` calls ``fn(ctx, batch)`` once per
    micro-batch with the batch as the loader gives it, moved to the device;
    ``validation_step=fn`` is called the same way under ``torch.no_grad()``,
    with the models in eval mode (there ``backward``, ``step`` and
    ``zero_grad`` are refused). A step returns its loss (a scalar tensor,
    History ``train_loss``) or a mapping of scalars: ``"loss"`` and any other
    key ``k`` (History ``train_k``, ``val_k`` from ``validation_step``).

    Every optimizer's gradients are zeroed at the start of each accumulation
    group, and, off the group's last micro-batch, DDP's all-reduce (FSDP's
    reduce-scatter) waits for the last one, so the usual hand-written pattern
    (one loss, its ``backward``, its optimizer's ``step``, then the next) gives
    the hand-written loop's numbers under every launcher and precision.

    Attributes:
        models: Name -> model as trained: DDP-wrapped, sharded or compiled, so a
            call goes through the wrapper (one model given alone is ``"model"``).
            In ``validation_step``, the models themselves (a forward without
            gradients needs no DDP).
        optimizers: Name -> optimizer (one given alone is ``"optimizer"``).
        device: Where the batch is and the models run.
        epoch: The epoch in progress, from 1 (the History's ``epoch``).
        global_step: Training steps completed before this one (one per
            accumulation group, whatever the number of optimizers).
        is_last_micro_batch: True when this micro-batch ends its accumulation
            group: :meth:`step` steps now (always, with ``grad_accum_steps=1``).
        training: False in ``validation_step``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from nn_handler import NNHandler
        >>> def two_views(ctx, batch):       # one model, two forward calls, one loss
        ...     x, y = batch
        ...     with ctx.autocast():
        ...         loss = nn.functional.mse_loss(ctx.model(x) + ctx.model(-x), y)
        ...     ctx.backward(loss)
        ...     ctx.step()
        ...     return loss
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> handler = NNHandler(nn.Linear(3, 1), torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
        ...                     training_step=two_views)
        >>> handler.set_train_loader((torch.randn(32, 3), torch.randn(32, 1)), batch_size=8)
        >>> len(handler.train(2, progress=False)["train_loss"]), handler.global_step
        (2, 8)
    """

    def __init__(self, models: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer],
                 precision: Precision, device: torch.device, *, scaler: Any = None, accumulate: int = 1,
                 clip_grad_norm: float | None = None, hooks: "OptimizerSteps | None" = None,
                 check_each_step: bool = False, training: bool = True):
        self.models: Mapping[str, nn.Module] = MappingProxyType(dict(models))
        self.optimizers: Mapping[str, torch.optim.Optimizer] = MappingProxyType(dict(optimizers))
        self.device, self.training = device, training
        self.epoch, self.global_step, self.is_last_micro_batch = 0, 0, True
        self._precision, self._scaler, self._accumulate, self._clip = precision, scaler, accumulate, clip_grad_norm
        self._hooks, self._check_each_step = hooks, check_each_step
        self._model = next(iter(self.models.values())) if len(self.models) == 1 else None
        self._only = next(iter(self.optimizers.items())) if len(self.optimizers) == 1 else None
        self._unscale = scaler is not None and (clip_grad_norm is not None or bool(hooks and hooks.before))
        self._ddp = any(isinstance(m, DistributedDataParallel) for m in self.models.values())
        # The stall watchdog's mark around each backward, where a watchdog runs (a group's; none in one process).
        self._backward_watch = (watching("backward (DDP's gradient all_reduce)") if current_watchdog() is not None
                                else None)
        # Set by the loop for each micro-batch: its index in the epoch (for a
        # non-finite loss), the optimizers asked to step (to step them when an
        # unsized loader ends inside a group), whether the step function runs.
        self._batch_index = 0
        self._asked: list[str] = []
        self._in_step_fn = False
        self._stepping = False  # this context's own optimizer step: not one by hand
        # Every optimizer's parameters: under fp16 the gradients still accumulating when the scale changes follow it.
        self._params = [p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]]
        self._retained = False  # a backward of this micro-batch kept its graph (retain_graph=True)
        self._backward_in_group = False  # ctx.backward ran in this accumulation group (set by the loop at its start)
        # The real samples of a batch that ends in DistributedSampler padding (else None): the built-in
        # step's loss and metrics for the History cover those rows only.
        self._real_rows: int | None = None
        self._counted_loss: torch.Tensor | None = None  # the built-in step's loss over those rows

    @property
    def model(self) -> nn.Module:
        """The model, when there is one (as trained); with several, :attr:`models` by name."""
        if self._model is None:
            raise AttributeError(f"ctx.model: this handler has {len(self.models)} models "
                                 f"({', '.join(map(repr, self.models))}); use ctx.models[name]")
        return self._model

    def autocast(self):
        """The run's ``torch.autocast`` (``amp``), or a no-op context in full precision."""
        return self._precision.autocast()

    def backward(self, loss: torch.Tensor, *, retain_graph: bool | None = None) -> None:
        """Gradients of ``loss``: divided by ``grad_accum_steps``, scaled under fp16.

        Off an accumulation group's last micro-batch, the gradients of DDP and
        FSDP models stay on this rank until the last one. In a single CPU
        process the loss is checked first: a NaN or infinite loss raises
        :class:`~nn_handler.NonFiniteLossError` before any gradient is made.

        Args:
            loss: A scalar tensor (each backward of a step may have its own).
            retain_graph: As ``Tensor.backward``'s: keep the graph for a second backward through it (refused
                under DDP, which averages a model's gradients once per forward: add the losses instead).
        """
        if not self.training:
            self._refuse_in_validation("backward")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigurationError(f"ctx.backward needs a scalar tensor (the loss, mean over the batch), got "
                                     f"{_shape_or_type(loss)}")
        if self._retained and self._ddp:
            # DDP averages a model's gradients once per forward: a second backward through the same forward
            # would add this rank's gradients alone, and the ranks would train apart without a word.
            raise ConfigurationError(
                "ctx.backward after a ctx.backward(..., retain_graph=True): under DDP a second backward through "
                "the same forward is not averaged over the ranks; add the losses and call ctx.backward once "
                "(ctx.backward(loss + penalty))")
        self._retained = self._retained or bool(retain_graph)
        self._backward_in_group = True
        # .item(): on the CPU a plain read, a tenth of the cost of bool(torch.isfinite(loss)).
        if self._check_each_step and not math.isfinite(value := loss.item()):
            raise NonFiniteLossError(self.epoch, self._batch_index, value)
        if self._accumulate > 1:
            loss = loss / self._accumulate
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        if self._backward_watch is None:
            loss.backward(retain_graph=retain_graph)
        else:
            with self._backward_watch:
                loss.backward(retain_graph=retain_graph)

    def step(self, name: str | None = None) -> None:
        """Step optimizer ``name`` (the one, when there is one) if this micro-batch ends its accumulation group.

        In that order: unscale its gradients (fp16), clip its trainable
        parameters' gradients (``clip_grad_norm``), ``on_before_optimizer_step``,
        the optimizer's step (the fp16 scaler's, which skips a step with
        inf/NaN gradients, then the scaler's update), zero its gradients,
        ``on_optimizer_step``. Elsewhere in a group it does nothing: the
        gradients accumulate. With several optimizers each hook runs once per
        optimizer, with the same step number. Its per-step scheduler steps
        once the training step is over (once, however often it stepped).

        Raises:
            ConfigurationError: ``name`` is not one of :attr:`optimizers` (or left out with several).
        """
        if not self.training:
            self._refuse_in_validation("step")
        if name is None and self._only is not None:
            name, optimizer = self._only
        else:
            try:
                optimizer = self.optimizers[name]
            except (KeyError, TypeError):
                optimizer = self._optimizer(name, "step")  # raises, naming this handler's optimizers
        self._asked.append(name)
        if self.is_last_micro_batch:
            self._take_step(name, optimizer)

    def zero_grad(self, name: str | None = None) -> None:
        """Zero the gradients of optimizer ``name`` now (every optimizer's when left out), accumulated ones too."""
        if not self.training:
            self._refuse_in_validation("zero_grad")
        for optimizer in self.optimizers.values() if name is None else [self._optimizer(name, "zero_grad")]:
            optimizer.zero_grad(set_to_none=True)

    def _take_step(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step of :meth:`step`, unconditionally (the loop's, for a group an unsized loader ended)."""
        n = self.global_step + 1
        if not self._backward_in_group and (self._scaler is not None or self._accumulate > 1):
            # Gradients from a plain loss.backward(): not scaled under fp16 (unscaling would shrink them by the
            # scale), not divided by grad_accum_steps.
            raise ConfigurationError(
                f"ctx.step({name!r}) after no ctx.backward in this accumulation group: gradients from a plain "
                f"loss.backward() are {'not scaled for fp16' if self._scaler is not None else ''}"
                f"{' and ' if self._scaler is not None and self._accumulate > 1 else ''}"
                f"{'not divided by grad_accum_steps' if self._accumulate > 1 else ''}; call ctx.backward(loss)")
        if self._unscale:
            self._scaler.unscale_(optimizer)  # clip (and show the hooks) the true gradients, not the scaled ones
        if self._clip is not None:
            # Read at each step: a callback may freeze or unfreeze layers between steps.
            nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]
                                      if p.requires_grad], self._clip)
        hooks = self._hooks
        if hooks is not None and hooks.before:
            hooks.before_step(name, n)
        self._stepping = True
        try:
            if self._scaler is not None:
                self._scaler.step(optimizer)  # skips the update on inf/NaN gradients
            else:
                optimizer.step()
        finally:
            self._stepping = False
        optimizer.zero_grad(set_to_none=True)
        if self._scaler is not None:
            update_scale(self._scaler, [p.grad for p in self._params if p.grad is not None])
        if hooks is not None:
            hooks.after_step(name, n)

    def _refuse_step_by_hand(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer's step pre-hook (the loop's, while a training step runs): only :meth:`step` steps."""
        if self._in_step_fn and not self._stepping:
            name = next((n for n, o in self.optimizers.items() if o is optimizer), "?")
            raise ConfigurationError(
                f"optimizer {name!r} was stepped by hand (optimizer.step()) in the training step: call "
                f"ctx.backward(loss) and ctx.step({name!r}) instead. They divide the loss by grad_accum_steps, "
                f"scale it under fp16 and step at the end of an accumulation group, once DDP averaged the "
                f"gradients; a step by hand elsewhere trains each rank on its own gradients, and the ranks diverge")

    def _optimizer(self, name: str | None, what: str) -> torch.optim.Optimizer:
        if name is None:
            if not self.optimizers:
                raise ConfigurationError(f"ctx.{what}(): this handler has no optimizer")
            raise ConfigurationError(f"ctx.{what}() needs the optimizer's name: this handler has "
                                     f"{', '.join(map(repr, self.optimizers))}")
        try:
            return self.optimizers[name]
        except (KeyError, TypeError):
            raise ConfigurationError(f"ctx.{what}({name!r}): no optimizer of that name; this handler's are "
                                     f"{', '.join(map(repr, self.optimizers)) or 'none'}") from None

    def _refuse_in_validation(self, what: str) -> None:
        raise ConfigurationError(f"ctx.{what}() in validation_step: validation runs without gradients "
                                 f"(torch.no_grad); compute and return the losses only")

    def __repr__(self) -> str:
        return (f"StepContext(models={list(self.models)}, optimizers={list(self.optimizers)}, device={self.device}, "
                f"epoch={self.epoch}, global_step={self.global_step})")


def _shape_or_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}"
