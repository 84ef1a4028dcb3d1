"""Debug guard: a ``torch.distributed`` collective inside code that only some ranks run raises at once.

The most common DDP hang: ``dist.all_reduce`` (or a barrier, a broadcast)
inside an ``@on_rank(0)`` function or a ``main_process_first`` block. Only
those ranks reach it, so it waits for ranks that never come. nn_handler's own
collectives refuse there already; with ``NN_HANDLER_DEBUG=1`` or
``on_rank(..., debug=True)`` the user's direct torch calls do too.

How: while the guarded code runs, a profile function (``sys.setprofile``, this
thread only) watches for calls of torch's collective functions. That costs a
little on every Python call, which is why it is a debug option.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from typing import Iterator, Mapping

__all__: list[str] = []

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
                "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
                "monitored_barrier", "new_group", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
                "scatter_object_list")
_codes: dict | None = None


def debug_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``NN_HANDLER_DEBUG`` is set to something other than ``""``/``0``/``false``."""
    value = (os.environ if environ is None else environ).get("NN_HANDLER_DEBUG", "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _collective_codes() -> dict:
    global _codes
    if _codes is None:
        import torch.distributed.distributed_c10d as c10d

        found = {}
        for name in _COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is not None:
                found[inspect.unwrap(fn).__code__] = name  # past torch's logging wrappers
        _codes = found
    return _codes


@contextlib.contextmanager
def no_collectives(where: str, ranks: str) -> Iterator[None]:
    """Raise ``RuntimeError`` when the block calls a torch collective (this thread only).

    Args:
        where: Names the code, e.g. ``"the on_rank(0) function save"``.
        ranks: Who runs it, e.g. ``"rank 0"``.
    """
    codes = _collective_codes()
    previous = sys.getprofile()

    def check(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            sys.setprofile(previous)
            name = codes[frame.f_code]
            raise RuntimeError(
                f"torch.distributed.{name} was called inside {where}, which only {ranks} runs: the other ranks "
                f"never join this {name}, so it would hang until the process group's timeout. Call it outside, "
                f"on every rank (to share a value from rank 0, use on_rank(..., broadcast_result=True)). "
                f"(Raised by the debug guard: NN_HANDLER_DEBUG=1 or on_rank(..., debug=True).)"
            )
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(check)
    try:
        yield
    finally:
        sys.setprofile(previous)
