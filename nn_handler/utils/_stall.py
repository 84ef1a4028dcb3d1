"""Stall diagnosis: a hung collective names the missing rank, where it is, and ends the job.

Each process of a group runs one watchdog thread (started by
``initialize_ddp``). The thread being watched only sets a few attributes
(:func:`watching`, :func:`watch_collectives`); the watchdog does all store I/O::

    watched thread                     watchdog thread (about once a second)
    --------------                     -------------------------------------
    with watching("all_reduce"):  ──>  heartbeat: rank, host, pid, step, doing, file:line, since
        dist.all_reduce(...)           in a collective > stall_timeout and a rank elsewhere?
                                         -> set "request" in the store
                                       "request" seen (any rank): publish own stack, wait for the
                                         others' stacks, write the report (log + file), then
                                         raise CollectiveStallError in the watched thread:
                                         a signal when it runs Python code; when it is blocked in
                                         the collective, the peers' exit wakes it (gloo fails)
    gloo fails ("Connection closed by peer") inside a watched collective:
      the watchdog checks which ranks stopped beating -> CollectiveStallError naming the dead rank;
      when the store itself went away, the rank that served it (rank 0) died: each rank reports alone

A rank that cannot be interrupted (stuck in C code) exits after a grace
period, with its report written, so the others wake up too.

Private: ``initialize_ddp(stall_timeout=...)`` and ``watch_collectives`` (in
:mod:`nn_handler.utils.ddp`) are the public faces.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Iterator, Mapping

from .._checks import check_number, invalid
from ..errors import CollectiveStallError
from ._stall_report import elsewhere as _elsewhere, headline, render_report, stuck_inside as _stuck_inside
from ._stall_report import write_torchelastic_error_file

__all__ = ["watch_collectives"]

log = logging.getLogger(__name__)

ENV_VAR = "NN_HANDLER_STALL_TIMEOUT"
DIR_ENV_VAR = "NN_HANDLER_STALL_DIR"  # where the reports go, when set
DEFAULT_STALL_TIMEOUT = 300.0  # well under the group's timeout (60 min by default)
BEAT_S = 1.0
STACKS_WAIT_S = 3.0  # how long a reporting rank waits for the others' stacks
GRACE_S = 5.0  # after the report: how long a rank may take to raise before it exits
_INTERRUPT = getattr(signal, "SIGUSR2", None)
_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_DIRS = (os.path.join(_TORCH_DIR, "torch") + os.sep, _PACKAGE_DIR + os.sep)
_PLUMBING = ("<", os.path.dirname(os.path.abspath(__import__("multiprocessing").__file__)),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "_workers"))
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def resolve_stall_timeout(value="env", environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds a rank may wait in a collective for a missing rank; ``None``: no watchdog.

    The keyword wins; ``"env"`` reads ``NN_HANDLER_STALL_TIMEOUT`` (seconds,
    ``inf``, or ``none``/``off``), default 300 s. ``inf``: the watchdog still
    names a rank that died, but never calls a wait a stall. Less than the
    watchdog's sampling period (1 s) is refused: it could not tell such a wait.

    Example:
        >>> resolve_stall_timeout(None), resolve_stall_timeout("env", {}), resolve_stall_timeout("env", {ENV_VAR: "3"})
        (None, 300.0, 3.0)
        >>> resolve_stall_timeout("env", {ENV_VAR: "inf"}) == resolve_stall_timeout(float("inf"))
        True
    """
    if not isinstance(value, str) or value != "env":
        name, seconds = "stall_timeout", check_number("stall_timeout", value, unit="seconds", allow_none=True)
    else:
        environ = os.environ if environ is None else environ
        name, value = ENV_VAR, environ.get(ENV_VAR, "").strip()
        if not value:
            return DEFAULT_STALL_TIMEOUT
        if value.lower() in ("none", "off"):
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = None
        if seconds is None or not seconds > 0:
            raise invalid(ENV_VAR, "a number of seconds > 0 (or inf), or 'none' to turn the stall watchdog off", value)
    if seconds is not None and seconds < BEAT_S:
        raise invalid(name, f"at least {BEAT_S:g} s, the stall watchdog's sampling period (it looks at each rank once "
                            f"every {BEAT_S:g} s, so a shorter wait cannot be told)", value,
                      hint="None (or 'none' in the variable) turns the watchdog off")
    return seconds


