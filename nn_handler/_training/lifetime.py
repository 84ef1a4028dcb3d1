"""Handlers that still hold a process group are closed at interpreter exit.

A gloo group still referenced by a live DDP model can abort the process while
the interpreter tears down (measured with torch 2.13), so a script that never
calls ``close()`` gets it called for it, once, at exit.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

__all__ = ["forget", "track_for_exit"]

log = logging.getLogger(__name__)

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_registered = False


def _close_live() -> None:
    for handler in list(_live):
        try:
            handler.close()
        except Exception as exc:  # exiting anyway: report, do not mask the exit status
            log.warning("closing %r at exit failed: %s", handler, exc)


def track_for_exit(handler: Any) -> None:
    """Call ``handler.close()`` at interpreter exit unless :func:`forget` is called first."""
    global _registered
    _live.add(handler)
    if not _registered:  # on first use, not at import
        atexit.register(_close_live)
        _registered = True


def forget(handler: Any) -> None:
    """The handler closed itself: nothing to do for it at exit."""
    _live.discard(handler)
