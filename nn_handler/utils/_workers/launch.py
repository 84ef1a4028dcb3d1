"""What :meth:`NNHandler.launch` runs inside the workers of a :class:`~nn_handler.ParallelExecutor`.

The executor owns the processes (start, death detection, shutdown, fail-fast);
this module only adds the rendezvous: each worker takes its pool position as
its rank, exports the launcher variables ``initialize_ddp`` reads, and joins.

Private: NNHandler.launch is the public face.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from ..._checks import check_int
from .._devices import cuda_count
from ..ddp import find_free_port

__all__ = ["launch"]


def _join_group(devices: list[str], port: int, device: torch.device) -> None:
    from .worker import worker_index
    from ..ddp import initialize_ddp

    # The worker's position in the pool is its rank, and on GPUs also the
    # position of the GPU the pool pinned it to, so LOCAL_RANK names that GPU.
    rank, world_size = worker_index(), len(devices)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    initialize_ddp()


def _run_rank(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device | None = None) -> Any:
    import torch.distributed as dist

    result = fn(*args, **kwargs)
    # Only on success: after a failure the group is left as it is, so the
    # failed rank's own error reaches the caller first (fail-fast) rather
    # than a peer's "connection closed"; the pool then kills every worker.
    dist.destroy_process_group()
    return result


def launch(fn: Callable[..., Any], args: tuple, kwargs: dict, nprocs: int | None, timeout: float | None) -> Any:
    """Run ``fn(*args, **kwargs)`` on a fresh local process group of ``nprocs`` ranks; rank 0's result."""
    from .executor import ParallelExecutor

    gpus = cuda_count()
    if nprocs is None:
        if gpus == 0:
            raise ValueError("NNHandler.launch(fn, nprocs=N): without GPUs, say how many CPU processes to start")
        nprocs = gpus
    check_int("nprocs", nprocs, minimum=1)
    if gpus and nprocs > gpus:
        raise ValueError(f"nprocs={nprocs} but this machine has {gpus} GPUs; one process per GPU")
    devices = [f"cuda:{i}" for i in range(nprocs)] if gpus else ["cpu"] * nprocs
    executor = ParallelExecutor(device_ids=devices, timeout=timeout, initializer=_join_group,
                                initargs=(devices, find_free_port()))
    with executor:
        # Errors name the user's function, not the wrapper that runs it.
        name = getattr(fn, "__qualname__", None) or repr(fn)
        return executor._run(_run_rank, (fn, args, kwargs), {}, fail_fast=True, name=name)[0]
