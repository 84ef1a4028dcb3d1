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
    lines = [f"nn_handler stall report from rank {rank} ({time.strftime('%Y-%m-%d %H:%M:%S')})",
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
    return (f"{collective} stalled: ranks {waiting} waited in it; " + "; ".join(parts or ["no rank is missing"])
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
