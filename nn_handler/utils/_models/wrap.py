"""Wrapping models for DataParallel/DDP and sharding loaders: the one path behind :mod:`.parallel`.

Public names are re-exported by :mod:`nn_handler.utils.parallel`; this module
is private so that its layout can change.
"""


import inspect
import logging
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import DataParallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ..._checks import check_bool, check_int, check_number, invalid
from ...errors import ConfigurationError
from .._env import detect_launch_env
from .reports import get_device_count
from .._devices import CUDA_ONLY, cuda_count, parse_device, parse_device_ids
from ..ddp import get_rank, get_world_size, initialize_ddp, is_distributed, resolve_device

__all__ = [
    "MultiGPUMode",
    "MultiGPUConfig",
    "resolve_parallel_mode",
    "prepare_model",
    "prepare_dataloader",
    "unwrap_parallel_model",
    "setup_parallel_model",
    "parallelize_if_available",
]

log = logging.getLogger(__name__)

ParallelMode = Literal["none", "dataparallel", "distributed"]


class MultiGPUMode(str, Enum):
    """The values :attr:`MultiGPUConfig.mode` accepts (plain strings work too)."""

    AUTO = "auto"
    NONE = "none"
    DATAPARALLEL = "dataparallel"
    DISTRIBUTED = "distributed"


_MODES = tuple(m.value for m in MultiGPUMode)
_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


