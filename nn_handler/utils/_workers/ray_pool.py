"""The Ray backend of ParallelExecutor: one Ray actor per device, behind the small interface of :mod:`.pool`.

Data flow::

    caller threads                     this pool (in the caller)                    actor i (one per device)
    --------------                     -------------------------                    ------------------------
    submit/run/map: pickle fn, args
      ──> queue a task ──────────────> a free actor takes the first task
                                       that fits it (run: each actor its own)
                                     ──> actor.call.remote(fn, kind, payload) ──> fn(..., device=dev_i)
    Future.result() <── settle <────── ObjectRef.future() is done <───────────── ("ok"|"err", body, where)
                                       ├─ RayActorError: WorkerDiedError naming the node and host; Ray
                                       │   restarts the actor (max_restarts), whose first task (ready)
                                       │   runs the initializer again; the call is never re-run
                                       │   (max_task_retries=0)
                                       └─ a task's deadline: ray.kill(actor) (restarted) ──> TimeoutError

One task in flight per actor: a task's ``timeout`` counts from when an actor
has it, and a slow task never holds up others queued behind it on one actor.
Functions travel as the local pool packs them (cloudpickle, with where their
``device`` argument goes); arguments and results travel through Ray's object
store. Ray is imported here only, and only when an executor asks for it.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
import warnings
from concurrent.futures import Future

from ...errors import (
    DeviceError,
    ParallelExecutionError,
    PayloadPicklingError,
    RankFailure,
    WorkerDiedError,
)
from . import transport as _transport
from . import worker as _worker
from .ray_actor import DeviceActor, Session, cluster_gpus, import_ray
from .scheduler import _Call

__all__ = ["RayPool"]

# Seconds an actor may take to start, initializer included, when the task timeout is shorter.
_START_ALLOWANCE = 60.0
# Largest payload (bytes) sent inside a task rather than through Ray's object store: Ray's own limit
# for arguments it inlines (max_direct_call_object_size).
_INLINE_BYTES = 100 * 1024
# Seconds shutdown() waits for Ray to have the killed actors dead.
_STOP_GRACE = 10.0
# Times a restarted actor is asked whether it is back before its tasks go to it anyway (10 s in all).
_REVIVE_TRIES = 100


# ----------------------------------------------------------------------------- the pool
class _Task:
    __slots__ = ("call", "key", "payload", "target")

    def __init__(self, call: _Call, key: int, payload, target: int | None):
        self.call, self.key, self.payload, self.target = call, key, payload, target


class _Slot:
    __slots__ = ("index", "device", "actor", "where", "task", "deadline", "reviving")

    def __init__(self, index: int, device: str):
        self.index, self.device = index, device
        self.actor = self.task = self.deadline = None
        self.reviving = False  # restarted by Ray: its tasks wait until it answers
        self.where = (None, "", "")  # (pid, node id, host) of its last reply


class RayPool:
    """One Ray actor per device; tasks from any number of caller threads go to whichever actor is free.

    Args:
        devices: Device kinds, one actor each (``"cuda"``: ``num_gpus=1``, ``"cpu"``: ``num_cpus=1``).
        pass_device: Call functions with ``device=torch.device(...)``.
        init_blob: Pickled ``(initializer, initargs)``, run in each actor at every (re)start, by its
            first task: an initializer that ends its process fails that task (no endless restarts).
        address: As ``ray.init`` takes it; used only when this process has no Ray yet.
        start_timeout: Seconds the actors may take to start (initializer included).
    """

    def __init__(self, devices: list[str] | None, *, pass_device: bool, init_blob: bytes | None,
                 address: str | None = None, start_timeout: float | None = None):
        self._ray = import_ray()
        Session.enter(address)
        self._session = True
        try:
            self.devices = self._place(devices)
        except BaseException:
            self._leave()
            raise
        self._pass_device, self._init_blob = pass_device, init_blob
        # A new actor process imports torch (seconds): a short task timeout still leaves it that long to start.
        self._start_timeout = None if start_timeout is None else max(start_timeout, _START_ALLOWANCE)
        # Functions travel whole (Ray's object store carries their large tensors like any argument).
        self.functions = _transport.Encoder(None, private=True)
        self._fn_ids = itertools.count(1)
        self._slots = [_Slot(i, d) for i, d in enumerate(self.devices)]
        self._lock = threading.RLock()
        self._queue: collections.deque[_Task] = collections.deque()
        self._idle = threading.Condition(self._lock)  # notified when nothing is queued or running
        self._started = self._closed = self._closing = False
        self._owner = os.getpid()
        self._timer: threading.Thread | None = None
        self._timer_wake = threading.Event()

    def _place(self, devices: list[str] | None) -> list[str]:
        gpus = cluster_gpus()
        if devices is None:
            devices = ["cuda"] * gpus if gpus else None
        wanted = 0 if devices is None else devices.count("cuda")
        if devices is None or (gpus == 0 and wanted):
            n = 1 if devices is None else len(devices)
            warnings.warn(f"the Ray cluster has no GPUs: running {n} worker{'s' if n != 1 else ''} on the CPU "
                          f"instead (pass device_ids=['cpu', ...] to ask for CPU workers without this warning)",
                          RuntimeWarning, stacklevel=5)
            return ["cpu"] * n
        if wanted > gpus:
            raise DeviceError(f"asked for {wanted} GPU workers but the Ray cluster has {gpus} GPU"
                              f"{'s' if gpus != 1 else ''}")
        cpus = int(self._ray.cluster_resources().get("CPU", 0))
        if devices.count("cpu") > cpus:
            raise DeviceError(f"asked for {devices.count('cpu')} CPU workers (one CPU each) but the Ray cluster "
                              f"has {cpus} CPU{'s' if cpus != 1 else ''}")
        return devices

    # ----------------------------------------------------------------- life cycle
    def start(self) -> None:
        with self._lock:
            self._check_open()
            if self._started:
                return
            remote = self._ray.remote(DeviceActor)
            for slot in self._slots:
                resources = {"num_gpus": 1, "num_cpus": 0} if slot.device == "cuda" else {"num_cpus": 1}
                # max_restarts: a dead actor comes back and runs its initializer again; max_task_retries=0:
                # a call in flight when it died is never re-run (a user's function may not be safe twice).
                slot.actor = remote.options(max_restarts=-1, max_task_retries=0, **resources).remote(
                    slot.index, slot.device, self._pass_device, self._init_blob)
            self._started = True
        refs = [slot.actor.ready.remote() for slot in self._slots]
        done, waiting = self._ray.wait(refs, num_returns=len(refs), timeout=self._start_timeout)
        failures, exceptions, died = [], {}, False
        for slot, ref in zip(self._slots, refs):
            if ref in waiting:
                failures.append(RankFailure(rank=slot.index, device=slot.device, message=(
                    f"actor did not start within {self._start_timeout:g}s (does the cluster have the resources?)")))
                continue
            try:
                failure, slot.where = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as exc:
                failures.append(self._died(slot, exc, "start-up"))
                died = True
                continue
            if failure is not None:
                self._record(failure, failures, exceptions)
        if failures:
            self.terminate()
            cls = WorkerDiedError if died and len(failures) == sum(f.died for f in failures) else \
                ParallelExecutionError
            raise cls.create(failures, exceptions, function="worker start-up (initializer)")
        self._timer = threading.Thread(target=self._watch_deadlines, name="nn_handler-ray-deadlines", daemon=True)
        self._timer.start()

    def shutdown(self, *, wait: bool = True, ask: bool = True, cancel: bool = False) -> None:
        """Kill the actors once the queued and running tasks are done (``wait=False``: now); idempotent."""
        if os.getpid() != self._owner:
            self._closed = True
            return
        with self._lock:
            self._closing = True
            if cancel:
                self._cancel_queued()
            if wait:
                while self._busy():
                    self._idle.wait()
        self._close_now(wait)

    def shutdown_later(self, cancel: bool = False) -> None:
        with self._lock:
            self._closing = True
            if cancel:
                self._cancel_queued()
            busy = self._busy()
        if not busy:
            self.shutdown()
        else:
            threading.Thread(target=self.shutdown, name="nn_handler-shutdown", daemon=True).start()

    def terminate(self) -> None:
        """Kill every actor now; calls still running fail with WorkerDiedError."""
        self.shutdown(wait=False)

    def _close_now(self, wait: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = self._closing = True
            for slot in self._slots:
                if slot.task is not None:
                    task, slot.task = slot.task, None
                    self._fail(task, RankFailure(rank=slot.index, device=slot.device, pid=slot.where[0],
                                                 node=slot.where[1], host=slot.where[2],
                                                 message="the executor was shut down while the call ran"), died=True)
            self._cancel_queued()
            self._idle.notify_all()
        gone = []
        for slot in self._slots:
            if slot.actor is not None:
                try:
                    self._ray.kill(slot.actor, no_restart=True)
                    gone.append(slot.actor.ready.remote())  # fails once Ray has the actor dead
                except Exception:
                    pass  # already gone with its node or its Ray
                slot.actor = None
        if gone and wait:
            self._ray.wait(gone, num_returns=len(gone), timeout=_STOP_GRACE)
        self._timer_wake.set()
        self._leave()

    def _leave(self) -> None:
        if self._session:
            self._session = False
            Session.leave()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_owner(self) -> None:
        if os.getpid() != self._owner:
            raise RuntimeError(
                f"this executor belongs to process {self._owner}; a forked child cannot use its parent's actors: "
                f"create a new ParallelExecutor in the child"
            )

    def _check_open(self) -> None:
        self.check_owner()
        if self._closed or self._closing:
            raise RuntimeError("this executor has been shut down; create a new one")

    def _busy(self) -> bool:
        return bool(self._queue) or any(slot.task is not None for slot in self._slots)

    def _cancel_queued(self) -> None:
        while self._queue:
            self._queue.popleft().call.future.cancel()

    # ----------------------------------------------------------------- calls (any thread)
    def new_fn_id(self) -> int:
        return next(self._fn_ids)

    def run(self, fn_blob, args, kwargs, timeout, name, fail_fast=False) -> list:
        """Call the function once on every actor; results in actor order."""
        if not self._started:
            self.start()
        payload = self._put((args, kwargs))
        call = _Call(self.new_fn_id(), "run", fn_blob, name, timeout, Future(), broadcast=True, fail_fast=fail_fast)
        call.fn_ref = self._inline_or_put(_message(fn_blob), len(fn_blob.body))
        # This thread waits on the replies of the tasks it sends itself (ray.wait): a reply then costs
        # no hop through a thread of Ray's and a concurrent Future, about a third of a warm call.
        call.owner, call.direct = threading.get_ident(), []
        self._enqueue([call], [_Task(call, slot.index, payload, slot.index) for slot in self._slots])
        try:
            while call.direct:
                refs = [ref for _, _, ref in call.direct]
                ready, _ = self._ray.wait(refs, num_returns=1)
                for slot, task, ref in [d for d in call.direct if d[2] in ready]:
                    call.direct.remove((slot, task, ref))
                    self._settle(slot, task, lambda ref=ref: self._ray.get(ref))
            return call.future.result()
        except KeyboardInterrupt:
            self.terminate()
            raise

    def submit(self, fn_id, fn_blob, kind, objs, timeout, name) -> list[Future]:
        """Queue one task per object (``"run"``: ``(args, kwargs)``; ``"map"``: a chunk) for any free actor."""
        if not self._started:
            self.start()
        fn_ref = self._inline_or_put(_message(fn_blob), len(fn_blob.body))
        calls, tasks = [], []
        for obj in objs:
            call = _Call(fn_id, kind, fn_blob, name, timeout, Future())
            call.fn_ref = fn_ref
            calls.append(call)
            tasks.append(_Task(call, 0, self._put(obj), None))
        self._enqueue(calls, tasks)
        return [call.future for call in calls]

    def _put(self, obj):
        """``obj`` pickled as the local pool pickles it: the bytes, or a reference to them in Ray's object store."""
        try:
            data, _ = self.functions.dumps(obj)  # no shared memory here: tensors travel inside the bytes
        except Exception as exc:  # the executor then names the argument that cannot be pickled
            raise PayloadPicklingError(str(exc)) from exc
        return self._inline_or_put(data, len(data))

    def _inline_or_put(self, value, size: int):
        # Small values go inside the task, as Ray does for arguments itself (a put costs about a
        # millisecond); a large one is put once, and every actor of a run reads that one copy.
        return value if size < _INLINE_BYTES else self._ray.put(value)

    def _enqueue(self, calls: list[_Call], tasks: list[_Task]) -> None:
        with self._lock:
            self._check_open()
            for call in calls:
                call.pending = 1 if not call.broadcast else len(self._slots)
            self._queue.extend(tasks)
            self._dispatch()

    def _dispatch(self) -> None:
        """Give each idle actor the first queued task that fits it (the lock is held)."""
        for slot in self._slots:
            while slot.task is None and not slot.reviving and slot.actor is not None:
                task = next((t for t in self._queue if t.target is None or t.target == slot.index), None)
                if task is None:
                    break
                self._queue.remove(task)
                call = task.call
                if call.done:
                    continue
                if not call.started:
                    if not call.future.set_running_or_notify_cancel():
                        call.done = True  # cancelled before any actor had it
                        continue
                    call.started = True
                slot.task = task
                slot.deadline = None if call.timeout is None else time.monotonic() + call.timeout
                ref = slot.actor.call.remote(call.fn_ref, call.kind, task.payload)
                if getattr(call, "owner", None) == threading.get_ident():
                    call.direct.append((slot, task, ref))  # its caller waits on it (run)
                else:
                    ref.future().add_done_callback(lambda f, slot=slot, task=task: self._settle(slot, task, f.result))
                if slot.deadline is not None:
                    self._timer_wake.set()

    def _revive(self, slot: _Slot, tries: int = 0) -> None:
        """Hold the slot's tasks until Ray has restarted its actor (the lock is held).

        A task sent while the old process is still going down would die with
        it; ``ready`` is safe to send again, so it goes first, until it is answered.
        """
        slot.reviving = True
        ref = slot.actor.ready.remote()
        ref.future().add_done_callback(lambda f: self._revived(slot, f, tries))

    def _revive_again(self, slot: _Slot, tries: int) -> None:
        with self._lock:
            if not self._closed and slot.actor is not None:
                self._revive(slot, tries)

    def _revived(self, slot: _Slot, done: Future, tries: int) -> None:
        with self._lock:
            if self._closed or slot.actor is None:
                return
            try:
                _, where = done.result()
                if where[:2] == slot.where[:2]:  # the old process answered before it went: not back yet
                    raise self._ray.exceptions.RayActorError()
                slot.where = where
            except self._ray.exceptions.RayActorError:
                if tries < _REVIVE_TRIES:  # Ray is still marking it as restarting: ask again soon
                    timer = threading.Timer(0.1, self._revive_again, args=(slot, tries + 1))
                    timer.daemon = True
                    timer.start()
                    return
            except BaseException:
                pass
            slot.reviving = False
            self._dispatch()
            if not self._busy():
                self._idle.notify_all()

    def _settle(self, slot: _Slot, task: _Task, outcome) -> None:
        """An actor's reply or death: resolve the task, give the actor its next one.

        ``outcome()`` returns the reply or raises; called by a thread of Ray's
        (a ref's future is done) or by the caller of a run, which waits itself.
        """
        try:
            status, body, where = outcome()
            error = None
        except self._ray.exceptions.RayActorError as exc:
            status, error = "died", exc
        except BaseException as exc:  # e.g. the result could not be stored or fetched
            status, error = "lost", exc
        with self._lock:
            if slot.task is not task:
                return  # timed out or shut down: already failed
            slot.task = slot.deadline = None
            if status == "ok":
                slot.where = where
                self._done(task, body)
            elif status == "err":
                slot.where = where
                failures, exceptions = [], {}
                self._record(body, failures, exceptions)
                self._fail(task, failures[0], exceptions.get(failures[0].rank))
            elif status == "died" and _never_sent(error):
                self._queue.appendleft(task)  # the actor died idle, unseen: the task waits for its restart
                self._revive(slot)
            elif status == "died":
                self._fail(task, self._died(slot, error, "the call"), died=True)
                if not self._closed:
                    self._revive(slot)
            else:
                self._fail(task, RankFailure(rank=slot.index, device=slot.device, pid=slot.where[0],
                                             node=slot.where[1], host=slot.where[2],
                                             exc_type=type(error).__qualname__, message=_worker.describe(error)))
            if not self._closed:
                self._dispatch()
            if not self._busy():
                self._idle.notify_all()

    def _died(self, slot: _Slot, exc: BaseException, during: str) -> RankFailure:
        pid, node, host = slot.where
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return RankFailure(rank=slot.index, device=slot.device, pid=pid, node=node, host=host,
                           message=f"actor died during {during} ({type(exc).__name__}: {first}); "
                                   f"Ray restarts it for the next call")

    def _record(self, body, failures: list, exceptions: dict) -> None:
        record, blob = body
        failures.append(record)
        if blob is not None:
            try:
                exceptions[record.rank] = _transport.loads(blob)
            except (Exception, SystemExit):
                pass  # a class only the actor can import: the record (type name, message, traceback) stays

    # ----------------------------------------------------------------- outcomes (the lock is held)
    def _done(self, task: _Task, value) -> None:
        call = task.call
        if call.done:
            return
        call.add_result(task.key, value)
        if call.pending == 0:
            self._finish(call)

    def _fail(self, task: _Task, record: RankFailure, exc: BaseException | None = None, died: bool = False) -> None:
        call = task.call
        if call.done:
            return
        call.add_failure(record, exc, died)
        if call.broadcast and died and call.pending:
            # As the local pool: fail now, not when the others finish, and stop their share of the call
            # (restarted), so that nothing of a failed call keeps running unseen.
            for slot in self._slots:
                if slot.task is not None and slot.task.call is call:
                    slot.task = slot.deadline = None
                    self._restart(slot)
            call.pending = 0
        if call.pending == 0:
            self._finish(call)

    def _restart(self, slot: _Slot) -> None:
        """Kill the actor of ``slot`` for Ray to restart (initializer again); its next tasks wait for it.

        From a thread of its own: this runs in Ray's callbacks too, and
        ``ray.kill`` called there waits for the thread it is called from.
        """
        slot.reviving = True
        threading.Thread(target=self._kill_and_revive, args=(slot, slot.actor), daemon=True,
                         name="nn_handler-ray-restart").start()

    def _kill_and_revive(self, slot: _Slot, actor) -> None:
        try:
            self._ray.kill(actor, no_restart=False)
        except Exception:
            pass  # gone with its node: Ray restarts it elsewhere
        with self._lock:
            if not self._closed and slot.actor is actor:
                self._revive(slot)

    def _finish(self, call: _Call) -> None:
        call.done = True
        # The call's share still queued (a broadcast whose other actors are busy) goes.
        for task in [t for t in self._queue if t.call is call]:
            self._queue.remove(task)
        if call.future.done():
            return
        if not call.future.running():
            call.future.set_running_or_notify_cancel()
        if call.failures:
            call.future.set_exception(call.error())
        else:
            call.future.set_result(call.value(len(self._slots)))

    # ----------------------------------------------------------------- timeouts
    def _watch_deadlines(self) -> None:
        while not self._closed:
            with self._lock:
                deadlines = [s.deadline for s in self._slots if s.deadline is not None]
            wait = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            self._timer_wake.wait(wait)
            self._timer_wake.clear()
            now = time.monotonic()
            stuck = []
            with self._lock:
                for slot in self._slots:
                    if slot.task is not None and slot.deadline is not None and now >= slot.deadline:
                        task, slot.task, slot.deadline = slot.task, None, None
                        task.call.timed_out = True
                        self._fail(task, RankFailure(
                            rank=slot.index, device=slot.device, pid=slot.where[0], node=slot.where[1],
                            host=slot.where[2], message=f"still running after the {task.call.timeout:g}s timeout; "
                                                        f"actor restarted"))
                        stuck.append(slot)
            if stuck:
                with self._lock:
                    for slot in stuck:
                        self._restart(slot)  # stuck: replaced rather than waited for
                    if not self._busy():
                        self._idle.notify_all()


def _never_sent(error: BaseException) -> bool:
    """Whether Ray refused the task because its actor was restarting: it never reached the actor.

    Ray says so only in the message of ActorUnavailableError (whose type
    also covers a task lost in flight, which may have run and is never re-sent).
    """
    return type(error).__name__ == "ActorUnavailableError" and "actor is restarting" in str(error)


def _message(fn_blob: _transport.PackedFunction) -> tuple:
    return fn_blob.digest, fn_blob.body, fn_blob.bindings, fn_blob.unchanging
