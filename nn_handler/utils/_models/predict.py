"""Data-parallel inference over every device: the public face of :mod:`nn_handler._inference`.

``parallel_predict`` checks its arguments and hands the model and the input to the inference engine
(:mod:`nn_handler._inference.engine`): batches go out to a :class:`~nn_handler.ParallelExecutor`'s workers, the
outputs come back in input order or are written to a predictions directory. Public names are re-exported by
:mod:`nn_handler.utils.parallel`.
"""

from __future__ import annotations

import copy
import itertools
import os
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..._checks import check_bool, check_choice, check_int
from ..._inference import engine
from ..._inference.sources import Source
from ...errors import ConfigurationError
from .placement import DEVICE_MAP_ATTR
from .wrap import unwrap_parallel_model
from .._devices import cuda_count, split_device_ids

__all__ = ["parallel_predict", "get_data_parallel_info", "validate_data_parallel_setup"]


def _cpu_copy(model: nn.Module) -> nn.Module:
    """The model itself when it lives on the CPU, else a CPU copy made without a second copy on its device."""
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if all(t.device.type == "cpu" for t in tensors):
        return model
    # deepcopy consults the memo by id: hand it CPU versions of every
    # parameter and buffer so nothing is duplicated on the GPU.
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().cpu(), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().cpu()
    return copy.deepcopy(model, memo)


def _check_autocast(autocast) -> bool | torch.dtype:
    if isinstance(autocast, (bool, torch.dtype)):
        return autocast
    raise ConfigurationError(f"autocast must be True, False or a torch.dtype, got {autocast!r}")


