"""The process engine behind ParallelExecutor, @parallelize_on_gpus and NNHandler.launch.

Data flow::

    caller thread                                   worker i (one per device)
    -------------                                   ------------------------
    run/map ──> Encoder.dumps(fn), dumps(args)
            ──> conn_i.send_bytes((call, kind, fn, payload)) ──> recv, loads, fn(..., device=dev_i)
                                                                 Encoder.dumps(result) ──┐
    wait([conn_0..n, sentinel_0..n]) <───────────────────────── send_bytes((ok|err, call, body))
      ├─ a reply: store it; map: hand this worker the next chunk
      ├─ a sentinel: the worker died ──> WorkerDiedError now; it is restarted on next use
      └─ the deadline: kill the stuck workers ──> TimeoutError; restarted on next use

One duplex pipe per worker (no queue shared by all): a dead worker can only
break its own pipe, and dynamic load balancing is "send the next chunk to
whichever worker answered". Death is seen on the process sentinel, never by
waiting on a pipe a dead worker will not write to.

Workers come from a forkserver that imported torch once (cheap cold start,
CUDA-safe because the server never touches CUDA), or from ``spawn`` where
there is no forkserver.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from ..errors import ParallelExecutionError, RankFailure, WorkerDiedError, describe_exit
from . import _transport
from ._worker import guard_against_bootstrap, main_module_hidden, worker_main

_pool_ids = itertools.count()
# How long a stopping worker gets to leave on its own before it is killed.
_STOP_GRACE = 2.0


def _context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Only takes effect if this process has not started its forkserver yet.
        ctx.set_forkserver_preload(["torch", "nn_handler.utils._worker"])
        return ctx
    return mp.get_context("spawn")


class PayloadPicklingError(TypeError):
    """The arguments of a call could not be pickled (raised before anything is sent)."""


class ExecutorTimeoutError(ParallelExecutionError, TimeoutError):
    """A call ran past the executor's ``timeout``; the stuck workers were replaced."""