class _Now:
    """What the watched thread is doing: written by it (cheap attribute sets), read by the watchdog."""

    __slots__ = ("collective", "since", "auto", "entries", "thread", "step", "task")

    def __init__(self) -> None:
        self.collective: str | None = None  # the collective nn_handler named, while in it
        self.since = 0.0  # time.monotonic() when it entered
        self.auto = 0  # depth of watch_collectives(): the watchdog then reads the stack
        # watch_collectives() blocks entered and trainer batches begun so far: the same collective at the
        # same line in the next block (the next step) is a new wait, however briefly the thread was away.
        self.entries = 0
        self.thread = threading.get_ident()
        self.step: int | None = None
        self.task: str | None = None  # the rank-restricted work it runs (an on_rank function), which peers await


def _frames(frame) -> list:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out  # innermost first


def _user_frame(frames):
    """The innermost frame of the user's code (not torch, not nn_handler); else the innermost one."""
    for f in frames:
        if _is_users(f.f_code.co_filename):
            return f
    return frames[0] if frames else None


def _is_users(filename: str) -> bool:
    # Not torch, not nn_handler, not the stdlib's waiting and context machinery, not import internals.
    return not (filename.startswith("<") or os.path.abspath(filename).startswith(_OWN_DIRS)
                or os.path.basename(filename) in ("threading.py", "contextlib.py"))


def _where(frame) -> str:
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _torch_collective(frames) -> str | None:
    """The torch.distributed call the thread waits in (its outermost c10d frame), if any."""
    for f in reversed(frames):
        if f.f_code.co_filename.endswith(_C10D):
            return f.f_code.co_name
    return None


def _tb_frames(exc: BaseException) -> list:
    """The frames of ``exc``'s traceback, innermost first."""
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]


def _failed_collective(exc: BaseException) -> str:
    return _torch_collective(_tb_frames(exc)) or "a torch.distributed collective"


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        return False


