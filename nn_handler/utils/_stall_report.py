"""Which ranks a stall waits for, and the text of its report: one line per rank, each rank's own stack, the headline.

Pure functions of the heartbeats (plain dicts) the watchdog in
:mod:`nn_handler.utils._stall` gathered, so they are tested without processes.
"""

from __future__ import annotations

import json
import os
import time
from typing import Mapping

from ..errors import CollectiveStallError

_EXCHANGE = "status exchange of "
#: The name main_process_first's status exchange goes by (``"status exchange of main_process_first block"``).
MAIN_PROCESS_FIRST = "main_process_first block"
# The @on_rank functions decorated in this process (their qualnames): a status exchange of one of them that a
# rank never entered is the user's `if rank == 0: save()`. Filled at decoration, on every rank alike.
_RANK_FUNCTIONS: set[str] = set()


def note_rank_function(name: str) -> None:
    """Remember that ``name`` is an @on_rank function (its exchange is the user's, see :func:`skipped_call`)."""
    _RANK_FUNCTIONS.add(name)


def skipped_call(collective: str, beats: Mapping[int, dict | None], missing) -> str:
    """The likely cause when ranks never entered an @on_rank function or main_process_first block that the
    others wait in: the function called under ``if rank == 0:``. ``""`` when it is not that.

    Example:
        >>> note_rank_function("save")
        >>> beats = {0: {"collective": "status exchange of save"}, 1: {"collective": None, "task": None}}
        >>> skipped_call("status exchange of save", beats, [1]).split(":")[0]
        'the @on_rank function save was called on rank 0 only'
        >>> skipped_call("all_reduce", beats, [1])
        ''
    """
    name = collective[len(_EXCHANGE):] if collective.startswith(_EXCHANGE) else None
    if name is None or (name not in _RANK_FUNCTIONS and name != MAIN_PROCESS_FIRST):
        return ""
    never = [r for r in missing if beats.get(r) is None or beats[r].get("task") != name]  # (not inside it either)
    if not never:
        return ""
    entered = [r for r, b in sorted(beats.items()) if b is not None and b["collective"] == collective]
    what = "the main_process_first block" if name == MAIN_PROCESS_FIRST else f"the @on_rank function {name}"
    ranks = ", ".join(map(str, entered)) or "?"
    return (f"{what} was called on rank{'s' if len(entered) != 1 else ''} {ranks} only: "
            f"rank{'s' if len(never) != 1 else ''} {', '.join(map(str, never))} never entered it; call it on every "
            f"rank, not under `if rank == 0:` (it runs on its own ranks by itself, and the others wait for it there)")


def elsewhere(beat: dict | None, collective: str) -> bool:
    """Whether a rank is not where ``collective`` needs it.

    A rank that runs the on_rank function (or main_process_first block) whose
    status exchange the others wait in is where it should be: saving a large
    checkpoint may take minutes, and the others wait for it by design. Unless
    it waits in a collective there, which the others never join.
    """
    if beat is None:
        return True
    return beat["collective"] != collective and not (
        beat.get("task") is not None and beat["collective"] is None  # waiting in a collective there: stalled
        and collective == f"status exchange of {beat['task']}")


def stuck_inside(beats: Mapping[int, dict | None]) -> tuple[int, dict] | None:
    """A rank waiting in a collective inside rank-restricted work that other ranks wait for, with its beat."""
    for rank, beat in sorted(beats.items()):
        if beat is None or beat["collective"] is None or beat.get("task") is None:
            continue
        awaited = f"status exchange of {beat['task']}"
        if beat["collective"] != awaited and any(b is not None and b["collective"] == awaited for b in beats.values()):
            return rank, beat
    return None


def _rank_line(r: int, b: dict | None, dead: list, missing: list) -> str:
    if b is None:
        return f"  rank {r}: no heartbeat ever (it never started its watchdog)" + ("  <- DEAD" if r in dead else "")
    doing = f"in {b['collective']}" if b["collective"] else _own_code(b)
    step = f", step {b['step']}" if b.get("step") is not None else ""
    head = f"  rank {r} (host {b['host']}, pid {b['pid']}{step}): "
    if r in dead:
        return (head + f"DEAD: no heartbeat for {time.time() - b['time']:.1f} s, process gone; last seen "
                f"{doing} at {b['where']}")
    tag = "  <- MISSING" if r in missing else ""
    return head + f"{doing} for {b['for_s']:.1f} s at {b['where']}{tag}"


def _own_code(b: dict) -> str:
    return "running its own code" + (f" inside {b['inside']}" if b.get("inside") else "")


def render_report(rank, collective, beats, stacks, dead, missing, timeout, note: str = "") -> str:
    """The text of one rank's report (log and file); ``note``: a line on what this rank could not see."""
    cause = skipped_call(collective, beats, missing)
    lines = [cause] if cause else []
    lines += [f"nn_handler stall report from rank {rank} ({time.strftime('%Y-%m-%d %H:%M:%S')})",
             f"collective: {collective} (stall_timeout {timeout:g} s)",
             f"dead ranks: {dead or 'none'}; ranks not in {collective}: {missing or 'none'}"]
    lines += [note] if note else []
    lines.append("ranks:")
    lines += [_rank_line(r, beats.get(r), dead, missing) for r in sorted(beats)]
    for r in sorted(stacks):
        lines.append(f"--- stack of rank {r} (from rank {r} itself, innermost last) ---")
        lines.append(stacks[r].rstrip())
    return "\n".join(lines) + "\n"


def headline(rank, collective, beats, dead, missing, path, note: str = "") -> str:
    parts = []
    for r in dead:
        b = beats.get(r)
        parts.append(f"rank {r} died" + (f" (pid {b['pid']} on {b['host']}, last seen at {b['where']})" if b else ""))
    for r in missing:
        b = beats.get(r)
        where = (f" is at {b['where']}" + (f" in {b['collective']}" if b["collective"] else
                                           f", {_own_code(b)}" if b.get("inside") else "")) if b else \
            " never sent a heartbeat"
        parts.append(f"rank {r}{where}")
    waiting = [r for r, b in sorted(beats.items())
               if b is not None and r not in dead and b["collective"] == collective]
    cause = skipped_call(collective, beats, missing)
    return ((f"{cause}; " if cause else "") + f"{collective} stalled: ranks {waiting} waited in it; " + "; ".join(parts or ["no rank is missing"])
            + (f"; {note}" if note else "") + f" (report of rank {rank}: {path})")


def write_torchelastic_error_file(error: CollectiveStallError, report: str) -> None:
    # Under torchrun the agent shows the first error file it finds; without
    # @record on the user's main nobody writes it, so write it here.
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": f"CollectiveStallError: {error}\n{report}",
                                   "extraInfo": {"py_callstack": f"CollectiveStallError: {error}\n{report}", "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass
