"""The constructor's training knobs, validated once into a frozen record.

Private: :class:`~nn_handler.NNHandler` is the public face; its docstring
documents each knob.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Union

import torch

from .._checks import check_bool, check_int, check_number, invalid
from ..errors import ConfigurationError

DDP_KEYS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb", "broadcast_buffers")
Resume = Union[Literal["auto"], str, os.PathLike, None]


@dataclass(frozen=True)
class TrainingConfig:
    """What ``NNHandler(...)`` was told about how to train; build it with :meth:`from_arguments`.

    Example:
        >>> TrainingConfig.from_arguments(grad_accum_steps=2).grad_accum_steps
        2
        >>> TrainingConfig.from_arguments(keep_last=0)
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: keep_last must be an int >= 1, got 0
    """

    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    finite_check_every: int | None = None
    metrics: Mapping[str, Callable] = field(default_factory=dict)
    amp: bool = False
    seed: int | None = None
    sync_batchnorm: bool = False
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path | None = None
    resume: Resume = None
    keep_last: int = 2
    overwrite: bool = False
    preemption_check_every: int | None = None

    @classmethod
    def from_arguments(
        cls, *, grad_accum_steps: int = 1, clip_grad_norm: float | None = None, finite_check_every: int | None = None,
        metrics: Mapping[str, Callable] | None = None, amp: bool = False, seed: int | None = None,
        sync_batchnorm: bool = False, ddp_kwargs: Mapping[str, Any] | None = None,
        checkpoint_dir: str | os.PathLike | None = None, resume: Resume = None, keep_last: int = 2,
        overwrite: bool = False, preemption_check_every: int | None = None,
    ) -> "TrainingConfig":
        """Check every knob (the first mistake raises :class:`~nn_handler.ConfigurationError`) and freeze them."""
        check_int("grad_accum_steps", grad_accum_steps, minimum=1)
        directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
        check_int("keep_last", keep_last, minimum=1)
        check_int("preemption_check_every", preemption_check_every, minimum=1, allow_none=True)
        if resume == "auto" and directory is None:
            raise ConfigurationError("resume='auto' looks for checkpoints in checkpoint_dir; pass checkpoint_dir=...")
        if resume is not None and not isinstance(resume, (str, os.PathLike)):
            raise invalid("resume", "None, 'auto' or a checkpoint path", resume)
        check_bool("overwrite", overwrite)
        if overwrite and directory is None:
            raise ConfigurationError("overwrite=True applies to checkpoint_dir's files; pass checkpoint_dir=...")
        if overwrite and resume == "auto":
            raise ConfigurationError("overwrite=True starts a new run over the checkpoints in checkpoint_dir, and "
                                     "resume='auto' continues them: choose one")
        check_number("clip_grad_norm", clip_grad_norm, allow_none=True)
        check_int("finite_check_every", finite_check_every, minimum=1, allow_none=True)
        metrics = _checked_metrics(metrics)
        unknown = sorted(set(ddp_kwargs or {}) - set(DDP_KEYS))
        if unknown:
            raise ConfigurationError(f"unknown ddp_kwargs {unknown}; allowed: {', '.join(DDP_KEYS)}")
        return cls(grad_accum_steps=grad_accum_steps, clip_grad_norm=clip_grad_norm,
                   finite_check_every=finite_check_every, metrics=metrics, amp=bool(amp), seed=seed,
                   sync_batchnorm=bool(sync_batchnorm), ddp_kwargs=dict(ddp_kwargs or {}), checkpoint_dir=directory,
                   resume=resume, keep_last=keep_last, overwrite=overwrite,
                   preemption_check_every=preemption_check_every)


def _checked_metrics(metrics: Any) -> dict[str, Callable]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigurationError(f"metrics must be a dict of name -> fn(outputs, targets), got {type(metrics).__name__}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or not callable(fn):
            raise ConfigurationError(f"metric {name!r} must map a str to a callable fn(outputs, targets), got {fn!r}")
    return dict(metrics)


def seed_everything(seed: int) -> None:
    """Seed ``random``, torch (every CUDA device too) and NumPy when it is installed."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np  # not a requirement: seeded only where the user has it

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def config_property(name: str) -> property:
    """A constructor knob of the trainer, read-only: it lives in the frozen :class:`TrainingConfig`."""
    return property(lambda self: getattr(self.config, name), doc=f"The ``{name}`` given to the constructor.")
