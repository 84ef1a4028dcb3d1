"""nn_handler: decorator-centric parallel execution for PyTorch.

Example:
    >>> import nn_handler
    >>> nn_handler.initialize_ddp()[0]   # a plain `python` run is not distributed
    False
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    CheckpointMismatchError,
    CollectiveStallError,
    ConfigurationError,
    DeviceError,
    ExecutorTimeoutError,
    LaunchEnvironmentError,
    MissingExtraError,
    NNHandlerError,
    PredictionsError,
    NonFiniteLossError,
    ParallelExecutionError,
    RankFailedError,
    TrainingPreempted,
    WorkerDiedError,
)

# Every other public name is loaded on first use (module __getattr__, as
# CPython's concurrent/futures/__init__.py does): a worker child imports this
# package before it runs a call, and must not pay for torch.distributed, the
# trainer and the model helpers it does not use. Each name comes from its
# public home module.
_LAZY = {
    ".utils.ddp_decorators": ("ParallelExecutor", "parallelize_on_gpus", "on_rank", "main_process_first",
                              "any_rank", "all_ranks", "parallel_on_all_devices"),
    # Where a worker's functions find it: the module every worker has already loaded.
    ".utils._workers.worker": ("worker_state",),
    ".utils.ddp": ("barrier", "cleanup_ddp", "find_free_port", "get_local_rank", "get_rank", "get_world_size",
                   "initialize_ddp", "is_distributed", "is_main_process", "resolve_device", "should_use_distributed",
                   "watch_collectives"),
    ".utils.parallel": ("MultiGPUConfig", "MultiGPUMode", "get_device_count", "get_gpu_memory_info", "get_gpu_stats",
                        "get_recommended_batch_size", "is_parallel_available", "parallelize_if_available",
                        "prepare_dataloader", "prepare_model", "print_gpu_memory_info", "resolve_parallel_mode",
                        "setup_parallel_model", "unwrap_parallel_model", "dispatch_model", "get_data_parallel_info",
                        "parallel_predict", "plan_device_map", "validate_data_parallel_setup"),
    ".callbacks": ("Callback", "CSVLogger", "EarlyStopping", "ModelCheckpoint"),
    ".loggers": ("TensorBoardLogger", "MLflowLogger", "WandbLogger"),
    ".handler": ("NNHandler",),
    "._training.context": ("StepContext",),  # what a training_step gets; its home is the trainer's package
    ".history": ("History",),
    "._inference.reader": ("Predictions",),  # what parallel_predict(output_dir=...) returns
    ".seeding": ("seed_everything",),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ loads these
    from .callbacks import Callback, CSVLogger, EarlyStopping, ModelCheckpoint
    from ._training.context import StepContext
    from .handler import NNHandler
    from .history import History
    from ._inference.reader import Predictions
    from .seeding import seed_everything
    from .loggers import MLflowLogger, TensorBoardLogger, WandbLogger
    from .utils._workers.worker import worker_state
    from .utils.ddp import (
        barrier,
        cleanup_ddp,
        find_free_port,
        get_local_rank,
        get_rank,
        get_world_size,
        initialize_ddp,
        is_distributed,
        is_main_process,
        resolve_device,
        should_use_distributed,
    )
    from .utils.ddp_decorators import (
        ParallelExecutor,
        all_ranks,
        any_rank,
        main_process_first,
        on_rank,
        parallel_on_all_devices,
        parallelize_on_gpus,
    )
    from .utils.parallel import (
        MultiGPUConfig,
        MultiGPUMode,
        dispatch_model,
        get_data_parallel_info,
        get_device_count,
        get_gpu_memory_info,
        get_gpu_stats,
        get_recommended_batch_size,
        is_parallel_available,
        parallel_predict,
        parallelize_if_available,
        plan_device_map,
        prepare_dataloader,
        prepare_model,
        print_gpu_memory_info,
        resolve_parallel_mode,
        setup_parallel_model,
        unwrap_parallel_model,
        validate_data_parallel_setup,
    )

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "NNHandlerError",
    "LaunchEnvironmentError",
    "DeviceError",
    "ParallelExecutionError",
    "WorkerDiedError",
    "RankFailedError",
    "CollectiveStallError",
    "ParallelExecutor",
    "parallelize_on_gpus",
    "ExecutorTimeoutError",
    "worker_state",
    "initialize_ddp",
    "resolve_device",
    "should_use_distributed",
    "watch_collectives",
    "get_rank",
    "get_local_rank",
    "get_world_size",
    "is_distributed",
    "is_main_process",
    "barrier",
    "cleanup_ddp",
    "find_free_port",
    "on_rank",
    "main_process_first",
    "any_rank",
    "all_ranks",
    "parallel_on_all_devices",
    # nn_handler.utils.parallel
    "ConfigurationError",
    "MultiGPUConfig",
    "MultiGPUMode",
    "resolve_parallel_mode",
    "prepare_model",
    "prepare_dataloader",
    "unwrap_parallel_model",
    "setup_parallel_model",
    "parallelize_if_available",
    "get_device_count",
    "is_parallel_available",
    "get_gpu_memory_info",
    "print_gpu_memory_info",
    "get_gpu_stats",
    "get_recommended_batch_size",
    "dispatch_model",
    "plan_device_map",
    "parallel_predict",
    "Predictions",
    "PredictionsError",
    "get_data_parallel_info",
    "validate_data_parallel_setup",
    # nn_handler.handler
    "NNHandler",
    "StepContext",
    "History",
    "seed_everything",
    "Callback",
    "EarlyStopping",
    "ModelCheckpoint",
    "CSVLogger",
    "TensorBoardLogger",
    "MLflowLogger",
    "WandbLogger",
    "NonFiniteLossError",
    "CheckpointError",
    "CheckpointMismatchError",
    "MissingExtraError",
    "TrainingPreempted",
    "PREEMPTED_EXIT_CODE",
]
