"""The process engine behind ParallelExecutor, @parallelize_on_gpus and NNHandler.launch.

Data flow::

    caller threads                        engine thread (one per pool)             worker i (one per device)
    --------------                        ----------------------------             ------------------------
    submit/run/map: pickle fn, args
      ──> queue a task, wake the engine ──> a free worker takes the first task
                                            that fits it (run: each worker its own)
                                          ──> write (fn_id, kind, fn, payload) ──> ack ("got"), fn(..., device=dev_i)
    Future.result() <── set_result ─────── poll(pipes, sentinels, wake pipe) <──── (ok|err, fn_id, body)
                                            ├─ a reply: resolve the task's future; recycle the worker if asked
                                            ├─ a sentinel before the ack of a task it never read: requeue it
                                            ├─ a sentinel: that task fails with WorkerDiedError (a run: the
                                            │   call's other workers are stopped too); replaced on next use
                                            └─ a task's deadline: its workers are killed ──> TimeoutError

Every task carries its caller's future, so callers in many threads share the
workers and one caller's failure or timeout touches only its own tasks.
One duplex pipe per worker (no queue shared by all): a dead worker can only
break its own pipe. Death is seen on the process sentinel, never by waiting on
a pipe a dead worker will not write to. The engine owns the running tasks;
the pool lock guards the slots and the queue, and the engine lets go of it
while it waits.

Workers come from a forkserver that imported torch once (cheap cold start,
CUDA-safe because the server never touches CUDA), or from ``spawn`` where
there is no forkserver.
"""

from __future__ import annotations

import collections
import errno
import itertools
import multiprocessing as mp
import os
import pickle
import select
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait

from ...errors import (  # ExecutorTimeoutError, PayloadPicklingError: re-exported, their home was here
    ExecutorTimeoutError,
    ParallelExecutionError,
    PayloadPicklingError,
    RankFailure,
    WorkerDiedError,
    describe_exit,
)
from . import pipes
from . import transport as _transport
from .worker import describe, guard_against_bootstrap, main_module_hidden, worker_main

_pool_ids = itertools.count()
# How long a stopping worker gets to leave on its own before it is killed.
_STOP_GRACE = 2.0
_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL


_forkserver_user: int | None = None  # the process whose forkserver our workers come from


def _context():
    global _forkserver_user
    # A child made with os.fork() inherits its parent's forkserver handle,
    # which only the parent can check on: it spawns its workers instead.
    if "forkserver" in mp.get_all_start_methods() and _forkserver_user in (None, os.getpid()):
        _forkserver_user = os.getpid()
        ctx = mp.get_context("forkserver")
        # Only takes effect if this process has not started its forkserver yet.
        ctx.set_forkserver_preload(["torch", "nn_handler.utils._workers.worker"])
        return ctx
    return mp.get_context("spawn")


@dataclass
class _Slot:
    index: int
    device: str
    process: mp.process.BaseProcess | None = None
    conn: object = None
    incarnation: int = 0
    has_fn_for: int | None = None  # function id this worker already holds
    task: "_Task | None" = None  # the task it runs
    unread: bool = False  # running, but the worker has read none of its message yet
    acked: bool = False  # running, and the worker has the whole task
    deadline: float | None = None
    served: int = 0  # tasks since it started (max_tasks_per_worker)
    probing: bool = False  # a memory probe is on its way back (worker_memory_limit)

    @property
    def alive(self) -> bool:
        return self.process is not None


class _Call:
    """What one caller waits for: a broadcast (one task per worker, ``run``) or a single task (``submit``,
    one ``map`` chunk). Its future gets the result or the error."""

    def __init__(self, fn_id: int, kind: str, fn_blob: bytes, name: str, timeout: float | None,
                 future: Future, broadcast: bool = False, fail_fast: bool = False, files=()):
        self.fn_id, self.kind, self.fn_blob, self.name = fn_id, kind, fn_blob, name
        self.timeout, self.future, self.broadcast, self.fail_fast = timeout, future, broadcast, fail_fast
        self.files = list(files)  # shared-memory files of its arguments, removed when it ends
        self.pending = 0
        self.results: dict = {}
        self.failures: list[RankFailure] = []
        self.exceptions: dict = {}
        self.died = self.timed_out = self.started = self.done = False


@dataclass
class _Task:
    call: _Call
    key: int  # a broadcast: the worker index; else 0
    payload: object  # bytes, or a thunk that writes a map chunk's tensors to shared memory at dispatch
    target: int | None  # the worker that must run it (a broadcast), or None for any
    resent: bool = False


