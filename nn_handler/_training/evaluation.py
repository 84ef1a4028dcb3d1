"""Evaluate and predict: every sample counted exactly once over all ranks.

``DistributedSampler(drop_last=False)`` pads a dataset whose size does not
divide by the number of ranks; evaluation cuts the padding off each rank's
last batch, and prediction sends each output back with its sample index, so
neither counts a sample twice.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .._padding import pad_concat
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
from .context import StepContext
from .parts import Parts, builtin_validation
from .sharding import is_sharded
from .step import StepValues, ValidationStep
from .uneven import even_batches

log = logging.getLogger(__name__)


def eval_sums(parts: Parts, config: TrainingConfig, loader: DataLoader,
              epoch: int | None = None) -> tuple[list, list[str]]:
    """This rank's ``[loss_sum, count, (value_sum, samples)...]`` over its real (unpadded) samples, and the values'
    names, agreed with the other ranks.

    The validation step (the handler's ``validation_step``, else the built-in
    loss and metrics) runs under ``torch.no_grad()`` on the models themselves.
    """
    step, values = validation_step(parts, config)
    ctx = StepContext(parts.modules, parts.optimizers, parts.precision, parts.device, training=False)
    ctx.epoch = parts.view.epoch if epoch is None else epoch
    ctx.global_step = parts.view.global_step
    sync_buffers(parts, "NNHandler.evaluate")  # rank 0's running statistics, as in the exported model
    modes = [(module, module.training) for module in parts.modules.values()]
    for module, _ in modes:
        module.eval()
    real = D.real_sample_count(loader)
    losses, sizes, columns = [], [], M.Columns()
    seen = 0
    # A sharded model's forward is a collective: every rank runs it on every batch, padding included.
    lockstep = parts.in_group and any(is_sharded(m) for m in parts.modules.values())
    try:
        with torch.no_grad():
            for batch in even_batches(loader) if lockstep else loader:
                batch = B.move(batch, parts.device)
                n = B.sample_count(batch)
                keep = n if real is None else min(n, real - seen)
                seen += n
                if keep <= 0 and not lockstep and values.names is not None:
                    break  # only DistributedSampler padding is left (a step that names its values ran once)
                if 0 < keep < n:
                    # Cut before the forward: a model's own loss then covers the real samples only.
                    batch = B.head(batch, keep, rows=n)  # per-sample lists too (names, texts)
                loss, returned = values.read(step(ctx, batch))
                if keep <= 0:
                    continue
                losses.append(loss)
                sizes.append(keep)
                if returned:
                    columns.add(returned, keep)
    finally:
        for module, was_training in modes:
            module.train(was_training)
    names = M.agree_on_names(list(values.names if values.fixed else columns.values), values.fixed, parts.in_group)
    if not losses:
        return [torch.zeros((), dtype=torch.float64), 0.0] + columns.sums(names, parts.device), names
    return M.batch_sums(torch.stack(losses).to(torch.float64), sizes, columns, names), names


def validation_step(parts: Parts, config: TrainingConfig) -> tuple[Callable, StepValues]:
    """The validation step (the handler's ``validation_step``, else the built-in one), and its reader.

    Raises:
        ConfigurationError: There is neither (a ``training_step`` without ``validation_step`` or ``loss_fn``).
    """
    if config.validation_step is not None:
        return config.validation_step, StepValues("validation_step")
    if not builtin_validation(config, parts.models, parts.loss_fn):
        raise ConfigurationError(NO_VALIDATION)
    return ValidationStep(parts.loss_fn, config.metrics, parts.precision), StepValues("the step", list(config.metrics))


def validation_runs(parts: Parts, config: TrainingConfig) -> bool:
    """True when ``train()`` validates: a validation loader and a validation step; without a step, one log line."""
    if parts.val_loader is None:
        return False
    if config.validation_step is not None or builtin_validation(config, parts.models, parts.loss_fn):
        return True
    if parts.is_main_process:
        log.warning("validation skipped: %s", NO_VALIDATION)
    return False


NO_VALIDATION = ("no validation step: with training_step (or several models) pass validation_step=fn(ctx, batch), "
                 "or, with one model, a loss_fn")


def evaluate(parts: Parts, config: TrainingConfig, loader: DataLoader) -> dict[str, float]:
    """``{"loss": ..., "<name>": ...}`` over ``loader``, identical on every rank."""
    check_collective_allowed("NNHandler.evaluate")  # its sums meet in an all_reduce, a sharded forward is one
    D.check_not_empty(loader, "evaluation")
    sums, names = eval_sums(parts, config, loader)
    totals, _ = M.reduce_over_ranks(sums, [], parts.device, parts.distributed)
    if totals[1] == 0:
        raise ConfigurationError("evaluate(): the data yielded no samples")
    return {k.removeprefix("val_"): v for k, v in M.means("val_", totals, names).items()}


def predict(parts: Parts, module: nn.Module, loader: DataLoader, padding_value: float = -100) -> Any:
    """``module``'s outputs for every sample of ``loader``, in dataset order, on CPU, on every rank.

    A tensor output gives one tensor, a tuple one tuple, a mapping output (a Hugging Face ``ModelOutput``) the same
    kind of mapping, each of their batched tensors concatenated, padded with ``padding_value`` where the batches'
    lengths differ (:func:`nn_handler._padding.pad_concat`).
    """
    check_collective_allowed("NNHandler.predict")  # the outputs meet in a gather, a sharded forward is a collective
    sampler = loader.sampler
    real = D.real_sample_count(loader)
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
    local = pad_concat(outputs, padding_value) if outputs else None
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
    full = pad_concat([out for _, out, _ in parts_of_ranks], padding_value)
    ordered = O.in_order(full, [i for indices, _, _ in parts_of_ranks for i in indices], len(sampler.dataset))
    return O.as_kind(parts_of_ranks[0][2], ordered)


def _batched(out: Any, dropped: set[str]) -> Any:
    """A batch's output as :func:`.outputs.batched_cpu` keeps it; an output with nothing batched is refused."""
    kept = O.batched_cpu(out, dropped)
    if kept is None or next(tensors(kept), None) is None:
        raise TypeError(f"predict() needs a model that returns tensors with a batch dimension (a tensor, a tuple of "
                        f"them, or a mapping such as a Hugging Face ModelOutput), got {type(out).__name__}")
    return kept


def predict_data_parallel(parts: Parts, module: nn.Module, data: Any, batch_size: int | None,
                          device_ids: Sequence[int | str] | None, padding_value: float = -100) -> Any:
    """:func:`~nn_handler.parallel_predict` over ``module`` (unwrapped), from a single process: the same outputs as
    :func:`predict` (ragged ones padded with ``padding_value``)."""
    if parts.in_group:
        raise ConfigurationError(
            "predict(data_parallel=True) starts one worker per device itself; call it from a single "
            "process, not from every DDP rank (plain predict() already splits the data over the ranks)"
        )
    if batch_size is None and isinstance(data, DataLoader):
        batch_size = data.batch_size
    if isinstance(data, tuple) and all(isinstance(t, torch.Tensor) for t in data):
        data = TensorDataset(*data)
    return parallel_predict(InputsOnly(module), data, batch_size=batch_size or D.DEFAULT_BATCH_SIZE,
                            device_ids=device_ids, autocast=parts.precision.dtype or False,
                            padding_value=padding_value)


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
        return O.batched_cpu(out, set())  # as predict(): a scalar (a loss) in a tuple is None
