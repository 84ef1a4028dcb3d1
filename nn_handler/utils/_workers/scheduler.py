"""The engine: which worker runs what, read back as its replies arrive.

:class:`Scheduler` is the half of :class:`~.pool.WorkerPool` that deals with
tasks; the pool itself starts, stops and reaps the worker processes. Callers
in any thread queue tasks (each with its caller's future) and hand them to
free workers at once (:mod:`.bookkeeping`: calls in, outcomes out); the engine waits on every worker's pipe and sentinel
(and on a wake-up pipe), resolves futures as replies arrive, gives the freed
worker the next task that fits it, and enforces deadlines. One thread at a
time does the engine's work: the caller waiting on ``run()`` or on a task's
``result()``, else the pool's engine thread. Everything that touches the slots or the queue holds
the pool lock (futures settled under it get their results once it is let go);
the engine lets go of it while it waits.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import time
import traceback
from concurrent.futures import Future

from ...errors import RankFailure
from . import lending, pipes
from . import transport as _transport
from .bookkeeping import Bookkeeping
from .calls import _POLL_IN, _Call, _Slot, _Task, _readable
from .task_errors import describe

logger = logging.getLogger(__name__)

# How long a stopping worker gets to leave on its own before it is killed.
_STOP_GRACE = 2.0
# The driver spins (pipes.spin) only after a round whose wait was shorter than this: where tasks take
# long, a spin per reply only takes a share of a core from the workers (a map of 0.5 ms items on 2 workers
# and 2 cores ran at 1.91x the in-process rate with a spin every round, 2.01x without).
_SPIN_AFTER_WAIT = 4 * pipes.SPIN


class Scheduler(Bookkeeping):
    """The engine: hands queued tasks to workers, reads their replies, enforces deadlines; mixed into
    :class:`~.pool.WorkerPool`, whose slots, lock, queue and process methods (``start``, ``_kill``,
    ``_death``, ``terminate``) it uses. Calls come in, and outcomes are settled, through :class:`Bookkeeping`."""

    # ----------------------------------------------------------------- the engine
    # The engine's work (poll the workers, settle replies, hand out tasks,
    # enforce deadlines) is done by one thread at a time, the one holding the
    # driver lock: a caller of run(), or of a task future's result(), that
    # waits for its own result does it itself, which spares two thread
    # switches per call; the engine thread does it whenever work is
    # outstanding and no caller is driving (callbacks, asyncio, a result()
    # with a timeout). The engine thread never waits for the driver lock:
    # whoever stops driving with work outstanding (or during a shutdown)
    # calls it in, after letting go of the driver lock, so that a task
    # queued meanwhile is never left without a driver.
    def _engine_main(self) -> None:
        try:
            while True:
                with self._lock:
                    while True:
                        if self._closed or (self._closing and not self._busy()):
                            return
                        if self._busy() and self._driver.acquire(blocking=False):
                            break
                        # Nothing to do, or a caller drives: it calls us in
                        # when it stops with work left (see _drive_until).
                        self._engine_wanted.wait()
                try:
                    while True:
                        with self._lock:
                            if self._closed or not self._busy():
                                break  # (the caller that drove may have done it all): never poll an idle pool
                        if not self._drive_once():
                            break
                finally:
                    self._driver.release()
        except BaseException as exc:  # a bug or a failed restart: fail every caller rather than hang them
            self._fail_everything(exc)
            if not self._closed:
                raise
        finally:
            with self._lock:
                self._idle.notify_all()
                if self._closed:
                    self._close_wake_pipe()

    def drive_for(self, future: Future, until: float | None = None) -> None:
        """Do the engine's work in this thread until ``future`` is done (its ``result()`` is waited on) or
        ``time.monotonic()`` reaches ``until``, unless another thread is doing it."""
        if os.getpid() != self._owner or self._closed:
            return  # a forked child has none of the workers; a closed pool has nothing to drive
        try:
            self._drive_until(future, until)
        except KeyboardInterrupt:
            # Ctrl-C (main thread) while waiting: harmless in the poll, where
            # nothing was read yet; elsewhere it may have cut a reply or a
            # message in half, and no worker of this pool can be trusted.
            if not self._polling:
                self.terminate()
            raise

    def call_engine_in(self) -> None:
        """Have the engine thread drive the tasks a submit left to whoever would look at them (see _enqueue)."""
        if self._deferred:
            with self._lock:
                self._deferred = False
                self._engine_wanted.notify()

    def _drive_until(self, future: Future, until: float | None = None) -> None:
        """Do the engine's work in this thread until ``future`` is done (or ``until``), unless another thread
        is doing it."""
        if not self._driver.acquire(blocking=False):
            return  # the driver settles our future too
        self._deferred = False  # a driver reads every reply; if it stops with work left, it calls the engine in
        try:
            if until is not None and until <= time.monotonic():
                self._drive_once(until)  # done(): read what has come, waiting for nothing
            while not future.settled() and (until is None or time.monotonic() < until) and self._drive_once(until):
                pass
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):  # Ctrl-C: the caller terminates the pool
                self._fail_everything(exc)
            raise
        finally:
            self._driver.release()
            # Read without the lock first (the common case: nothing left). A
            # task queued after this look is queued after the release, so its
            # own caller takes the driver lock, or calls the engine thread in.
            if self._busy() or self._closing:
                with self._lock:
                    self._engine_wanted.notify()  # other callers' tasks: the engine thread takes over (or ends)

    def _drive_once(self, until: float | None = None) -> bool:
        """One round of the engine (the driver lock is held): hand out tasks, wait for the workers or the
        next deadline (or ``until``), settle what came back. ``False`` once the pool is closed."""
        with self._lock:
            if self._closed:
                return False
            if self._queue:
                self._dispatch()
            if self._polled != self._generation:  # a worker started or ended: watch the current ones
                self._polled, self._watched = self._generation, self._watch_list()
                self._poller = select.poll()
                for fd in self._watched:
                    self._poller.register(fd, _POLL_IN)
            timeout = self._next_deadline()
            if until is not None:
                left = until - time.monotonic()
                timeout = left if timeout is None else min(timeout, left)
        self._polling = True  # (see drive_for)
        ready = self._poller.poll(0)
        if not ready and (timeout is None or timeout > 0):
            began = time.perf_counter()
            if self._spinning:
                ready = pipes.spin(self._poller)
            if not ready:
                ready = self._poller.poll(None if timeout is None else int(timeout * 1000) + 1)
            self._spinning = time.perf_counter() - began < _SPIN_AFTER_WAIT
        self._polling = False
        with self._lock:
            if self._closed:
                return False
            self._handle(ready, self._watched)
            self._check_deadlines()
            if self._queue or self._closing:
                self._dispatch()  # the workers freed take their next tasks before anything is unpickled
            batch, self._replies = self._replies, []
            if batch:
                self._loading.append(batch)
        # Unpickled after the workers have their next tasks, and without the lock. A done-callback run as
        # the lock was let go may have driven rounds of its own (it called run()): they load their own.
        if batch:
            self._load_replies(batch)
        if self._stale_names:
            self._drop_stale_names()  # a dead worker's files (a result it was sending): its call has failed now
        return True

    def _watch_list(self) -> dict:
        """fd -> (slot, incarnation) to poll: the wake-up pipe, and every worker's pipe and sentinel."""
        watched: dict = {self._wake_r: None}
        for slot in self._slots:
            if slot.alive:
                watched[slot.conn.fileno()] = watched[slot.process.sentinel] = (slot, slot.incarnation)
        return watched

    def _next_deadline(self) -> float | None:
        """Seconds to the nearest deadline of a running task, or None."""
        deadlines = [s.deadline for s in self._slots if s.task is not None and s.deadline is not None]
        return min(deadlines) - time.monotonic() if deadlines else None

    def _dispatch(self) -> None:
        """Give every free worker the first queued task that fits it."""
        for slot in self._slots:
            while self._queue and slot.task is None and not slot.probing:
                task = self._take(slot)
                if task is None:
                    break
                self._begin(slot, task)
        if self._closing and not self._busy():
            self._idle.notify_all()  # shutdown() waits for it

    def _take(self, slot: _Slot) -> _Task | None:
        """Pop the first queued task that ``slot`` may run, skipping those of calls cancelled or failed."""
        while True:
            head = self._queue[0] if self._queue else None
            if head is not None and (head.target is None or head.target == slot.index):
                task = self._queue.popleft()  # the common case, without a search
            else:
                pos = next((i for i, t in enumerate(self._queue) if t.target is None or t.target == slot.index), None)
                if pos is None:
                    return None
                task = self._queue[pos]
                del self._queue[pos]
            call = task.call
            if call.done:
                continue  # its call failed already
            if not call.started:
                call.started = True
                if not call.future.set_running_or_notify_cancel():  # cancelled while queued
                    call.done = True
                    self._calls.discard(call)
                    _transport.remove_files(call.files)
                    continue
            return task

    def _begin(self, slot: _Slot, task: _Task) -> None:
        call = task.call
        try:
            # One that died since it was last seen is not looked for here (a
            # system call per task): its death before it read the task gives
            # the task to a replacement (see _handle_slot).
            if slot.process is None:
                self.start([slot])
            payload = task.payload() if callable(task.payload) else task.payload
            named = self._named_copies(call) if self._named_only else None
        except BaseException as exc:
            if self._closed:
                raise
            self._finish(call, exc)
            return
        handed = time.monotonic()
        deadline = None if call.timeout is None else handed + call.timeout
        fn_part = None if slot.has_fn_for == call.fn_id else call.fn_blob.message(slot.functions)
        # What it may write again, once every reply it sent has been loaded (see lending.settle).
        files = lending.settle(slot.files) if not slot.unloaded else ((), ())
        if named:
            files = (*files, named)
        unread = pipes.send(slot.fd, slot.process, pickle.dumps((call.fn_id, call.kind, fn_part, payload, files)),
                            deadline)
        # The rest after the write, while the worker wakes (nobody reads it before the pool lock is let go).
        slot.task, slot.handed, slot.deadline, slot.unread = task, handed, deadline, unread
        slot.has_fn_for = call.fn_id
        slot.sent += 1
        slot.task_message = slot.sent
        if self._memory_limit is not None:
            slot.probing = True  # read after the result: the worker's memory once the task is done
            slot.sent += 1
            pipes.send(slot.fd, slot.process, pickle.dumps((0, "memory", None, self._memory_limit, ((), ()))),
                       slot.deadline)

    def _handle(self, ready: list, watched: dict) -> None:
        for fd, _ in ready:
            if fd == self._wake_r:
                try:
                    while os.read(fd, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            slot, incarnation = watched[fd]
            # Several messages may be waiting (a reply and a memory probe's): read them all now.
            while slot.incarnation == incarnation and slot.process is not None:  # else: replaced, or seen already
                self._handle_slot(slot)
                # Nothing more when the buffer holds no whole message and the last read emptied the pipe:
                # what comes later wakes the engine's poll (saves a system call per reply).
                if not (slot.process is not None and (slot.inbox.has_message()
                                        or not slot.inbox.drained and _readable(slot.conn.fileno()))):
                    break

    def _handle_slot(self, slot: _Slot) -> None:
        reply = slot.inbox.receive(slot.deadline if slot.task is not None else None)
        if reply is pipes.LATE:
            return  # the deadline check fails the task
        task = slot.task
        if reply is None:
            if task is None:
                self._kill(slot)  # died while idle: the next task gets a fresh one
            elif slot.unread and not slot.acked and not task.resent:
                # It ended before it had the task (it was dying between
                # calls): nothing of it ran, so a replacement takes it.
                self._kill(slot)
                slot.task, task.resent = None, True
                self._queue.appendleft(task)
            else:
                during = "the call" if slot.acked else "the transfer of the call's arguments"
                slot.task = None
                self._task_failed(task, self._death(slot, during=during), died=True)
            return
        status, _, body = reply
        if status == "refused":
            self._refused(slot, task, body)
            return
        if status == "mem":
            slot.probing = False
            held, dropped = body
            if dropped:  # result files given back, which it kept to write into: let go above the limit
                lending.spares_dropped(slot.files, dropped)
            if held > self._memory_limit:
                logger.info("worker %d (pid %d) replaced: it holds %s after its task, above worker_memory_limit=%s",
                            slot.index, slot.process.pid, _size(held), _size(self._memory_limit))
                self._kill(slot)  # recycled: the next task starts a fresh one (the initializer runs again)
            return
        slot.task = None
        slot.served += 1
        if status == "val":  # a plain result, loaded with the reply: nothing of the user's to run outside the lock
            self._task_done(task, body)
        elif status == "ok":
            # Unpickled by the engine after it has given the worker its next
            # task, and without the lock: callers queue work meanwhile.
            self._replies.append((task, body, slot, slot.incarnation, slot.process.pid, slot.files))
            slot.unloaded += 1
        elif status == "end":
            self._end_after(slot, task, *body)
            return
        else:
            record, blob = body
            exc = None
            if blob is not None:
                try:
                    exc = _transport.loads(blob)
                except (Exception, SystemExit):
                    pass  # e.g. a class only the worker can import: the record (type name, message, traceback) stays
            if status == "exit":  # the function ended its worker (SystemExit): replace it
                slot.process.join(_STOP_GRACE)
                self._kill(slot)
            self._task_failed(task, record, exc)
        if slot.alive and self._max_tasks is not None and slot.served >= self._max_tasks:
            if logger.isEnabledFor(logging.INFO):
                logger.info("worker %d (pid %d) replaced after %d task%s (max_tasks_per_worker=%d); it holds %s",
                            slot.index, slot.process.pid, slot.served, "s"[:slot.served != 1], self._max_tasks,
                            _held_by(slot.process.pid))
            self._kill(slot)  # recycled, as above

    # ----------------------------------------------------------------- /proc/<pid>/fd refused
    # Workers open this process's held files (shm_files.create) through /proc/<pid>/fd. Where that is refused
    # (checked at the pool's first start, or met later: this process turned non-dumpable, changed its uid),
    # every file is named from then on, and the calls pickled before go with named copies of their files.
    _named_only = False

    def _name_files_from_now(self, why: str) -> None:
        if not self._named_only:
            self._named_only = True
            logger.info("workers cannot open this process's files through /proc (%s): large arguments go "
                        "through named files from now on", why)
            for encoder in (self._args, self.functions, self._items):
                encoder.hold = False

    def _named_copies(self, call: _Call) -> dict:
        """The named copies of ``call``'s held files (its arguments', its function's), made once per call."""
        if call.named is None:
            call.named = self._args.named_copies([*call.files, *call.fn_blob.files])
            call.files.extend(call.named.values())  # removed with the call's other files
        return call.named

    def _refused(self, slot: _Slot, task: _Task, why: str) -> None:
        """``slot``'s worker may not open the files of ``task`` (nothing of it ran): send it again, once, with
        its files named, as every later call's are."""
        slot.task, slot.has_fn_for = None, None  # its function is sent again too (its body only if evicted)
        self._name_files_from_now(why)
        if not task.renamed:
            task.renamed = True
            self._queue.appendleft(task)
            return
        message = (f"{why}; sent again with its files named, it was refused again. Keep the caller dumpable "
                   f"(no prctl(PR_SET_DUMPABLE, 0), no change of uid) while the executor runs")
        record = RankFailure(rank=slot.index, device=slot.device, pid=slot.process.pid, exc_type="PermissionError",
                             message=message)
        self._task_failed(task, record, PermissionError(message))

    def _end_after(self, slot: _Slot, task: _Task, status: str, _, body) -> None:
        """A task's reply, after which its worker ends (an item of a ``return_exceptions`` map raised
        ``SystemExit``): settle the task as its reply says, then replace the worker."""
        if status == "val":
            self._task_done(task, body)
        elif status == "ok":
            self._replies.append((task, body, slot, slot.incarnation, slot.process.pid, slot.files))
            slot.unloaded += 1  # its files stay until the result is loaded (see _kill)
        else:
            record, blob = body
            self._task_failed(task, record, _transport.load_error(blob))
        slot.process.join(_STOP_GRACE)
        self._kill(slot)

    def _load_replies(self, replies: list) -> None:
        """Unpickle results (outside the lock), then hand them to their futures."""
        outcomes = []
        for task, body, slot, incarnation, pid, _ in replies:
            try:
                outcomes.append((task, _transport.loads(body), None))
            except (Exception, SystemExit) as exc:  # SystemExit too: it would end the engine
                outcomes.append((task, None, (*_unloadable(task.call.name, slot, pid, exc), slot, incarnation)))
        with self._lock:
            self._loading = [batch for batch in self._loading if batch is not replies]
            for *_, slot, incarnation, _, files in replies:
                self._loaded(slot, incarnation, files)
            for task, value, failure in outcomes:
                if failure is None:
                    self._task_done(task, value)
                    continue
                record, error, slot, incarnation = failure
                if slot.incarnation == incarnation and slot.alive and slot.task is None:
                    self._drop_reply_files(slot)  # else its kill or the shutdown removes them
                self._task_failed(task, record, error)
            if self._closing and not self._busy():
                self._idle.notify_all()  # shutdown() waits for it

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            task = slot.task
            if task is not None and slot.deadline is not None and now >= slot.deadline and not task.call.done:
                began, timeout = slot.started.value, task.call.timeout
                if began >= slot.handed and now < began + timeout:
                    slot.deadline = began + timeout  # it started late (loading): its own time runs from then
                elif slot.acked and began < slot.handed and now < slot.handed + 2 * timeout:
                    slot.deadline = min(now + 0.05, slot.handed + 2 * timeout)  # loading gets as long again
                else:
                    self._timeout(task.call)

    def _timeout(self, call: _Call) -> None:
        """Kill the workers still running the call's tasks (stuck: replace them rather than wait); fail it."""
        call.failures, call.exceptions, call.timed_out = [], {}, True
        for slot in self._slots:
            if slot.task is not None and slot.task.call is call:
                pid = slot.process.pid
                loading = slot.acked and slot.started.value < slot.handed
                what = ("was still loading the function or its arguments after twice" if loading else
                        "still running after" if slot.acked else "had not taken the call's arguments within")
                slot.task = None
                self._kill(slot)
                call.failures.append(RankFailure(rank=slot.index, device=slot.device, pid=pid,
                                                 message=f"{what} the {call.timeout:g}s timeout; worker replaced"))
        self._finish(call)


def _held_by(pid: int) -> str:
    """What the worker ``pid`` holds, as :func:`~.worker.memory_in_use` counts it less its file mappings."""
    try:
        with open(f"/proc/{pid}/status") as f:
            held = sum(int(line.split()[1]) for line in f if line.startswith(("RssAnon:", "RssShmem:"))) << 10
    except (OSError, ValueError, IndexError):
        return "an unknown amount of memory"
    return _size(held)


def _size(nbytes: int) -> str:
    """``"412 MiB"``, or bytes below one.

    Example:
        >>> _size(412 << 20), _size(1000)
        ('412 MiB', '1000 bytes')
    """
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def _unloadable(name: str, slot, pid: int, exc: BaseException) -> tuple[RankFailure, pickle.UnpicklingError]:
    """A result the caller cannot unpickle (a class only the worker can import, a ``__reduce__`` that fails
    here): a ``pickle.UnpicklingError``, as an argument the worker cannot load is an error of its own type
    there; the traceback of the failed load stands as its cause."""
    error = pickle.UnpicklingError(f"the result of {name} could not be unpickled in the caller: {describe(exc)}")
    record = RankFailure(rank=slot.index, device=slot.device, pid=pid, exc_type="UnpicklingError",
                         message=str(error), traceback=traceback.format_exc())
    return record, error
