"""The values every logger logs, under the same names and at the same global steps.

- Per step, every ``log_every_n_steps`` optimizer steps (global steps N, 2N, ...
  counted from 1): ``train_loss`` and ``train_<key>`` for every other value the
  training step returns, each the mean of the step's micro-batches that
  returned it (the step's own value, not a window average), and the learning
  rates ``lr_group<i>`` (``lr_<optimizer>_group<i>`` with several optimizers).
  Read on the host at those steps only: no device sync at the others.
- Per epoch, at the epoch's last global step: every number of its History row.

Example:
    >>> import torch
    >>> class Trainer: optimizers = {}  # the learning rates come from the trainer's optimizers
    >>> series = StepSeries(every=2)
    >>> series.epoch_begin(0)
    >>> series.batch_end(1, torch.tensor(1.0), {"loss": torch.tensor(1.0), "d": 0.5}, Trainer)
    >>> series.batch_end(2, torch.tensor(3.0), {"loss": torch.tensor(3.0), "d": 1.5}, Trainer)
    {'train_loss': 3.0, 'train_d': 1.5}
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

from .._checks import check_int, invalid

HParam = bool | int | float | str


class StepSeries:
    """The values of the optimizer steps of a run, read at every ``every``-th global step.

    Feed it every micro-batch (:meth:`batch_end`, from ``on_batch_end``); the
    micro-batch that ends a logged step returns that step's values.
    """

    def __init__(self, every: int):
        self.every = check_int("log_every_n_steps", every, minimum=1)
        self._pending: list[tuple[Any, Any]] = []  # (loss, outputs) of the micro-batches of the step under way
        self._last_step = -1

    def epoch_begin(self, global_step: int) -> None:
        self._pending.clear()
        self._last_step = global_step

    def batch_end(self, global_step: int, loss: Any, outputs: Any, trainer: Any) -> dict[str, float] | None:
        """Add a micro-batch; ``{name: value}`` when it ended a step that is logged, else None (nothing read).

        ``trainer.optimizers`` is asked for the learning rates at the logged steps only.
        """
        # Called at every micro-batch on the training thread: a comparison (and an append inside an accumulation
        # group), no more. What is logged is taken apart (detached, filtered, averaged, read) at logged steps only.
        if global_step == self._last_step:  # inside an accumulation group: kept (a mapping copied: it may be reused)
            self._pending.append((loss, dict(outputs) if isinstance(outputs, Mapping) else outputs))
            return None
        self._last_step = global_step
        if global_step % self.every:
            self._pending.clear()
            return None
        batches, self._pending = [*self._pending, (loss, outputs)], []
        sums: dict[str, list[float]] = {}
        for batch_loss, batch_outputs in batches:
            for name, value in _batch_values(batch_loss, batch_outputs).items():
                # A key some micro-batches did not return: the mean of those that did.
                sums.setdefault(name, []).append(float(value))  # the read (a device sync): at logged steps only
        return {**{name: sum(v) / len(v) for name, v in sums.items()}, **learning_rates(trainer.optimizers)}


def _batch_values(loss: Any, outputs: Any) -> dict[str, Any]:
    values = {"train_loss": loss.detach() if hasattr(loss, "detach") else loss}
    if isinstance(outputs, Mapping):
        for key, value in outputs.items():
            if key != "loss" and _is_scalar(value):
                values[f"train_{key}"] = value.detach() if hasattr(value, "detach") else value
    return values


def _is_scalar(value: Any) -> bool:
    if hasattr(value, "numel"):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def learning_rates(optimizers: Mapping[str, Any]) -> dict[str, float]:
    """``lr_group<i>`` of each parameter group (``lr_<name>_group<i>`` with several optimizers).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> learning_rates({"optimizer": opt}), learning_rates({"G": opt, "D": opt})
        ({'lr_group0': 0.1}, {'lr_G_group0': 0.1, 'lr_D_group0': 0.1})
    """
    rates = {}
    for name, optimizer in optimizers.items():
        where = "" if len(optimizers) == 1 else f"{name}_"
        for i, group in enumerate(optimizer.param_groups):
            rates[f"lr_{where}group{i}"] = float(group["lr"])
    return rates


def epoch_values(handler: Any, epoch: int, logs: Mapping[str, Any]) -> dict[str, float] | None:
    """The numbers of an epoch's History row; None for the part of an epoch a step or time limit stopped.

    Example:
        >>> class Done: epoch, partial_epoch = 1, False
        >>> epoch_values(Done(), 1, {"epoch": 1, "train_loss": 0.5, "val_loss": None, "note": "x"})
        {'epoch': 1.0, 'train_loss': 0.5}
    """
    if getattr(handler, "partial_epoch", False) or handler.epoch < epoch:
        return None  # the run that completes the epoch logs it once, whole
    return {key: float(value) for key, value in logs.items()
            if isinstance(value, numbers.Real) and not isinstance(value, bool)}


def checked_hparams(hparams: Mapping[str, HParam] | None) -> dict[str, HParam]:
    """``hparams`` as a dict, each key a str and each value a bool, int, float or str.

    Example:
        >>> checked_hparams({"layers": [2, 3]})
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: hparams['layers'] must be a bool, int, float or str, got [2, 3]
    """
    if hparams is not None and not isinstance(hparams, Mapping):
        raise invalid("hparams", "a mapping of str to bool, int, float or str", hparams)
    for key, value in (hparams or {}).items():
        if not isinstance(key, str):
            raise invalid("hparams", "a mapping with str keys", key)
        if not isinstance(value, (bool, int, float, str)):
            raise invalid(f"hparams[{key!r}]", "a bool, int, float or str", value)
    return dict(hparams or {})


def settings_of(handler: Any) -> dict[str, HParam]:
    """What the handler trains with, logged once beside the user's ``hparams``: models, optimizers, knobs.

    Example:
        >>> import torch
        >>> class View:
        ...     models = {"model": torch.nn.Linear(2, 1)}
        ...     optimizers = {"optimizer": torch.optim.SGD(models["model"].parameters(), lr=0.1)}
        ...     world_size, device = 1, torch.device("cpu")
        >>> settings_of(View())["optimizer"], settings_of(View())["parameters"]
        ('SGD', 3)
    """
    settings: dict[str, HParam] = {}
    models, optimizers = dict(handler.models), dict(handler.optimizers)
    for name, model in models.items():
        where = "" if len(models) == 1 else f"_{name}"
        settings[f"model{where}"] = type(model).__name__
        settings[f"parameters{where}"] = sum(p.numel() for p in model.parameters())
    for name, optimizer in optimizers.items():
        where = "" if len(optimizers) == 1 else f"_{name}"
        settings[f"optimizer{where}"] = type(optimizer).__name__
    settings.update(world_size=int(handler.world_size), device=str(getattr(handler.device, "type", handler.device)))
    loader = getattr(handler, "train_loader", None)
    if isinstance(getattr(loader, "batch_size", None), int):
        settings["batch_size"] = loader.batch_size
    config = getattr(handler, "config", None)  # NNHandler's knobs, where the view is one
    for knob in ("grad_accum_steps", "clip_grad_norm", "amp", "strategy", "seed", "scheduler_interval"):
        value = getattr(config, knob, None)
        if isinstance(value, (bool, int, float, str)):
            settings[knob] = value
    return settings