@dataclass
class MultiGPUConfig:
    """How to spread a model over devices; validated on construction.

    Attributes:
        mode: ``"auto"`` (distributed when a process group exists or a launcher
            started several processes, else ``DataParallel`` with 2+ local
            GPUs, else nothing), ``"none"``, ``"dataparallel"`` or
            ``"distributed"``. A :class:`MultiGPUMode` works too.
        device_ids: CUDA devices for ``DataParallel`` (ints or ``"cuda:N"``);
            ``None`` means all. Ignored by DDP, which uses one GPU per process
            (the local rank's).
        output_device: Where ``DataParallel`` gathers outputs; ``device_ids[0]``
            by default.
        backend: Process-group backend when :func:`prepare_model` has to create
            the group; ``None`` picks ``nccl`` for CUDA and ``gloo`` otherwise.
        find_unused_parameters: DDP: tolerate parameters that get no gradient.
        gradient_as_bucket_view: DDP: gradients are views into the
            communication buckets (saves one copy of the gradients).
        broadcast_buffers: DDP: broadcast buffers from rank 0 every forward.
        bucket_cap_mb: DDP: bucket size in MiB; must be > 0.
        static_graph: DDP: the set of used parameters never changes between
            iterations. Off by default, unlike the seed: a wrong ``True``
            corrupts training silently, a wrong ``False`` only costs speed.
        sync_bn: DDP: convert BatchNorm layers to ``SyncBatchNorm``. Off by
            default (the seed turns it on) because it changes the model and
            adds a collective to every BatchNorm forward.

    Raises:
        ConfigurationError: An unknown mode or backend, a non-positive bucket
            size, a flag that is not a bool, or an ``output_device`` outside
            ``device_ids``.
        DeviceError: ``device_ids`` that are not a non-empty list of distinct
            GPU ids, or a device that does not exist on this machine.

    Example:
        >>> MultiGPUConfig(mode="none").mode
        'none'
        >>> MultiGPUConfig(mode="hybrid")
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: mode must be one of 'auto', 'none', 'dataparallel', 'distributed', got 'hybrid'
    """

    mode: str = "auto"
    device_ids: list[int] | None = None
    output_device: int | None = None
    backend: str | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25
    static_graph: bool = False
    sync_bn: bool = False

    def __post_init__(self) -> None:
        mode = self.mode.value if isinstance(self.mode, MultiGPUMode) else self.mode
        if not isinstance(mode, str) or mode.strip().lower() not in _MODES:
            raise invalid("mode", f"one of {', '.join(map(repr, _MODES))}", self.mode)
        self.mode = mode.strip().lower()

        for name in ("find_unused_parameters", "gradient_as_bucket_view", "broadcast_buffers",
                     "static_graph", "sync_bn"):
            check_bool(name, getattr(self, name))

        check_number("bucket_cap_mb", self.bucket_cap_mb, unit="MiB")

        if self.backend is not None:
            if not isinstance(self.backend, str) or self.backend.lower() not in _BACKENDS:
                raise invalid("backend", f"one of {', '.join(map(repr, _BACKENDS))} or None", self.backend,
                              hint="None picks the backend for the device")
            self.backend = self.backend.lower()

        if self.device_ids is not None:
            self.device_ids = [d.index for d in parse_device_ids(self.device_ids)]
        if self.output_device is not None:
            # One of device_ids (checked just above) exists; on its own it is checked here.
            out = parse_device(self.output_device, types=CUDA_ONLY, exists=self.device_ids is None,
                               what="output_device").index
            if self.device_ids is not None and out not in self.device_ids:
                raise ConfigurationError(f"output_device {out} is not one of device_ids {self.device_ids}")
            self.output_device = out

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments this config passes to ``DistributedDataParallel``.

        Example:
            >>> MultiGPUConfig(bucket_cap_mb=50).ddp_kwargs()["bucket_cap_mb"]
            50
        """
        kwargs = {
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "bucket_cap_mb": self.bucket_cap_mb,
            "static_graph": self.static_graph,
        }
        # Syncing buffers is DDP's default everywhere; torch 2.13 deprecates the
        # argument (a FutureWarning on every wrap), so pass it only to turn it off.
        if not self.broadcast_buffers:
            kwargs["broadcast_buffers"] = False
        return kwargs


def _no_group_message(what: str) -> str:
    return (
        f"{what} needs a torch.distributed process group, but none exists and this process was not "
        f"started by a multi-process launcher; start the script with `torchrun --nproc_per_node=N script.py` "
        f"(or srun/mpirun), or call nn_handler.initialize_ddp() first"
    )


def resolve_parallel_mode(config: MultiGPUConfig | None = None, *, device: Any = None) -> ParallelMode:
    """Decide how :func:`prepare_model` will wrap a model, without touching the model.

    Args:
        config: The settings; ``MultiGPUConfig()`` (auto) when omitted.
        device: The device the caller wants the model on; in auto mode a
            non-CUDA device means no ``DataParallel``.

    Returns:
        ``"none"``, ``"dataparallel"`` or ``"distributed"``.

    Raises:
        ConfigurationError: ``mode="distributed"`` without a process group or
            a multi-process launcher.

    Example:
        >>> resolve_parallel_mode(MultiGPUConfig(mode="none"))
        'none'
        >>> resolve_parallel_mode(MultiGPUConfig(), device="cpu")  # a plain `python` run on CPU
        'none'
    """
    config = _check_config(config)
    if config.mode == "none":
        return "none"
    launched = is_distributed() or detect_launch_env().is_distributed
    if config.mode == "distributed":
        if not launched:
            raise ConfigurationError(_no_group_message("mode='distributed'"))
        return "distributed"
    if config.mode == "dataparallel":
        return "dataparallel"
    if launched:
        return "distributed"
    if device is not None and resolve_device(device).type != "cuda":
        return "none"
    gpus = len(config.device_ids) if config.device_ids is not None else cuda_count()
    return "dataparallel" if gpus >= 2 else "none"


def _check_config(config: MultiGPUConfig | None) -> MultiGPUConfig:
    if config is None:
        return MultiGPUConfig()
    if not isinstance(config, MultiGPUConfig):
        raise TypeError(f"config must be a MultiGPUConfig or None, got {type(config).__name__}")
    return config


def _is_wrapped(model: nn.Module) -> bool:
    # The torch classes themselves: the module-level names are what gets built (and stubbed in tests).
    return isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))


def _move(model: nn.Module, device: torch.device) -> nn.Module:
    # One place that moves models, so tests that fake GPUs can stub it out.
    return model.to(device)


def unwrap_parallel_model(model: nn.Module) -> nn.Module:
    """The model inside ``DataParallel``, ``DistributedDataParallel`` and ``torch.compile`` wrappers.

    Useful for saving checkpoints (keys without ``module.``) and reaching the
    model's own attributes. A model that is not wrapped comes back as is.

    Args:
        model: A model, wrapped any number of times.

    Returns:
        The innermost model.

    Example:
        >>> import torch.nn as nn
        >>> inner = nn.Linear(2, 2)
        >>> unwrap_parallel_model(nn.DataParallel(inner)) is inner
        True
    """
    while True:
        if _is_wrapped(model):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def prepare_model(
    model: nn.Module,
    config: MultiGPUConfig | None = None,
    *,
    device: torch.device | str | int | None = None,
) -> nn.Module:
    """Wrap ``model`` for the parallel mode that ``config`` and the environment select.

    * ``"none"``: the model itself, moved to ``device`` when one is given.
    * ``"dataparallel"``: moved to the first of ``config.device_ids`` (all
      GPUs by default; ``device``, when given, is put first) and wrapped in
      ``nn.DataParallel``.
    * ``"distributed"``: creates the process group from the launch environment
      if none exists yet, optionally converts BatchNorm to ``SyncBatchNorm``,
      moves the model to ``device`` (default: the local rank's GPU, else CPU)
      and wraps it in ``DistributedDataParallel`` with the config's knobs;
      ``device_ids=[index]`` is passed only for a CUDA device.

    A model already wrapped in ``DataParallel`` or ``DistributedDataParallel``
    comes back unchanged.

    Args:
        model: The model to wrap.
        config: The settings; ``MultiGPUConfig()`` (auto) when omitted.
        device: Where the model should live (anything
            :func:`~nn_handler.resolve_device` accepts).

    Returns:
        The model, wrapped or not.

    Raises:
        ConfigurationError: ``mode="distributed"`` without a process group or
            launcher, or ``mode="dataparallel"`` without CUDA or with a
            ``device`` that is not one of ``device_ids``.
        DeviceError: A device that does not exist.

    Example:
        >>> import torch.nn as nn
        >>> model = prepare_model(nn.Linear(4, 2), MultiGPUConfig(mode="none"), device="cpu")
        >>> type(model).__name__
        'Linear'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _check_config(config)
    if _is_wrapped(model):
        log.debug("%s is already wrapped; returned unchanged", type(model).__name__)
        return model
    target = resolve_device(device) if device is not None else None
    mode = resolve_parallel_mode(config, device=target)
    if mode == "none":
        return _move(model, target) if target is not None else model
    if mode == "dataparallel":
        return _wrap_data_parallel(model, config.device_ids, config.output_device, target)
    return _wrap_distributed(model, config, target)


def _wrap_data_parallel(model, device_ids, output_device, target) -> nn.Module:
    count = cuda_count()
    if count == 0:
        raise ConfigurationError(
            "mode='dataparallel' needs CUDA devices, but CUDA is not available here; "
            "use mode='auto' or 'none' on this machine"
        )
    ids = [d.index for d in parse_device_ids(device_ids)] if device_ids is not None else list(range(count))
    if target is not None:
        if target.type != "cuda":
            raise ConfigurationError(f"mode='dataparallel' runs on CUDA devices, but device={target} was given")
        if target.index not in ids:
            raise ConfigurationError(f"device {target} is not one of device_ids {ids}")
        # DataParallel keeps the master copy on device_ids[0]: put the asked device first.
        ids.remove(target.index)
        ids.insert(0, target.index)
    out = ids[0] if output_device is None else output_device
    model = _move(model, torch.device("cuda", ids[0]))
    log.info("wrapping %s in DataParallel over cuda devices %s", type(model).__name__, ids)
    return DataParallel(model, device_ids=ids, output_device=out)


def _wrap_distributed(model: nn.Module, config: MultiGPUConfig, target) -> nn.Module:
    if not is_distributed():
        # The launcher says distributed (checked by resolve_parallel_mode) but
        # nobody has formed the group yet: form it here, once.
        initialize_ddp(backend=config.backend)
    if target is None:
        target = resolve_device("cuda") if cuda_count() else torch.device("cpu")
    if config.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = _move(model, target)
    kwargs = config.ddp_kwargs()
    if target.type == "cuda":
        kwargs.update(device_ids=[target.index], output_device=target.index)
    log.info("wrapping %s in DistributedDataParallel on %s (rank %d of %d)",
             type(model).__name__, target, get_rank(), get_world_size())
    return DistributedDataParallel(model, **kwargs)


# DataLoader settings carried over when a loader is rebuilt; filtered against
# the installed DataLoader's signature (older torch lacks in_order, ...).
_LOADER_SETTINGS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                    "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
                    "persistent_workers", "pin_memory_device", "in_order")


