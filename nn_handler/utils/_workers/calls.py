"""What the scheduler keeps track of: one slot per worker, one call per caller, one task per worker's share.

:class:`_Slot` mirrors a worker process (its pipe, what it runs, what it
holds); :class:`_Call` is what one caller waits for, with the future that
gets its outcome (a :class:`CallFuture`, or for ``run()`` a
:class:`RunFuture`); :class:`_Task` is one worker's share of a call.
"""

from __future__ import annotations

import multiprocessing as mp
import select
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from ...errors import ExecutorTimeoutError, ParallelExecutionError, RankFailure, WorkerDiedError
from . import pipes
from . import transport as _transport

_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, _POLL_IN)
    return bool(poller.poll(0))


@dataclass
class _Slot:
    index: int
    device: str
    process: mp.process.BaseProcess | None = None
    conn: "pipes.Channel | None" = None  # its replies come on conn (fileno), its messages go to conn.writer
    fd: int = -1  # conn.writer's descriptor (non-blocking)
    incarnation: int = 0
    files: str = ""  # the prefix of its result files (see lending)
    unloaded: int = 0  # its replies read and not yet loaded: their files must stay until they are
    has_fn_for: int | None = None  # function id this worker already holds
    # The twin of the worker's cache of function bodies: what need not be sent again.
    functions: _transport.FunctionCache = field(default_factory=_transport.FunctionCache)
    task: "_Task | None" = None  # the task it runs
    unread: bool = False  # running, and its message went in one write: the worker may have read none of it
    # How many messages the worker has read in full: a counter in shared memory
    # it bumps without a word, so that a task costs no acknowledgement (a
    # wake-up of the caller) and yet its death tells whether it had the task.
    reads: object = None
    sent: int = 0  # messages written to this process
    inbox: "pipes.Inbox | None" = None  # what it sent, read as it comes
    task_message: int = 0  # the number of its task's message
    deadline: float | None = None
    started: object = None  # when it began its task's function (shared memory): the timeout counts from then,
    handed: float = 0.0  # not from when the task was handed over, before its module's first import
    served: int = 0  # tasks since it started (max_tasks_per_worker)
    probing: bool = False  # a memory probe is on its way back (worker_memory_limit)

    @property
    def alive(self) -> bool:
        return self.process is not None

    @property
    def acked(self) -> bool:
        """Running, and the worker has read its task's whole message (so it may have run some of it)."""
        return self.reads is not None and self.reads.value >= self.task_message

    def exited(self) -> bool:
        """Whether its process has ended: its sentinel is readable. (``Process.is_alive()`` asks the same
        through a selector, at ten times the cost, on every call.)"""
        return _readable(self.process.sentinel)


class _Call:
    """What one caller waits for: a broadcast (one task per worker, ``run``) or a single task (``submit``,
    one ``map`` chunk). Its future gets the result or the error."""

    def __init__(self, fn_id: int, kind: str, fn_blob: _transport.PackedFunction, name: str, timeout: float | None,
                 future: Future, broadcast: bool = False, fail_fast: bool = False, files=()):
        self.fn_id, self.kind, self.fn_blob, self.name = fn_id, kind, fn_blob, name
        self.timeout, self.future, self.broadcast, self.fail_fast = timeout, future, broadcast, fail_fast
        self.files = list(files)  # shared-memory files of its arguments, removed when it ends
        self.named: dict | None = None  # named copies of its held files, for workers refused them (see Scheduler)
        self.pending = 0
        self.results: dict = {}
        self.failures: list[RankFailure] = []
        self.exceptions: dict = {}
        self.died = self.timed_out = self.started = self.done = False
        # A run() whose caller is a daemon thread (never joined at exit) is cut short at exit; see WorkerPool.
        # Tasks submitted (submit, map) run to the end whoever submitted them, as concurrent.futures runs them.
        self.caller_daemon = broadcast and threading.current_thread().daemon

    # The bookkeeping both pools (local and Ray) share; each decides what to stop and when to finish.
    def add_result(self, key: int, value) -> None:
        self.results[key] = value
        self.pending -= 1

    def add_failure(self, record: RankFailure, exc: BaseException | None = None, died: bool = False) -> None:
        self.failures.append(record)
        if exc is not None:
            self.exceptions[record.rank] = exc
        self.died = self.died or died
        self.pending -= 1

    def error(self) -> ParallelExecutionError:
        """The exception for a call with failures: a timeout, a death, or the function's own error."""
        cls = ExecutorTimeoutError if self.timed_out else WorkerDiedError if self.died else ParallelExecutionError
        return cls.create(self.failures, self.exceptions, function=self.name)

    def value(self, workers: int):
        """A broadcast's results in worker order, or the single task's result."""
        return [self.results[i] for i in range(workers)] if self.broadcast else self.results[0]