def parallel_predict(
    model_or_factory: nn.Module | Callable[..., nn.Module],
    data,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    length: Callable[[Any], int] | None = None,
    collate_fn: Callable[[list], Any] | None = None,
    output_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    on_error: str = "raise",
    padding_value: float = -100,
    device_ids: Sequence[int | str] | None = None,
    backend: str = "local",
    autocast: bool | torch.dtype = False,
    num_workers: int = 0,
    progress: bool = False,
):
    """Run a model over a data set on every device at once; outputs in input order, in memory or on disk.

    One worker per device (a :class:`~nn_handler.ParallelExecutor`) builds the model once (or gets it once);
    the input is read here as it goes, formed into batches, and only the batches travel, at most
    :data:`~nn_handler._inference.engine.IN_FLIGHT_PER_DEVICE` per device at a time, to whichever device is
    free. Runs under ``torch.inference_mode`` with the model in ``eval()`` mode. Without CUDA it runs on CPU
    workers.

    A batch that is a tensor is called as ``model(batch)``, a tuple or list as ``model(*batch)``, a dict as
    ``model(**batch)``: give it inputs only. The model returns batched outputs (a tensor, or a tuple / dict of
    them, each with the batch along dim 0), or a ``list`` with one output per item (per-sample tensors of their
    own shapes).

    With ``output_dir``, each finished batch's outputs are written there at once (one safetensors shard per
    batch, see :class:`~nn_handler.Predictions`) and the call returns a :class:`~nn_handler.Predictions` that
    reads them lazily: the caller's memory stays bounded whatever the data set's size. The same call again
    after a crash or a kill keeps what is on disk and computes only the missing items (it says so on stderr);
    a rerun over other data or settings is refused (``overwrite=True`` starts over).

    Args:
        model_or_factory: An ``nn.Module`` (a model on a GPU is sent as a CPU copy), or a picklable callable
            returning one, called in each worker (with ``device=`` when it has that parameter); prefer a factory
            for large models.
        data: A tensor (split along dim 0), a map-style ``Dataset``, a ``DataLoader`` (its dataset and
            ``collate_fn``, in dataset order), a list of samples, or any iterable of samples (a generator, an
            ``IterableDataset``: read once, as it goes, no ``len`` needed).
        batch_size: Samples per batch (with a ``DataLoader``, its own by default). With ``max_tokens``: at most
            this many.
        max_tokens: Token budget per batch instead: items are sorted by ``length`` within windows of
            :data:`~nn_handler._inference.batching.SORT_WINDOW` items and cut into batches whose longest item
            times their item count is at most ``max_tokens``; an item longer than that is a batch of its own.
        length: ``length(sample) -> int``, an item's length (``len`` for sequences). Needed by ``max_tokens``;
            with ``output_dir``, each item's per-position outputs (tensors of two dims or more after the batch's)
            are stored cut to its own length along the first of them, where the batch padded them to its longest.
        collate_fn: Builds a batch from a list of samples, as a ``DataLoader``'s does; the ``DataLoader``'s own,
            else ``default_collate``, by default.
        output_dir: Write the outputs there as they come (and resume from what is there); ``None``: return them.
        overwrite: Remove the outputs already in ``output_dir`` and start over.
        on_error: ``"raise"``: a batch whose forward raises fails the call, with its item range and the worker's
            traceback, once every other batch in flight is done (and written). ``"skip"`` (with ``output_dir``):
            record its items in ``Predictions.failed`` and go on; a rerun tries them again. A batch of several
            items that runs out of device memory is first retried once as two halves.
        padding_value: In memory, outputs whose shapes differ between batches (per-token outputs of batches
            padded each to their longest) are padded to the longest with it.
        device_ids: Devices, e.g. ``[0, 1]`` or ``["cpu", "cpu"]``; all GPUs by default (one CPU worker, with a
            ``RuntimeWarning``, without CUDA). With ``backend="ray"``: ``"cuda"`` or ``"cpu"`` per actor.
        backend: ``"local"`` (worker processes here) or ``"ray"`` (Ray actors anywhere in the cluster; give
            ``output_dir`` on storage every node sees). A batch whose worker dies is run again elsewhere.
        autocast: Mixed precision: ``True`` (float16 on CUDA, bfloat16 on CPU) or a dtype.
        num_workers: Threads that read samples of a map-style data set ahead, here in the caller (they help where
            reading releases the GIL: files, image decoding, tokenizers).
        progress: Show progress in items (a bar on a terminal, a line every few seconds in a log: items done,
            items/s, time left).

    Returns:
        Without ``output_dir``: the outputs of all batches joined along dim 0 in input order (a tensor, or a
        tuple / list / dict of tensors), padded with ``padding_value`` where they differ; a list of per-item
        outputs when the model returns one; other outputs as a list with one entry per batch. With
        ``output_dir``: a :class:`~nn_handler.Predictions`.

    Raises:
        ConfigurationError: Bad arguments, empty data, or an ``output_dir`` holding another run's outputs.
        ParallelExecutionError: The model failed on a worker (with its remote traceback and, in a note, the
            batch's items).
        DeviceError: A device id that does not exist.

    Example:
        >>> import torch, torch.nn as nn
        >>> torch.manual_seed(0) and None
        >>> model = nn.Linear(3, 2)
        >>> x = torch.randn(10, 3)
        >>> out = parallel_predict(model, x, batch_size=4, device_ids=["cpu", "cpu"])
        >>> torch.allclose(out, model(x))
        True
    """
    check_int("batch_size", batch_size, minimum=1, allow_none=True)
    check_int("max_tokens", max_tokens, minimum=1, allow_none=True)
    check_int("num_workers", num_workers, minimum=0)
    check_choice("on_error", on_error, ("raise", "skip"))
    check_choice("backend", backend, ("local", "ray"))
    check_bool("overwrite", overwrite)
    check_bool("progress", progress)
    autocast = _check_autocast(autocast)
    for name, fn in (("length", length), ("collate_fn", collate_fn)):
        if fn is not None and not callable(fn):
            raise ConfigurationError(f"{name} must be a function or None, got {fn!r}")
    if max_tokens is not None and length is None:
        raise ConfigurationError("max_tokens needs length=fn(sample) -> int, an item's length (len for sequences)")
    if on_error == "skip" and output_dir is None:
        raise ConfigurationError("on_error='skip' needs output_dir=: the failed items are recorded in its manifest "
                                 "(Predictions.failed)")
    payload, is_factory = _model_payload(model_or_factory)
    if batch_size is None and max_tokens is None:
        batch_size = data.batch_size if isinstance(data, DataLoader) else None
        if batch_size is None:
            raise ConfigurationError("parallel_predict needs batch_size=N, or max_tokens=N with length=fn")
    source = Source.of(data)
    return engine.predict(payload, is_factory, source, batch_size=batch_size, max_tokens=max_tokens, length=length,
                          collate_fn=collate_fn, device_ids=device_ids, autocast=autocast, num_workers=num_workers,
                          output_dir=output_dir, overwrite=overwrite, on_error=on_error, padding_value=padding_value,
                          backend=backend, progress=progress)