class WorkerPool:
    """One warm process per device; tasks from any number of caller threads go to whichever worker is free.

    Args:
        devices: Device strings, one worker each (``"cuda:0"``, ``"cpu"``).
        pass_device: Call functions with ``device=torch.device(...)``.
        init_blob: Pickled ``(initializer, initargs)``, run once per worker start.
        threads: ``torch.set_num_threads`` value in each worker.
        start_timeout: Seconds a worker may take to start (initializer
            included) before it is killed; ``None`` waits as long as it lives.
        max_tasks: Replace a worker after this many tasks (``None``: never).
        memory_limit: Replace a worker whose memory after a task exceeds this many bytes.
    """

    def __init__(self, devices: list[str], *, pass_device: bool, init_blob: bytes | None, threads: int,
                 start_timeout: float | None = None, max_tasks: int | None = None, memory_limit: int | None = None):
        self.devices = list(devices)
        self._pass_device = pass_device
        self._init_blob = init_blob
        self._threads = threads
        self._start_timeout = start_timeout
        self._max_tasks, self._memory_limit = max_tasks, memory_limit
        self._token = f"{os.getpid()}-{next(_pool_ids)}"
        self._slots = [_Slot(i, d) for i, d in enumerate(devices)]
        self._fn_ids = itertools.count(1)
        self._args = _transport.Encoder(_transport.shm_prefix(f"{self._token}-a"), private=True)
        # map items go to one worker each: it unlinks their files as it loads them
        self._items = _transport.Encoder(_transport.shm_prefix(f"{self._token}-m"))
        self._lock = threading.RLock()  # the slots and the queue
        self._queue: collections.deque[_Task] = collections.deque()
        self._idle = threading.Condition(self._lock)  # notified when nothing is queued or running
        self._engine: threading.Thread | None = None
        self._wake_r = self._wake_w = None
        self._closed = False  # no worker will run anything any more
        self._closing = False  # shutdown(): no new calls; the engine ends once the queue is empty
        self._owner = os.getpid()  # a forked child inherits this object, never its workers

    # ----------------------------------------------------------------- life cycle
    def start(self, slots: list[_Slot] | None = None) -> None:
        """Start every worker (of ``slots``: all by default) that is not running, and wait until each is ready."""
        self.check_owner()
        with self._lock:
            if self._closed:
                raise RuntimeError("this executor has been shut down; create a new one")
            idle = [s for s in slots or self._slots if s.task is None]  # the engine sees to busy ones
            for slot in idle:
                if slot.alive and not slot.process.is_alive():
                    self._kill(slot)  # died between calls: reap it and start a new one
            fresh = [s for s in idle if not s.alive]
            if not fresh:
                return
            guard_against_bootstrap()
            ctx = _context()
            try:
                for slot in fresh:
                    self._start_worker(ctx, slot)
                self._await_ready(fresh)
                self._wake()  # the engine watches the new pipes from now on
            except BaseException:
                # Ctrl-C during the initializer, a process that could not be
                # created: the workers started so far end with the start.
                self.terminate()
                raise

    def _start_worker(self, ctx, slot: _Slot) -> None:
        slot.incarnation += 1
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        prefix = _transport.shm_prefix(f"{self._token}-w{slot.index}.{slot.incarnation}")
        # Not daemonic, so that a function may start its own executor in a
        # worker. What daemon=True gave, the pool does itself: shutdown() and
        # the executor's finalizer end the workers (also at exit), and a
        # worker ends on its own on EOF or when the caller is gone.
        process = ctx.Process(
            target=worker_main,
            args=(child_conn, slot.index, slot.device, self._threads, self._init_blob,
                  self._pass_device, prefix, os.getpid()),
            name=f"nn_handler-worker-{slot.index}",
            daemon=False,
        )
        # Ctrl-C half-way through start() would leave a process the pool does
        # not know of: it is delivered once the slot holds the process.
        with pipes.sigint_deferred():
            try:
                with main_module_hidden(always=False):  # a script fed on stdin cannot be imported
                    process.start()
            except BaseException:
                parent_conn.close()
                child_conn.close()
                raise
            finally:
                # Kept out of multiprocessing's own exit hook, which would join a
                # non-daemonic worker (a hang if it is stuck) and which, in a child
                # made with os.fork(), would stop the parent's workers.
                mp.process._children.discard(process)
            child_conn.close()  # only the child holds its end: EOF once it dies
            slot.process, slot.conn = process, parent_conn
            slot.has_fn_for, slot.served, slot.probing = None, 0, False

    def _await_ready(self, fresh: list[_Slot]) -> None:
        pending = {s.conn: s for s in fresh}
        failures, exceptions, timed_out = [], {}, False
        deadline = None if self._start_timeout is None else time.monotonic() + self._start_timeout
        while pending:
            sentinels = {s.process.sentinel: s for s in pending.values()}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready_handles = wait(list(pending) + list(sentinels), timeout=left)
            if not ready_handles:
                what = "the initializer did not finish" if self._init_blob is not None else "did not start"
                for slot in list(pending.values()):
                    failures.append(RankFailure(rank=slot.index, device=slot.device, pid=slot.process.pid,
                                                message=f"{what} within the {self._start_timeout:g}s timeout; "
                                                        f"worker killed"))
                    self._kill(slot)
                pending.clear()
                timed_out = True
            for ready in ready_handles:
                slot = pending.get(ready) or sentinels.get(ready)
                if slot is None or slot.conn not in pending:
                    continue
                reply = self._receive(slot)
                del pending[slot.conn]
                if reply is None:
                    failures.append(self._death(slot, during="start-up"))
                elif reply[0] == "err":
                    self._record_error(slot, reply[2], failures, exceptions)
                    self._kill(slot)
        if failures:
            self._close_now(ask=True)
            if timed_out:
                cls = ExecutorTimeoutError
            else:
                cls = WorkerDiedError if all(f.died for f in failures) else ParallelExecutionError
            raise cls(failures, exceptions, function="worker start-up (initializer)")

    def shutdown(self, *, wait: bool = True, ask: bool = True, cancel: bool = False) -> None:
        """Stop every worker once the queued and running tasks are done; idempotent.

        Args:
            wait: ``False`` (at interpreter exit, the finalizer of a dropped
                executor) kills the workers at once instead: a call running in
                another thread, maybe a daemon that never returns, fails.
            ask: ``False`` kills the workers without asking (:meth:`terminate`).
            cancel: Cancel the tasks still queued (``cancel_futures``).
        """
        if os.getpid() != self._owner:
            self._forget()
            return
        if not wait:
            self._closed = True  # the engine ends, and starts nothing
            for slot in list(self._slots):
                pipes.signal_kill(slot.process)  # the engine (or a starting caller) sees them die and lets go
            self._wake()
            if not self._lock.acquire(timeout=10):
                return  # the workers are dead already; nothing else to wait for
            try:
                self._close_now(ask=False)
            finally:
                self._lock.release()
            return
        try:
            with self._lock:
                self._closing = True
                if cancel:
                    self._cancel_queued()
                engine = self._engine
                self._wake()
                while engine is not None and engine is not threading.current_thread() and self._busy():
                    self._idle.wait()  # the queue drains: every task still in it runs first
            if engine is not None and engine is not threading.current_thread():
                engine.join()
            with self._lock:
                self._close_now(ask=ask)
        except BaseException:
            self.terminate()  # Ctrl-C while waiting: no worker outlives it
            raise

    def _close_now(self, ask: bool) -> None:
        """Mark the pool closed, fail what is still pending, stop the workers (the lock is held)."""
        if self._closed and not any(s.alive for s in self._slots) and self._wake_r is None:
            return
        try:
            self._closed = True
            if ask:
                self._stop_idle_workers()
        finally:
            # Even when Ctrl-C ends the wait above: a second Ctrl-C must
            # not leave a worker running (and the pool marked closed).
            with pipes.sigint_deferred():
                for slot in self._slots:
                    if slot.task is not None:
                        task, slot.task = slot.task, None
                        self._task_failed(task, self._death(slot), died=True)
                    self._kill(slot)
                self._cancel_queued()
                _transport.remove_prefixed(_transport.shm_prefix(self._token))
                self._wake()
                if self._engine is None or not self._engine.is_alive():
                    self._close_wake_pipe()
                self._idle.notify_all()

    def _stop_idle_workers(self) -> None:
        """Ask idle workers to leave and give them a moment to do so."""
        for slot in self._slots:
            if slot.alive and slot.task is None:
                try:
                    slot.conn.send_bytes(pickle.dumps((0, "stop", None, None)))
                except OSError:
                    pass
        deadline = time.monotonic() + _STOP_GRACE
        for slot in self._slots:
            if slot.alive and slot.task is None:
                slot.process.join(max(0.0, deadline - time.monotonic()))

    def _forget(self) -> None:
        """In a forked child: drop the parent's pipes without a word to its workers."""
        self._closed = True
        for slot in self._slots:
            if slot.conn is not None:
                slot.conn.close()  # our copy only; the parent keeps its own
            slot.process = slot.conn = None

    @property
    def closed(self) -> bool:
        return self._closed

    def check_owner(self) -> None:
        """Raise if this process is a fork of the one that made the pool (before any lock: a thread of
        the parent may have held it at the fork)."""
        if os.getpid() != self._owner:
            raise RuntimeError(
                f"this executor belongs to process {self._owner}; a forked child cannot use its parent's workers: "
                f"create a new ParallelExecutor in the child"
            )

    def _check_open(self) -> None:
        self.check_owner()
        if self._closed or self._closing:
            raise RuntimeError("this executor has been shut down; create a new one")

    def _kill(self, slot: _Slot) -> None:
        """End a worker for good and reap it (no zombie), dropping its unread result files."""
        if slot.process is None:
            return
        with pipes.sigint_deferred():  # half-reaped, the slot would be stuck with a closed process
            if slot.process.is_alive():
                slot.process.kill()
            slot.process.join()
            slot.process.close()
            if slot.conn is not None:
                slot.conn.close()
            slot.process = slot.conn = None
            slot.has_fn_for, slot.probing = None, False
        _transport.remove_prefixed(_transport.shm_prefix(f"{self._token}-w{slot.index}.{slot.incarnation}"))

    def _death(self, slot: _Slot, during: str = "the call") -> RankFailure:
        slot.process.join(1.0)
        exitcode = slot.process.exitcode
        hint = ""
        if self._closed:  # killed by shutdown(wait=False) from another thread, e.g. at interpreter exit
            hint = "; the executor was shut down while the call ran"
        elif during == "start-up":
            hint = ("; see its output above. If your script creates the executor at import time, start it under "
                    "`if __name__ == \"__main__\":` (workers import the main module)")
        record = RankFailure(
            rank=slot.index,
            device=slot.device,
            pid=slot.process.pid,
            message=f"worker died during {during} ({describe_exit(exitcode)}){hint}",
            exitcode=exitcode,
        )
        self._kill(slot)
        return record


    # ----------------------------------------------------------------- calls (any thread)
    def new_fn_id(self) -> int:
        """An id for a function: a worker that holds it is not sent it again within one map."""
        return next(self._fn_ids)

    def run(self, fn_blob: bytes, args, kwargs, timeout: float | None, name: str, fail_fast: bool = False) -> list:
        """Call the function on every worker; results in worker order.

        It waits for the tasks the workers are running, then each worker runs
        it once. ``fail_fast``: fail at the first failure instead of waiting
        for every worker's reply; for calls whose workers wait on each other
        (a process group), where the others would wait for the failed one forever.
        """
        future = self.run_async(fn_blob, args, kwargs, timeout, name, fail_fast)
        try:
            return future.result()
        except KeyboardInterrupt:
            self.terminate()  # Ctrl-C: every worker ends with the call
            raise

    def run_async(self, fn_blob: bytes, args, kwargs, timeout: float | None, name: str,
                  fail_fast: bool = False) -> Future:
        payload, files = self._encode((args, kwargs))
        call = _Call(self.new_fn_id(), "run", fn_blob, name, timeout, Future(), broadcast=True,
                     fail_fast=fail_fast, files=files)
        self._enqueue([call], [_Task(call, slot.index, payload, slot.index) for slot in self._slots])
        return call.future

    def submit(self, fn_id: int, fn_blob: bytes, kind: str, objs: list, timeout: float | None,
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
                call = _Call(fn_id, kind, fn_blob, name, timeout, Future())
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
            if exc.errno == errno.ENOSPC:
                raise  # no room in shared memory nor in the temp dir: not a pickling problem
            raise PayloadPicklingError(str(exc)) from exc
        except Exception as exc:
            raise PayloadPicklingError(str(exc)) from exc

    def _enqueue(self, calls: list[_Call], tasks: list[_Task]) -> None:
        try:
            self.start()  # replaces idle workers that died since the last call (errors raise here)
            with self._lock:
                self._check_open()
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
        except BaseException:
            for call in calls:
                _transport.remove_files(call.files)
            raise
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, TypeError, OSError):
            pass  # full (it will wake anyway) or no engine yet

    def _busy(self) -> bool:
        return bool(self._queue) or any(s.task is not None for s in self._slots)

    def _cancel_queued(self) -> None:
        while self._queue:
            task = self._queue.popleft()
            if not task.call.done:
                task.call.done = True
                _transport.remove_files(task.call.files)
                if not task.call.future.cancel():  # a broadcast already running elsewhere
                    task.call.future.set_exception(RuntimeError("this executor was shut down before the call ran"))

    def _close_wake_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None

    # ----------------------------------------------------------------- the engine thread
    def _engine_main(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or (self._closing and not self._busy()):
                        return
                    self._dispatch()
                    watched, timeout = self._watch_list()
                poller = select.poll()
                for fd in watched:
                    poller.register(fd, _POLL_IN)
                ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))
                with self._lock:
                    if self._closed:
                        return
                    self._handle({fd for fd, _ in ready}, watched)
                    self._check_deadlines()
        except BaseException as exc:  # a bug or a failed restart: fail every caller rather than hang them
            with self._lock:
                for slot in self._slots:
                    if slot.task is not None:
                        task, slot.task = slot.task, None
                        self._finish(task.call, exc)
                while self._queue:
                    self._finish(self._queue.popleft().call, exc)
            raise
        finally:
            with self._lock:
                self._idle.notify_all()
                if self._closed:
                    self._close_wake_pipe()

    def _watch_list(self) -> tuple[dict, float | None]:
        """fd -> (slot, incarnation) to poll, and seconds to the nearest task deadline."""
        watched: dict = {self._wake_r: None}
        deadlines = []
        for slot in self._slots:
            if slot.alive:
                watched[slot.conn.fileno()] = watched[slot.process.sentinel] = (slot, slot.incarnation)
                if slot.task is not None and slot.deadline is not None:
                    deadlines.append(slot.deadline)
        return watched, (min(deadlines) - time.monotonic() if deadlines else None)

    def _dispatch(self) -> None:
        """Give every free worker the first queued task that fits it."""
        for slot in self._slots:
            while self._queue and slot.task is None and not slot.probing:
                task = self._take(slot)
                if task is None:
                    break
                self._begin(slot, task)
        if not self._busy():
            self._idle.notify_all()

    def _take(self, slot: _Slot) -> _Task | None:
        for pos, task in enumerate(self._queue):
            if task.target is None or task.target == slot.index:
                del self._queue[pos]
                call = task.call
                if call.done:
                    continue  # its call failed already
                if not call.started:
                    call.started = True
                    if not call.future.set_running_or_notify_cancel():  # cancelled while queued
                        call.done = True
                        _transport.remove_files(call.files)
                        return self._take(slot)
                return task
        return None

    def _begin(self, slot: _Slot, task: _Task) -> None:
        call = task.call
        try:
            if not slot.alive or not slot.process.is_alive():
                self._kill(slot)  # ended since it was last seen: a fresh one takes the task
                self.start([slot])
            payload = task.payload() if callable(task.payload) else task.payload
        except BaseException as exc:
            if self._closed:
                raise
            self._finish(call, exc)
            return
        slot.task, slot.acked = task, False
        slot.deadline = None if call.timeout is None else time.monotonic() + call.timeout
        fn_part = None if slot.has_fn_for == call.fn_id else call.fn_blob
        slot.has_fn_for = call.fn_id
        message = pickle.dumps((call.fn_id, call.kind, fn_part, payload))
        slot.unread = pipes.send(slot.conn, slot.process, message, slot.deadline)
        if self._memory_limit is not None:
            slot.probing = True  # read after the result: the worker's memory once the task is done
            pipes.send(slot.conn, slot.process, pickle.dumps((0, "memory", None, None)), slot.deadline)

    def _handle(self, ready: set, watched: dict) -> None:
        for fd in ready:
            if fd == self._wake_r:
                try:
                    while os.read(fd, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            slot, incarnation = watched[fd]
            if slot.incarnation != incarnation or not slot.alive:
                continue  # replaced since the poll began, or seen through its other handle
            self._handle_slot(slot)

    def _handle_slot(self, slot: _Slot) -> None:
        reply = pipes.receive(slot.conn, slot.process, slot.deadline if slot.task is not None else None)
        if reply is pipes.LATE:
            return  # the deadline check fails the task
        task = slot.task
        if reply is None:
            if task is None:
                self._kill(slot)  # died while idle: the next task gets a fresh one
            elif slot.unread and not task.resent:
                # It ended before it read any of the task (it was dying
                # between calls): nothing of it ran, so a replacement takes it.
                self._kill(slot)
                slot.task, task.resent = None, True
                self._queue.appendleft(task)
            else:
                during = "the call" if slot.acked else "the transfer of the call's arguments"
                slot.task = None
                self._task_failed(task, self._death(slot, during=during), died=True)
            return
        status, _, body = reply
        if status == "got":  # the worker has the task and starts on it
            slot.unread, slot.acked = False, True
            return
        if status == "mem":
            slot.probing = False
            if body > self._memory_limit:
                self._retire(slot)
            return
        slot.task = None
        slot.served += 1
        if status == "ok":
            try:
                value = _transport.loads(body)
            except (Exception, SystemExit) as exc:  # SystemExit too: it would end the engine
                self._drop_reply_files(slot)
                self._task_failed(task, self._unpickle_failure(slot, exc))
            else:
                self._task_done(task, value)
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
            self._retire(slot)

    def _retire(self, slot: _Slot) -> None:
        """Recycling: end a worker after its task; the next task starts a fresh one (the initializer runs again)."""
        self._kill(slot)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            task = slot.task
            if task is not None and slot.deadline is not None and now >= slot.deadline and not task.call.done:
                self._timeout(task.call)

    def _timeout(self, call: _Call) -> None:
        """Kill the workers still running the call's tasks (stuck: replace them rather than wait); fail it."""
        call.failures, call.exceptions, call.timed_out = [], {}, True
        for slot in self._slots:
            if slot.task is not None and slot.task.call is call:
                pid = slot.process.pid
                what = "still running after" if slot.acked else "had not taken the call's arguments within"
                slot.task = None
                self._kill(slot)
                call.failures.append(RankFailure(rank=slot.index, device=slot.device, pid=pid,
                                                 message=f"{what} the {call.timeout:g}s timeout; worker replaced"))
        self._finish(call)

    # ----------------------------------------------------------------- outcomes (the lock is held)
    def _task_done(self, task: _Task, value) -> None:
        call = task.call
        if call.done:
            return
        call.results[task.key] = value
        call.pending -= 1
        if call.pending == 0:
            self._finish(call)

    def _task_failed(self, task: _Task, record: RankFailure, exc: BaseException | None = None,
                     died: bool = False) -> None:
        call = task.call
        if call.done:
            return
        call.failures.append(record)
        if exc is not None:
            call.exceptions[record.rank] = exc
        call.died = call.died or died
        call.pending -= 1
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
        _transport.remove_files(call.files)
        if error is None and call.failures:
            cls = ExecutorTimeoutError if call.timed_out else WorkerDiedError if call.died else ParallelExecutionError
            error = cls.create(call.failures, call.exceptions, function=call.name)
        if call.future.done():
            return
        if error is not None:
            call.future.set_exception(error)
        elif call.broadcast:
            call.future.set_result([call.results[i] for i in range(len(self._slots))])
        else:
            call.future.set_result(call.results[0])
    def _drop_reply_files(self, slot: _Slot) -> None:
        """Remove the result files of a reply that will not be loaded (the worker is idle: nothing else is in flight)."""
        _transport.remove_prefixed(_transport.shm_prefix(f"{self._token}-w{slot.index}.{slot.incarnation}"))

    @staticmethod
    def _receive(slot: _Slot, deadline: float | None = None):
        """The next reply of ``slot``; ``None`` when it died, ``pipes.LATE`` past ``deadline``."""
        return pipes.receive(slot.conn, slot.process, deadline)

    def _record_error(self, slot: _Slot, body, failures: list, exceptions: dict) -> None:
        record, blob = body
        failures.append(record)
        if blob is not None:
            try:
                exceptions[slot.index] = _transport.loads(blob)
            except (Exception, SystemExit):
                pass  # e.g. a class only the worker can import: the record (type name, message, traceback) stays

    @staticmethod
    def _unpickle_failure(slot: _Slot, exc: BaseException) -> RankFailure:
        return RankFailure(rank=slot.index, device=slot.device, pid=slot.process.pid, exc_type=type(exc).__qualname__,
                           message=f"the result could not be unpickled in the caller: {describe(exc)}")

    def terminate(self) -> None:
        """Kill every worker at once (Ctrl-C, caller error) and close the pool."""
        if os.getpid() != self._owner:
            return self.shutdown()
        with pipes.sigint_deferred():  # a second Ctrl-C waits until they are gone
            self.shutdown(wait=False)
