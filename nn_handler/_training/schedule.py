"""The LR scheduler and the optimizer-step hooks: when the loop steps what, around each optimizer step.

``scheduler_interval`` (Lightning's word) says when the scheduler steps:
``"epoch"`` once per completed epoch, ``"step"`` once per training step in
which its optimizer stepped (after gradient accumulation; once also when a
step's inner loop stepped it several times, so ``steps_per_epoch`` sizes
every schedule). ``None`` picks by type: ``OneCycleLR`` and
``CyclicLR``, per-batch by torch's own docs, step per step; every other
scheduler per epoch. ``ReduceLROnPlateau`` steps on the epoch's monitored
value, so it stays per epoch.

Around one optimizer step (:meth:`~.context.StepContext.step`), :class:`OptimizerSteps` runs::

    unscale (fp16) -> clip -> on_before_optimizer_step(handler, n[, name]) -> optimizer step (fp16: the
    scaler's step, then its update()), zero its gradients -> global_step = n -> on_optimizer_step(handler, n[, name])

and once the training step is over, the per-step scheduler of each optimizer that stepped in it. A hook that
takes a third parameter gets the optimizer's name.

A step that the fp16 ``GradScaler`` skipped (inf/NaN gradients) still counts:
``global_step`` grows and a per-step scheduler steps, as Lightning does (the
HF Trainer also counts it in ``global_step`` but holds its scheduler back),
so the LR is a function of ``global_step`` alone and a resume needs nothing more.

A per-step schedule is sized in training steps: :func:`optimizer_steps_per_epoch` (``handler.steps_per_epoch``)
counts those of an epoch on this rank, as Lightning's ``estimated_stepping_batches`` does for a whole run.

Private: :class:`~nn_handler.NNHandler` is the public face (``scheduler=``,
``scheduler_interval=``, ``set_scheduler``, ``steps_per_epoch``, the hooks of :class:`~nn_handler.Callback`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.optim import lr_scheduler

from .._checks import check_choice
from ..errors import ConfigurationError
from .hooks import accepts_positional

INTERVALS = ("epoch", "step")
PER_STEP = (lr_scheduler.OneCycleLR, lr_scheduler.CyclicLR)  # per batch by their own docs


def check_interval(interval: Any) -> str | None:
    """``scheduler_interval`` checked: ``"epoch"``, ``"step"`` or None.

    Example:
        >>> check_interval("batch")
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: scheduler_interval must be one of 'epoch', 'step' or None, got 'batch'
    """
    return check_choice("scheduler_interval", interval, INTERVALS, allow_none=True)


def resolve_interval(scheduler: Any, interval: str | None) -> str | None:
    """When ``scheduler`` steps: ``"epoch"`` or ``"step"`` (None without a scheduler).

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> resolve_interval(lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10), None)
        'step'
        >>> resolve_interval(lr_scheduler.StepLR(opt, 1), None), resolve_interval(lr_scheduler.StepLR(opt, 1), "step")
        ('epoch', 'step')
    """
    if scheduler is None:
        return None
    if interval is None:
        return "step" if isinstance(scheduler, PER_STEP) else "epoch"
    if interval == "step" and isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        raise ConfigurationError(
            "scheduler_interval='step' cannot drive ReduceLROnPlateau: it steps on the epoch's val_loss (or "
            "train_loss), once per epoch; leave scheduler_interval=None (or 'epoch'), or use a per-step scheduler")
    return interval


def build_scheduler(scheduler: Any, kwargs: dict[str, Any], optimizer: torch.optim.Optimizer | None,
                    interval: str | None = None) -> Any:
    """``scheduler`` as an instance over ``optimizer`` (built from a class with ``kwargs``), checked."""
    if isinstance(scheduler, type):
        if optimizer is None:
            raise ConfigurationError("set an optimizer before building a scheduler from a class")
        scheduler = scheduler(optimizer, **kwargs)
    elif kwargs:
        raise ConfigurationError("scheduler_kwargs only apply when the scheduler is given as a class")
    if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")):
        raise TypeError(f"scheduler must be an LR scheduler, got {type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ConfigurationError("the scheduler was built for another optimizer than this handler's")
    resolve_interval(scheduler, interval)  # refuse ReduceLROnPlateau per step now, not at train()
    return scheduler


def learning_rates(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, float]:
    """The History's ``lr`` (the first parameter group's), or with several optimizers ``lr_<name>`` of each.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> learning_rates({"optimizer": opt}), learning_rates({"G": opt, "D": opt})
        ({'lr': 0.1}, {'lr_G': 0.1, 'lr_D': 0.1})
    """
    if len(optimizers) == 1:
        return {"lr": next(iter(optimizers.values())).param_groups[0]["lr"]}
    return {f"lr_{name}": optimizer.param_groups[0]["lr"] for name, optimizer in optimizers.items()}


def epoch_learning_rates(optimizers: dict[str, torch.optim.Optimizer],
                         resume: dict[str, Any] | None) -> dict[str, float]:
    """The History's learning rates for the epoch about to run: :func:`learning_rates` now, or, for an epoch
    continued after a stop, those of its first step (a per-step scheduler has moved them on since).

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0475)
        >>> epoch_learning_rates({"optimizer": opt}, None), epoch_learning_rates({"optimizer": opt},
        ...                                                                      {"epoch_start": {"lr": {"lr": 0.05}}})
        ({'lr': 0.0475}, {'lr': 0.05})
    """
    started = None if resume is None else resume["epoch_start"].get("lr")  # absent from older checkpoints
    return dict(started) if started else learning_rates(optimizers)


def optimizer_steps_per_epoch(loader: Any, grad_accum_steps: int) -> int:
    """Optimizer steps one epoch of ``loader`` makes on this rank, after accumulation.

    A step per ``grad_accum_steps`` batches; the epoch's last group counts also when it is shorter (the loop
    steps at its end).

    Example:
        >>> optimizer_steps_per_epoch(range(7), 1), optimizer_steps_per_epoch(range(7), 3)
        (7, 3)
    """
    if loader is None:
        raise ConfigurationError("steps_per_epoch needs the training data: call set_train_loader() first")
    try:
        batches = len(loader)  # under DDP, the batches of this rank's shard
    except TypeError:
        raise ConfigurationError(
            "steps_per_epoch: the training loader has no length (an IterableDataset without __len__), so an "
            "epoch's steps are not known before it ends; size the schedule from your own count, or train by "
            "steps (train(max_steps=N)) with a schedule of N steps") from None
    return math.ceil(batches / grad_accum_steps)


def step_per_epoch(scheduler: Any, interval: str | None, row: dict[str, Any]) -> None:
    """The scheduler's step at the end of a completed epoch, when it steps per epoch."""
    if interval != "epoch":
        return
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(row.get("val_loss", row["train_loss"]))
    else:
        scheduler.step()


