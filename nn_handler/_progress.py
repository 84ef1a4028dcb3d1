"""Progress of a loop: a tqdm bar on a terminal (or in a notebook), a plain line every few seconds elsewhere.

Off a terminal (``nohup``, SLURM, a pipe, a log file) a redrawn bar is unreadable: tqdm writes each refresh
after a carriage return, so a log file gets one endless line, and a bar that is not drawn at all says
nothing. There, :func:`progress_bar` writes a line every :data:`INTERVAL_S` seconds with done/total, rate and
elapsed time, and a last one at the end. Used by ``ParallelExecutor.map(progress=True)`` and by
``NNHandler.train``'s epoch bars.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> bar = progress_bar(3, "map", "item", file=out)
    >>> bar.update(3)
    >>> bar.close()
    >>> out.getvalue().startswith("map: 3/3 items (100%)")
    True
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["progress_bar", "close", "LogLines", "INTERVAL_S"]

#: Seconds between two progress lines off a terminal.
INTERVAL_S = 5.0


def is_interactive(file: Any) -> bool:
    """True where a redrawn bar reads well: a terminal, or a notebook's output (never a tty, drawn by tqdm.auto)."""
    try:
        if file.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False
    return type(file).__module__.startswith("ipykernel")


def progress_bar(total: int | None, desc: str, unit: str, *, file: TextIO | None = None, disable: bool = False,
                 **tqdm_kwargs: Any):
    """A tqdm bar where it can be drawn, else a :class:`LogLines` with the same ``update``/``set_postfix``/``close``.

    Args:
        total: How many steps, or ``None`` when unknown.
        desc: What is counted, at the start of each line (``"map"``, ``"epoch 2/10"``).
        unit: One step (``"item"``, ``"batch"``).
        file: Where to write; ``sys.stderr`` (looked up at the call) by default.
        disable: Show nothing.
        tqdm_kwargs: More arguments for the tqdm bar (``leave``, ``dynamic_ncols``).
    """
    from tqdm.auto import tqdm

    file = sys.stderr if file is None else file
    if disable or is_interactive(file):
        return tqdm(total=total, desc=desc, unit=unit, file=file, disable=disable, **tqdm_kwargs)
    return LogLines(total, desc, unit, file)


def close(bar, failed: str | None = None) -> None:
    """Close a bar of :func:`progress_bar`; ``failed``: why the work ended early, on its last line.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> bar = progress_bar(5, "train_one", "item", file=out)
        >>> bar.update(2)
        >>> close(bar, "failed at item 2: ValueError: lr=5.0 diverges")
        >>> line = out.getvalue().strip()
        >>> line.startswith("train_one: 2/5 items (40%)"), line.endswith(", failed at item 2: ValueError: lr=5.0 diverges")
        (True, True)
    """
    if failed is None:
        bar.close()
    elif isinstance(bar, LogLines):
        bar.close(failed)
    else:  # a drawn bar: the reason after its counts, where tqdm puts a postfix
        bar.set_postfix_str(", ".join(filter(None, (bar.postfix, failed))), refresh=False)
        bar.close()


class LogLines:
    """Progress as plain lines: at most one every :data:`INTERVAL_S` seconds while it runs, and one at the end.

    Each line reads ``"map: 40/100 items (40%), 12.50item/s, elapsed 00:03, left 00:04"`` (rendered by tqdm's
    own ``format_meter``), with the postfix (``loss=0.31``) after it.
    """

    def __init__(self, total: int | None, desc: str, unit: str, file: TextIO, interval: float | None = None):
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.interval = INTERVAL_S if interval is None else interval
        self.n, self.postfix, self.closed = 0, "", False
        self.start = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        """``n`` steps more; a line if the last one is :attr:`interval` seconds old."""
        if self.closed:
            return  # (as tqdm: a late step after the end draws nothing)
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._write(now)

    def set_postfix(self, postfix: dict | None = None, refresh: bool = False, **kwargs: Any) -> None:
        """What follows the counts on the next line, as tqdm's ``set_postfix`` (``loss=0.31, samples_s=900``)."""
        items = {**(postfix or {}), **kwargs}
        self.postfix = ", ".join(f"{key}={value}" for key, value in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """What follows the counts on the next line, as tqdm's ``set_postfix_str`` (``"3 failed"``)."""
        self.postfix = s

    def close(self, failed: str | None = None) -> None:
        """The last line (once); ``failed``: why the work ended early, said at its end instead of the time left."""
        if not self.closed:
            self.closed = True
            self._write(time.monotonic(), failed)

    def _write(self, now: float, failed: str | None = None) -> None:
        from tqdm import tqdm

        units = self.unit + ("es" if self.unit.endswith(("ch", "sh", "s", "x")) else "s")  # batches, items
        counts = "{n_fmt}/{total_fmt} " + units + " ({percentage:.0f}%)" if self.total else "{n_fmt} " + units
        left = ", left {remaining}" if self.total and failed is None else ""
        end = "" if failed is None else ", " + failed.replace("{", "{{").replace("}", "}}")
        text = tqdm.format_meter(self.n, self.total, now - self.start, prefix=self.desc, unit=self.unit,
                                 postfix=self.postfix or None,
                                 bar_format="{desc}: " + counts + ", {rate_fmt}, elapsed {elapsed}" + left + "{postfix}"
                                 + end)
        try:
            self.file.write(text + "\n")
            self.file.flush()
        except (OSError, ValueError):  # a closed pipe or file must not fail the work it reports on
            pass
