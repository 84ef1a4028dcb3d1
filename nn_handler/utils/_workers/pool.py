"""The process engine behind ParallelExecutor, @parallelize_on_gpus and NNHandler.launch.

Data flow::

    caller thread                                   worker i (one per device)
    -------------                                   ------------------------
    run/map ──> Encoder.dumps(fn), dumps(args)
            ──> write (call, kind, fn, payload) to conn_i ──> recv, ack ("got"), loads, fn(..., device=dev_i)
                                                                 Encoder.dumps(result) ──┐
    wait([conn_0..n, sentinel_0..n]) <───────────────────────── send_bytes((ok|err, call, body))
      ├─ a reply: store it; map: hand this worker the next chunk
      ├─ a sentinel before the ack of a task it never read: a fresh worker takes the task
      ├─ a sentinel: the worker died ──> kill the call's other busy workers, WorkerDiedError now
      └─ the deadline: kill the busy workers ──> TimeoutError (all are restarted on next use)

One duplex pipe per worker (no queue shared by all): a dead worker can only
break its own pipe, and dynamic load balancing is "send the next chunk to
whichever worker answered". Death is seen on the process sentinel, never by
waiting on a pipe a dead worker will not write to.

Workers come from a forkserver that imported torch once (cheap cold start,
CUDA-safe because the server never touches CUDA), or from ``spawn`` where
there is no forkserver.
"""

from __future__ import annotations

import errno
import functools
import itertools
import multiprocessing as mp
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
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
    has_fn_for: int | None = None  # call id whose function this worker already holds
    # The twin of the worker's cache of function bodies: what need not be sent again.
    functions: _transport.FunctionCache = field(default_factory=_transport.FunctionCache)

    @property
    def alive(self) -> bool:
        return self.process is not None


