"""Callback hooks called with more than a plain loop: ``on_batch_end`` with the step's outputs, ``on_exception``.

``on_batch_end(handler, step, loss)`` is the hook every callback has; one
that takes a fourth parameter, ``on_batch_end(handler, step, loss, outputs)``,
also gets what the training step returned for the batch (the loss, or the
mapping with the loss and the other values), as Lightning's
``on_train_batch_end`` gets its ``outputs``: a logger reads the values it logs
from there, only at the steps it logs.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

BatchEnd = Callable[[Any, int, Any, Any], None]


def batch_end_calls(callbacks: list) -> list[BatchEnd]:
    """One ``call(view, step, loss, outputs)`` per callback: its ``on_batch_end`` with ``outputs`` if it takes them.

    Example:
        >>> class Old:
        ...     def on_batch_end(self, handler, step, loss): print("old", step, loss)
        >>> class New:
        ...     def on_batch_end(self, handler, step, loss, outputs=None): print("new", step, outputs)
        >>> for call in batch_end_calls([Old(), New()]):
        ...     call(None, 3, 0.5, {"loss": 0.5, "acc": 1.0})
        old 3 0.5
        new 3 {'loss': 0.5, 'acc': 1.0}
    """
    return [cb.on_batch_end if takes_outputs(cb.on_batch_end) else _without_outputs(cb.on_batch_end)
            for cb in callbacks]


def accepts_positional(hook: Callable, count: int) -> bool:
    """True when ``hook`` can be called with ``count`` positional arguments (that many parameters, or ``*args``).

    How a hook that grew a parameter (``on_batch_end``'s ``outputs``, the optimizer hooks' ``name``) is told from
    one written before it: the older form keeps being called as it was.

    Example:
        >>> accepts_positional(lambda handler, step: None, 3), accepts_positional(lambda *args: None, 3)
        (False, True)
    """
    try:
        parameters = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as documented, in its older form
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in parameters)
            or sum(p.kind in positional for p in parameters) >= count)


def takes_outputs(hook: Callable) -> bool:
    """True when the bound ``on_batch_end`` accepts a fourth argument (a parameter, or ``*args``)."""
    return accepts_positional(hook, 4)


def _without_outputs(hook: Callable) -> BatchEnd:
    def call(view: Any, step: int, loss: Any, outputs: Any) -> None:
        hook(view, step, loss)
    return call


def notify_exception(callbacks: list, view: Any, exc: BaseException) -> None:
    """``on_exception(handler, exc)`` of every callback; one that raises itself is logged and the others still run
    (the training's own exception is what propagates)."""
    for cb in callbacks:
        try:
            cb.on_exception(view, exc)
        except Exception:  # noqa: BLE001 - never hide the training's own error behind a hook's
            log.exception("%s.on_exception raised while training ended with %s", type(cb).__name__,
                          type(exc).__name__)
