"""The per-rank failure record and how a set of them reads: what failed, where, root cause first.

Plain data that crosses process boundaries (a worker, a rank, a Ray actor builds one; the caller renders
them). Split from :mod:`nn_handler.errors`, which re-exports :class:`RankFailure` and :func:`describe_exit`;
like it, this module imports nothing from the package, so a spawned worker loads it cheaply.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

__all__ = ["RankFailure", "describe_exit"]


def describe_exit(exitcode: int | None) -> str:
    """Render a process exit code the way a person reads it.

    Example:
        >>> describe_exit(-9)
        'killed by signal SIGKILL'
        >>> describe_exit(3)
        'exit code 3'
    """
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What went wrong on one rank (or worker); plain data that crosses process boundaries.

    Attributes:
        rank: The rank or worker index that failed.
        device: The device the rank ran on, as a string (``"cuda:1"``, ``"cpu"``).
        pid: The process id, when known.
        exc_type: Qualified name of the exception type (``"ValueError"``), or
            ``None`` when the process died without raising.
        message: ``str()`` of the exception, or a description of the death.
        traceback: The formatted remote traceback, or ``""``.
        exitcode: The process exit code when it died (negative: a signal).
        node: The cluster node it ran on (a Ray node id), or ``""`` on this machine.
        host: The host name of that node, or ``""`` on this machine.
    """

    rank: int
    device: str = "?"
    pid: int | None = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    node: str = ""
    host: str = ""

    @property
    def died(self) -> bool:
        """True when the process ended without raising an exception."""
        return self.exc_type is None

    def headline(self, what: str = "call") -> str:
        """One line saying what failed and where, e.g. ``"f failed on rank 1 (cpu, pid 42): ValueError: bad"``."""
        where = f"rank {self.rank} ({self.device}" + (f", pid {self.pid}" if self.pid else "")
        if self.host or self.node:
            where += f", host {self.host or '?'}, node {self.node[:12] or '?'}"
        where += ")"
        if self.died:
            return f"{what} died on {where}: {self.message or describe_exit(self.exitcode)}"
        return f"{what} failed on {where}: {self.exc_type}: {self.message}"


# What gloo says on a rank whose peer's process went away: never the root cause.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


def _likely_cause_first(f: "RankFailure") -> tuple[int, int]:
    # An exception raised by user code explains more than a worker that was
    # torn down afterwards, and a death explains its peers' broken connections.
    # A RankFailedError only relays another rank's failure (an @on_rank function's).
    if f.died:
        return 1, f.rank
    relayed = any(text in f.message for text in _PEER_GONE) or (f.exc_type or "").startswith("RankFailedError")
    return (2 if relayed else 0), f.rank


def _render(failures: tuple[RankFailure, ...], what: str, root_traceback: bool = True) -> str:
    ordered = sorted(failures, key=_likely_cause_first)
    lines = [ordered[0].headline(what)]
    if len(ordered) > 1:
        lines.append(f"{len(ordered)} ranks failed; in order of likely cause:")
        lines.extend("  " + f.headline(what) for f in ordered)
    for i, f in enumerate(ordered):
        if f.traceback and (root_traceback or i):  # (without: the root's is the error's __cause__)
            lines.append(f"\n--- remote traceback of rank {f.rank} ---\n{f.traceback.rstrip()}")
    return "\n".join(lines)


def _render_rank_failed(function: str, failures: tuple[RankFailure, ...]) -> str:
    # The first traceback is the error's __cause__, which Python prints above the message: not here too.
    cause = next((f for f in failures if f.traceback), None)
    if len(failures) == 1:
        lines = [failures[0].headline(function)]
    else:
        lines = [f"{function} failed on ranks {', '.join(str(f.rank) for f in failures)}:"]
        lines.extend("  " + f.headline(function) for f in failures)
    for f in failures:
        if f.traceback and f is not cause:
            lines.append(f"--- traceback of rank {f.rank} ---\n{f.traceback.rstrip()}")
    return "\n".join(lines)
