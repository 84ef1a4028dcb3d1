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
                                       │   restarts the actor (max_restarts); the call is never re-run
                                       │   (max_task_retries=0)
                                       ├─ a task's deadline: ray.kill(actor) (restarted) ──> TimeoutError
                                       └─ the actor's next task first asks it ``ready`` (the initializer
                                           runs again): if that kills it, the task fails (WorkerDiedError)

A function's body goes to an actor once, later calls send its digest (a twin
of each actor's cache, as in the local pool; a restarted actor answers ``miss``).

One task in flight per actor: a task's ``timeout`` counts from when an actor
has it, and a slow task never holds up others queued behind it on one actor.
Functions travel as the local pool packs them (cloudpickle, with where their
``device`` argument goes); arguments and results travel through Ray's object
store. Ray is imported here only, and only when an executor asks for it, and
never touched once it is shut down (``ray.kill`` would start a new one).
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import threading
import time
from concurrent.futures import Future

from ...errors import (
    ExecutorTimeoutError,
    ParallelExecutionError,
    PayloadPicklingError,
    RankFailure,
    WorkerDiedError,
)
from . import ray_failures as _failures
from . import transport as _transport
from . import worker as _worker
from .ray_actor import DeviceActor, Session, import_ray, place
from .calls import _Call, _Task

__all__ = ["RayPool"]

# Seconds an actor may take to start, initializer included, when the task timeout is shorter.
_START_ALLOWANCE = 60.0
# Largest payload (bytes) sent inside a task rather than through Ray's object store: Ray's own limit
# for arguments it inlines (max_direct_call_object_size).
_INLINE_BYTES = 100 * 1024
# Seconds shutdown() waits for Ray to have the killed actors dead.
_STOP_GRACE = 10.0
# Seconds between the questions to an actor that Ray is restarting, whether it is back.
_REVIVE_PERIOD = 0.1
# Seconds between looks at the replies of a run that are in while others are not.
_LOOK = 0.5


