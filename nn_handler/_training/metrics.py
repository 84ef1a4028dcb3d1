"""The epoch's numbers: weighted sums, one all-reduce over the ranks, means, non-finite losses.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import NonFiniteLossError
from ..utils._stall import watching
from ..utils.ddp import is_distributed
from . import batches as B


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
        with watching("all_reduce (loss and metrics over ranks)"):
            dist.all_reduce(t)
    flat = t.cpu().tolist()
    return flat[:n], [flat[n + r * k:n + (r + 1) * k] for r in range(world)]


def weighted_sum(values: list, weights: torch.Tensor) -> torch.Tensor:
    t = torch.stack([torch.as_tensor(v).detach().reshape(()).to(weights.device, torch.float64) for v in values])
    return (t * weights).sum()


def as_float64(values: list) -> torch.Tensor:
    """Per-batch metric values as one float64 CPU tensor (what a mid-epoch checkpoint keeps)."""
    return torch.stack([torch.as_tensor(v).detach().reshape(()).to("cpu", torch.float64) for v in values]) \
        if values else torch.zeros(0, dtype=torch.float64)


def batch_sums(stacked: torch.Tensor, sizes: list[int], metric_values: list[list]) -> list:
    """``[loss_sum, count, metric_sums...]`` from the batches' float64 losses, each weighted by its sample count."""
    weights = torch.tensor(sizes, dtype=torch.float64, device=stacked.device)
    return [(stacked * weights).sum(), float(sum(sizes))] + [weighted_sum(v, weights) for v in metric_values]


def real_part(outputs: Any, targets: Any, loss: torch.Tensor, keep: int, rows: int,
              loss_fn: Callable | None) -> tuple[torch.Tensor, Any, Any]:
    """``(loss, outputs, targets)`` of a batch's first ``keep`` of ``rows`` rows, for the epoch's sums.

    The loss is ``loss_fn`` over those rows, without a second forward. A model's own loss (no ``loss_fn``) is
    the one it computed over the whole batch: it has no per-row form.

    Example:
        >>> import torch
        >>> out, y = torch.tensor([[1.0], [3.0]]), torch.zeros(2, 1)
        >>> real_part(out, y, torch.tensor(5.0), 1, 2, torch.nn.MSELoss())[0]
        tensor(1.)
    """
    if keep == 0:
        return loss, outputs, targets  # weighed 0
    with torch.no_grad():
        outputs, targets = B.head(outputs, keep, rows), B.head(targets, keep, rows)
        if loss_fn is not None:
            loss = loss_fn(outputs, targets).detach()
    return loss, outputs, targets


def means(prefix: str, sums: list[float], metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{prefix + "loss": ..., prefix + name: ...}`` from ``[loss_sum, count, metric_sums...]``."""
    n = sums[1]
    out = {f"{prefix}loss": sums[0] / n}
    out.update({f"{prefix}{name}": s / n for name, s in zip(metrics, sums[2:])})
    return out


def first_nonfinite(losses: torch.Tensor) -> tuple[int, float]:
    """``(index, value)`` of the first NaN/inf entry, or ``(-1, 0.0)``."""
    bad = (~torch.isfinite(losses)).nonzero()
    if bad.numel() == 0:
        return -1, 0.0
    i = int(bad[0, 0])
    return i, float(losses[i])


def raise_nonfinite(epoch: int, bad: list[tuple[int, int, float]], distributed: bool) -> None:
    """Raise for the earliest ``(rank, step, value)``; the same error on every rank."""
    step = min(s for _, s, _ in bad)
    value = next(v for _, s, v in bad if s == step)
    # Name the ranks where it started: through the gradient all-reduce a
    # NaN on one rank reaches every rank's weights one step later.
    ranks = [r for r, s, _ in bad if s == step] if distributed else ()
    raise NonFiniteLossError(epoch, step, value, ranks)


def raise_if_nonfinite(losses: list[torch.Tensor], epoch: int, device: torch.device, distributed: bool) -> None:
    """Check the epoch's losses so far on every rank (one small collective when distributed)."""
    step, value = first_nonfinite(torch.stack(losses))
    _, ranks = reduce_over_ranks([], [step, value], device, distributed)
    bad = [(r, int(v[0]), v[1]) for r, v in enumerate(ranks) if v[0] >= 0]
    if bad:
        raise_nonfinite(epoch, bad, distributed)
