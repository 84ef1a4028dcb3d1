"""Decorators for distributed and multi-GPU code: the public face; the machinery lives in private modules.

- :func:`on_rank`: run a function on some ranks only; a failure there raises
  on every rank, so no rank waits forever at the next collective.
- :func:`main_process_first`: rank 0 runs a block first, then the others.
- :func:`any_rank` / :func:`all_ranks`: agree on a flag across ranks.
- :func:`parallel_on_all_devices`: a function as the forward of ``nn.DataParallel``.
- :class:`ParallelExecutor` / :func:`parallelize_on_gpus`: a warm pool with
  one worker process per device; a call runs on every device at once.

Example:
    >>> from nn_handler.utils.ddp_decorators import on_rank
    >>> @on_rank(0)
    ... def log(message):
    ...     return message.upper()
    >>> log("epoch 1 done")   # single process: runs here
    'EPOCH 1 DONE'
"""

from ._collectives import all_ranks, any_rank
from ._models.data_parallel import parallel_on_all_devices
from ._workers.executor import ExecutorTimeoutError, ParallelExecutor, worker_state
from ._workers.reusable import parallelize_on_gpus
from ._rank import main_process_first, on_rank

__all__ = [
    "on_rank",
    "main_process_first",
    "any_rank",
    "all_ranks",
    "parallel_on_all_devices",
    "ParallelExecutor",
    "parallelize_on_gpus",
    "ExecutorTimeoutError",
    "worker_state",
]
