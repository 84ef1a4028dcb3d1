"""What went wrong in a Ray pool, told as the local pool tells it: :class:`~nn_handler.RankFailure` records.

Ray's own messages carry terminal colour codes and its internal frames; the
records here carry what the user needs: which actor, where, and why.
"""

from __future__ import annotations

import re

from ...errors import RankFailure
from . import transport as _transport
from .task_errors import describe

_COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # the terminal colour codes in Ray's own messages


def clean(text: str) -> str:
    """Ray's message without its terminal colour codes.

    Example:
        >>> clean("\\x1b[36mray::DeviceActor.call()\\x1b[39m failed")
        'ray::DeviceActor.call() failed'
    """
    return _COLOURS.sub("", text)


def resources(device: str) -> dict:
    """What an actor for ``device`` asks Ray for: one GPU, or one CPU."""
    return {"num_gpus": 1, "num_cpus": 0} if device == "cuda" else {"num_cpus": 1}


def never_sent(error: BaseException) -> bool:
    """Whether Ray refused the task because its actor was restarting: it never reached the actor.

    Ray says so only in the message of ActorUnavailableError (whose type
    also covers a task lost in flight, which may have run and is never re-sent).
    """
    return type(error).__name__ == "ActorUnavailableError" and "actor is restarting" in str(error)


def record(slot, message: str, **fields) -> RankFailure:
    """A failure of the actor of ``slot`` (a pool's slot: index, device, where it last answered from)."""
    pid, node, host = slot.where
    return RankFailure(rank=slot.index, device=slot.device, pid=pid, node=node, host=host, message=message, **fields)


def died(slot, exc: BaseException, during: str) -> RankFailure:
    text = clean(str(exc)).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return record(slot, f"actor died during {during} ({type(exc).__name__}: {first}); Ray restarts it for the next "
                        f"call")


def not_started(ray, slot, waited: float, what: str = "start") -> str:
    """Why an actor is not up after ``waited`` seconds: what it needs, and what the cluster has free now."""
    needs = {("GPU" if k == "num_gpus" else "CPU"): v for k, v in resources(slot.device).items() if v}
    free = ray.available_resources()
    have = {k: free.get(k, 0.0) for k in needs}
    return (f"actor did not {what} within {waited:g}s (start_timeout): it needs {needs} and the cluster has "
            f"{have} free now (if short, free those resources or add nodes; else its initializer is slow)")


def lost(ray, slot, name: str, error: BaseException) -> tuple[RankFailure, BaseException | None]:
    """The record and exception of a reply that Ray could not deliver: most often a result that cannot be pickled."""
    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, TypeError):
        # Ray pickles the reply after the actor's method returned: say it as the local pool does.
        exc = TypeError(f"the result of {name.rpartition('.')[2]} could not be pickled ({describe(cause)}); "
                        f"return tensors, numbers, lists or dicts of them")
    else:
        exc = cause if isinstance(cause, BaseException) else None
    shown = exc if exc is not None else error
    return record(slot, clean(describe(shown)), exc_type=type(shown).__qualname__,
                  traceback=clean(getattr(error, "traceback_str", "") or "")), exc


def load_error(body, failures: list, exceptions: dict) -> None:
    """An actor's ``("err", body)``: its record, and the exception itself where it can be loaded here."""
    failure, blob = body
    failures.append(failure)
    if (error := _transport.load_error(blob)) is not None:
        exceptions[failure.rank] = error