def takes_name(hook: Callable) -> bool:
    """True when a bound optimizer-step hook takes a third argument (the optimizer's name), or ``*args``.

    Example:
        >>> class Old:
        ...     def on_optimizer_step(self, handler, step): ...
        >>> class New:
        ...     def on_optimizer_step(self, handler, step, name): ...
        >>> takes_name(Old().on_optimizer_step), takes_name(New().on_optimizer_step)
        (False, True)
    """
    return accepts_positional(hook, 3)


def _with_name(hook: Callable) -> Callable[[Any, int, str], None]:
    """``hook(view, n, name)``, for a hook that takes the name or one that does not."""
    if takes_name(hook):
        return hook
    return lambda view, n, name: hook(view, n)


def _overrides(cb: Any, hook: str) -> bool:
    """True when ``cb``'s class (or a base of it other than ``Callback``) defines ``hook``."""
    owner = next((k for k in type(cb).__mro__ if hook in vars(k)), None)
    return owner is not None and not (owner.__module__ == "nn_handler.callbacks" and owner.__name__ == "Callback")


class OptimizerSteps:
    """The hooks and the schedulers around the optimizer steps of a ``train()`` call.

    :meth:`~.context.StepContext.step` calls :meth:`before_step` and
    :meth:`after_step` around each optimizer's step; with several optimizers
    each hook runs once per optimizer, with the same step number (the
    training step's, which counts accumulation groups). The loop calls
    :meth:`training_step_done` at each group's end.

    Args:
        parts: The call's parts (callbacks, schedulers by optimizer name, the view the hooks get).
        state: The run's state (``global_step`` grows here).
        interval: ``scheduler_interval`` as given (None: by each scheduler's type).
    """

    def __init__(self, parts: Any, state: Any, interval: str | None):
        self.parts, self.state = parts, state
        self.intervals = {name: resolve_interval(s, interval) for name, s in parts.schedulers.items()}
        self.per_step = {name: s for name, s in parts.schedulers.items() if self.intervals[name] == "step"}
        # Only callbacks that override a hook are called: with none, fp16 gradients
        # are not unscaled for a hook nobody reads (clipping still unscales them).
        self.before = [_with_name(cb.on_before_optimizer_step) for cb in parts.callbacks
                       if _overrides(cb, "on_before_optimizer_step")]
        self.after = [_with_name(cb.on_optimizer_step) for cb in parts.callbacks
                      if _overrides(cb, "on_optimizer_step")]
        self._stepped: dict[str, Any] = {}  # the per-step schedulers whose optimizer stepped in this training step
        self.warned: set = set()  # the optimizer steps that did not happen, said once per train() call

    def before_step(self, name: str, n: int) -> None:
        """``on_before_optimizer_step(handler, n[, name])``: the gradients are final (unscaled, clipped)."""
        for hook in self.before:
            hook(self.parts.view, n, name)

    def after_step(self, name: str, n: int) -> None:
        """After optimizer ``name`` stepped: ``global_step = n``, ``on_optimizer_step``; its scheduler is due."""
        self.state.global_step = n
        for hook in self.after:
            hook(self.parts.view, n, name)
        scheduler = self.per_step.get(name)
        if scheduler is not None:
            self._stepped[name] = scheduler

    def training_step_done(self) -> None:
        """The per-step scheduler of each optimizer that stepped in the training step: one step each."""
        if self._stepped:
            for scheduler in self._stepped.values():
                scheduler.step()
            self._stepped.clear()

    def epoch_done(self, row: dict[str, Any]) -> None:
        """The per-epoch schedulers' steps at the end of a completed epoch."""
        for name, scheduler in self.parts.schedulers.items():
            step_per_epoch(scheduler, self.intervals[name], row)
