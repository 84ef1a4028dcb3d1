"""Data-parallel inference over every device through :class:`~nn_handler.ParallelExecutor`.

How a call flows::

    caller                                   worker i (one per device)
    ------                                   -------------------------
    ParallelExecutor(initializer=_start_worker, initargs=(token, model, data, ...))
                                      ---->  build or unpickle the model once, move it to
                                             the device, keep it with the data in _WORKERS[token]
    ex.map(_run_task, [batch ranges])  ---->  for each range it is sent: load the batches
                                             (num_workers threads load ahead), forward,
                                             outputs to the CPU
    concatenate in input order        <----  per-range outputs

Only batch index ranges travel per task; the model and the data travel once
per worker. ``_start_worker`` and ``_run_task`` live in this importable module,
so they are pickled by reference and ``_WORKERS`` is this module's dict in the
worker. Public names are re-exported by :mod:`nn_handler.utils.parallel`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import cloudpickle
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from ..._checks import check_int
from ..._tree import combine, detach_cpu, to_device
from ...errors import ConfigurationError
from .._workers.executor import ParallelExecutor
from .placement import DEVICE_MAP_ATTR
from .wrap import unwrap_parallel_model
from .._devices import cuda_count, split_device_ids

__all__ = ["parallel_predict", "get_data_parallel_info", "validate_data_parallel_setup"]

# Per-worker state, keyed by the call's token: set by _start_worker in the
# worker process; empty in the caller.
_WORKERS: dict[str, dict[str, Any]] = {}

# With loader threads, a task is several batches so that the threads have
# batches to load ahead; about this many tasks per device still keeps the
# devices evenly busy.
_TASKS_PER_DEVICE = 4


def _start_worker(token: str, model_or_factory, is_factory: bool, data, settings: dict, device: torch.device) -> None:
    if is_factory:
        wants_device = "device" in inspect.signature(model_or_factory).parameters
        model = model_or_factory(device=device) if wants_device else model_or_factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    else:
        model = model_or_factory
    state = {"model": model.to(device).eval(), "data": data, "device": device, **settings}
    if settings["num_workers"]:
        # Threads, not processes: no second pool of processes per device to
        # start and feed. Loading that releases the GIL (file reads, image
        # decoding, tokenizers, torch ops) runs in parallel all the same.
        state["loader_pool"] = ThreadPoolExecutor(settings["num_workers"], thread_name_prefix="nn_handler-load")
    _WORKERS[token] = state


def _call(model: nn.Module, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def _batches(state: dict, start: int, stop: int):
    data, size = state["data"], state["batch_size"]
    ranges = [(i, min(i + size, stop)) for i in range(start, stop, size)]
    if isinstance(data, torch.Tensor):
        yield from (data[a:b] for a, b in ranges)
        return

    def load(bounds):
        return state["collate_fn"]([data[j] for j in range(*bounds)])

    pool = state.get("loader_pool")
    # The pool's map submits every batch of the task at once: the threads
    # load ahead while this thread runs the model.
    yield from (pool.map(load, ranges) if pool is not None else map(load, ranges))


def _run_task(token: str, task: tuple[int, int], device: torch.device) -> list:
    state = _WORKERS[token]
    model, autocast = state["model"], state["autocast"]
    outputs = []
    with torch.inference_mode():
        for batch in _batches(state, *task):
            batch = to_device(batch, device)
            if autocast is False:
                out = _call(model, batch)
            else:
                dtype = autocast if isinstance(autocast, torch.dtype) else (
                    torch.float16 if device.type == "cuda" else torch.bfloat16)
                with torch.autocast(device_type=device.type, dtype=dtype):
                    out = _call(model, batch)
            outputs.append(detach_cpu(out))
    return outputs


def _concat(outputs: list):
    """One output from the per-batch outputs: tensors concatenated, anything else one entry per batch, in order."""
    return combine(outputs, _concat_leaves)


def _concat_leaves(leaves: list):
    if isinstance(leaves[0], torch.Tensor):
        return torch.cat([o.reshape(1) if o.dim() == 0 else o for o in leaves])
    return leaves


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


def _check_data(data):
    """``(data to send, collate_fn, length)`` for a tensor, a map-style dataset, a DataLoader or a sequence."""
    collate_fn = default_collate
    if isinstance(data, DataLoader):
        collate_fn, data = data.collate_fn, data.dataset
    if isinstance(data, IterableDataset):
        raise ConfigurationError(
            "parallel_predict needs random access to spread batches over devices; an IterableDataset has none. "
            "Pass a map-style Dataset, a tensor or a list"
        )
    if isinstance(data, torch.Tensor):
        if data.dim() == 0:
            raise ConfigurationError("data is a 0-dimensional tensor; parallel_predict splits data along dim 0")
        return data.cpu(), collate_fn, data.shape[0]
    if isinstance(data, (Dataset, Sequence)) and not isinstance(data, (str, bytes)):
        try:
            return data, collate_fn, len(data)
        except TypeError:
            pass
    raise TypeError(
        f"data must be a tensor, a map-style Dataset (with __len__), a DataLoader or a list of samples, "
        f"got {type(data).__name__}"
    )


def _pickling_error(payload, is_factory: bool, data, original: TypeError) -> TypeError:
    """Say whether the model (or factory) or the data is what cannot travel to the workers."""
    what = "the model factory" if is_factory else "the model"
    for label, obj, remedy in (
        (what, payload, "pass a factory that builds the model in each worker" if not is_factory
         else "define it at module level and keep unpicklable objects out of its closure"),
        (f"data ({type(data).__name__})", data, "open files, connections and locks lazily in __getitem__"),
    ):
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            return TypeError(f"{label} cannot be pickled to send to the workers ({exc}); {remedy}")
    return original


def _check_autocast(autocast) -> bool | torch.dtype:
    if isinstance(autocast, (bool, torch.dtype)):
        return autocast
    raise ConfigurationError(f"autocast must be True, False or a torch.dtype, got {autocast!r}")


def parallel_predict(
    model_or_factory: nn.Module | Callable[..., nn.Module],
    data,
    *,
    batch_size: int,
    device_ids: Sequence[int | str] | None = None,
    autocast: bool | torch.dtype = False,
    num_workers: int = 0,
    progress: bool = False,
):
    """Run a model over a dataset on every device at once; outputs come back in input order.

    One worker process per device (a :class:`~nn_handler.ParallelExecutor`)
    gets the model once (or builds it from the factory once) and the data
    once; batches then go to whichever device is free, so a faster device
    simply does more of them. Runs under ``torch.inference_mode`` with the
    model in ``eval()`` mode. Without CUDA it runs on CPU workers.

    A batch that is a tensor is called as ``model(batch)``, a tuple or list as
    ``model(*batch)``, a dict as ``model(**batch)``: give it inputs only.

    Args:
        model_or_factory: An ``nn.Module`` (a model on a GPU is sent as a CPU
            copy), or a picklable callable returning one, called in each worker
            (with ``device=`` when it has that parameter); prefer a factory for
            large models.
        data: A tensor (split along dim 0), a map-style ``Dataset``, a
            ``DataLoader`` (its dataset and ``collate_fn`` are used, in
            dataset order), or a list of samples.
        batch_size: Samples per forward pass on one device.
        device_ids: Devices, e.g. ``[0, 1]`` or ``["cpu", "cpu"]``; all GPUs
            by default (one CPU worker, with a ``RuntimeWarning``, without CUDA).
        autocast: Mixed precision: ``True`` (float16 on CUDA, bfloat16 on
            CPU) or a dtype.
        num_workers: Threads per device that load and collate samples ahead
            of the model. Threads, because the executor's workers cannot start
            processes; they help where loading releases the GIL (file reads,
            image decoding, tokenizers), not for pure-Python preprocessing.
        progress: Draw a tqdm bar (tasks of a few batches each, per second,
            and an ETA) on a terminal.

    Returns:
        The outputs of all batches joined along dim 0: a tensor, or a
        tuple/list/dict of tensors when the model returns one; other outputs
        come back as a list with one entry per batch.

    Raises:
        ConfigurationError: Bad ``batch_size``/``num_workers``/``autocast``,
            empty data, or an ``IterableDataset``.
        ParallelExecutionError: The model failed on a worker (with its remote traceback).
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
    check_int("batch_size", batch_size, minimum=1)
    check_int("num_workers", num_workers, minimum=0)
    autocast = _check_autocast(autocast)
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
    data, collate_fn, length = _check_data(data)
    if length == 0:
        raise ConfigurationError("data is empty: there is nothing to predict")

    token = uuid.uuid4().hex
    settings = {"batch_size": batch_size, "num_workers": num_workers, "collate_fn": collate_fn, "autocast": autocast}
    try:
        executor = ParallelExecutor(device_ids=device_ids, initializer=_start_worker,
                                    initargs=(token, payload, is_factory, data, settings))
    except TypeError as exc:
        raise _pickling_error(payload, is_factory, data, exc) from exc
    with executor:
        n_batches = math.ceil(length / batch_size)
        per_task = 1 if num_workers == 0 else max(1, math.ceil(n_batches / (_TASKS_PER_DEVICE * executor.num_workers)))
        step = per_task * batch_size
        tasks = [(start, min(start + step, length)) for start in range(0, length, step)]
        run_task = functools.partial(_run_task, token)
        run_task.__name__ = "parallel_predict"  # what its progress line and its errors call it
        per_task_outputs = list(executor.map(run_task, tasks, progress=progress))
    return _concat([out for outputs in per_task_outputs for out in outputs])


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
