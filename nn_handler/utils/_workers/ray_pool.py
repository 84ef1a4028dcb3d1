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
The actors' start, restarts and end are :mod:`.ray_lifecycle`; this module
sends tasks and settles their outcomes.
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import threading
import time
from concurrent.futures import Future

from ...errors import PayloadPicklingError, RankFailure
from . import ray_failures as _failures
from . import server
from . import transport as _transport
from .calls import _Call, _Task
from .ray_actor import Session, import_ray, place
from .ray_lifecycle import ActorLifecycle, _Slot
from .task_errors import describe

__all__ = ["RayPool"]

# Largest payload (bytes) sent inside a task rather than through Ray's object store: Ray's own limit
# for arguments it inlines (max_direct_call_object_size).
_INLINE_BYTES = 100 * 1024
# Seconds between looks at the replies of a run that are in while others are not.
_LOOK = 0.5


# ----------------------------------------------------------------------------- the pool
class RayPool(ActorLifecycle):
    """One Ray actor per device; tasks from any number of caller threads go to whichever actor is free.

    Args:
        devices: Device kinds, one actor each (``"cuda"``: ``num_gpus=1``, ``"cpu"``: ``num_cpus=1``).
        pass_device: Call functions with ``device=torch.device(...)``.
        init_blob: Pickled ``(initializer, initargs)``, run in each actor at every (re)start, by its
            first task: an initializer that ends its process fails that task (no endless restarts).
        address: As ``ray.init`` takes it; used only when this process has no Ray yet.
        start_timeout: Seconds the actors may take to start (initializer included); ``None``: no bound.
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
        self._seed = server.base_seed()  # the actors' random streams, as a local pool's workers' (not the env)
        self._start_timeout = start_timeout
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
            self._fail(task, _failures.record(slot, _failures.clean(describe(exc)),
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
                            self._ray, slot, self._start_timeout, what="come back"),
                            exc_type="TimeoutError"))
                    else:
                        self._fail(task, _failures.record(slot, f"still running after the {task.call.timeout:g}s "
                                                               f"timeout; actor restarted"))
                        self._restart(slot)  # stuck: replaced rather than waited for
                self._after_settle()
