"""The Ray pool's actors: their start, their restarts and their end, apart from the tasks sent to them.

:class:`ActorLifecycle` is the half of :class:`~.ray_pool.RayPool` that
starts one actor per device (and waits for every initializer), brings back an
actor Ray restarted (asking it ``ready``, which runs its initializer again,
before its next task), kills a stuck one for Ray to restart, and kills them
all at shutdown, leaving the Ray session it joined. Which task goes to which
actor, and what its caller gets, is :mod:`.ray_pool`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

from ...errors import ExecutorTimeoutError, ParallelExecutionError, RankFailure, WorkerDiedError
from . import ray_failures as _failures
from . import transport as _transport
from .calls import _Task
from .ray_actor import DeviceActor, Session
from .task_errors import describe

# Seconds shutdown() waits for Ray to have the killed actors dead.
_STOP_GRACE = 10.0
# Seconds between the questions to an actor that Ray is restarting, whether it is back.
_REVIVE_PERIOD = 0.1



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


class ActorLifecycle:
    """Start, bring back, restart and stop the actors; mixed into :class:`~.ray_pool.RayPool`, whose slots,
    lock, queue and outcomes (``_send``, ``_fail``, ``_after_settle``) it uses."""

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
                                                              self._init_blob, self._seed)
            self._started = True
        refs = [slot.actor.ready.remote() for slot in self._slots]
        done, waiting = self._ray.wait(refs, num_returns=len(refs), timeout=self._start_timeout)
        failures, exceptions, died = [], {}, False
        for slot, ref in zip(self._slots, refs):
            if ref in waiting:
                failures.append(RankFailure(rank=slot.index, device=slot.device, exc_type="TimeoutError",
                                            message=_failures.not_started(self._ray, slot, self._start_timeout)))
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

    # ----------------------------------------------------------------- restarts (the lock is held)
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
                self._fail(task, _failures.record(slot, _failures.clean(describe(exc)),
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
