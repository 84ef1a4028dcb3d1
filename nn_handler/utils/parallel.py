"""Model wrapping, device and memory reports, data-parallel inference, model placement.

One path for every way a model is spread over devices: :func:`prepare_model`
and :func:`prepare_dataloader` choose between no wrapping, ``DataParallel`` and
``DistributedDataParallel`` from a :class:`MultiGPUConfig` and the launch
environment (NNHandler calls these same two functions); the seed's helpers
(:func:`setup_parallel_model`, :func:`parallelize_if_available`, ...) are thin
layers over them. Device and rank questions are answered by
:mod:`nn_handler.utils.ddp`; nothing here reads CUDA or the launcher's
variables another way. Decisions are made at call time; importing this module
has no effects.

Example:
    >>> import torch.nn as nn
    >>> from nn_handler.utils.parallel import MultiGPUConfig, prepare_model, unwrap_parallel_model
    >>> model = prepare_model(nn.Linear(4, 2), MultiGPUConfig(mode="none"))
    >>> unwrap_parallel_model(model) is model
    True
"""

from __future__ import annotations

from ._models.placement import DEVICE_MAP_ATTR, dispatch_model, parse_memory_size, plan_device_map
from ._models.predict import get_data_parallel_info, parallel_predict, validate_data_parallel_setup
from ._models.reports import (
    get_device_count,
    get_gpu_memory_info,
    get_gpu_stats,
    get_recommended_batch_size,
    is_parallel_available,
    print_gpu_memory_info,
)
from ._models.wrap import (
    MultiGPUConfig,
    MultiGPUMode,
    parallelize_if_available,
    prepare_dataloader,
    prepare_model,
    resolve_parallel_mode,
    setup_parallel_model,
    unwrap_parallel_model,
)

__all__ = [
    "MultiGPUMode",
    "MultiGPUConfig",
    "resolve_parallel_mode",
    "prepare_model",
    "prepare_dataloader",
    "unwrap_parallel_model",
    "get_device_count",
    "is_parallel_available",
    "get_gpu_memory_info",
    "print_gpu_memory_info",
    "get_gpu_stats",
    "get_recommended_batch_size",
    "setup_parallel_model",
    "parallelize_if_available",
    "dispatch_model",
    "plan_device_map",
    "parse_memory_size",
    "DEVICE_MAP_ATTR",
    "parallel_predict",
    "get_data_parallel_info",
    "validate_data_parallel_setup",
]