def _loader_settings(loader: DataLoader) -> dict[str, Any]:
    accepted = inspect.signature(DataLoader.__init__).parameters
    settings = {name: getattr(loader, name) for name in _LOADER_SETTINGS if name in accepted and hasattr(loader, name)}
    if not settings.get("num_workers"):
        settings.pop("prefetch_factor", None)  # only allowed with worker processes
        settings["persistent_workers"] = False
    return settings


def _check_shardable(loader: DataLoader) -> None:
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise ConfigurationError(
            f"the loader uses a custom batch_sampler ({type(batch_sampler).__name__}) that a DistributedSampler "
            f"cannot replace; shard it by rank yourself (nn_handler.get_rank(), get_world_size()) "
            f"or build the loader with batch_size= instead"
        )
    sampler = loader.sampler
    plain = type(sampler) is SequentialSampler or (
        type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None
    )
    if not plain:
        raise ConfigurationError(
            f"the loader uses a sampler ({type(sampler).__name__}) whose order or weights a DistributedSampler "
            f"would drop; shard it by rank yourself, or use shuffle=True/False instead of a custom sampler"
        )


def prepare_dataloader(
    loader: DataLoader,
    config: MultiGPUConfig | None = None,
    *,
    shuffle: bool | None = None,
    seed: int = 0,
) -> DataLoader:
    """Give each rank its own shard of ``loader``'s data when the run is distributed.

    When :func:`resolve_parallel_mode` says ``"distributed"``, returns a new
    loader over the same dataset with a ``DistributedSampler`` for this rank,
    keeping ``batch_size``, ``collate_fn``, ``num_workers``, ``pin_memory``,
    ``drop_last``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``,
    ``generator``, ``prefetch_factor``, ``persistent_workers`` and the rest.
    Call ``loader.sampler.set_epoch(epoch)`` at the start of every epoch so
    shuffling differs between epochs. In every other mode, and when the loader
    already has a ``DistributedSampler``, the loader comes back unchanged. An
    ``IterableDataset`` is returned unchanged with a warning: it must shard
    itself.

    Args:
        loader: The loader to shard.
        config: The settings; ``MultiGPUConfig()`` (auto) when omitted.
        shuffle: Shuffle the shards; by default, as the original loader did
            (``RandomSampler``) or did not.
        seed: Shuffling seed; must be the same on every rank.

    Returns:
        The loader to iterate on this rank.

    Raises:
        ConfigurationError: The loader has a custom sampler or batch sampler
            (sharding it would silently change what is sampled), or
            ``mode="distributed"`` without a process group or launcher.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4)
        >>> prepare_dataloader(loader) is loader  # not distributed
        True
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"loader must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if shuffle is not None and not isinstance(shuffle, bool):
        raise TypeError(f"shuffle must be True, False or None, got {shuffle!r}")
    if resolve_parallel_mode(_check_config(config)) != "distributed":
        return loader
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            "prepare_dataloader: an IterableDataset cannot take a DistributedSampler; it is returned unchanged, "
            "so it must yield a different shard on each rank itself (use nn_handler.get_rank())",
            RuntimeWarning,
            stacklevel=2,
        )
        return loader
    _check_shardable(loader)
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    if type(loader) is not DataLoader:
        warnings.warn(
            f"prepare_dataloader: {type(loader).__name__} is rebuilt as a plain DataLoader",
            RuntimeWarning,
            stacklevel=2,
        )
    sampler = DistributedSampler(
        loader.dataset, num_replicas=get_world_size(), rank=get_rank(), shuffle=shuffle, seed=seed
    )
    return DataLoader(loader.dataset, sampler=sampler, **_loader_settings(loader))


# --- the seed's wrapping helpers ---------------------------------------------------------------


def setup_parallel_model(
    model: nn.Module,
    device_ids: list[int] | None = None,
    output_device: int | None = None,
    distributed: bool = False,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """Wrap ``model`` in ``DataParallel`` over several GPUs, or in DDP when asked.

    With ``distributed=False`` the model is wrapped in ``DataParallel`` when
    two or more GPUs are used (all of them, or ``device_ids``) and returned
    unchanged otherwise. With ``distributed=True`` it is wrapped in
    ``DistributedDataParallel`` on this rank's GPU (``device_ids[0]`` when
    given), or on CPU where there is no GPU; the process group must exist. A
    model already wrapped comes back unchanged.

    Args:
        model: The model to parallelize.
        device_ids: GPUs to use; all by default.
        output_device: GPU that gathers ``DataParallel`` outputs; ``device_ids[0]`` by default.
        distributed: Use ``DistributedDataParallel`` instead of ``DataParallel``.
        find_unused_parameters: DDP only: tolerate parameters that get no gradient.

    Returns:
        The wrapped model, or ``model`` itself.

    Raises:
        ConfigurationError: ``distributed=True`` without a process group, or
            more than one ``device_ids`` entry with ``distributed=True``.
        DeviceError: A device id that does not exist.

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Linear(4, 2)
        >>> setup_parallel_model(model) is model or get_device_count() > 1  # unchanged below 2 GPUs
        True
    """
    if _is_wrapped(model):
        return model
    if distributed:
        if not is_distributed():
            raise ConfigurationError(_no_group_message("setup_parallel_model(distributed=True)"))
        if device_ids is not None and len(device_ids) > 1:
            raise ConfigurationError(
                f"distributed=True uses one GPU per process, got device_ids={list(device_ids)}; "
                f"pass one id (or none: the local rank's GPU) and start one process per GPU"
            )
        config = MultiGPUConfig(mode="distributed", device_ids=device_ids,
                                find_unused_parameters=find_unused_parameters)
        device = torch.device("cuda", config.device_ids[0]) if config.device_ids else None
        return prepare_model(model, config, device=device)
    config = MultiGPUConfig(mode="none", device_ids=device_ids, output_device=output_device)
    gpus = len(config.device_ids) if config.device_ids is not None else get_device_count()
    if gpus < 2:
        return model
    return _wrap_data_parallel(model, config.device_ids, config.output_device, None)


def parallelize_if_available(model: nn.Module, min_gpus: int = 2, **kwargs: Any) -> nn.Module:
    """:func:`setup_parallel_model` when at least ``min_gpus`` GPUs exist, else ``model`` unchanged.

    Args:
        model: The model to parallelize.
        min_gpus: Fewest GPUs worth parallelizing over; >= 1.
        **kwargs: Passed to :func:`setup_parallel_model`.

    Returns:
        The possibly wrapped model.

    Raises:
        ConfigurationError: ``min_gpus`` below 1.

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Linear(4, 2)
        >>> parallelize_if_available(model, min_gpus=1000) is model
        True
    """
    check_int("min_gpus", min_gpus, minimum=1)
    if get_device_count() < min_gpus:
        return model
    return setup_parallel_model(model, **kwargs)
