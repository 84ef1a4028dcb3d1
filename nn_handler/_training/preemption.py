"""Preemption: a SIGTERM during :meth:`NNHandler.train` becomes a checkpoint and a clean exit.

What SLURM (``scancel``, ``--signal``, preemption), Kubernetes (pod
eviction) and torchrun (which forwards its own SIGTERM to the workers) send
is SIGTERM, followed by SIGKILL after a grace period (30 s by default in all
three). The flow, on every rank::

    SIGTERM (any rank, any moment)  ->  _on_signal sets a flag; nothing else
    step boundary due for a check   ->  one all-reduce of 2 ints on the side gloo group:
                                        (signal seen on any rank, steps until the next check)
    agreed                          ->  the handler writes a checkpoint from rank 0 and raises
                                        TrainingPreempted on every rank: exit PREEMPTED_EXIT_CODE

Why not check every step: the check is a collective (a rank cannot stop alone,
the others would wait for it in the next gradient all-reduce). Measured on the
2-core test machine, one such check between two local gloo processes costs
0.7-1 ms (a network round trip or more between nodes): against steps of 10 ms
that would be a 7-10 % tax for an event that happens once per job. So the ranks
agree on the next check while they check: each proposes as many steps as fit
in about :data:`CHECK_INTERVAL_S` seconds of its own recent step time, and
the smallest proposal wins (the same number on every rank, so every rank
checks at the same step). The cost is one tiny collective per second of
training whatever the step time (about 0.1 %), and the reaction delay is about one second
or one step, whichever is longer: far inside the grace period. A single
process needs no agreement and looks at the flag after every step.

``train(max_time=...)`` rides on the same collective: each rank adds "past my
deadline" to it, so the ranks stop together at the first check after the
earliest deadline (about one second late at most, as a preemption).

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import torch.distributed as dist

from ..errors import PREEMPTED_EXIT_CODE, TrainingPreempted  # re-exported: their home was here
from ..utils._collectives import check_collective_allowed, reduce_ints, side_group

__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS", "TrainingPreempted", "SignalCatcher", "PreemptionMonitor"]

log = logging.getLogger(__name__)

#: Signals that mean "save and stop" while ``train`` runs with a checkpoint directory.
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)

#: About how many seconds of training pass between two preemption checks of a distributed run.
CHECK_INTERVAL_S = 1.0
_MAX_INTERVAL = 10_000  # steps; bounds the wait when steps are microseconds long


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; the number as text for a signal Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class SignalCatcher:
    """While entered, the preemption signals set :attr:`received` instead of ending the process.

    The previous handlers are put back on exit, also when training raised, so
    a script's own handlers (or the default action) apply again outside
    ``train``. A signal that arrived but was not turned into a checkpoint
    (training failed or ended first; the caller did not set :attr:`handled`)
    is then delivered again, to the previous handler: torchrun stopping the
    workers of a failed group, or a scheduler's SIGTERM that came too late to
    save, still ends the process as it would have without nn_handler.
    Python only allows installing handlers from the main thread;
    elsewhere (a training thread) nothing is installed and the signals keep
    their previous meaning, which is logged once.

    Example:
        >>> import os, signal
        >>> with SignalCatcher() as catcher:
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     catcher.handled = True  # e.g. a checkpoint was written
        >>> catcher.received == signal.SIGTERM
        True
        >>> signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        True
    """

    def __init__(self, signals: tuple[int, ...] = PREEMPTION_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None
        self.handled = False  # set by the caller once the signal became a checkpoint
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes of the main thread: set a flag and return.
        # Logging or I/O here could deadlock on a lock the interrupted code holds.
        if self.received is None:
            self.received = signum

    def __enter__(self) -> "SignalCatcher":
        if threading.current_thread() is not threading.main_thread():
            log.info("train() runs outside the main thread: %s will not trigger a preemption checkpoint",
                     ", ".join(signal_name(s) for s in self.signals))
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        installed = bool(self._previous)
        for sig, previous in self._previous.items():
            # None: the previous handler was installed from C; the default is the closest we can restore.
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if installed and self.received is not None and not self.handled:
            signal.raise_signal(self.received)


def all_max(values: list[int], distributed: bool) -> list[int]:
    """Element-wise maximum of ``values`` over all ranks, in one all-reduce on the side gloo group.

    Without a process group (or with ``distributed=False``) the values themselves.
    """
    side = side_group() if distributed else None
    if side is None:
        return [int(v) for v in values]
    check_collective_allowed("NNHandler.train")
    return reduce_ints(side, values, dist.ReduceOp.MAX)


class PreemptionMonitor:
    """Decides at which optimizer steps the ranks agree on a preemption signal and on ``max_time``.

    Args:
        catcher: Where the signal is recorded (None: no signal is watched).
        distributed: Whether the ranks must agree (a collective); a single
            process reads its flag after every step.
        every: Agree every this many optimizer steps; ``None`` adapts the
            interval to about :data:`CHECK_INTERVAL_S` seconds.
        deadline: A ``time.monotonic()`` value after which training stops
            (``train(max_time=...)``); the ranks agree on it in the same
            collective, so they stop at the same step.

    Every rank must call :meth:`step_done` after every optimizer step and
    :meth:`epoch_end` at the end of every epoch: the interval is agreed, so
    the ranks reach each check at the same step.
    """

    def __init__(self, catcher: SignalCatcher | None, distributed: bool, every: int | None = None,
                 deadline: float | None = None):
        self.catcher, self.distributed, self.every, self.deadline = catcher, distributed, every, deadline
        # The first check after one step: it measures the step time the
        # adaptive interval is derived from, and a signal that arrived before
        # training started is honoured at once.
        self._countdown = 1
        self._steps = 0
        self._mark = time.perf_counter()

    @property
    def signalled(self) -> bool:
        """True when this rank received a preemption signal."""
        return self.catcher is not None and self.catcher.received is not None

    @property
    def out_of_time(self) -> bool:
        """True when this rank is past the deadline."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _proposal(self, now: float) -> int:
        if self.every is not None:
            return self.every
        elapsed = now - self._mark
        if self._steps == 0 or elapsed <= 0:
            return 1
        return max(1, min(_MAX_INTERVAL, int(CHECK_INTERVAL_S * self._steps / elapsed)))

    def _agree(self, extra: list[int]) -> list[int]:
        """``[signal on any rank, deadline passed on any rank, *extra (max over ranks)]``."""
        if not self.distributed:
            self._countdown = 1
            return [int(self.signalled), int(self.out_of_time), *extra]
        now = time.perf_counter()
        # MAX over (flag, -interval, time, extra): "any rank" for the flags,
        # the smallest proposed interval for the next check.
        agreed = all_max([int(self.signalled), -self._proposal(now), int(self.out_of_time), *extra], True)
        self._countdown, self._steps, self._mark = -agreed[1], 0, now
        return [agreed[0], *agreed[2:]]

    def step_done(self, last_of_epoch: bool = False) -> str | None:
        """After an optimizer step: ``"preempt"`` or ``"time"`` on every rank when the ranks agreed to stop now.

        The last step of an epoch is never a check: :meth:`epoch_end` follows
        and agrees for it, after the epoch is complete.
        """
        self._steps += 1
        self._countdown -= 1
        if self._countdown > 0 or last_of_epoch:
            return None
        preempt, time_up = self._agree([])
        return "preempt" if preempt else "time" if time_up else None

    def epoch_end(self, stop: bool) -> tuple[bool, bool, bool]:
        """At an epoch's end, in one collective: ``(stop on any rank, preemption signal, deadline passed)``."""
        preempt, time_up, stop_any = self._agree([int(bool(stop))])
        return bool(stop_any), bool(preempt), bool(time_up)