class WorkerPool:
    """One warm process per device, serving calls one at a time.

    Args:
        devices: Device strings, one worker each (``"cuda:0"``, ``"cpu"``).
        pass_device: Call functions with ``device=torch.device(...)``.
        init_blob: Pickled ``(initializer, initargs)``, run once per worker start.
        threads: ``torch.set_num_threads`` value in each worker.
        start_timeout: Seconds a worker may take to start (initializer
            included) before it is killed; ``None`` waits as long as it lives.
    """

    def __init__(self, devices: list[str], *, pass_device: bool, init_blob: bytes | None, threads: int,
                 start_timeout: float | None = None):
        self.devices = list(devices)
        self._pass_device = pass_device
        self._init_blob = init_blob
        self._threads = threads
        self._start_timeout = start_timeout
        self._token = f"{os.getpid()}-{next(_pool_ids)}"
        self._slots = [_Slot(i, d) for i, d in enumerate(devices)]
        self._call_ids = itertools.count(1)
        self._args = _transport.Encoder(_transport.shm_prefix(f"{self._token}-a"), private=True)
        # functions: their large tensors, shared by every worker of a call like arguments
        self.functions = _transport.Encoder(_transport.shm_prefix(f"{self._token}-f"), private=True)
        # map items go to one worker each: it unlinks their files as it loads them
        self._items = _transport.Encoder(_transport.shm_prefix(f"{self._token}-m"))
        self._lock = threading.RLock()  # one call at a time; shutdown waits for it
        self._closed = False
        self._owner = os.getpid()  # a forked child inherits this object, never its workers

    # ----------------------------------------------------------------- life cycle
    def start(self, slots: list[_Slot] | None = None) -> None:
        """Start every worker (of ``slots``: all by default) that is not running, and wait until each is ready."""
        self.check_owner()
        with self._lock:
            self._check_open()
            for slot in slots or self._slots:
                if slot.alive and not slot.process.is_alive():
                    self._kill(slot)  # died between calls: reap it and start a new one
            fresh = [s for s in slots or self._slots if not s.alive]
            if not fresh:
                return
            guard_against_bootstrap()
            ctx = _context()
            try:
                for slot in fresh:
                    self._start_worker(ctx, slot)
                self._await_ready(fresh)
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
            slot.has_fn_for = None
            slot.functions = _transport.FunctionCache()  # a new process holds no function yet

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
            self.shutdown()
            if timed_out:
                cls = ExecutorTimeoutError
            else:
                cls = WorkerDiedError if all(f.died for f in failures) else ParallelExecutionError
            raise cls(failures, exceptions, function="worker start-up (initializer)")

    def shutdown(self, *, wait: bool = True, ask: bool = True) -> None:
        """Stop every worker; idempotent. Between calls every worker is idle: each is asked to stop.

        Args:
            wait: Wait for a call running in another thread to end. ``False``
                (at interpreter exit, where that thread may be a daemon that
                never returns) kills its workers at once instead.
            ask: ``False`` kills the workers without asking (:meth:`terminate`).
        """
        if os.getpid() != self._owner:
            self._forget()
            return
        if not self._lock.acquire(blocking=wait):
            self._closed = True  # the call's next start() fails instead of restarting them
            for slot in list(self._slots):
                pipes.signal_kill(slot.process)  # the calling thread sees them die and lets go
            if not self._lock.acquire(timeout=10):
                return  # the workers are dead already; nothing else to wait for
        try:
            if self._closed and not any(s.alive for s in self._slots):
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
                        self._kill(slot)
                    _transport.remove_prefixed(_transport.shm_prefix(self._token))
        finally:
            self._lock.release()

    def _stop_idle_workers(self) -> None:
        """Ask idle workers to leave and give them a moment to do so."""
        for slot in self._slots:
            if slot.alive:
                try:
                    slot.conn.send_bytes(pickle.dumps((0, "stop", None, None)))
                except OSError:
                    pass
        deadline = time.monotonic() + _STOP_GRACE
        for slot in self._slots:
            if slot.alive:
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
        if self._closed:
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
            slot.has_fn_for = None
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

    # ----------------------------------------------------------------- calls
    def run(self, fn_blob: bytes, args, kwargs, timeout: float | None, name: str, fail_fast: bool = False) -> list:
        """Call the function on every worker; results in worker order.

        ``fail_fast``: raise at the first failure instead of waiting for every
        worker's reply; for calls whose workers wait on each other (a process
        group), where the others would wait for the failed one forever.
        """
        payload, files = self._encode((args, kwargs))
        try:
            tasks = [(slot.index, payload, slot.index) for slot in self._slots]
            results = self._dispatch("run", fn_blob, tasks, timeout, name, fail_fast)
        finally:
            _transport.remove_files(files)
        return [results[i] for i in range(len(self._slots))]

    def map(self, fn_blob: bytes, chunks, timeout: float | None, name: str) -> list:
        """Call the function on every item; chunks go to whichever worker is free.

        Every chunk is pickled before anything runs (an item that cannot be
        pickled fails the call before it starts), but a chunk with large
        tensors gets its shared-memory files only when a worker is about to
        receive it, and the worker unlinks them as it loads it: shared memory
        holds a chunk or two per worker, whatever the size of the input.
        """
        files: list[str] = []

        def encode(chunk) -> bytes:
            payload, created = self._encode(chunk, self._items)
            files.extend(created)
            return payload

        tasks = []
        for key, chunk in enumerate(chunks):
            try:
                payload = self._items.probe(chunk)
            except Exception as exc:
                raise PayloadPicklingError(str(exc)) from exc
            tasks.append((key, payload if payload is not None else functools.partial(encode, chunk), None))
        try:
            results = self._dispatch("map", fn_blob, tasks, timeout, name)
        finally:
            _transport.remove_files(files)  # chunks whose worker died before loading them
        return [item for key in range(len(tasks)) for item in results[key]]

    def _encode(self, obj, encoder: _transport.Encoder | None = None) -> tuple[bytes, list[str]]:
        try:
            return (encoder or self._args).dumps(obj)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise  # no room in shared memory nor in the temp dir: not a pickling problem
            raise PayloadPicklingError(str(exc)) from exc
        except Exception as exc:
            raise PayloadPicklingError(str(exc)) from exc

    def _dispatch(self, kind: str, fn_blob: bytes, tasks: list, timeout: float | None, name: str,
                  fail_fast: bool = False) -> dict:
        with self._lock:
            self.start()  # replaces workers that died or were killed since the last call
            call_id = next(self._call_ids)
            deadline = None if timeout is None else time.monotonic() + timeout
            queue = list(reversed(tasks))  # pop() takes the first task
            running: dict[int, tuple] = {}  # slot index -> task
            unread: set[int] = set()  # running, but the worker has read none of its message yet
            acked: set[int] = set()  # running, and the worker has the whole task
            resent: set[int] = set()  # slots whose task already went to a replacement once
            results, failures, exceptions = {}, [], {}
            try:
                while queue or running:
                    for slot in self._slots:
                        if slot.index not in running and queue:
                            task = self._next_task_for(slot, queue)
                            if task is not None:
                                if not slot.alive or not slot.process.is_alive():
                                    self._kill(slot)  # ended since start() looked: a fresh one takes the task
                                    self.start([slot])
                                running[slot.index] = task
                                acked.discard(slot.index)
                                unread.discard(slot.index)
                                if self._send(slot, call_id, kind, fn_blob, task[1], deadline):
                                    unread.add(slot.index)
                    if not running:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise self._timeout(running, acked, timeout, name)
                    by_handle = {}
                    for index in running:
                        busy = self._slots[index]
                        by_handle[busy.conn] = by_handle[busy.process.sentinel] = busy
                    died = False
                    for handle in wait(list(by_handle), timeout=left):
                        slot = by_handle[handle]
                        if not slot.alive or slot.index not in running:
                            continue  # already handled through its other handle
                        reply = self._receive(slot, deadline)
                        if reply is pipes.LATE:
                            continue  # the deadline check above raises the timeout
                        if reply is None and slot.index in unread and slot.index not in resent:
                            # It ended before it read any of the task (it was
                            # dying between calls): nothing of it ran, so its
                            # replacement takes the task.
                            self._kill(slot)
                            queue.append(running.pop(slot.index))
                            unread.discard(slot.index)
                            resent.add(slot.index)
                            continue
                        if reply is None:
                            during = "the call" if slot.index in acked else "the transfer of the call's arguments"
                            failures.append(self._death(slot, during=during))
                            running.pop(slot.index)
                            died = True
                            continue
                        status, _, body = reply
                        if status == "got":  # the worker has the task and starts on it
                            unread.discard(slot.index)
                            acked.add(slot.index)
                            continue
                        key = running.pop(slot.index)[0]
                        if status == "ok":
                            try:
                                results[key] = _transport.loads(body)
                                continue
                            except (Exception, SystemExit) as exc:  # SystemExit too: it would end the caller
                                self._drop_reply_files(slot)
                                failures.append(self._unpickle_failure(slot, exc))
                        else:
                            self._record_error(slot, body, failures, exceptions)
                        if status == "exit":  # the function ended its worker (SystemExit): replace it
                            slot.process.join(_STOP_GRACE)
                            self._kill(slot)
                        queue.clear()  # map: no new chunks once a call has failed
                    if died or (failures and fail_fast and running):
                        # Fail now, not when the others finish; and stop their
                        # share of this call, so that nothing of a failed call
                        # keeps running unseen or delays the next call.
                        self._stop(running)
                        cls = WorkerDiedError if died else ParallelExecutionError
                        raise cls(failures, exceptions, function=name)
            except KeyboardInterrupt:
                self.terminate()  # Ctrl-C: every worker ends with the call
                raise
            except BaseException:
                self._stop(running)
                raise
            if failures:
                raise ParallelExecutionError(failures, exceptions, function=name)
            return results

    @staticmethod
    def _next_task_for(slot: _Slot, queue: list):
        # run: each task is addressed to one worker; map: any worker takes the next one.
        for pos in range(len(queue) - 1, -1, -1):
            if queue[pos][2] in (None, slot.index):
                key, payload, target = queue.pop(pos)
                # map: a chunk with large tensors is written to shared memory only now
                return key, payload() if callable(payload) else payload, target
        return None

    def _drop_reply_files(self, slot: _Slot) -> None:
        """Remove the result files of a reply that will not be loaded (the worker is idle: nothing else is in flight)."""
        _transport.remove_prefixed(_transport.shm_prefix(f"{self._token}-w{slot.index}.{slot.incarnation}"))

    @staticmethod
    def _receive(slot: _Slot, deadline: float | None = None):
        """The next reply of ``slot``; ``None`` when it died, ``pipes.LATE`` past ``deadline``."""
        return pipes.receive(slot.conn, slot.process, deadline)

    @staticmethod
    def _write(slot: _Slot, data: bytes, deadline: float | None) -> bool:
        """Send one message to ``slot``; True when the worker read none of it (see :func:`pipes.send`)."""
        return pipes.send(slot.conn, slot.process, data, deadline)

    def _send(self, slot: _Slot, call_id: int, kind: str, fn: _transport.PackedFunction, payload: bytes,
              deadline: float | None) -> bool:
        """Send one task; True when the worker has read none of it yet (it may still be dying)."""
        fn_part = None if slot.has_fn_for == call_id else fn.message(slot.functions)
        slot.has_fn_for = call_id
        return self._write(slot, pickle.dumps((call_id, kind, fn_part, payload)), deadline)

    def _stop(self, running: dict) -> None:
        """Kill the workers still running a failed call's tasks; the next call starts fresh ones."""
        for index in running:
            self._kill(self._slots[index])
        running.clear()

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

    def _timeout(self, running: dict, acked: set, timeout: float, name: str) -> ExecutorTimeoutError:
        failures = []
        for index in sorted(running):
            slot = self._slots[index]
            pid = slot.process.pid
            self._kill(slot)  # stuck: replace it rather than wait on it
            what = "still running after" if index in acked else "had not taken the call's arguments within"
            failures.append(RankFailure(rank=index, device=slot.device, pid=pid,
                                        message=f"{what} the {timeout:g}s timeout; worker replaced"))
        running.clear()
        return ExecutorTimeoutError(failures, function=name)

    def terminate(self) -> None:
        """Kill every worker at once (Ctrl-C, caller error) and close the pool."""
        if os.getpid() != self._owner:
            return self.shutdown()
        with self._lock, pipes.sigint_deferred():  # a second Ctrl-C waits until they are gone
            self.shutdown(ask=False)