class Watchdog:
    """The watchdog of one process of a group (see the module docstring)."""

    def __init__(self, store, rank: int, world_size: int, timeout: float, report_dir: str | None = None,
                 store_host: int | None = None):
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        # The rank whose process serves the store (rank 0 unless torchrun's agent does): its
        # death takes the heartbeats with it, so its last one is kept here.
        self.store_host, self._host_beat = store_host, None
        self._store_gone = False
        # None: the cwd; NNHandler: beside its checkpoint dir; NN_HANDLER_STALL_DIR wins over both.
        self.report_dir = report_dir or os.environ.get(DIR_ENV_VAR) or None
        self.report_stem = "nn_handler-stall"
        self.now = _Now()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.error: CollectiveStallError | None = None
        self.reported = threading.Event()
        self.delivered = False  # the error was raised in the watched thread
        self._busy = False  # a report is being made
        self._peer_lost: str | None = None  # the collective that failed because a peer went away
        self._beat = 0
        self._own_stack: str | None = None
        self._own_where: str | None = None
        self._seen: tuple[str, float] = ("", time.monotonic())  # (where, since) of the last observation
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nn_handler-stall-watchdog", daemon=True)

    # --- the watchdog thread -------------------------------------------------

    def start(self) -> None:
        # One handler for the process's life, delegating to the current
        # watchdog; installed only where nobody else uses the signal.
        if (_INTERRUPT is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(_INTERRUPT) in (signal.SIG_DFL, None)):
            signal.signal(_INTERRUPT, _on_interrupt)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(BEAT_S)
            self._wake.clear()
            if self._stop:
                break
            if not self._store_gone:
                try:
                    self._tick()
                    continue
                except Exception as exc:  # the store went away: the group is ending or its host died
                    log.debug("stall watchdog: the store went away: %s", exc)
                    self._store_gone = True  # for good: a TCPStore client does not reconnect
                    if self._peer_lost:  # it failed in the middle of that report: make it without the store
                        self._busy = False
            if self._busy or self._peer_lost:
                self._without_store()

    def _observe(self) -> dict:
        now = self.now
        frames = _frames(sys._current_frames().get(now.thread))
        collective, since, inside = now.collective, now.since, None
        if collective is not None and frames and _is_users(frames[0].f_code.co_filename):
            # In a collective nn_handler named but running the user's code (a hook inside
            # backward): not waiting in it, and the ranks that do wait there wait for this one.
            collective, inside = None, collective
        elif collective is None and (now.auto or now.task is not None):
            # Inside rank-restricted work too: the others wait for the work to end, never for that collective.
            collective = _torch_collective(frames)
        where = self._own_where or _where(_user_frame(frames))
        key = f"{collective}@{where}#{now.entries}"
        if collective is None or now.collective is None or inside:  # since: when it was first seen there
            since = self._seen[1] if self._seen[0] == key else time.monotonic()
        self._seen = (key, since)
        self._beat += 1
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "step": now.step, "collective": collective,
                "task": now.task, "inside": inside,
                "where": where, "for_s": round(time.monotonic() - since, 1), "beat": self._beat,
                "time": time.time()}

    def _tick(self) -> None:
        me = self._observe()
        self.store.set(f"hb/{self.rank}", json.dumps(me))
        host = f"hb/{self.store_host}"
        if self.store_host not in (None, self.rank) and (self._host_beat or self.store.check([host])):
            self._host_beat = json.loads(self.store.get(host))
        if self.reported.is_set():
            return
        if self._peer_lost:
            self._report(self._peer_lost, me, peer_lost=True)
        elif self.store.check(["request"]):
            self._report(json.loads(self.store.get("request"))["collective"], me)
        elif me["collective"] and me["for_s"] > self.timeout:
            beats = self._beats()
            if any(_elsewhere(b, me["collective"]) for b in beats.values()):
                if self.store.add("requests", 1) == 1:
                    self.store.set("request", json.dumps({"by": self.rank, "collective": me["collective"]}))
                self._report(me["collective"], me)

    def _beats(self) -> dict[int, dict | None]:
        keys = [f"hb/{r}" for r in range(self.world_size)]
        return {r: json.loads(self.store.get(k)) if self.store.check([k]) else None for r, k in enumerate(keys)}

    def _report(self, collective: str, me: dict, peer_lost: bool = False) -> None:
        self._busy = True
        if peer_lost and not self.store.check(["request"]):
            self.store.set("request", json.dumps({"by": self.rank, "collective": collective}))
        self.store.set(f"stack/{self.rank}", self._stack())
        first = self._beats()
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + STACKS_WAIT_S
        while True:
            for r in range(self.world_size):
                if r not in stacks and self.store.check([f"stack/{r}"]):
                    stacks[r] = self.store.get(f"stack/{r}").decode()
            if len(stacks) == self.world_size or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        beats = self._beats()
        beats[self.rank] = me
        note = ""
        stuck = _stuck_inside(beats)
        if stuck is not None:  # the stall is the collective inside the work, whoever asked for the report
            r, b = stuck
            collective = f"status exchange of {b['task']}"
            note = (f"rank {r} waits in {b['collective']} inside {b['task']}, which not every rank runs: the others "
                    f"wait for it to end and never join that {b['collective']}; call it outside, on every rank")
        dead = [r for r in range(self.world_size) if r not in stacks and self._is_dead(first.get(r), beats.get(r))]
        missing = [r for r, b in beats.items() if r not in dead and _elsewhere(b, collective)]
        if peer_lost and not dead:  # an ordinary error (or a peer that exited cleanly): not ours to explain
            self._busy, self._peer_lost = False, None
            self.reported.set()
            return
        self._conclude(collective, beats, stacks, dead, missing, note)

    def _without_store(self) -> None:
        """A report is due but the store is gone: say that its host died, if it did; else leave the error be."""
        host, beat, collective = self.store_host, self._host_beat, self._peer_lost
        alive = beat is not None and beat["host"] == self.host and not _process_gone(beat["pid"])
        if self._busy or not collective or host in (None, self.rank) or alive:
            self._busy, self._peer_lost = False, None
            self.reported.set()
            return
        # The watched thread's collective failed because a peer went away, and so did the
        # store that rank `host` served: it died. The other ranks' places went with the store.
        self._busy = True
        note = f"rank {host} hosted the group's store, which went away with it: the other ranks are not known here"
        self._conclude(collective, {self.rank: self._observe(), host: beat}, {self.rank: self._stack()},
                       [host], [], note)

    def _conclude(self, collective, beats, stacks, dead, missing, note: str = "") -> None:
        """Write the report, set the error for the watched thread, and make it raise."""
        text = render_report(self.rank, collective, beats, stacks, dead, missing, self.timeout, note)
        path = self._write(text)
        log.error("%s\n(report written to %s)", text, path)
        self.error = CollectiveStallError(headline(self.rank, collective, beats, dead, missing, path, note),
                                          collective, missing, dead, path)
        write_torchelastic_error_file(self.error, text)
        self._busy = False
        self.reported.set()
        self._interrupt()

    def _is_dead(self, before: dict | None, after: dict | None) -> bool:
        if after is None:
            return True
        if after["host"] == self.host and _process_gone(after["pid"]):
            return True
        return before is not None and before["beat"] == after["beat"]  # no heartbeat for STACKS_WAIT_S

    def report_next_to(self, checkpoint_dir) -> None:
        """Write reports beside ``checkpoint_dir`` (``runs/a`` -> ``runs/a-stall-rank0.txt``), not into it."""
        if os.environ.get(DIR_ENV_VAR):
            return
        path = os.path.abspath(os.fspath(checkpoint_dir)).rstrip(os.sep)
        self.report_dir, self.report_stem = os.path.dirname(path), f"{os.path.basename(path)}-stall"

    def _stack(self) -> str:
        if self._own_stack:  # the watched thread left the collective with an error: where it failed
            return self._own_stack
        frames = _frames(sys._current_frames().get(self.now.thread))[::-1]  # outermost first
        if not frames:
            return "(no stack: the thread ended)\n"
        # Leave out the process's plumbing (multiprocessing, nn_handler's workers) above the user's code.
        while len(frames) > 1 and frames[0].f_code.co_filename.startswith(_PLUMBING):
            frames.pop(0)
        return "".join(traceback.format_list(traceback.extract_stack(frames[-1], limit=len(frames))))

    def _write(self, text: str) -> str:
        directory = self.report_dir or os.getcwd()
        path = os.path.join(directory, f"{self.report_stem}-rank{self.rank}.txt")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        except OSError as exc:
            log.warning("could not write the stall report to %s: %s", path, exc)
        return path

    def _interrupt(self) -> None:
        """Make the watched thread raise the error; exit the process when it cannot be reached."""
        blocked = self._seen[0].split("@")[0] != "None"  # in a collective when last seen
        # Blocked inside rank-restricted work, the cause: its peers wake only when it leaves, so it exits first.
        cause = blocked and self.now.task is not None
        if not blocked and _INTERRUPT is not None and signal.getsignal(_INTERRUPT) is _on_interrupt \
                and self.now.thread == threading.main_thread().ident:
            signal.pthread_kill(self.now.thread, _INTERRUPT)
        # A rank blocked in the collective wakes when a peer leaves; a peer
        # stuck in C code only leaves when its own grace runs out, so the
        # blocked rank waits twice as long before it gives up.
        deadline = time.monotonic() + GRACE_S * (2 if blocked and not cause else 1)
        while time.monotonic() < deadline and not self.delivered and not self._stop:
            time.sleep(0.1)
        if not self.delivered and not self._stop:
            log.error("rank %d could not raise CollectiveStallError in its main thread; exiting", self.rank)
            logging.shutdown()
            os._exit(1)

    # --- the watched thread ----------------------------------------------------

    def explain(self, exc: BaseException, collective: str) -> None:
        """In the watched thread, when a watched collective raised: raise the stall error it stands for."""
        if self.error is None:
            if not self._busy and not _is_peer_failure(exc):
                return
            # For the report, this thread is still where the collective failed.
            now = self.now
            previous = now.collective, now.since
            summary = traceback.extract_tb(exc.__traceback__)
            self._own_stack = "".join(traceback.format_list(summary))
            mine = [f for f in reversed(summary) if _is_users(f.filename)]
            self._own_where = f"{mine[0].filename}:{mine[0].lineno} ({mine[0].name})" if mine else None
            if now.collective is None:
                now.collective, now.since = collective, self._seen[1]
            try:
                if not self._busy:
                    self._peer_lost = collective
                    self._wake.set()
                self.reported.wait(STACKS_WAIT_S + 2 * BEAT_S + 2)
            finally:
                (now.collective, now.since), self._own_stack, self._own_where = previous, None, None
            if self.error is not None and self.error.dead:  # the error from gloo does not travel as a __cause__
                self.error.args = (f"{self.error}; the collective failed with: {str(exc).splitlines()[0]}",)
        if self.error is not None:
            self.delivered = True
            raise self.error from exc