@dataclass
class _Task:
    call: _Call
    key: int  # a broadcast: the worker index; else 0
    payload: object  # bytes, or a thunk that writes a map chunk's tensors to shared memory at dispatch
    target: int | None  # the worker that must run it (a broadcast), or None for any
    resent: bool = False  # given to a replacement: its worker died before it had read it
    renamed: bool = False  # sent again, its files named: its worker was refused them (see Scheduler)


class CallFuture(Future):
    """The future of a submitted task: ``result()`` does the engine's work in the waiting thread, as ``run()``
    does, while no other thread is doing it.

    The reply is then read by the thread that wants it, not by the engine
    thread, which would hand it over: a thread switch less per task, and the
    engine thread is not even woken (see ``Scheduler._enqueue``). Every other
    way of looking at the outcome (``done()``, ``exception()``, a done-callback,
    ``concurrent.futures.wait`` and ``as_completed``, asyncio) reads what has
    come and calls the engine thread in.

    Example:
        >>> from nn_handler import ParallelExecutor
        >>> with ParallelExecutor(device_ids=["cpu"], pass_device=False) as ex:   # doctest: +SKIP
        ...     type(ex.submit(pow, 2, 10)).__name__
        'CallFuture'
    """

    def __init__(self, pool=None):
        super().__init__()
        self._pool = pool
        if pool is not None:
            self._waiters = _CallingIn(pool)  # concurrent.futures.wait and as_completed put their waiter here

    def result(self, timeout=None):
        return super().result(self._drive_within(timeout))

    def exception(self, timeout=None):
        return super().exception(self._drive_within(timeout))

    def done(self) -> bool:
        if self._pool is not None and self._pool._deferred and not super().done():
            self._drive(time.monotonic())  # what has come, without waiting
        return super().done()

    def settled(self) -> bool:
        """``done()`` without looking for the outcome (the pool's own check while it drives)."""
        return super().done()

    def add_done_callback(self, fn) -> None:
        super().add_done_callback(fn)
        if self._pool is not None:
            self._pool.call_engine_in()  # it must run even if nobody waits

    def _drive_within(self, timeout: float | None) -> float | None:
        """Drive for at most ``timeout`` seconds; what is left of it for the base class's wait."""
        until = None if timeout is None else time.monotonic() + timeout
        self._drive(until)
        return None if until is None else max(0.0, until - time.monotonic())

    def _drive(self, until: float | None) -> None:
        if self._pool is not None and not super().done():
            self._pool.drive_for(self, until)
            if not super().done():
                self._pool.call_engine_in()  # another thread drives, or the time is up: nobody may be left


class _CallingIn(list):
    """A future's list of waiters that calls the pool's engine thread in when one is added.

    ``concurrent.futures.wait`` adds its waiter while it holds the future's
    lock, and the pool takes a future's lock under its own (to start a
    task): taking the pool lock here could deadlock, so a short-lived thread
    does it (only for a task nobody drives yet, see ``Scheduler._enqueue``).
    """

    def __init__(self, pool):
        super().__init__()
        self._pool = pool

    def append(self, waiter) -> None:
        super().append(waiter)
        if self._pool._deferred:
            threading.Thread(target=self._pool.call_engine_in, name="nn_handler-call-in", daemon=True).start()


class RunFuture:
    """What ``run()`` waits on: the settling and waiting of a ``Future``, without its callbacks, cancellation
    and states, which nobody can reach here (the caller only ever gets the result). A sixth of the cost.

    Example:
        >>> future = RunFuture()
        >>> future.set_running_or_notify_cancel(), future.done()
        (True, False)
        >>> future.set_result([1, 1])
        >>> future.done(), future.result()
        (True, [1, 1])
    """

    __slots__ = ("_done", "_result", "_error", "_waiting")

    def __init__(self):
        self._done, self._result, self._error = False, None, None
        self._waiting = threading.Lock()  # held until settled: result() in another thread waits on it
        self._waiting.acquire()

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return self._done

    settled = done

    def set_result(self, result) -> None:
        self._settle(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, result, error) -> None:
        if self._done:
            raise InvalidStateError("already settled")
        self._result, self._error, self._done = result, error, True
        self._waiting.release()

    def result(self):
        if not self._done:
            with self._waiting:  # another thread drives: it settles this
                pass
        if self._error is None:
            return self._result
        error = self._error
        try:
            raise error
        finally:
            self = error = None  # no cycle from the traceback through this frame back to the error
