"""What :meth:`NNHandler.launch` runs inside the workers of a :class:`~nn_handler.ParallelExecutor`.

The executor owns the processes (start, death detection, shutdown); this
module only adds the rendezvous: each worker takes a rank, exports the
launcher variables ``initialize_ddp`` reads, and joins the group.

Private: NNHandler.launch is the public face.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch

from .utils.ddp import _cuda_count, find_free_port

__all__ = ["launch"]


def _claim_rank(claim_dir: str, world_size: int) -> int:
    # Workers on CPU all get the device "cpu", so the device cannot tell them
    # apart: each takes the lowest rank whose claim file it creates first
    # (O_EXCL makes the creation atomic, so no two workers get one rank).
    for rank in range(world_size):
        try:
            os.close(os.open(os.path.join(claim_dir, f"rank{rank}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return rank
        except FileExistsError:
            continue
    raise RuntimeError(f"more workers than the {world_size} ranks of this launch")


def _join_group(claim_dir: str, devices: list[str], port: int, device: torch.device) -> None:
    from .utils.ddp import initialize_ddp

    world_size = len(devices)
    # A GPU worker's rank is its GPU's position, so LOCAL_RANK names the GPU
    # the pool already pinned it to.
    rank = devices.index(str(device)) if device.type == "cuda" else _claim_rank(claim_dir, world_size)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    initialize_ddp()


def _run_rank(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device | None = None) -> Any:
    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        return rank, fn(*args, **kwargs)
    except BaseException:
        # Peers may be waiting in a collective for this rank; tearing the
        # group down closes its connections, so they fail now instead of at
        # the group's timeout, and the caller sees every rank's error.
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], args: tuple, kwargs: dict, nprocs: int | None, timeout: float | None) -> Any:
    """Run ``fn(*args, **kwargs)`` on a fresh local process group of ``nprocs`` ranks; rank 0's result."""
    from .utils.ddp_decorators import ParallelExecutor

    gpus = _cuda_count()
    if nprocs is None:
        if gpus == 0:
            raise ValueError("NNHandler.launch(fn, nprocs=N): without GPUs, say how many CPU processes to start")
        nprocs = gpus
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    if gpus and nprocs > gpus:
        raise ValueError(f"nprocs={nprocs} but this machine has {gpus} GPUs; one process per GPU")
    devices = [f"cuda:{i}" for i in range(nprocs)] if gpus else ["cpu"] * nprocs
    with tempfile.TemporaryDirectory(prefix="nn_handler-launch-") as claim_dir:
        executor = ParallelExecutor(device_ids=devices, timeout=timeout, initializer=_join_group,
                                    initargs=(claim_dir, devices, find_free_port()))
        with executor:
            results = dict(executor.run(_run_rank, fn, args, kwargs))
    return results[0]
