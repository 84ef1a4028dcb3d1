"""The constructor's training knobs, validated once into a frozen record.

Private: :class:`~nn_handler.NNHandler` is the public face; its docstring
documents each knob.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Union

import torch

from .._checks import check_bool, check_choice, check_int, check_number, invalid
from ..errors import ConfigurationError
from .precision import check_amp
from .schedule import check_interval

STRATEGIES = ("auto", "ddp", "fsdp")
FSDP_KEYS = ("reshard_after_forward", "cpu_offload")
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
    amp: bool | str = False  # False, True, "bf16" or "fp16": precision.py says what it means on a device
    seed: int | None = None
    sync_batchnorm: bool = False
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path | None = None
    resume: Resume = None
    keep_last: int = 2
    overwrite: bool = False
    preemption_check_every: int | None = None
    strategy: str = "ddp"  # "auto" resolves to "ddp"
    fsdp_wrap: tuple = ()  # module classes to shard on their own; () = every child with parameters
    fsdp_kwargs: Mapping[str, Any] = field(default_factory=dict)
    compile: bool = False
    compile_kwargs: Mapping[str, Any] = field(default_factory=dict)
    scheduler_interval: str | None = None  # "epoch", "step", None: by the scheduler's type (schedule.py)
    training_step: Callable | None = None  # fn(ctx, batch); None: the built-in step (step.py)
    validation_step: Callable | None = None

    @classmethod
    def from_arguments(
        cls, *, grad_accum_steps: int = 1, clip_grad_norm: float | None = None, finite_check_every: int | None = None,
        metrics: Mapping[str, Callable] | None = None, amp: bool | str = False, seed: int | None = None,
        sync_batchnorm: bool = False, ddp_kwargs: Mapping[str, Any] | None = None,
        checkpoint_dir: str | os.PathLike | None = None, resume: Resume = None, keep_last: int = 2,
        overwrite: bool = False, preemption_check_every: int | None = None, strategy: str = "auto",
        fsdp_wrap: Any = None, fsdp_kwargs: Mapping[str, Any] | None = None, compile: bool = False,
        compile_kwargs: Mapping[str, Any] | None = None, scheduler_interval: str | None = None,
        training_step: Callable | None = None, validation_step: Callable | None = None,
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
        amp = check_amp(amp)
        unknown = sorted(set(ddp_kwargs or {}) - set(DDP_KEYS))
        if unknown:
            raise ConfigurationError(f"unknown ddp_kwargs {unknown}; allowed: {', '.join(DDP_KEYS)}")
        strategy = "ddp" if check_choice("strategy", strategy, STRATEGIES) == "auto" else strategy
        _check_strategy(strategy, fsdp_wrap, fsdp_kwargs, ddp_kwargs, sync_batchnorm)
        compile_kwargs = _checked_compile(compile, compile_kwargs)
        check_interval(scheduler_interval)
        for name, fn in (("training_step", training_step), ("validation_step", validation_step)):
            if fn is not None and not callable(fn):
                raise invalid(name, "a function fn(ctx, batch) -> loss or {'loss': ..., ...}", fn)
        return cls(compile=compile, compile_kwargs=compile_kwargs, strategy=strategy,
                   fsdp_wrap=_wrap_classes(fsdp_wrap), fsdp_kwargs=dict(fsdp_kwargs or {}),
                   training_step=training_step, validation_step=validation_step,
                   grad_accum_steps=grad_accum_steps, clip_grad_norm=clip_grad_norm,
                   finite_check_every=finite_check_every, metrics=metrics, amp=amp, seed=seed,
                   sync_batchnorm=bool(sync_batchnorm), ddp_kwargs=dict(ddp_kwargs or {}), checkpoint_dir=directory,
                   resume=resume, keep_last=keep_last, overwrite=overwrite,
                   preemption_check_every=preemption_check_every, scheduler_interval=scheduler_interval)


def _check_strategy(strategy: str, wrap: Any, fsdp_kwargs: Any, ddp_kwargs: Any, sync_batchnorm: bool) -> None:
    if strategy != "fsdp":
        for name, value in (("fsdp_wrap", wrap), ("fsdp_kwargs", fsdp_kwargs)):
            if value:
                raise ConfigurationError(f"{name} applies to strategy='fsdp' only (this handler's strategy is "
                                         f"{strategy!r}): pass strategy='fsdp', or drop {name}")
        return
    if ddp_kwargs or sync_batchnorm:
        what = "ddp_kwargs" if ddp_kwargs else "sync_batchnorm=True"
        raise ConfigurationError(f"{what} applies to strategy='ddp'; with strategy='fsdp' use fsdp_kwargs "
                                 f"({', '.join(FSDP_KEYS)}) or drop it")
    if fsdp_kwargs is not None and not isinstance(fsdp_kwargs, Mapping):
        raise invalid("fsdp_kwargs", f"a dict with keys among {', '.join(FSDP_KEYS)}", fsdp_kwargs)
    fsdp_kwargs = dict(fsdp_kwargs or {})
    unknown = sorted(set(fsdp_kwargs) - set(FSDP_KEYS))
    if unknown:
        raise ConfigurationError(f"unknown fsdp_kwargs {unknown}; allowed: {', '.join(FSDP_KEYS)}")
    reshard = fsdp_kwargs.get("reshard_after_forward", True)
    if not isinstance(reshard, bool):
        check_int("fsdp_kwargs['reshard_after_forward']", reshard, minimum=1)
    check_bool("fsdp_kwargs['cpu_offload']", fsdp_kwargs.get("cpu_offload", False))


def _checked_compile(compile: Any, kwargs: Any) -> dict[str, Any]:
    """``compile_kwargs`` checked against ``torch.compile``'s own keywords (``model``: NNHandler's to pass)."""
    check_bool("compile", compile)
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise invalid("compile_kwargs", "a dict of torch.compile keywords (e.g. {'mode': 'max-autotune'})", kwargs)
    if kwargs and not compile:
        raise ConfigurationError("compile_kwargs apply with compile=True: pass compile=True, or drop compile_kwargs")
    allowed = sorted(set(inspect.signature(torch.compile).parameters) - {"model"})
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ConfigurationError(f"unknown compile_kwargs {unknown}; torch.compile takes {', '.join(allowed)}")
    return dict(kwargs)


def check_for_device(config: "TrainingConfig", device: torch.device, distributed: bool) -> None:
    """The knobs that only some devices can honour, checked once the device is known."""
    if config.sync_batchnorm and distributed and device.type != "cuda":
        raise ConfigurationError(
            f"sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm does not run on {device.type}); "
            f"leave it False here: each rank then normalizes with its own batch statistics"
        )
    if config.fsdp_kwargs.get("cpu_offload") and device.type != "cuda":
        raise ConfigurationError(f"fsdp_kwargs['cpu_offload']=True keeps the shards of a GPU run in CPU memory; "
                                 f"this run is on {device.type}: leave it False")


def _wrap_classes(wrap: Any) -> tuple:
    """``fsdp_wrap`` as a tuple of ``nn.Module`` subclasses (a single class is accepted too)."""
    if wrap is None:
        return ()
    classes = (wrap,) if isinstance(wrap, type) else wrap
    try:
        classes = tuple(classes)
    except TypeError:
        classes = None
    if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        raise invalid("fsdp_wrap", "a set of torch.nn.Module subclasses (e.g. {TransformerBlock}) or None", wrap,
                      "classes, not instances: every submodule of those classes is sharded on its own")
    return classes


def _checked_metrics(metrics: Any) -> dict[str, Callable]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigurationError(f"metrics must be a dict of name -> fn(outputs, targets), got {type(metrics).__name__}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or not callable(fn):
            raise ConfigurationError(f"metric {name!r} must map a str to a callable fn(outputs, targets), got {fn!r}")
    return dict(metrics)


def config_property(name: str) -> property:
    """A constructor knob of the trainer, read-only: it lives in the frozen :class:`TrainingConfig`."""
    return property(lambda self: getattr(self.config, name), doc=f"The ``{name}`` given to the constructor.")
