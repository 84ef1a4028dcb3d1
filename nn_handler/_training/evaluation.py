"""Evaluate and predict: every sample counted exactly once over all ranks.

``DistributedSampler(drop_last=False)`` pads a dataset whose size does not
divide by the number of ranks; evaluation cuts the padding off each rank's
last batch, and prediction sends each output back with its sample index, so
neither counts a sample twice.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .._tree import tensors
from ..errors import ConfigurationError
from ..utils._collectives import check_collective_allowed, gather, side_group
from ..utils.parallel import parallel_predict
from . import batches as B
from . import data as D
from . import metrics as M
from . import outputs as O
from .buffers import sync_buffers
from .config import TrainingConfig
from .parts import Parts
from .sharding import is_sharded
from .uneven import even_batches


def eval_sums(parts: Parts, config: TrainingConfig, loader: DataLoader) -> list:
    """This rank's ``[loss_sum, count, metric_sums...]`` over its real (unpadded) samples."""
    module, loss_fn, metrics, precision = parts.module, parts.loss_fn, config.metrics, parts.precision
    sync_buffers(parts, "NNHandler.evaluate")  # rank 0's running statistics, as in the exported model
    was_training = module.training
    module.eval()
    real = D.real_sample_count(loader)
    losses, sizes = [], []
    metric_values: list[list] = [[] for _ in metrics]
    seen = 0
    # A sharded model's forward is a collective: every rank runs it on every batch, padding included.
    lockstep = is_sharded(module) and parts.in_group
    try:
        # The unwrapped module: DDP's forward is not needed without
        # gradients, and avoiding it keeps evaluation free of collectives.
        with torch.no_grad(), precision.autocast():
            for batch in even_batches(loader) if lockstep else loader:
                inputs, targets = B.split(B.move(batch, parts.device))
                B.check_targets(inputs, targets, loss_fn, "validation")
                n = B.size_of(inputs, targets)
                keep = n if real is None else min(n, real - seen)
                seen += n
                if keep <= 0 and not lockstep:
                    break  # only DistributedSampler padding is left
                if 0 < keep < n:
                    # Cut before the forward: a model's own loss then covers the real samples only.
                    inputs, targets = B.cut(inputs, targets, keep, n)  # per-sample lists too (names, texts)
                outputs = precision.convert_output(B.call(module, inputs))
                if keep <= 0:
                    continue
                losses.append(B.loss_of(outputs, targets, loss_fn).detach())
                sizes.append(keep)
                for values, fn in zip(metric_values, metrics.values()):
                    values.append(fn(outputs, targets))
    finally:
        module.train(was_training)
    if not losses:
        return [torch.zeros((), dtype=torch.float64), 0.0] + [0.0] * len(metrics)
    return M.batch_sums(torch.stack(losses).to(torch.float64), sizes, metric_values)


def evaluate(parts: Parts, config: TrainingConfig, loader: DataLoader) -> dict[str, float]:
    """``{"loss": ..., "<metric>": ...}`` over ``loader``, identical on every rank."""
    check_collective_allowed("NNHandler.evaluate")  # its sums meet in an all_reduce, a sharded forward is one
    D.check_not_empty(loader, "evaluation")
    totals, _ = M.reduce_over_ranks(eval_sums(parts, config, loader), [], parts.device, parts.distributed)
    if totals[1] == 0:
        raise ConfigurationError("evaluate(): the data yielded no samples")
    return {k.removeprefix("val_"): v for k, v in M.means("val_", totals, config.metrics).items()}