def _model_payload(model_or_factory) -> tuple[Any, bool]:
    """What travels to the workers: a CPU copy of the model, or the factory."""
    if isinstance(model_or_factory, nn.Module):
        model = unwrap_parallel_model(model_or_factory)
        if hasattr(model, DEVICE_MAP_ATTR):
            raise ConfigurationError(
                "the model is spread over several devices by dispatch_model; parallel_predict puts a whole copy "
                "on each device. Pass a model (or factory) that fits on one device"
            )
        payload, is_factory = _cpu_copy(model), False
    elif callable(model_or_factory):
        payload, is_factory = model_or_factory, True
    else:
        raise TypeError(
            f"model_or_factory must be an nn.Module or a callable that returns one, got {type(model_or_factory).__name__}"
        )
    return payload, is_factory


# --- the seed's introspection --------------------------------------------------------------------


def get_data_parallel_info(device_ids: Sequence[int | str] | None = None) -> dict[str, Any]:
    """What data-parallel inference would use here.

    Args:
        device_ids: The GPUs asked for; all by default. Ids that do not exist
            are left out (:func:`validate_data_parallel_setup` names them).

    Returns:
        ``enabled`` (two or more GPUs will be used), ``device_count`` (how
        many devices), ``devices`` (``["cuda:0", "cuda:1"]``, or ``["cpu"]``
        without CUDA) and ``primary_device`` (the first of them).

    Example:
        >>> info = get_data_parallel_info()
        >>> info["primary_device"] == info["devices"][0] and info["device_count"] == len(info["devices"])
        True
    """
    count = cuda_count()
    ids = list(range(count)) if device_ids is None else [d.index for d in split_device_ids(device_ids)[0] or []]
    devices = [f"cuda:{i}" for i in ids] or ["cpu"]
    return {
        "enabled": len(ids) >= 2,
        "device_count": len(devices),
        "devices": devices,
        "primary_device": devices[0],
    }


def validate_data_parallel_setup(device_ids: Sequence[int | str] | None = None) -> list[str]:
    """Human-readable problems with data-parallel inference on this machine; ``[]`` when there are none.

    Checks that CUDA is available, that at least two GPUs will be used, and
    that every id in ``device_ids`` exists and appears once.

    Example:
        >>> problems = validate_data_parallel_setup()
        >>> problems == [] or all(isinstance(p, str) for p in problems)
        True
    """
    count = cuda_count()
    valid, id_problems = ([], []) if device_ids is None else split_device_ids(device_ids)
    if valid is None:  # not a list at all: nothing else to say
        return id_problems
    problems = []
    if count == 0:
        problems.append("CUDA is not available: inference would run on the CPU, without data parallelism")
    problems += id_problems  # the messages the entry points raise for the same ids
    used = count if device_ids is None else len(valid)
    if count == 1 and device_ids is None:
        problems.append("only 1 CUDA device is available; data parallelism needs at least 2")
    elif count and device_ids is not None and used < 2:
        problems.append(f"device_ids {list(device_ids)} select {used} usable GPU{'s' if used != 1 else ''}; "
                        f"data parallelism needs at least 2")
    return problems