def _on_interrupt(signum, frame) -> None:
    # Runs in the main thread, between two bytecodes or out of a sleep or a lock wait.
    dog = _dog
    if dog is not None and dog.error is not None and not dog.delivered:
        dog.delivered = True
        raise dog.error


def _is_peer_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        t in text for t in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                            "connection closed", "Connection refused"))


# --- the process's watchdog ----------------------------------------------------

_dog: Watchdog | None = None


def current() -> Watchdog | None:
    """This process's watchdog, or ``None``."""
    return _dog


def start(store, rank: int, world_size: int, timeout: float | None, store_host: int | None = None) -> Watchdog | None:
    """Start the watchdog of a new group (``initialize_ddp``); ``timeout=None``: none.

    ``store_host``: the rank whose process serves ``store`` (``None``: no rank, torchrun's agent does).
    """
    global _dog
    stop()
    if timeout is None or store is None:
        return None
    _dog = Watchdog(store, rank, world_size, timeout, store_host=store_host)
    _dog.start()
    return _dog


def set_timeout(timeout: float | None) -> None:
    """Change the running watchdog's timeout (``None``: stop it); harmless without one."""
    if timeout is None:
        stop()
    elif _dog is not None:
        _dog.timeout = timeout


def stop() -> None:
    """Stop the watchdog (``cleanup_ddp``); harmless without one."""
    global _dog
    dog, _dog = _dog, None
    if dog is not None:
        dog.stop()


