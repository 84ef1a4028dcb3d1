"""Small pieces of the training loop that do not need the handler: batches, reductions, AMP, memory.

Private: :mod:`nn_handler.handler` is the public face.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ._tree import apply, tensors, to_device  # noqa: F401  (to_device: the loop's name for it)
from .utils.ddp import is_distributed


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch: a pair gives both, a lone tensor or 1-tuple only inputs."""
    if isinstance(batch, (list, tuple)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
        raise ValueError(
            f"a batch must be (inputs, targets) or inputs alone, got a {type(batch).__name__} of {len(batch)} items; "
            f"give the loader a collate_fn that returns a pair"
        )
    return batch, None


def batch_size_of(inputs: Any, targets: Any) -> int:
    """Number of samples in a batch: the first dimension of the targets, else of the inputs."""
    for obj in (targets, inputs):
        first = obj if isinstance(obj, torch.Tensor) else next((t for _, t in tensors(obj)), None)
        if first is not None and first.dim() > 0:
            return first.shape[0]
    raise ValueError("cannot tell the batch size: neither targets nor inputs hold a tensor with a batch dimension")


def head(obj: Any, n: int) -> Any:
    """The first ``n`` samples of a batch-shaped object (tensors inside tuples, lists, dicts, dataclasses)."""
    return apply(obj, lambda t: t[:n])


def real_sample_count(loader: DataLoader) -> int | None:
    """How many of this rank's samples are real when a ``DistributedSampler`` pads the dataset.

    ``DistributedSampler(drop_last=False)`` repeats samples so every rank gets
    the same count; the repeats occupy the last global positions, so on each
    rank they are the trailing ones. Returns ``None`` when nothing is padded.
    """
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    n = len(sampler.dataset)
    return len(range(sampler.rank, n, sampler.num_replicas))


def autocast_context(device: torch.device, enabled: bool):
    """bf16 autocast on CPU, fp16 on CUDA; a no-op context when disabled."""
    if not enabled:
        return contextlib.nullcontext()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA allocations since the last reset; on CPU the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def comm_device(device: torch.device) -> torch.device:
    """Where a tensor must live for a collective of the default group (NCCL needs CUDA)."""
    if is_distributed() and dist.get_backend() == "nccl":
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_over_ranks(
    sums: Sequence[float | torch.Tensor], mine: Sequence[float], device: torch.device, distributed: bool = True
) -> tuple[list[float], list[list[float]]]:
    """In one all-reduce: ``sums`` summed over ranks, and every rank's ``mine`` in rank order.

    ``mine`` must have the same length on every rank. Without a process group
    (or with ``distributed=False``) the totals are the values themselves and
    there is one rank.
    """
    distributed = distributed and is_distributed()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    n, k = len(sums), len(mine)
    t = torch.zeros(n + world * k, dtype=torch.float64)
    if n:
        t[:n] = torch.stack([torch.as_tensor(v).detach().to("cpu", torch.float64).reshape(()) for v in sums])
    if k:
        t[n + rank * k:n + (rank + 1) * k] = torch.tensor([float(v) for v in mine], dtype=torch.float64)
    if world > 1:
        t = t.to(comm_device(device))
        dist.all_reduce(t)
    flat = t.cpu().tolist()
    return flat[:n], [flat[n + r * k:n + (r + 1) * k] for r in range(world)]


# Under torchrun, when one rank fails its peers fail a moment later, in the
# collective that waited for it ("Connection closed by peer"). torchrun names
# as root cause the failure with the earliest timestamp, in whole seconds, and
# the lowest rank on a tie, so a peer's secondary error could be reported
# instead of the rank that really failed. A peer that waits a little lets the
# agent see the real failure first; the agent then stops it with SIGTERM, so
# the wait rarely runs to its end.
PEER_FAILURE_GRACE_S = 2.0
_PEER_FAILURE_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_peer_failure(exc: BaseException) -> bool:
    """True for the errors a rank gets when another rank of its group went away.

    Example:
        >>> is_peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4242"))
        True
        >>> is_peer_failure(ValueError("bad batch"))
        False
    """
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_FAILURE_TEXT)


def wait_if_peer_failed(exc: BaseException, environ: Mapping[str, str] | None = None) -> bool:
    """Under torchrun, pause :data:`PEER_FAILURE_GRACE_S` before a peer failure propagates; True if it paused."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ or not is_peer_failure(exc):
        return False
    time.sleep(PEER_FAILURE_GRACE_S)
    return True
