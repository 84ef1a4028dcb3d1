"""What a task's exception in a worker becomes: its record for the caller, and a result that cannot travel.

One home below the worker loop (:mod:`.worker`), the settled maps (:mod:`.sweep`)
and the Ray actor (:mod:`.ray_actor`), which all report a failure this way;
it imports nothing of theirs.

Example:
    >>> record, blob = failure_record(3, "cpu", ValueError("bad item"), "Traceback ...")
    >>> (record.rank, record.exc_type, record.message, blob is not None)
    (3, 'ValueError', 'bad item', True)
    >>> unpicklable_result(len, TypeError("cannot pickle 'generator' object"))
    TypeError("the result of len could not be pickled (cannot pickle 'generator' object); return tensors, numbers, lists or dicts of them")
"""

from __future__ import annotations

import os

from ...errors import RankFailure
from . import transport as _transport

__all__ = ["describe", "failure_record", "unpicklable_result"]


def describe(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's own ``__str__`` raises."""
    try:
        return str(exc)
    except Exception as inner:
        try:
            detail = f"{type(inner).__qualname__}: {inner}"
        except Exception:
            detail = type(inner).__qualname__
        return f"<str() failed: {detail}>"


def failure_record(index: int, device: str, exc: BaseException, tb: str) -> tuple[RankFailure, bytes | None]:
    """The record of ``exc`` raised by worker ``index``, and the exception pickled (``None``: not rebuildable)."""
    record = RankFailure(
        rank=index,
        device=device,
        pid=os.getpid(),
        exc_type=type(exc).__qualname__,
        message=describe(exc),  # a failing __str__ must not take the worker down with it
        traceback=tb,
    )
    # Send the exception object itself only if it can be rebuilt: a class
    # with a custom __init__ often cannot be unpickled. (A class the caller
    # cannot import loads fine here; the caller guards its own loads.)
    try:
        blob = _transport.Encoder(None).dumps(exc)[0]
        _transport.loads(blob)
    except Exception:
        blob = None
    return record, blob


def unpicklable_result(fn, exc: Exception) -> Exception:
    """What a result that cannot be pickled raises: the pickling error's own type, as ``ProcessPoolExecutor``
    gives it (``PicklingError``, ``TypeError``), saying what to return instead (``TypeError`` where that type
    takes no message)."""
    message = (f"the result of {getattr(fn, '__name__', 'the function')} could not be pickled ({describe(exc)}); "
               f"return tensors, numbers, lists or dicts of them")
    try:
        error = type(exc)(message)
    except Exception:
        return TypeError(message)
    return error if isinstance(error, Exception) else TypeError(message)
