"""Sweeps: a CPU pool sized as ``ProcessPoolExecutor`` sizes it, and maps that keep every item's outcome.

- :func:`cpu_pool`: ``ParallelExecutor(max_workers=N)`` is N CPU workers whose functions are called without
  a device, as ``ProcessPoolExecutor(max_workers=N)``; given with ``num_gpus`` or ``device_ids`` it must agree.
  A function that needs a ``device`` there is told so at the call (:func:`check_device_given`).
- ``map(..., return_exceptions=True)`` (as ``asyncio.gather`` has it): the function runs inside
  :class:`Settled`, which catches an item's exception in the worker and returns it as a :class:`Raised`
  record, so one failed item fails nothing else of its chunk; a result that cannot be pickled is its own
  item's error too (:func:`unpicklable_items`), and an item that raises ``SystemExit`` ends its worker once
  the chunk is sent; :func:`outcomes` turns the records back into
  the error a plain ``map`` would have raised (the task's own exception type, also a
  :class:`~nn_handler.ParallelExecutionError`, the worker's traceback its ``__cause__``).

Example:
    >>> cpu_pool(4, None, None, None)
    (['cpu', 'cpu', 'cpu', 'cpu'], False)
    >>> cpu_pool(None, None, [0, 1], None)
    ([0, 1], True)
"""

from __future__ import annotations

import functools
import inspect
import sys
import traceback
import types
import weakref
from dataclasses import dataclass
from typing import Sequence

from ..._checks import check_int, invalid
from ...errors import ConfigurationError, ParallelExecutionError, RankFailure
from . import worker
from .task_errors import failure_record, unpicklable_result

__all__ = ["cpu_pool", "required_device", "check_device_given", "Settled", "Raised", "outcomes", "unpicklable_items",
           "function_name"]


def cpu_pool(max_workers: int | None, num_gpus: int | None, device_ids: Sequence[int | str] | None,
             pass_device: bool | None) -> tuple[Sequence[int | str] | None, bool]:
    """The ``device_ids`` and ``pass_device`` that ``max_workers`` stands for; raises where they disagree.

    ``pass_device`` not given (``None``): ``False`` with ``max_workers`` alone (called as a process pool
    calls), ``True`` otherwise (as before).
    """
    if type(max_workers) is int and max_workers < 1:
        raise invalid("max_workers", "greater than 0", max_workers)  # ProcessPoolExecutor's words
    check_int("max_workers", max_workers, minimum=1, allow_none=True)
    if max_workers is None:
        return device_ids, True if pass_device is None else bool(pass_device)
    if num_gpus is not None:
        raise ConfigurationError(f"max_workers={max_workers} and num_gpus={num_gpus} both size the pool; give "
                                 f"max_workers for CPU workers, or num_gpus / device_ids for one worker per device")
    if device_ids is None:
        return ["cpu"] * max_workers, False if pass_device is None else bool(pass_device)
    if isinstance(device_ids, (str, int)) or len(device_ids) != max_workers:
        raise ConfigurationError(f"max_workers={max_workers} disagrees with device_ids={device_ids!r} (one worker "
                                 f"per device); give one of them")
    return device_ids, True if pass_device is None else bool(pass_device)


# code object -> where its function must be given `device` (see required_device); cached as the executor
# caches where it puts the device: inspecting a signature costs more than the rest of a warm call.
_required: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_KEYWORD = sys.maxsize  # a keyword-only `device`: no positional argument gives it
_UNKNOWN = object()


def required_device(func, every_callable: bool = True) -> int | None:
    """Where a call of ``func`` must give ``device`` (a parameter without a default): its positional index
    (``sys.maxsize`` when keyword-only), or ``None`` where it needs none or its signature cannot be read.

    A plain function's answer is cached by its code object. ``every_callable=False`` (the per-call check):
    ``None`` for anything but a Python function, whose signature would cost more than the call.

    Example:
        >>> def train(lr, device): ...
        >>> required_device(train), required_device(lambda lr, device=None: lr), required_device(pow)
        (1, None, None)
    """
    if type(func) is types.FunctionType:
        if "__wrapped__" not in func.__dict__ and "__signature__" not in func.__dict__:  # (cheaper than hasattr)
            found = _required.get(func.__code__, _UNKNOWN)
            if found is _UNKNOWN:
                found = _required[func.__code__] = _device_in_signature(func)
            return found
    elif not every_callable:
        return None
    return _device_in_signature(func)


