"""The process engine behind ParallelExecutor, @parallelize_on_gpus and NNHandler.launch.

Data flow::

    caller threads                        the engine (one thread at a time)       worker i (one per device)
    --------------                        ----------------------------             ------------------------
    submit/run/map: pickle fn, args
      ──> queue a task ───────────────────> a free worker takes the first task
                                            that fits it (run: each worker its own)
                                          ──> write (fn_id, kind, fn, payload) ──> count it read, fn(..., device=dev_i)
    Future.result() <── set_result ─────── poll(pipes, sentinels, wake pipe) <──── (ok|val|err, fn_id, body)
                                            ├─ a reply: resolve the task's future; recycle the worker if asked
                                            ├─ a sentinel, the task unread by its count: requeue it
                                            ├─ a sentinel: that task fails with WorkerDiedError (a run: the
                                            │   call's other workers are stopped too); replaced on next use
                                            └─ a task's deadline: its workers are killed ──> TimeoutError

The engine's work is done by the caller waiting on ``run()`` or on a task's
``result()`` (no hand-off between threads on the hot path), else by the
pool's engine thread (callbacks, asyncio, ``as_completed``). Every task carries its caller's future, so callers in many
threads share the workers and one caller's failure or timeout touches only
its own tasks.
One pair of pipes per worker (no queue shared by all): a dead worker can only
break its own pipe. Death is seen on the process sentinel, never by waiting on
a pipe a dead worker will not write to. The engine owns the running tasks;
the pool lock guards the slots and the queue, and the engine lets go of it
while it waits. This module starts, stops and reaps the processes; the
tasks' half (queue, engine, outcomes) is :mod:`.scheduler`, what it keeps
track of (slots, calls, tasks, their futures) :mod:`.calls`.

No worker is a fork of the caller. Workers come from a forkserver that is a
fresh interpreter (it imported torch once for all of them and never touches
CUDA), or from ``spawn`` where there is none: :mod:`.server` decides. Each new
worker gets the caller's environment as it is when the worker starts and its
own random seeds (:func:`.worker.seed_streams`, after its imports), and imports with the caller's
``sys.path``; see docs/executor.md, "How a worker starts, and what it inherits".
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
import weakref
from multiprocessing.connection import wait

from ...errors import (  # ExecutorTimeoutError, PayloadPicklingError: re-exported, their home was here
    ExecutorTimeoutError,
    ParallelExecutionError,
    PayloadPicklingError,
    RankFailure,
    WorkerDiedError,
    describe_exit,
)
from . import lending, pipes, server
from . import transport as _transport
from .calls import _Slot, _Task
from .scheduler import _STOP_GRACE, Scheduler
from .settling import SettlingLock
from .worker import guard_against_bootstrap, worker_main

__all__ = ["WorkerPool", "ExecutorTimeoutError", "PayloadPicklingError"]

logger = logging.getLogger(__name__)
_pool_ids = itertools.count()

# The default of ParallelExecutor(start_timeout=...): seconds a new worker may take to be ready to run tasks: its
# process, the import of the caller's main script (`import transformers` and friends), the initializer (loading a
# model). A bound of its own, generous, whatever the task timeout (which is per task): a start that never ends (a
# script that joins a process group at import time, without a main guard) is killed and said so, one that is only
# slow is left to finish.
START_TIMEOUT = 300.0


_open_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()  # what the exit hook waits for


def _finish_at_exit() -> None:
    """The program does not exit until the tasks submitted are done, as ``concurrent.futures`` promises.

    Run by ``threading``'s shutdown hook (as ``concurrent.futures`` does),
    before non-daemon threads are joined and before the executors'
    finalizers (``atexit``) kill what is left.
    """
    for pool in list(_open_pools):
        pool.finish_at_exit()


def _register_exit_hook() -> None:
    try:
        threading._register_atexit(_finish_at_exit)
    except (AttributeError, RuntimeError):  # another Python, or the interpreter is already shutting down
        pass


_register_exit_hook()


class WorkerPool(Scheduler):
    """One warm process per device; tasks from any number of caller threads go to whichever worker is free.

    Args:
        devices: Device strings, one worker each (``"cuda:0"``, ``"cpu"``).
        pass_device: Call functions with ``device=torch.device(...)``.
        init_blob: Pickled ``(initializer, initargs)``, run once per worker start.
        threads: ``torch.set_num_threads`` value in each worker.
        start_limit: Seconds a worker may take to start (initializer
            included) before it is killed (the executor's ``start_timeout``); ``None``: no bound.
        start_timeout: The same, for a caller whose deadline covers start-up (it wins over ``start_limit``);
            an attribute too.
        max_tasks: Replace a worker after this many tasks (``None``: never).
        memory_limit: Replace a worker whose memory after a task exceeds this many bytes.
    """

    def __init__(self, devices: list[str], *, pass_device: bool, init_blob: bytes | None, threads: int,
                 start_limit: float | None = START_TIMEOUT, start_timeout: float | None = None,
                 max_tasks: int | None = None, memory_limit: int | None = None):
        self.devices = list(devices)
        self._pass_device = pass_device
        self._init_blob = init_blob
        self._threads = threads
        self.start_timeout, self.start_limit = start_timeout, start_limit
        self._max_tasks, self._memory_limit = max_tasks, memory_limit
        self.import_main = True  # a new worker imports the caller's main script (see server.inheritance)
        self._token = f"{os.getpid()}-{next(_pool_ids)}"
        self._seed = server.base_seed()  # every worker's random streams derive from it and its place
        self._slots = [_Slot(i, d) for i, d in enumerate(devices)]
        self._fn_ids = itertools.count(1)
        self._args = _transport.Encoder(_transport.shm_prefix(f"{self._token}-a"), private=True)
        # functions: their large tensors, shared by every worker of a call like arguments
        self.functions = _transport.Encoder(_transport.shm_prefix(f"{self._token}-f"), private=True)
        # map items go to one worker each: it unlinks their files as it loads them
        self._items = _transport.Encoder(_transport.shm_prefix(f"{self._token}-m"))
        self._lock = SettlingLock()  # the slots and the queue; futures settle once it is let go
        self._queue: collections.deque[_Task] = collections.deque()
        self._calls: set = set()  # every call not finished yet: none is left unanswered when the pool closes
        self._idle = threading.Condition(self._lock)  # notified when nothing is queued or running
        self._engine: threading.Thread | None = None
        self._wake_r = self._wake_w = None
        self._wake_lock = threading.Lock()
        self._engine_wanted = threading.Condition(self._lock)  # the engine thread waits here while nothing is outstanding
        # Held by the thread doing the engine's work (see Scheduler); re-entrant: a done-callback run by that
        # thread may call run() and drive its call itself.
        self._driver = threading.RLock()
        self._poller, self._watched, self._polled = None, {}, None  # the driver's: what it polls, as of which generation
        self._polling = False  # the driver waits in poll(): a Ctrl-C there cuts nothing in half
        self._spinning = True  # the driver polls for a moment before it sleeps (see pipes.spin)
        self._deferred = False  # tasks on workers that nobody drives yet (see Scheduler._enqueue)
        self._replies: list = []  # the driver's: results read, to unpickle once the lock is let go
        self._loading: list = []  # the driver's: batches of results being unpickled (a callback may drive more)
        self._unloaded_of_killed: dict[str, int] = {}  # a killed worker's file prefix -> its replies still to load
        self._generation = 0  # bumped whenever a worker starts or ends: the engine's cue to re-read the slots
        self._closed = False  # no worker will run anything any more
        self._closing = False  # shutdown(): no new calls; the engine ends once the queue is empty
        self._owner = os.getpid()  # a forked child inherits this object, never its workers
        self._dying: list = []  # killed workers not reaped yet (see _kill)
        self._failing = False  # a call is failing: the workers killed with it are not waited for
        self._stale_files: list = []  # file prefixes of those workers, to drop with them
        self._stale_names: list = []  # the same, whose named files are not removed yet (see _drop_stale_names)
        self._descriptors_checked = False  # whether workers were seen to open this process's files (see start)
        _open_pools.add(self)

    # ----------------------------------------------------------------- life cycle
    def start(self, slots: list[_Slot] | None = None) -> None:
        """Start every worker (of ``slots``: all by default) that is not running, and wait until each is ready."""
        self.check_owner()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown (this executor has been shut "
                                   "down; create a new one)")
            idle = [s for s in slots or self._slots if s.task is None]  # the engine sees to busy ones
            for slot in idle:
                if slot.alive and slot.exited():
                    self._kill(slot)  # died between calls: reap it and start a new one
            fresh = [s for s in idle if not s.alive]
            if not fresh:
                return
            guard_against_bootstrap()
            self._reap()  # a new worker starts once the one it replaces is gone (its memory, its GPU)
            ctx = server.context()
            probe = None if self._descriptors_checked else _transport.probe(self._args.prefix)
            try:
                for slot in fresh:
                    self._start_worker(ctx, slot, probe)
                refusals = self._await_ready(fresh)
                self._wake()  # the engine watches the new pipes from now on
            except BaseException:
                # Ctrl-C during the initializer, a process that could not be
                # created: the workers started so far end with the start.
                self.terminate()
                raise
            finally:
                if probe is not None:
                    _transport.remove_files([probe])
            self._descriptors_checked = True
            if probe is not None and refusals:
                # The workers cannot open this process's files through /proc/<pid>/fd: name them instead (they
                # are then removed by the pool, and by a worker that outlives this process).
                self._name_files_from_now(refusals[0])

    def _start_worker(self, ctx, slot: _Slot, probe=None) -> None:
        slot.incarnation += 1
        parent_conn, child_conn = pipes.channel(ctx)
        reads, started = ctx.RawValue("Q", 0), ctx.RawValue("d", 0.0)  # see _Slot.reads, _Slot.started
        prefix = _transport.shm_prefix(f"{self._token}-w{slot.index}.{slot.incarnation}")
        # Not daemonic, so that a function may start its own executor in a
        # worker. What daemon=True gave, the pool does itself: shutdown() and
        # the executor's finalizer end the workers (also at exit), and a
        # worker ends on its own on EOF or when the caller is gone.
        process = server.process(
            ctx,
            target=worker_main,
            args=(child_conn, slot.index, slot.device, self._threads, self._init_blob,
                  self._pass_device, prefix, os.getpid(), reads, started,
                  # one worker id for each place and replacement: no two workers of the pool draw alike
                  server.inheritance(self._seed, slot.index + len(self._slots) * (slot.incarnation - 1),
                                     main=self.import_main), probe),
            name=f"nn_handler-worker-{slot.index}",
            daemon=False,
        )
        # Ctrl-C half-way through start() would leave a process the pool does
        # not know of: it is delivered once the slot holds the process.
        with pipes.sigint_deferred():
            try:
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
            slot.fd = parent_conn.writer.fileno()
            os.set_blocking(parent_conn.fileno(), False)  # see pipes: every read and write polls with a deadline
            os.set_blocking(slot.fd, False)
            slot.process, slot.conn, slot.files, slot.unloaded = process, parent_conn, prefix or "", 0
            slot.reads, slot.started, slot.sent = reads, started, 0
            slot.inbox = pipes.Inbox(parent_conn, process)
            self._generation += 1
            slot.has_fn_for, slot.served, slot.probing = None, 0, False
            slot.functions = _transport.FunctionCache()  # a new process holds no function yet

    def _await_ready(self, fresh: list[_Slot]) -> list[str]:
        """Wait until every worker of ``fresh`` is ready; why those that could not open the probe could not."""
        pending = {s.conn: s for s in fresh}
        stage: dict[int, str] = {}  # slot index -> "main" (imports the main script) or "init" (the initializer)
        failures, exceptions, timed_out, refusals = [], {}, False, []
        bound = self.start_timeout if self.start_timeout is not None else self.start_limit
        deadline = None if bound is None else time.monotonic() + bound
        while pending:
            sentinels = {s.process.sentinel: s for s in pending.values()}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready_handles = wait(list(pending) + list(sentinels), timeout=left)
            if not ready_handles:
                why = (f"the call's {bound:g}s timeout" if self.start_timeout is not None else
                       f"{bound:g}s (the executor's start_timeout: a worker's start-up has a bound of its own, "
                       f"apart from the task timeout; pass ParallelExecutor(start_timeout=...) for a slow start, "
                       f"None for no bound)")
                for slot in list(pending.values()):
                    what = "its initializer did not finish" if stage.get(slot.index) == "init" else "did not start"
                    failures.append(RankFailure(
                        rank=slot.index, device=slot.device, pid=slot.process.pid, exc_type="TimeoutError",
                        message=f"{what} within {why}; worker killed"))
                    self._kill(slot)
                pending.clear()
                timed_out = True
            for ready in ready_handles:
                slot = pending.get(ready) or sentinels.get(ready)
                if slot is None or slot.conn not in pending:
                    continue
                reply = self._receive(slot)
                while reply is not None and reply[0] in ("main", "init"):  # where its start-up has come to
                    stage[slot.index] = reply[0]
                    if not slot.inbox.has_message():
                        break
                    reply = self._receive(slot)
                if reply is not None and reply[0] in ("main", "init"):
                    continue  # wait on, for its pipe or its end
                del pending[slot.conn]
                if reply is None:
                    where = stage.get(slot.index)
                    failures.append(self._death(
                        slot, during="start-up, in its initializer" if where == "init" else "start-up",
                        importing_main=where == "main"))
                elif reply[0] == "err":
                    self._record_error(slot, reply[2], failures, exceptions)
                    self._kill(slot)
                elif reply[2] is not None:  # ready, but it could not open this process's files
                    refusals.append(reply[2])
        if failures:
            self._close_now(ask=True)
            if timed_out:
                cls = ExecutorTimeoutError
            else:
                cls = WorkerDiedError if all(f.died for f in failures) else ParallelExecutionError
            failed = {f.rank for f in failures}
            function = "initializer" if any(stage.get(rank) == "init" for rank in failed) else "worker start-up"
            raise cls(failures, exceptions, function=function)
        return refusals

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
                self._engine_wanted.notify_all()
                while engine is not None and engine is not threading.current_thread() and self._busy():
                    self._idle.wait()  # the queue drains: every task still in it runs first
            if engine is not None and engine is not threading.current_thread():
                engine.join()
            with self._lock:
                self._close_now(ask=ask)
        except BaseException:
            self.terminate()  # Ctrl-C while waiting: no worker outlives it
            raise

    def finish_at_exit(self) -> None:
        """Let every task submitted finish, then stop the workers; a call whose caller is a daemon thread
        (``run()``, never joined) is cut short instead, its workers killed."""
        if os.getpid() != self._owner or self._closed:
            return
        with self._lock:
            abandoned = {t.call for t in self._queue if t.call.caller_daemon}
            abandoned |= {s.task.call for s in self._slots if s.task is not None and s.task.call.caller_daemon}
            for call in abandoned:
                for slot in self._slots:
                    if slot.task is not None and slot.task.call is call:
                        slot.task = None
                        self._kill(slot)  # the next task starts a fresh worker
                self._finish(call, RuntimeError("the interpreter exited while this call of a daemon thread ran"))
        self.shutdown()

    def shutdown_later(self, cancel: bool = False) -> None:
        """``shutdown(wait=False)`` of an executor: no new tasks; the workers stop once the queued ones are done."""
        with self._lock:
            self._closing = True
            if cancel:
                self._cancel_queued()
            drained = self._engine is None or not self._busy()
        if drained:
            self.shutdown()
        else:  # the waiting is done by a thread of its own
            threading.Thread(target=self.shutdown, name="nn_handler-shutdown", daemon=True).start()

    def _close_now(self, ask: bool) -> None:
        """Mark the pool closed, fail what is still pending, stop the workers (the lock is held)."""
        if (self._closed and not any(s.alive for s in self._slots) and self._wake_r is None and not self._dying
                and not self._stale_files):
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
                self._reap()  # shutdown() returns once every worker is gone
                self._cancel_queued()
                for call in list(self._calls):  # e.g. its reply was read when Ctrl-C stopped the thread driving
                    self._finish(call, RuntimeError("this executor was shut down before the call's result was in"))
                _transport.remove_prefixed(_transport.shm_prefix(self._token))
                for files in self._unloaded_of_killed:
                    lending.forget(files)
                self._unloaded_of_killed.clear()
                self._wake()
                if self._engine is None or not self._engine.is_alive():
                    self._close_wake_pipe()
                self._idle.notify_all()
                self._engine_wanted.notify_all()

    def _stop_idle_workers(self) -> None:
        """Ask idle workers to leave and give them a moment to do so."""
        for slot in self._slots:
            if slot.alive and slot.task is None:
                try:
                    slot.conn.send_bytes(pickle.dumps((0, "stop", None, None, ((), ()))))
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
            raise RuntimeError("cannot schedule new futures after shutdown (this executor has been shut "
                               "down; create a new one)")

    def _kill(self, slot: _Slot) -> None:
        """End a worker for good and reap it (no zombie), dropping its unread result files.

        A worker that died in a call, and the other workers of a failed call, are reaped later (:meth:`_reap`,
        their files too), not waited for: a process takes a while to end (its memory is torn down, then its
        server reports its end), freeing a large result file takes milliseconds, and a call whose worker died
        should fail at once. A new worker of the slot starts once the old one is gone, and shutdown() returns
        once all are.
        """
        if slot.process is None:
            return
        with pipes.sigint_deferred():  # half-reaped, the slot would be stuck with a closed process
            if slot.process.is_alive():
                slot.process.kill()
            self._dying.append(slot.process)
            if not self._failing:
                self._reap()
            if slot.conn is not None:
                slot.conn.close()
            slot.process = slot.conn = None
            slot.has_fn_for, slot.probing = None, False
            self._generation += 1
        if slot.unloaded:  # replies of it not loaded yet: its files go once they are
            self._unloaded_of_killed[slot.files], slot.unloaded = slot.unloaded, 0
        elif self._failing:  # freeing a large result file's memory takes milliseconds too
            self._stale_files.append(slot.files)
            self._stale_names.append(slot.files)
        else:
            self._drop_files(slot.files)

    def _task_failed(self, task, record, exc=None, died=False) -> None:
        """The scheduler's, with the workers it kills for the failing call reaped later (see :meth:`_kill`)."""
        failing, self._failing = self._failing, True
        try:
            super()._task_failed(task, record, exc, died)
        finally:
            self._failing = failing

    def _reap(self) -> None:
        """Reap the workers killed with a failing call, and drop their files (see :meth:`_kill`)."""
        while self._dying:
            process = self._dying.pop()
            process.join()
            process.close()
        while self._stale_files:
            self._drop_files(self._stale_files.pop())

    def _loaded(self, slot: _Slot, incarnation: int, files: str) -> None:
        """A reply of ``slot`` (then at ``incarnation``, with ``files``) was loaded (the lock is held)."""
        if slot.incarnation == incarnation and slot.alive:
            slot.unloaded -= 1
        elif files in self._unloaded_of_killed:
            self._unloaded_of_killed[files] -= 1
            if not self._unloaded_of_killed[files]:
                del self._unloaded_of_killed[files]
                self._drop_files(files)

    def _drop_stale_names(self) -> None:
        """Remove the named files of workers that ended in a failed call (a result one was sending), once the
        call has failed: a kill of this process would leave them. The files it holds open (spares of earlier
        results, freed with it however it ends) go when the workers are reaped (see :meth:`_kill`)."""
        with self._lock:
            stale, self._stale_names = self._stale_names, []
        for prefix in stale:
            _transport.remove_prefixed(prefix)

    @staticmethod
    def _drop_files(prefix: str) -> None:
        """Remove what is left of a worker's files, named or open (results mapped from them stay valid)."""
        _transport.remove_prefixed(prefix)
        lending.forget(prefix)

    def _death(self, slot: _Slot, during: str = "the call", importing_main: bool = False) -> RankFailure:
        slot.process.join(1.0)
        exitcode = slot.process.exitcode
        hint = ""
        cut_off = server.cut_off(slot.process)
        if cut_off is not None:  # the worker may be running yet: not its exit code (multiprocessing says 255)
            exitcode = None
            message = (f"worker cut off from this process during {during}: {cut_off}, and the worker ends with "
                       f"it; the next call starts new workers from a new server")
        else:
            if self._closed:  # killed by shutdown(wait=False) from another thread, e.g. at interpreter exit
                hint = "; the executor was shut down while the call ran"
            elif importing_main:  # in the top level of the caller's script
                hint = ("; see its output above. If your script creates the executor at import time, start it "
                        "under `if __name__ == \"__main__\":` (workers import the main module)")
            elif during == "start-up":  # before it could import the script: nn_handler or torch, where it runs
                hint = ("; see its output above: it ended before it reached your code (can this Python import "
                        "nn_handler and torch with your sys.path?)")
            message = f"worker died during {during} ({describe_exit(exitcode)}){hint}"
        record = RankFailure(rank=slot.index, device=slot.device, pid=slot.process.pid, message=message,
                             exitcode=exitcode)
        failing, self._failing = self._failing, True  # its call fails now; its files are dropped later
        try:
            self._kill(slot)
        finally:
            self._failing = failing
        return record


    def _drop_reply_files(self, slot: _Slot) -> None:
        """Remove the result files of a reply that will not be loaded (the worker is idle: nothing else is in flight)."""
        _transport.remove_prefixed(slot.files)

    @staticmethod
    def _receive(slot: _Slot, deadline: float | None = None):
        """The next reply of ``slot``; ``None`` when it died, ``pipes.LATE`` past ``deadline``."""
        return slot.inbox.receive(deadline)

    def _record_error(self, slot: _Slot, body, failures: list, exceptions: dict) -> None:
        record, blob = body
        failures.append(record)
        if (error := _transport.load_error(blob)) is not None:
            exceptions[slot.index] = error

    def terminate(self) -> None:
        """Kill every worker at once (Ctrl-C, caller error) and close the pool."""
        if os.getpid() != self._owner:
            return self.shutdown()
        with pipes.sigint_deferred():  # a second Ctrl-C waits until they are gone
            self.shutdown(wait=False)
