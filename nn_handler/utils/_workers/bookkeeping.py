"""The tasks' bookkeeping: what callers in any thread queue, and what each caller's future gets.

:class:`Bookkeeping` is the half of :class:`~.scheduler.Scheduler` that takes
calls in and settles their outcomes; the engine that hands tasks to workers
and reads their replies is :mod:`.scheduler`. Callers pickle their payloads
and queue tasks (each with its caller's future), handing them to free workers
at once; an outcome (a result, a failure, a death, a timeout) is settled under
the pool lock and the future gets it once the lock is let go.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future

from ...errors import PayloadPicklingError, RankFailure
from . import transport as _transport
from .calls import CallFuture, RunFuture, _Call, _Task


class Bookkeeping:
    """Calls in, outcomes out; mixed into :class:`~.scheduler.Scheduler` (and so into
    :class:`~.pool.WorkerPool`), whose lock, slots, queue and engine it uses."""

    # ----------------------------------------------------------------- calls (any thread)
    def new_fn_id(self) -> int:
        """An id for a function: a worker that holds it is not sent it again within one map."""
        return next(self._fn_ids)

    def run(self, fn_blob: _transport.PackedFunction, args, kwargs, timeout: float | None, name: str, fail_fast: bool = False) -> list:
        """Call the function on every worker; results in worker order.

        It waits for the tasks the workers are running, then each worker runs
        it once. ``fail_fast``: fail at the first failure instead of waiting
        for every worker's reply; for calls whose workers wait on each other
        (a process group), where the others would wait for the failed one forever.
        """
        payload, files = self._encode((args, kwargs))
        call = _Call(self.new_fn_id(), "run", fn_blob, name, timeout, RunFuture(), broadcast=True,
                     fail_fast=fail_fast, files=files)
        self._enqueue([call], [_Task(call, slot.index, payload, slot.index) for slot in self._slots], driven=True)
        try:
            self._drive_until(call.future)
            return call.future.result()
        except KeyboardInterrupt:
            self.terminate()  # Ctrl-C: every worker ends with the call
            raise

    def submit(self, fn_id: int, fn_blob: _transport.PackedFunction, kind: str, objs: list, timeout: float | None,
               name: str) -> list[Future]:
        """Queue one task per object for whichever worker is free; their futures.

        ``kind`` ``"run"``: each object is ``(args, kwargs)``; ``"map"``: a
        chunk of items, whose large tensors go to shared memory only when a
        worker is about to take it. Everything is pickled before anything is
        queued (or a worker started).
        """
        calls, tasks = [], []
        try:
            for obj in objs:
                call = _Call(fn_id, kind, fn_blob, name, timeout, CallFuture(self))
                calls.append(call)
                tasks.append(_Task(call, 0, self._payload(call, kind, obj), None))
            self._enqueue(calls, tasks)
        except BaseException:
            for call in calls:
                _transport.remove_files(call.files)
            raise
        return [call.future for call in calls]

    def _payload(self, call: _Call, kind: str, obj):
        if kind == "run":
            payload, call.files = self._encode(obj)
            return payload
        try:
            payload = self._items.probe(obj)
        except Exception as exc:
            raise PayloadPicklingError(str(exc)) from exc
        if payload is not None:
            return payload

        def write_to_shared_memory() -> bytes:
            blob, created = self._encode(obj, self._items)
            call.files.extend(created)
            return blob

        return write_to_shared_memory

    def _encode(self, obj, encoder: _transport.Encoder | None = None) -> tuple[bytes, list[str]]:
        try:
            return (encoder or self._args).dumps(obj)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EMFILE, errno.ENFILE):
                raise  # no room in shared memory nor in the temp dir, no descriptor left: not a pickling problem
            raise PayloadPicklingError(str(exc)) from exc
        except Exception as exc:
            raise PayloadPicklingError(str(exc)) from exc

    def _enqueue(self, calls: list[_Call], tasks: list[_Task], driven: bool = False) -> None:
        """Queue the tasks and hand them to free workers now; ``driven``: the caller then waits by driving
        (:meth:`_drive_until`), else the engine thread is called in to wait for them."""
        try:
            if any(slot.process is None for slot in self._slots):
                self.start()  # starts the workers (errors raise here); one that died since is replaced in _begin
            with self._lock:
                self._check_open()
                self._calls.update(calls)
                for task in tasks:
                    task.call.pending += 1
                self._queue.extend(tasks)
                if self._engine is None:
                    self._wake_r, self._wake_w = os.pipe()
                    os.set_blocking(self._wake_r, False)
                    os.set_blocking(self._wake_w, False)
                    self._engine = threading.Thread(target=self._engine_main, name=f"nn_handler-engine-{self._token}",
                                                    daemon=True)  # never holds the interpreter open
                    self._engine.start()
                # The caller hands its tasks to free workers itself: the engine,
                # already waiting on every worker's pipe, wakes for the reply.
                # It is woken only to learn of a new deadline.
                try:
                    self._dispatch()
                except KeyboardInterrupt:
                    self.terminate()  # Ctrl-C half-way through a message: the worker cannot be trusted
                    raise
                wake = any(task.call.timeout is not None for task in tasks)
                if not driven:
                    if self._queue or wake:  # a task waits for a worker, or has a deadline: watch from now on
                        self._deferred = False
                        self._engine_wanted.notify()
                    else:
                        # Every task is on a worker: the engine thread (a wake-up,
                        # as costly as the task's round trip) is called in only if
                        # nobody drives, i.e. once a future's outcome is looked at
                        # other than through result() (see CallFuture).
                        self._deferred = True
        except BaseException:
            for call in calls:
                _transport.remove_files(call.files)
            raise
        if wake:
            self._wake()

    def _wake(self) -> None:
        with self._wake_lock:  # never a write to a descriptor that was closed (and maybe reused)
            try:
                os.write(self._wake_w, b"!")
            except (BlockingIOError, TypeError, OSError):
                pass  # full (it will wake anyway) or no engine yet

    def _busy(self) -> bool:
        # A memory probe on its way back counts (read now, to retire a worker above the limit), and so do
        # results read and not yet in their futures: a shutdown from another thread waits for them.
        if self._queue or not self._closed and (self._replies or self._loading):
            return True
        for slot in self._slots:
            if slot.task is not None or slot.probing:
                return True
        return False

    def _cancel_queued(self) -> None:
        while self._queue:
            task = self._queue.popleft()
            if not task.call.done:
                task.call.done = True
                self._calls.discard(task.call)
                _transport.remove_files(task.call.files)
                # (a broadcast already running elsewhere cannot be cancelled: it fails)
                self._lock.later(task.call.future, cancel=True,
                                 error=RuntimeError("this executor was shut down before the call ran"))

    def _close_wake_pipe(self) -> None:
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            self._wake_r = self._wake_w = None

    def _fail_everything(self, exc: BaseException) -> None:
        """The engine broke (a bug, a replacement whose initializer failed): every task gets ``exc``."""
        with self._lock:
            for slot in self._slots:
                if slot.task is not None:
                    task, slot.task = slot.task, None
                    self._finish(task.call, exc)
            while self._queue:
                self._finish(self._queue.popleft().call, exc)
            for batch in self._loading + [self._replies]:
                for task, *_ in batch:
                    self._finish(task.call, exc)
            self._loading, self._replies = [], []

    # ----------------------------------------------------------------- outcomes (the lock is held)
    def _task_done(self, task: _Task, value) -> None:
        call = task.call
        if call.done:
            return
        call.add_result(task.key, value)
        if call.pending == 0:
            self._finish(call)

    def _task_failed(self, task: _Task, record: RankFailure, exc: BaseException | None = None,
                     died: bool = False) -> None:
        call = task.call
        if call.done:
            return
        call.add_failure(record, exc, died)
        if call.broadcast and (died or call.fail_fast) and call.pending:
            # Fail now, not when the others finish; and stop their share of
            # this call, so that nothing of a failed call keeps running unseen.
            for slot in self._slots:
                if slot.task is not None and slot.task.call is call:
                    slot.task = None
                    self._kill(slot)
            call.pending = 0
        if call.pending == 0:
            self._finish(call)

    def _finish(self, call: _Call, error: BaseException | None = None) -> None:
        if call.done:
            return
        call.done = True
        self._calls.discard(call)
        if call.files:
            _transport.remove_files(call.files)
        if error is None and call.failures:
            error = call.error()
        if error is not None:
            self._lock.later(call.future, error=error)
        else:
            self._lock.later(call.future, result=call.value(len(self._slots)))
