"""nn_handler: decorator-centric parallel execution for PyTorch.

Example:
    >>> import nn_handler
    >>> nn_handler.initialize_ddp()[0]   # a plain `python` run is not distributed
    False
"""

from .errors import (
    DeviceError,
    LaunchEnvironmentError,
    NNHandlerError,
    ParallelExecutionError,
    RankFailedError,
    WorkerDiedError,
)
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

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "NNHandlerError",
    "LaunchEnvironmentError",
    "DeviceError",
    "ParallelExecutionError",
    "WorkerDiedError",
    "RankFailedError",
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
]