def _device_in_signature(func) -> int | None:
    try:
        # The callable's own signature: a wrapper that supplies `device` (functools.wraps) needs none from us.
        params = inspect.signature(func, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):
        return None  # builtins without a signature
    for i, p in enumerate(params):
        if p.name == "device":
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                return None
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else _KEYWORD
    return None


def check_device_given(func, needs: int | None, positional: int, keywords=()) -> None:
    """Raise where a call of ``func`` with ``positional`` arguments and ``keywords`` lacks the ``device`` it
    ``needs`` (:func:`required_device`), in a pool that calls functions without one (``pass_device=False``):
    the reverse of "takes no `device` argument but pass_device=True", told at the call, not per item."""
    if needs is None or needs < positional or "device" in keywords:
        return
    name = getattr(func, "__qualname__", None) or function_name(func)
    raise TypeError(f"{name} needs a `device` argument, but this executor calls functions without one "
                    f"(pass_device=False, as with max_workers alone); pass pass_device=True, or give "
                    f"device_ids=[...] instead of max_workers, to have each worker's device passed, or give "
                    f"`device` a default, or pass it yourself")


@dataclass(frozen=True, slots=True)
class Raised:
    """An item's exception, caught in the worker: its record and the pickled exception (``None``: not rebuildable)."""

    record: RankFailure
    blob: bytes | None


class Settled:
    """``func`` called as the worker calls a map's function, its exception returned as a :class:`Raised`.

    Any exception, as ``ProcessPoolExecutor`` gives each task its own: ``SystemExit`` and
    ``KeyboardInterrupt`` too, which end the worker (as without ``return_exceptions``) once the rest of its
    chunk is done and sent, so that no other item is lost with it.
    """

    def __init__(self, func, position: int | None, pass_device: bool, star: bool):
        if not callable(func):
            raise TypeError(f"expected a callable to run, got {type(func).__name__}: {func!r}")
        self.func, self.position, self.pass_device, self.star = func, position, pass_device, star
        self.__name__ = function_name(func)  # what the worker's messages call it

    def __call__(self, item, device=None):
        args = tuple(item) if self.star else (item,)
        try:
            return worker.call_with_device((self.func, self.position), args, {}, device, self.pass_device)
        except BaseException as exc:
            if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                worker.end_after_task()
            return _raised(exc, device)

    def settle_unpicklable(self, values: list, probe, device) -> list:
        """What the worker sends for a chunk whose results did not pickle: :func:`unpicklable_items`."""
        return unpicklable_items(values, self, probe, device)


def _raised(exc: BaseException, device) -> Raised:
    """The record of ``exc``, the exception being handled, raised on this worker."""
    index = worker.worker_index()
    return Raised(*failure_record(0 if index is None else index, _device_name(device), exc, traceback.format_exc()))


def unpicklable_items(values: list, fn, probe, device) -> list:
    """A settled chunk's results whose pickling failed, each that cannot be pickled replaced by its item's error.

    ``probe(value)`` pickles a value without writing its large tensors (``Encoder.probe``), raising what
    pickling it raises; ``fn`` names the function in the error.
    """
    settled = []
    for value in values:
        try:
            probe(value)
        except Exception as exc:
            try:
                raise unpicklable_result(fn, exc) from exc
            except Exception as error:
                value = _raised(error, device)
        settled.append(value)
    return settled


def function_name(func) -> str:
    """``func.__name__`` (through ``functools.partial``), else the name of its type.

    Example:
        >>> import functools
        >>> function_name(functools.partial(divmod, 7)), function_name(len), function_name(Settled(len, None, False, False))
        ('divmod', 'len', 'len')
    """
    while isinstance(func, functools.partial) and not hasattr(func, "__name__"):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def _device_name(device) -> str:
    if device is not None:
        return str(device)
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else "cpu"


def outcomes(values: list, name: str) -> list:
    """A chunk's results with each :class:`Raised` turned into the error a plain ``map`` raises for it."""
    return [_error(value, name) if isinstance(value, Raised) else value for value in values]


def _error(raised: Raised, name: str) -> BaseException:
    from . import transport

    exc = None
    if raised.blob is not None:
        try:  # a class this process cannot import: the record alone tells it
            exc = transport.loads(raised.blob)
        except Exception:
            exc = None
    record = raised.record
    return ParallelExecutionError.create([record], {} if exc is None else {record.rank: exc}, function=name)

