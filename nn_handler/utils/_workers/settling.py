"""The pool lock, which never runs a future's done-callbacks while it is held.

``Future.set_result`` runs the future's callbacks in the thread that sets
it. Set under the pool lock, a slow callback would hold up every caller, and
a callback that calls the executor again (``submit``, ``run``) would wait
for itself. So futures settled under the lock are settled only once the
thread that held it has let go of it entirely.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, InvalidStateError

_RLock = type(threading.RLock())


class SettlingLock(_RLock):
    """A re-entrant lock that settles the futures handed to :meth:`later` when it is released for good.

    Example:
        >>> lock, future = SettlingLock(), Future()
        >>> future.add_done_callback(lambda f: print("callback; lock held:", lock._is_owned()))
        >>> with lock:
        ...     lock.later(future, result=42)
        ...     future.done()
        False
        callback; lock held: False
        >>> future.result()
        42
    """

    def __init__(self):
        self._due: collections.deque = collections.deque()

    def later(self, future: Future, *, result=None, error: BaseException | None = None, cancel: bool = False) -> None:
        """Settle ``future`` (its result, ``error``, or cancelled, else ``error``) once the lock is let go."""
        self._due.append((future, result, error, cancel))

    def release(self) -> None:
        _RLock.release(self)
        if self._due and not self._is_owned():
            self._settle()

    def __exit__(self, *exc) -> None:  # release(), one call less: the pool takes this lock several times per call
        _RLock.release(self)
        if self._due and not self._is_owned():
            self._settle()

    def _release_save(self):  # Condition.wait lets go of it all: settle then too
        state = super()._release_save()
        if self._due:
            self._settle()
        return state

    def _settle(self) -> None:
        while True:
            try:
                future, result, error, cancel = self._due.popleft()
            except IndexError:
                return
            try:
                if cancel and future.cancel():
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            except InvalidStateError:
                pass  # its caller cancelled it meanwhile
