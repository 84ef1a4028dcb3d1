"""The epoch's numbers: weighted sums, one all-reduce over the ranks, means, non-finite losses.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import operator
import resource
import sys
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import NonFiniteLossError
from ..utils._collectives import gather, side_group
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


_DTYPE = operator.attrgetter("dtype")


def _stacked(values: list, device: torch.device | str) -> torch.Tensor:
    """Per-batch values (scalar tensors or numbers) as one float64 tensor on ``device``.

    Example:
        >>> _stacked([torch.tensor(1.5), 2, torch.tensor([3.0])], "cpu")
        tensor([1.5000, 2.0000, 3.0000], dtype=torch.float64)
    """
    try:
        # The step's detached scalar tensors, of one dtype (read in C: this is every batch's value): one stack and
        # one conversion, exact as each one's. Numbers, shapes (1,), several dtypes or devices (a resumed epoch's
        # values from its checkpoint) take the way below.
        if len(set(map(_DTYPE, values))) == 1:
            t = torch.stack(values)
            if t.dim() == 1:
                return t.detach().to(device, torch.float64)
    except (AttributeError, TypeError, RuntimeError):
        pass
    return torch.stack([torch.as_tensor(v).detach().reshape(()).to(device, torch.float64) for v in values])


def weighted_sum(values: list, weights: torch.Tensor) -> torch.Tensor:
    return (_stacked(values, weights.device) * weights).sum()


def as_float64(values: list) -> torch.Tensor:
    """Per-batch metric values as one float64 CPU tensor (what a mid-epoch checkpoint keeps)."""
    return _stacked(values, "cpu") if values else torch.zeros(0, dtype=torch.float64)


class Columns:
    """What a step returns besides its loss, by key: the value of each batch that reported it, and its samples.

    A key is averaged over the batches that report it, weighted by their
    samples, as Lightning's ``self.log`` averages a value logged on some
    steps only (a WGAN's generator loss, on its generator steps).

    Example:
        >>> columns = Columns()
        >>> columns.add({"d": 1.0, "g": 4.0}, 8)
        >>> columns.add({"d": 3.0}, 8)
        >>> sums = [float(s) for s in columns.sums(["d", "g", "x"], torch.device("cpu"))]
        >>> sums                      # (sum, samples) of each key: "x" came with no batch
        [32.0, 16.0, 32.0, 8.0, 0.0, 0.0]
        >>> means("train_", [0.0, 16.0, *sums], ["d", "g", "x"])
        {'train_loss': 0.0, 'train_d': 2.0, 'train_g': 4.0}
    """

    def __init__(self) -> None:
        self.values: dict[str, list] = {}
        self.sizes: dict[str, list[int]] = {}

    def add(self, returned: Mapping[str, Any], size: int) -> None:
        for name, value in returned.items():
            column = self.values.get(name)
            if column is None:
                column = self.values[name] = []
                self.sizes[name] = []
            column.append(value)
            self.sizes[name].append(size)

    def sums(self, names: list[str], device: torch.device) -> list:
        """``[sum, samples]`` of each of ``names``, flat (``0.0, 0.0`` for a key this rank's batches never had)."""
        out: list = []
        for name in names:
            sizes = self.sizes.get(name)
            if sizes:
                out += [weighted_sum(self.values[name], torch.tensor(sizes, dtype=torch.float64, device=device)),
                        float(sum(sizes))]
            else:
                out += [0.0, 0.0]
        return out

    def state(self) -> dict[str, Any]:
        """What a mid-epoch checkpoint keeps of them."""
        return {"keys": list(self.values), "metrics": [as_float64(v) for v in self.values.values()],
                "metric_sizes": [torch.tensor(s, dtype=torch.int64) for s in self.sizes.values()]}

    @classmethod
    def restored(cls, state: Mapping[str, Any], sizes: list[int]) -> "Columns":
        """From :meth:`state` (before ``metric_sizes`` was kept, every key came with every batch of ``sizes``)."""
        columns = cls()
        kept = state.get("metric_sizes") or [None] * len(state["metrics"])
        for name, values, n in zip(state.get("keys", []), state["metrics"], kept):
            columns.values[name] = list(values.unbind(0))
            columns.sizes[name] = list(sizes) if n is None else [int(k) for k in n]
        return columns


def agree_on_names(names: list[str], fixed: bool, in_group: bool) -> list[str]:
    """The value keys of every rank, in one order: their union, rank 0's first (one small gather per call).

    The epoch's sums meet in one all-reduce, by position: keys that differ
    between ranks would be summed into each other's columns. A key that some
    rank never had is there ``0, 0`` (no batch reported it). Keys known
    beforehand (``fixed``: the built-in step's metrics) are the same everywhere.
    """
    if fixed or not in_group or not is_distributed():
        return names
    union: dict[str, None] = {}
    for theirs in gather(side_group(), names):
        union.update(dict.fromkeys(theirs))
    return list(union)


def batch_sums(stacked: torch.Tensor, sizes: list[int], columns: Columns, names: list[str]) -> list:
    """``[loss_sum, count, (sum, samples) per name...]``: float64 losses and values, each weighted by its samples."""
    weights = torch.tensor(sizes, dtype=torch.float64, device=stacked.device)
    return [(stacked * weights).sum(), float(sum(sizes))] + columns.sums(names, stacked.device)


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


def means(prefix: str, sums: list[float], names: list[str]) -> dict[str, float]:
    """``{prefix + "loss": ..., prefix + name: ...}`` from ``[loss_sum, count, (sum, samples) per name...]``.

    A name that no batch reported (on any rank) is left out of the row.
    """
    out = {f"{prefix}loss": sums[0] / sums[1]}
    for i, name in enumerate(names):
        total, n = sums[2 + 2 * i], sums[3 + 2 * i]
        if n:
            out[f"{prefix}{name}"] = total / n
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
