"""nn_handler: decorator-centric parallel execution for PyTorch.

Example:
    >>> import nn_handler
    >>> nn_handler.initialize_ddp()[0]   # a plain `python` run is not distributed
    False
"""

from .errors import (
    ConfigurationError,
    DeviceError,
    LaunchEnvironmentError,
    NNHandlerError,
    ParallelExecutionError,
    RankFailedError,
    WorkerDiedError,
)
from .utils._executor import ExecutorTimeoutError, ParallelExecutor, parallelize_on_gpus, worker_state
from .utils.ddp_decorators import all_ranks, any_rank, main_process_first, on_rank, parallel_on_all_devices
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
from .utils.parallel import (
    MultiGPUConfig,
    MultiGPUMode,
    get_device_count,
    get_gpu_memory_info,
    get_gpu_stats,
    get_recommended_batch_size,
    is_parallel_available,
    parallelize_if_available,
    prepare_dataloader,
    prepare_model,
    print_gpu_memory_info,
    resolve_parallel_mode,
    setup_parallel_model,
    unwrap_parallel_model,
)
from .utils.parallel import (
    dispatch_model,
    get_data_parallel_info,
    parallel_predict,
    plan_device_map,
    validate_data_parallel_setup,
)
from .callbacks import Callback, CSVLogger, EarlyStopping, ModelCheckpoint
from .errors import CheckpointError, CheckpointMismatchError, MissingExtraError, NonFiniteLossError
from .handler import NNHandler
from .history import History
from ._preemption import PREEMPTED_EXIT_CODE, TrainingPreempted

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "NNHandlerError",
    "LaunchEnvironmentError",
    "DeviceError",
    "ParallelExecutionError",
    "WorkerDiedError",
    "RankFailedError",
    "ParallelExecutor",
    "parallelize_on_gpus",
    "ExecutorTimeoutError",
    "worker_state",
    "initialize_ddp",
    "resolve_device",
    "should_use_distributed",
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
    "get_data_parallel_info",
    "validate_data_parallel_setup",
    # nn_handler.handler
    "NNHandler",
    "History",
    "Callback",
    "EarlyStopping",
    "ModelCheckpoint",
    "CSVLogger",
    "NonFiniteLossError",
    "CheckpointError",
    "CheckpointMismatchError",
    "MissingExtraError",
    "TrainingPreempted",
    "PREEMPTED_EXIT_CODE",
]
