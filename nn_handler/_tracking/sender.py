"""A thread that sends a tracker's records, so that training never waits on the network.

Training puts records (metrics at a step, parameters, tags, the end state) and
goes on: a put is an append to a list. The thread sends what is queued, in
order, in batches, at most once every ``every_s`` seconds (a send costs the
process far more than the records in it: one call for all that gathered), and
wakes only when there is something to send. When a send
fails (the server is down, the network is out), the records stay queued, one
warning says so, and the thread tries again every ``retry_s`` seconds; when a
send works again, one line says so. :meth:`Sender.close` gives the thread
``timeout_s`` seconds to send the rest and then writes whatever is still unsent
to a local JSON-lines file, one record a line, and says where: training
returns within that bound however long the tracker's own client would retry.

Example:
    >>> sent = []
    >>> def send(records):  # removes what it sent from the front of the list
    ...     sent.extend(records)
    ...     records.clear()
    >>> sender = Sender(send, "demo", retry_s=0.1, every_s=60.0)
    >>> sender.put({"kind": "metrics", "step": 1, "values": {"loss": 0.5}})
    >>> sender.close(timeout_s=5.0, fallback=None)  # sends the rest at once; returns what could not be sent
    []
    >>> sent
    [{'kind': 'metrics', 'step': 1, 'values': {'loss': 0.5}}]
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("nn_handler.loggers")

Record = dict[str, Any]


class _QuietRetries(logging.Filter):
    """Drops the HTTP library's per-retry warnings of a sender thread: one warning of ours says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith(_THREAD_PREFIX)


_THREAD_PREFIX = "nn_handler sender"
logging.getLogger("urllib3.connectionpool").addFilter(_QuietRetries())


class Sender:
    """Sends queued records with ``send(records)`` from a daemon thread; see the module's docstring.

    Args:
        send: Sends a list of records and removes from its front those it sent; when it raises, the records
            left in the list are sent again later.
        what: Names the tracker in warnings (``"MLflow at http://..."``).
        retry_s: Seconds between tries while sends fail.
        every_s: Seconds at least between two sends (the first goes at once; :meth:`flush` and :meth:`close`
            send at once).
    """

    def __init__(self, send: Callable[[list[Record]], None], what: str, retry_s: float = 5.0, every_s: float = 0.0):
        self._send, self.what, self.retry_s, self.every_s = send, what, retry_s, every_s
        self._last_send = -float("inf")
        self._hurry = False  # flush() asks for a send now
        self._queue: list[Record] = []
        self._in_flight: list[Record] = []
        self._wake = threading.Condition()
        self._closing = False
        self.failing: BaseException | None = None  # the error of the last failed send, None once one worked
        self._thread = threading.Thread(target=self._run, name=f"{_THREAD_PREFIX}: {what}", daemon=True)
        self._thread.start()

    def put(self, record: Record) -> None:
        with self._wake:
            self._queue.append(record)
            if len(self._queue) == 1:  # the thread waits for a first record; with more queued it is awake already
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                # Let records gather until every_s has passed since the last send.
                while self._queue and not (self._closing or self._hurry):
                    left = self._last_send + self.every_s - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if not self._queue:
                    return
                self._hurry = False
                self._last_send = time.monotonic()
                self._in_flight, self._queue = self._queue, []
            try:
                self._send(self._in_flight)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure never reaches training
                with self._wake:
                    self._queue[:0], self._in_flight = self._in_flight, []
                    if self.failing is None:
                        log.warning("%s: could not send (%s: %s); training goes on, the records are kept and "
                                    "sent again every %g s", self.what, type(exc).__name__, _short(exc),
                                    self.retry_s)
                    self.failing = exc
                    if self._closing:
                        return
                    self._wake.wait(self.retry_s)  # close() wakes it
                continue
            with self._wake:
                self._in_flight = []
                if self.failing is not None:
                    log.warning("%s: sending again", self.what)
                    self.failing = None
                self._wake.notify_all()

    def flush(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` (None: no bound) for the queue to be sent; True if it was (False at once
        while sends fail)."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
        with self._wake:
            self._hurry = True
            self._wake.notify_all()
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive() or self.failing is not None:
                    return False
                self._wake.wait(min(left, 0.5))
        return True

    def close(self, timeout_s: float | None, fallback: Path | None) -> list[Record]:
        """Send what is queued within ``timeout_s`` (None: no bound), stop the thread; write the unsent to
        ``fallback`` (returned)."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self._thread.join(timeout_s)
        with self._wake:
            # A send still under way when the time ran out counts as unsent (it may yet arrive: the file may
            # then hold records the tracker has too).
            unsent = self._in_flight + self._queue
            self._queue, self._in_flight = [], []
        if unsent and fallback is not None:
            write_fallback(fallback, unsent)
            log.warning("%s: %d records could not be sent; written to %s (one JSON record a line)", self.what,
                        len(unsent), fallback)
        return unsent


def write_fallback(path: Path, records: list[Record]) -> None:
    """Append ``records`` to the JSON-lines file ``path`` (created with its directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:200]