@dataclass
class _Slot:
    index: int
    device: str
    process: mp.process.BaseProcess | None = None
    conn: object = None
    incarnation: int = 0
    owes: int | None = None  # call id of a reply still due from an abandoned call
    has_fn_for: int | None = None  # call id whose function this worker already holds

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
        self._lock = threading.RLock()  # one call at a time; shutdown waits for it
        self._closed = False

    # ----------------------------------------------------------------- life cycle
    def start(self) -> None:
        """Start every worker that is not running, and wait until each is ready."""
        with self._lock:
            self._check_open()
            for slot in self._slots:
                if slot.alive and not slot.process.is_alive():
                    self._kill(slot)  # died between calls: reap it and start a new one
            fresh = [s for s in self._slots if not s.alive]
            if not fresh:
                return
            guard_against_bootstrap()
            ctx = _context()
            for slot in fresh:
                slot.incarnation += 1
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                prefix = _transport.shm_prefix(f"{self._token}-w{slot.index}.{slot.incarnation}")
                slot.process = ctx.Process(
                    target=worker_main,
                    args=(child_conn, slot.index, slot.device, self._threads, self._init_blob,
                          self._pass_device, prefix, os.getpid()),
                    name=f"nn_handler-worker-{slot.index}",
                    daemon=True,
                )
                with main_module_hidden(always=False):  # a script fed on stdin cannot be imported
                    slot.process.start()
                child_conn.close()  # only the child holds its end: EOF once it dies
                slot.conn = parent_conn
                slot.owes = slot.has_fn_for = None
            self._await_ready(fresh)

    def _await_ready(self, fresh: list[_Slot]) -> None:
        pending = {s.conn: s for s in fresh}
        failures, exceptions = [], {}
        deadline = None if self._start_timeout is None else time.monotonic() + self._start_timeout
        while pending:
            sentinels = {s.process.sentinel: s for s in pending.values()}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready_handles = wait(list(pending) + list(sentinels), timeout=left)
            if not ready_handles:
                for slot in list(pending.values()):
                    failures.append(RankFailure(rank=slot.index, device=slot.device, pid=slot.process.pid,
                                                message=f"did not start within {self._start_timeout:g}s"))
                    self._kill(slot)
                pending.clear()
            for ready in ready_handles:
                slot = pending.get(ready) or sentinels.get(ready)
                if slot is None or slot.conn not in pending:
                    continue
                reply = self._receive(slot)
                del pending[slot.conn]
                if reply is None:
                    failures.append(self._death(slot, during="start-up"))
                elif reply[0] == "err":
                    record, blob = reply[2]
                    failures.append(record)
                    if blob is not None:
                        exceptions[slot.index] = _transport.loads(blob)
                    self._kill(slot)
        if failures:
            self.shutdown()
            cls = WorkerDiedError if all(f.died for f in failures) else ParallelExecutionError
            raise cls(failures, exceptions, function="worker start-up (initializer)")

    def shutdown(self) -> None:
        """Stop every worker; idempotent. Idle workers are asked to stop, busy ones are killed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._slots:
                if slot.alive and slot.owes is None:
                    try:
                        slot.conn.send_bytes(pickle.dumps((0, "stop", None, None)))
                    except OSError:
                        pass
            deadline = time.monotonic() + _STOP_GRACE
            for slot in self._slots:
                if slot.alive:
                    if slot.owes is None:
                        slot.process.join(max(0.0, deadline - time.monotonic()))
                    self._kill(slot)
            _transport.remove_prefixed(_transport.shm_prefix(self._token))

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this executor has been shut down; create a new one")

    def _kill(self, slot: _Slot) -> None:
        """End a worker for good and reap it (no zombie), dropping its unread result files."""
        if slot.process is None:
            return
        if slot.process.is_alive():
            slot.process.kill()
        slot.process.join()
        slot.process.close()
        slot.conn.close()
        slot.process = slot.conn = None
        slot.owes = slot.has_fn_for = None
        _transport.remove_prefixed(_transport.shm_prefix(f"{self._token}-w{slot.index}.{slot.incarnation}"))

    def _death(self, slot: _Slot, during: str = "the call") -> RankFailure:
        slot.process.join(1.0)
        exitcode = slot.process.exitcode
        hint = ""
        if during == "start-up":
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

    @staticmethod
    def _receive(slot: _Slot):
        """The next reply of ``slot``, or ``None`` when its pipe is closed (it died)."""
        try:
            if slot.process.is_alive() or slot.conn.poll():
                return pickle.loads(slot.conn.recv_bytes())
        except (EOFError, OSError):
            pass
        return None

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
        """Call the function on every item; chunks go to whichever worker is free."""
        files: list[str] = []
        tasks = []
        try:
            for key, chunk in enumerate(chunks):
                payload, created = self._encode(chunk)
                files += created
                tasks.append((key, payload, None))
            results = self._dispatch("map", fn_blob, tasks, timeout, name)
        finally:
            _transport.remove_files(files)
        return [item for key in range(len(tasks)) for item in results[key]]

    def _encode(self, obj) -> tuple[bytes, list[str]]:
        try:
            return self._args.dumps(obj)
        except Exception as exc:
            raise PayloadPicklingError(str(exc)) from exc

    def _dispatch(self, kind: str, fn_blob: bytes, tasks: list, timeout: float | None, name: str,
                  fail_fast: bool = False) -> dict:
        with self._lock:
            self.start()  # replaces workers that died or were killed since the last call
            call_id = next(self._call_ids)
            deadline = None if timeout is None else time.monotonic() + timeout
            queue = list(reversed(tasks))  # pop() takes the first task
            running: dict[int, int] = {}  # slot index -> task key
            results, failures, exceptions = {}, [], {}
            try:
                while queue or running:
                    for slot in self._slots:
                        if slot.owes is None and slot.index not in running and queue:
                            task = self._next_task_for(slot, queue)
                            if task is not None:
                                self._send(slot, call_id, kind, fn_blob, task[1])
                                running[slot.index] = task[0]
                    busy = [s for s in self._slots if s.alive and (s.index in running or s.owes is not None)]
                    if not busy:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise self._timeout(running, timeout, name)
                    by_handle = {}
                    for s in busy:
                        by_handle[s.conn] = by_handle[s.process.sentinel] = s
                    died = restart = False
                    for handle in wait(list(by_handle), timeout=left):
                        slot = by_handle[handle]
                        if not slot.alive:
                            continue  # already handled through its other handle
                        reply = self._receive(slot)
                        if reply is None and slot.index not in running:
                            self._kill(slot)  # died finishing an abandoned call: not this call's failure
                            restart = True
                            continue
                        if reply is None:
                            failures.append(self._death(slot))
                            running.pop(slot.index, None)
                            died = True
                            continue
                        status, reply_call, body = reply
                        if reply_call != call_id:  # a late reply of an abandoned call
                            slot.owes = None
                            continue
                        key = running.pop(slot.index)
                        if status == "ok":
                            try:
                                results[key] = _transport.loads(body)
                                continue
                            except Exception as exc:
                                record, blob = self._unpickle_failure(slot, exc), None
                        else:
                            record, blob = body
                        failures.append(record)
                        if blob is not None:
                            exceptions[slot.index] = _transport.loads(blob)
                        queue.clear()  # map: no new chunks once a call has failed
                    if failures and fail_fast and running:
                        self._abandon(running, call_id)  # their replies are discarded; shutdown kills them
                        raise ParallelExecutionError(failures, exceptions, function=name)
                    if died:
                        # Fail now, not when the others finish: they are left
                        # to finish their part, and their late replies are
                        # discarded before they take new work.
                        self._abandon(running, call_id)
                        raise WorkerDiedError(failures, exceptions, function=name)
                    if restart:
                        self.start()
            except KeyboardInterrupt:
                self.terminate()  # Ctrl-C: every worker ends with the call
                raise
            except BaseException:
                self._abandon(running, call_id)
                raise
            if failures:
                raise ParallelExecutionError(failures, exceptions, function=name)
            return results

    @staticmethod
    def _next_task_for(slot: _Slot, queue: list):
        # run: each task is addressed to one worker; map: any worker takes the next one.
        for pos in range(len(queue) - 1, -1, -1):
            if queue[pos][2] in (None, slot.index):
                return queue.pop(pos)
        return None

    def _send(self, slot: _Slot, call_id: int, kind: str, fn_blob: bytes, payload: bytes) -> None:
        fn_part = None if slot.has_fn_for == call_id else fn_blob
        slot.conn.send_bytes(pickle.dumps((call_id, kind, fn_part, payload)))
        slot.has_fn_for = call_id

    def _abandon(self, running: dict, call_id: int) -> None:
        for index in running:
            slot = self._slots[index]
            if slot.alive:
                slot.owes = call_id
        running.clear()

    @staticmethod
    def _unpickle_failure(slot: _Slot, exc: Exception) -> RankFailure:
        return RankFailure(rank=slot.index, device=slot.device, pid=slot.process.pid, exc_type=type(exc).__qualname__,
                           message=f"the result could not be unpickled in the caller: {exc}")

    def _timeout(self, running: dict, timeout: float, name: str) -> ExecutorTimeoutError:
        failures = []
        stuck = set(running) | {s.index for s in self._slots if s.alive and s.owes is not None}
        for index in sorted(stuck):
            slot = self._slots[index]
            pid = slot.process.pid
            self._kill(slot)  # stuck: replace it rather than wait on it
            failures.append(RankFailure(rank=index, device=slot.device, pid=pid,
                                        message=f"still running after the {timeout:g}s timeout; worker replaced"))
        running.clear()
        return ExecutorTimeoutError(failures, function=name)

    def terminate(self) -> None:
        """Kill every worker at once (Ctrl-C, caller error) and close the pool."""
        with self._lock:
            for slot in self._slots:
                slot.owes = 0 if slot.alive else None  # busy or not: kill, don't ask
            self.shutdown()
