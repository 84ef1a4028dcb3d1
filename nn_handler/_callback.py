"""The interface of a callback: the hooks :class:`~nn_handler.NNHandler` calls, and the view of the trainer they get.

:mod:`nn_handler.callbacks` re-exports both and holds the built-in callbacks; this module is their base, apart so
that the built-ins and the trackers (:mod:`nn_handler.loggers`) each build on it without one long module.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .history import History

__all__ = ["Callback", "TrainerView"]


@runtime_checkable
class TrainerView(Protocol):
    """What a callback may use of the trainer that calls it; :class:`~nn_handler.NNHandler` is one.

    Hooks are typed against this view, not against the trainer's class, so
    that this module never imports :mod:`nn_handler.handler` (which imports
    this one). The attributes are those documented on ``NNHandler``.
    """

    model: torch.nn.Module  # with several models: handler.models (an AttributeError here)
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    models: dict[str, torch.nn.Module]  # by name, unwrapped
    optimizers: dict[str, torch.optim.Optimizer]  # by name
    history: History
    epoch: int
    global_step: int
    stop_training: bool
    partial_epoch: bool  # the epoch ends part-way (max_steps, max_time): its values are not the epoch's
    distributed: bool
    rank: int
    world_size: int
    device: torch.device

    @property
    def module(self) -> torch.nn.Module:
        """The model without its DDP wrapper."""

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (and in a single process)."""

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write a full training checkpoint (call it on every rank)."""

    def save_model(self, path: str | os.PathLike) -> None:
        """Write the model's weights."""


class Callback:
    """Base class: override the hooks you need; all default to doing nothing.

    ``epoch`` arguments count from 1, as the History's ``epoch`` column.
    ``logs`` is the epoch's History row (plain floats, identical on every
    rank). A callback with state to keep across a resume returns it from
    :meth:`state_dict` (tensors and plain Python values only).

    When ``max_steps`` or ``max_time`` stops training inside an epoch, that
    part of the epoch still ends with ``on_validation_end`` and
    ``on_epoch_end``, with ``handler.partial_epoch`` True: its values cover
    only the batches trained so far, and the run that continues the epoch
    calls the hooks again for the whole of it. A callback that decides
    something from the values (stop, keep a best) returns at once for a
    part, as the built-in ones do; a logger may record it.

    Example:
        >>> class CountBatches(Callback):
        ...     def __init__(self):
        ...         self.n = 0
        ...     def on_batch_end(self, handler, step, loss):
        ...         self.n += 1
    """

    def on_train_begin(self, handler: TrainerView) -> None:
        """Before the first epoch of a :meth:`~NNHandler.train` call."""

    def on_train_end(self, handler: TrainerView) -> None:
        """After the last epoch (also after an early stop); not called when training raised (see :meth:`on_exception`)."""

    def on_epoch_begin(self, handler: TrainerView, epoch: int) -> None:
        """Before the first batch of ``epoch``."""

    def on_epoch_end(self, handler: TrainerView, epoch: int, logs: dict[str, Any]) -> None:
        """After validation, the scheduler step and the History update of ``epoch`` (or of its part)."""

    def on_batch_begin(self, handler: TrainerView, step: int) -> None:
        """Before batch ``step`` (from 0 within the epoch) is moved to the device."""

    def on_batch_end(self, handler: TrainerView, step: int, loss: "torch.Tensor") -> None:
        """After batch ``step``; ``loss`` is this rank's detached loss tensor.

        Calling ``loss.item()`` here waits for the GPU on every batch; keep it
        for debugging. With ``grad_accum_steps`` > 1 this runs per micro-batch;
        the two hooks below run once per optimizer step. A hook that takes a
        fourth parameter, ``on_batch_end(self, handler, step, loss, outputs)``,
        also gets what the training step returned for the batch, as it
        returned it (the loss, or the mapping of the loss and the other
        values), as Lightning's ``on_train_batch_end``: the loggers read the
        values they log there, at the steps they log only.
        """

    def on_before_optimizer_step(self, handler: TrainerView, step: int) -> None:
        """Before optimizer step ``step`` (the global step it becomes, from 1): the gradients are final.

        Accumulated, all-reduced under DDP (this rank's shards under FSDP),
        unscaled under fp16 and clipped (``clip_grad_norm``): what the
        optimizer is about to apply, e.g. for a gradient-norm logger. With
        several optimizers it runs once per optimizer: a hook written with a
        third parameter, ``(self, handler, step, name)``, gets the
        optimizer's name.
        """

    def on_optimizer_step(self, handler: TrainerView, step: int) -> None:
        """After optimizer step ``step`` (``handler.global_step == step``), before a per-step scheduler steps.

        The weights are updated and the LR is still the one this step used.
        A step the fp16 scaler skipped (inf/NaN gradients) counts. As
        :meth:`on_before_optimizer_step`, a hook with a third parameter
        ``name`` gets the optimizer's name.
        """

    def on_validation_end(self, handler: TrainerView, epoch: int, logs: dict[str, float]) -> None:
        """After validation of ``epoch``; ``logs`` has ``val_loss`` and ``val_<metric>``."""

    def on_exception(self, handler: TrainerView, exception: BaseException) -> None:
        """Training raised ``exception`` (on this rank): before it propagates, instead of ``on_train_end``.

        Also for :class:`~nn_handler.TrainingPreempted` (a preemption's stop)
        and ``KeyboardInterrupt``; the loggers record how the run ended here.
        An exception this hook raises is logged, never raised over the
        training's own.
        """

    def on_save_checkpoint(self, handler: TrainerView, payload: dict[str, Any]) -> None:
        """Before a checkpoint is written; may add entries to ``payload`` (plain values only)."""

    def on_load_checkpoint(self, handler: TrainerView, payload: dict[str, Any]) -> None:
        """After a checkpoint was loaded with ``resume=True``."""

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints and restored by :meth:`load_state_dict`."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