def predict(parts: Parts, config: TrainingConfig, loader: DataLoader, padding_value: float = -100) -> Any:
    """The model's outputs for every sample of ``loader``, in dataset order, on CPU, on every rank.

    A tensor output gives one tensor, a tuple one tuple, a mapping output (a Hugging Face ``ModelOutput``) the same
    kind of mapping, each of their batched tensors concatenated, padded with ``padding_value`` where the batches'
    lengths differ (:mod:`.outputs`).
    """
    check_collective_allowed("NNHandler.predict")  # the outputs meet in a gather, a sharded forward is a collective
    sampler = loader.sampler
    real = D.real_sample_count(loader)
    module = parts.module
    sync_buffers(parts, "NNHandler.predict")
    was_training = module.training
    module.eval()
    outputs, kind, dropped = [], None, set()  # kind: the type of the model's outputs (a tensor, a ModelOutput)
    lockstep = is_sharded(module) and parts.in_group  # a sharded forward is a collective
    try:
        with torch.no_grad(), parts.precision.autocast():
            for batch in even_batches(loader) if lockstep else loader:
                inputs, _ = B.split(B.move(batch, parts.device))
                out = parts.precision.convert_output(B.call(module, inputs))
                outputs.append(_batched(out, dropped))
                kind = type(out)
    finally:
        module.train(was_training)
    if parts.is_main_process:
        O.warn_dropped(dropped)
    local = O.concat(outputs, padding_value) if outputs else None
    if not isinstance(sampler, DistributedSampler) or not parts.in_group:
        if local is None:
            raise ConfigurationError("predict(): the data yielded no samples")
        return O.as_kind(kind, local)
    indices = list(iter(sampler))
    count = real if real is not None else len(indices)
    part = (indices[:count], None if local is None else B.head(local, count), kind)
    parts_of_ranks = [p for p in gather(side_group(), part) if p[1] is not None]  # not all_gather_object: numpy
    if not parts_of_ranks:
        raise ConfigurationError("predict(): the data yielded no samples")
    # The ranks' shards, each padded to its own longest, are padded to the longest of all as one batch would be.
    full = O.concat([out for _, out, _ in parts_of_ranks], padding_value)
    ordered = O.in_order(full, [i for indices, _, _ in parts_of_ranks for i in indices], len(sampler.dataset))
    return O.as_kind(parts_of_ranks[0][2], ordered)


def _batched(out: Any, dropped: set[str]) -> Any:
    """A batch's output as :func:`.outputs.batched_cpu` keeps it; an output with nothing batched is refused."""
    kept = O.batched_cpu(out, dropped)
    if kept is None or next(tensors(kept), None) is None:
        raise TypeError(f"predict() needs a model that returns tensors with a batch dimension (a tensor, a tuple of "
                        f"them, or a mapping such as a Hugging Face ModelOutput), got {type(out).__name__}")
    return kept


def predict_data_parallel(parts: Parts, config: TrainingConfig, data: Any, batch_size: int | None,
                          device_ids: Sequence[int | str] | None) -> torch.Tensor:
    """:func:`~nn_handler.parallel_predict` over the unwrapped model, from a single process."""
    if parts.in_group:
        raise ConfigurationError(
            "predict(data_parallel=True) starts one worker per device itself; call it from a single "
            "process, not from every DDP rank (plain predict() already splits the data over the ranks)"
        )
    if batch_size is None and isinstance(data, DataLoader):
        batch_size = data.batch_size
    if isinstance(data, tuple) and all(isinstance(t, torch.Tensor) for t in data):
        data = TensorDataset(*data)
    return parallel_predict(InputsOnly(parts.module), data, batch_size=batch_size or D.DEFAULT_BATCH_SIZE,
                            device_ids=device_ids, autocast=parts.precision.dtype or False)


class InputsOnly(nn.Module):
    """Feeds a model the inputs of ``(inputs, targets)`` batches, as :meth:`NNHandler.predict` does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *batch, **named):
        # parallel_predict calls a model with a mapping batch as model(**batch), which is what it needs.
        inputs, _ = B.split(batch if len(batch) > 1 else batch[0]) if batch else (named, None)
        out = B.call(self.model, inputs)
        if isinstance(out, Mapping):  # as predict(): its batched tensors, scalars such as the loss left out
            return O.as_kind(type(out), {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
        return out