# ----------------------------------------------------------------------------- the pool
class _Slot:
    __slots__ = ("index", "device", "actor", "where", "task", "deadline", "stale", "starting", "grace", "known",
                 "killing")

    def __init__(self, index: int, device: str):
        self.index, self.device = index, device
        self.actor = self.task = self.deadline = None
        # The actor died or was killed since it last answered: its next task first waits for it to be
        # back (ready, which runs the initializer), and fails if that kills it (one try per task).
        self.stale = False
        self.starting = False  # its task waits for that ready
        self.grace = 0  # deaths of ready not counted: the old process of an actor we killed may take one
        self.killing = False  # ray.kill is under way (in a thread of its own)
        self.known = _transport.FunctionCache()  # twin of the actor's function cache: what it holds
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
            self.devices = place(devices)
        except BaseException:
            self._leave()
            raise
        self._pass_device, self._init_blob = pass_device, init_blob
        # A new actor process imports torch (seconds): a short task timeout still leaves it that long to start.
        self._start_timeout = None if start_timeout is None else max(start_timeout, _START_ALLOWANCE)
        self._asked_timeout = start_timeout
        # Functions travel whole the first time (Ray's object store carries their large tensors like any argument).
        self.functions = _transport.Encoder(None, private=True)
        self._fn_ids = itertools.count(1)
        self._slots = [_Slot(i, d) for i, d in enumerate(self.devices)]
        self._lock = threading.RLock()
        self._queue: collections.deque[_Task] = collections.deque()
        self._idle = threading.Condition(self._lock)  # notified when nothing is queued or running
        self._started = self._closed = self._closing = self._ray_gone = False
        self._owner = os.getpid()
        self._timer: threading.Thread | None = None
        self._timer_wake = threading.Event()

    # ----------------------------------------------------------------- life cycle
    def start(self) -> None:
        with self._lock:
            self._check_open()
            if self._started:
                return
            remote = self._ray.remote(DeviceActor)
            for slot in self._slots:
                # max_restarts: a dead actor comes back and runs its initializer again; max_task_retries=0:
                # a call in flight when it died is never re-run (a user's function may not be safe twice).
                options = dict(max_restarts=-1, max_task_retries=0, **_failures.resources(slot.device))
                slot.actor = remote.options(**options).remote(slot.index, slot.device, self._pass_device,
                                                              self._init_blob)
            self._started = True
        refs = [slot.actor.ready.remote() for slot in self._slots]
        done, waiting = self._ray.wait(refs, num_returns=len(refs), timeout=self._start_timeout)
        failures, exceptions, died = [], {}, False
        for slot, ref in zip(self._slots, refs):
            if ref in waiting:
                failures.append(RankFailure(rank=slot.index, device=slot.device, exc_type="TimeoutError",
                                            message=_failures.not_started(self._ray, slot, self._start_timeout,
                                                                          self._asked_timeout)))
                continue
            try:
                failure, slot.where = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as exc:
                failures.append(_failures.died(slot, exc, "start-up"))
                died = True
                continue
            if failure is not None:
                _failures.load_error(failure, failures, exceptions)
        if failures:
            self.terminate()
            if waiting:
                cls = ExecutorTimeoutError
            else:
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
                while self._busy() and self._ray.is_initialized():
                    self._idle.wait(1.0)  # (a Ray shut down under us answers nothing more)
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
                    self._fail(task, _failures.record(slot, "the executor was shut down while the call ran"),
                               died=True)
            self._cancel_queued()
            self._idle.notify_all()
        gone = []
        # Ray shut down (by the user, or by its own exit hook before this executor's finalizer):
        # its actors went with it, and ray.kill would start a new Ray only to find none of them.
        up = self._ray.is_initialized()
        for slot in self._slots:
            if slot.actor is not None and up:
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
        if not self._closed and not self._ray.is_initialized():
            self._ray_gone = True
            self._close_now(wait=False)  # nothing of Ray is touched: it is gone
        if self._ray_gone:
            raise RuntimeError("Ray was shut down (ray.shutdown()) while this executor was open, and its actors "
                               "with it; create a new ParallelExecutor (it starts or joins a Ray again)")
        if self._closed or self._closing:
            raise RuntimeError("cannot schedule new futures after shutdown (this executor has been shut down; create a new one)")

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
        # This thread waits on the replies of the tasks it sends itself (ray.wait): a reply then costs
        # no hop through a thread of Ray's and a concurrent Future, about a third of a warm call.
        call.owner, call.direct = threading.get_ident(), []
        self._enqueue([call], [_Task(call, slot.index, payload, slot.index) for slot in self._slots])
        try:
            try:  # every reply in one ray.get, as a caller of actors by hand does
                replies = self._ray.get([d[2] for d in call.direct], timeout=_LOOK) if call.direct else []
            except Exception:  # not all in yet, or one failed: each as it comes, below
                replies = None
            if replies is not None:
                sent, call.direct = call.direct, []  # (a task sent again, its body asked for, comes in anew)
                for (slot, task, _), reply in zip(sent, replies):
                    self._settle(slot, task, lambda reply=reply: reply)
            while call.direct:
                # Looking every _LOOK seconds for replies in early: a death fails the call at once.
                ready = self._ray.wait([d[2] for d in call.direct], num_returns=len(call.direct), timeout=_LOOK)[0]
                done = [d for d in call.direct if d[2] in ready]
                for (slot, task, ref), outcome in zip(done, self._outcomes([d[2] for d in done])):
                    call.direct.remove((slot, task, ref))
                    self._settle(slot, task, outcome)
            return call.future.result()
        except KeyboardInterrupt:
            self.terminate()
            raise

    def _outcomes(self, refs: list) -> list:
        """For each of ``refs`` (all ready), what returns its reply or raises its error: one ray.get for all."""
        try:
            return [lambda reply=reply: reply for reply in self._ray.get(refs)]
        except Exception:  # one of them failed: each on its own
            return [lambda ref=ref: self._ray.get(ref) for ref in refs]

    def submit(self, fn_id, fn_blob, kind, objs, timeout, name) -> list[Future]:
        """Queue one task per object (``"run"``: ``(args, kwargs)``; ``"map"``: a chunk) for any free actor."""
        if not self._started:
            self.start()
        calls, tasks = [], []
        for obj in objs:
            call = _Call(fn_id, kind, fn_blob, name, timeout, Future())
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
            while slot.task is None and not slot.killing and slot.actor is not None:
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
                if slot.stale:
                    self._bring_back(slot)
                else:
                    self._send(slot, task)

    def _send(self, slot: _Slot, task: _Task) -> None:
        """Send ``task`` to the actor of ``slot``, which has it now (the lock is held)."""
        call = task.call
        slot.deadline = None if call.timeout is None else time.monotonic() + call.timeout
        message = call.fn_blob.message(slot.known)  # the body only if this actor lacks it
        fn_arg = message if message[1] is None or len(message[1]) < _INLINE_BYTES else self._put_message(call, message)
        try:
            if fn_arg is message and type(task.payload) is bytes:  # nothing in the object store:
                # one argument of bytes costs Ray a sixth of a warm call less than three of several types
                ref = slot.actor.call_packed.remote(pickle.dumps((message, call.kind, task.payload), protocol=5))
            else:
                ref = slot.actor.call.remote(fn_arg, call.kind, task.payload)
        except Exception as exc:  # Ray refused the task itself (its actor gone for good, say)
            slot.task = slot.deadline = None
            slot.known = _transport.FunctionCache()
            self._fail(task, _failures.record(slot, _failures.clean(_worker.describe(exc)),
                                              exc_type=type(exc).__qualname__))
            return
        if getattr(call, "owner", None) == threading.get_ident():
            call.direct.append((slot, task, ref))  # its caller waits on it (run)
        else:
            ref.future().add_done_callback(lambda f, slot=slot, task=task: self._settle(slot, task, f.result))
        if slot.deadline is not None:
            self._timer_wake.set()

    def _put_message(self, call: _Call, message: tuple):
        """A large function's message in Ray's object store, once per call (a run sends it to every actor)."""
        if getattr(call, "message_ref", None) is None:
            call.message_ref = self._ray.put(message)
        return call.message_ref

    def _bring_back(self, slot: _Slot) -> None:
        """Ask the actor of ``slot`` whether it is back (``ready`` runs its initializer); then send its task.

        The lock is held; the task waits in ``slot.task`` under the start
        timeout. A ready sent while the old process is still going down
        would die with it (we killed it: ``grace``); one sent while Ray
        restarts it is refused: asked again a moment later.
        """
        slot.starting = True
        slot.deadline = None if self._start_timeout is None else time.monotonic() + self._start_timeout
        self._ask_ready(slot, slot.task)
        if slot.deadline is not None:
            self._timer_wake.set()

    def _ask_ready(self, slot: _Slot, task: _Task) -> None:
        if not self._ray.is_initialized():  # (ready.remote() would start a new Ray)
            slot.task = slot.deadline = None
            slot.starting = False
            self._fail(task, _failures.record(slot, "Ray was shut down (ray.shutdown()) while the call waited"))
            return
        ref = slot.actor.ready.remote()
        ref.future().add_done_callback(lambda f: self._answered(slot, task, f))

    def _ask_again(self, slot: _Slot, task: _Task) -> None:
        with self._lock:
            if not self._closed and slot.task is task and slot.starting:
                self._ask_ready(slot, task)

    def _answered(self, slot: _Slot, task: _Task, done: Future) -> None:
        with self._lock:
            if self._closed or slot.task is not task or not slot.starting:
                return  # timed out or shut down meanwhile: already failed
            try:
                _, where = done.result()
                back = where[:2] != slot.where[:2]  # else the old process answered before it went
            except self._ray.exceptions.RayActorError as exc:
                if not _failures.never_sent(exc) and slot.grace == 0:
                    # It died running ready, that is its initializer: Ray would restart it for ever.
                    failure = _failures.died(slot, exc, "start-up (its initializer, run again after a restart)")
                    self._break(WorkerDiedError.create([failure], {}, function=task.call.name))
                    return
                slot.grace = 0 if _failures.never_sent(exc) else slot.grace - 1
                back = False
            except BaseException as exc:  # Ray itself failed: the task fails with it
                slot.task = slot.deadline = None
                slot.starting = False
                self._fail(task, _failures.record(slot, _failures.clean(_worker.describe(exc)),
                                                  exc_type=type(exc).__qualname__))
                self._after_settle()
                return
            if not back:  # Ray is still restarting it: ask again soon
                timer = threading.Timer(_REVIVE_PERIOD, self._ask_again, args=(slot, task))
                timer.daemon = True
                timer.start()
                return
            slot.where, slot.stale, slot.starting, slot.grace = where, False, False, 0
            slot.known = _transport.FunctionCache()  # a new process holds no function yet
            self._send(slot, task)

    def _break(self, error: BaseException) -> None:
        """An actor that cannot restart: as the local pool whose replacement worker cannot start, every
        call fails with ``error`` and the pool closes (the lock is held)."""
        self._closing = True
        calls = [slot.task.call for slot in self._slots if slot.task is not None]
        calls += [task.call for task in self._queue]
        self._queue.clear()
        for slot in self._slots:
            slot.task = slot.deadline = None
            slot.starting = False
        for call in calls:
            if not call.done:
                call.done = True
                if call.future.running() or call.future.set_running_or_notify_cancel():
                    call.future.set_exception(error)
        self._idle.notify_all()
        # Not here: this runs in Ray's callbacks, where ray.kill waits for the thread it is called from.
        threading.Thread(target=self._close_now, kwargs={"wait": False}, daemon=True,
                         name="nn_handler-ray-close").start()

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
            if status in ("ok", "err", "miss") and where[:2] != slot.where[:2]:
                slot.known = _transport.FunctionCache()  # restarted behind our back: a new process
                slot.where = where
            if status == "miss":  # it did not hold the body sent by its digest: send it whole
                slot.known = _transport.FunctionCache()
                self._send(slot, task)
                return
            slot.task = slot.deadline = None
            if status == "ok":
                self._done(task, body)
            elif status == "err":
                failures, exceptions = [], {}
                _failures.load_error(body, failures, exceptions)
                self._fail(task, failures[0], exceptions.get(failures[0].rank))
            elif status == "died":
                slot.stale, slot.known = True, _transport.FunctionCache()
                if _failures.never_sent(error):  # the actor died idle, unseen: the task waits for its restart
                    slot.task = task
                    self._bring_back(slot)
                    return
                self._fail(task, _failures.died(slot, error, "the call"), died=True)
            else:
                self._fail(task, *_failures.lost(self._ray, slot, task.call.name, error))
            self._after_settle()

    def _after_settle(self) -> None:
        if not self._closed:
            self._dispatch()
        if not self._busy():
            self._idle.notify_all()

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
                    if slot.starting:
                        slot.starting = False  # still stale: its next task asks again
                    else:
                        self._restart(slot)
            call.pending = 0
        if call.pending == 0:
            self._finish(call)

    def _restart(self, slot: _Slot) -> None:
        """Kill the actor of ``slot`` for Ray to restart (initializer again); its next task waits for it.

        From a thread of its own: this runs in Ray's callbacks too, and
        ``ray.kill`` called there waits for the thread it is called from.
        """
        slot.stale, slot.killing, slot.known = True, True, _transport.FunctionCache()
        threading.Thread(target=self._kill, args=(slot, slot.actor), daemon=True,
                         name="nn_handler-ray-restart").start()

    def _kill(self, slot: _Slot, actor) -> None:
        try:
            if self._ray.is_initialized():
                self._ray.kill(actor, no_restart=False)
        except Exception:
            pass  # gone with its node: Ray restarts it elsewhere
        with self._lock:
            slot.killing = False
            if slot.actor is actor:
                slot.grace = 1  # the next ready may still reach the old process and die with it
                self._after_settle()

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
            with self._lock:
                for slot in self._slots:
                    if slot.task is None or slot.deadline is None or now < slot.deadline:
                        continue
                    task, slot.task, slot.deadline = slot.task, None, None
                    task.call.timed_out = True
                    if slot.starting:  # Ray has not brought it back (no room in the cluster?): left as it is
                        slot.starting = False
                        self._fail(task, _failures.record(slot, _failures.not_started(
                            self._ray, slot, self._start_timeout, self._asked_timeout, what="come back"),
                            exc_type="TimeoutError"))
                    else:
                        self._fail(task, _failures.record(slot, f"still running after the {task.call.timeout:g}s "
                                                               f"timeout; actor restarted"))
                        self._restart(slot)  # stuck: replaced rather than waited for
                self._after_settle()