def client_store(addr: str, port: int, prefix: str, timeout: timedelta):
    """A store client of the watchdog's own (the group's client serves the main thread)."""
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


def note_step(step: int) -> None:
    """Show ``step`` in this process's heartbeat (the trainer calls it after each optimizer step)."""
    dog = _dog
    if dog is not None:
        dog.now.step = step


def new_wait() -> None:
    """The watched thread moved on (the trainer's next batch): the same collective at the same line is a new wait.

    Without it, a rank that waits 2 s in the same all_reduce of every step
    looks, to a watchdog sampling once a second, like one long wait.
    """
    dog = _dog
    if dog is not None:
        dog.now.entries += 1


@contextlib.contextmanager
def working_on(task: str) -> Iterator[None]:
    """Mark the calling thread as running ``task``, rank-restricted work that the other ranks wait for."""
    dog = _dog
    if dog is None:
        yield
        return
    previous, dog.now.task = dog.now.task, task
    try:
        yield
    finally:
        dog.now.task = previous


def watching(collective: str) -> contextlib.AbstractContextManager:
    """Mark the calling thread as waiting in ``collective`` (nn_handler's own collectives)."""
    dog = _dog
    # Entered around every backward of a training step: a class, not a
    # generator, and one shared no-op without a watchdog.
    return _NOT_WATCHING if dog is None else _Watching(dog, collective)


class _Watching:
    __slots__ = ("dog", "collective", "previous")

    def __init__(self, dog: Watchdog, collective: str):
        self.dog, self.collective = dog, collective

    def __enter__(self) -> None:
        now = self.dog.now
        self.previous = now.collective, now.since, now.thread
        now.collective, now.since, now.thread = self.collective, time.monotonic(), threading.get_ident()

    def __exit__(self, exc_type, exc, tb) -> bool:
        now = self.dog.now
        try:
            if exc_type is not None and issubclass(exc_type, RuntimeError):
                self.dog.explain(exc, self.collective)
        finally:
            now.collective, now.since, now.thread = self.previous
        return False


_NOT_WATCHING = contextlib.nullcontext()


@contextlib.contextmanager
def watch_collectives(step: int | None = None) -> Iterator[None]:
    """Watch the ``torch.distributed`` calls made inside the block for stalls.

    While the block runs, the stall watchdog (see ``initialize_ddp``'s
    ``stall_timeout``) looks at where this thread is: when it has waited in a
    collective longer than ``stall_timeout`` while another rank is elsewhere,
    every rank writes a report and raises
    :class:`~nn_handler.errors.CollectiveStallError`. Costs a few attribute
    sets; without a watchdog (no group, ``stall_timeout=None``) it does nothing.

    Args:
        step: A step number to show in the heartbeat and the report.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from nn_handler.utils.ddp import watch_collectives
        >>> with watch_collectives():
        ...     total = torch.ones(1)   # e.g. dist.all_reduce(total) in a job
    """
    dog = _dog
    if dog is None:
        yield
        return
    now = dog.now
    previous = now.thread, now.step
    now.auto += 1
    now.entries += 1
    now.thread = threading.get_ident()
    if step is not None:
        now.step = step
    try:
        yield
    except RuntimeError as exc:
        dog.explain(exc, _failed_collective(exc))
        raise
    finally:
        now.auto -= 1
        now.thread, now.step = previous
