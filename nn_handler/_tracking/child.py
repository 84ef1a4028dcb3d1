"""A tracker's client in a child process of its own: training's process only hands the records over.

A tracker's client (MLflow's, W&B's) spends a few hundred microseconds of
Python on every record it sends, all of it under the training process's GIL
when it runs there, thread or not. :class:`ChildSender` runs the client in a
fresh interpreter instead (``python -c "... from nn_handler._tracking.child
import main; main()"``; no CUDA, no fork of the training process) and gives the training process what
:class:`~.sender.Sender` gives it: :meth:`~ChildSender.put` is an append to a
list, a thread of its own forwards what gathered every ``every_s`` seconds
(one pipe write), and the child sends each batch at once, with the retries,
warnings and local fallback file of :class:`~.sender.Sender`. The child's
warnings come back as this process's (logger ``nn_handler.loggers``), and so
does the client's state (``run_id``).

The child never outlives training: it ends when :meth:`~ChildSender.close`
tells it to, or when its stdin closes because the training process is gone
(then it ends the run as failed, ``TrainingProcessLost``, sends the rest
within ``end_timeout_s`` and writes what is left to the fallback file). It ignores SIGINT and SIGTERM, which a terminal or a
scheduler sends the whole process group: the training process decides when
its tracker ends.

A client is a picklable object with ``send(records)`` (sends and removes from
the list's front what it sent; when it raises, what is left is sent again
later) and ``state() -> dict``, and optionally ``prepare()`` (called in the
child before it reads any record: importing the tracker's package, so that
the bounds on sending count network time, not an import) and ``close()``
(called in the child after the last send).
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .sender import Record, Sender, write_fallback

log = logging.getLogger("nn_handler.loggers")

LOST = "TrainingProcessLost"  # the failure of a run whose training process ended without ending it (SIGKILL)
_START_S = 120.0  # how long a reply may wait beyond its own bound: the child's interpreter and client importing


class ChildSender:
    """Sends records with ``client.send`` in a child process; see the module's docstring.

    Args:
        client: Picklable; ``send(records)``, ``state()`` and optionally ``close()`` run in the child.
        what: Names the tracker in warnings.
        every_s: Seconds at least between two forwards to the child (the first goes at once).
        end_timeout_s: When the training process is gone, how long the child may send the rest.
        fallback: Where the child writes what it could not send when it ends; ``{run_id}`` in the name is
            filled in from the client's state (``unstarted-run`` when it has none).
        retry_s: Seconds between tries while sends fail.
    """

    def __init__(self, client: Any, what: str, *, every_s: float, end_timeout_s: float | None,
                 fallback: Path | None, retry_s: float = 5.0):
        self.what = what
        self.state: dict[str, Any] = {}  # the client's state, as the child last reported it
        self._fallback = fallback
        self._ids = itertools.count()
        self._replies: dict[int, Any] = {}
        self._answered = threading.Condition()
        self._write_lock = threading.Lock()
        self._alive = True
        # The same nn_handler as here, found last (after the standard library: a site-packages put ahead of it
        # on PYTHONPATH could shadow it).
        package_root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path.append({package_root!r}); from {__name__} import main; main()"
        self._process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, close_fds=True)
        self._reader = threading.Thread(target=self._read, name=f"nn_handler tracker replies: {what}", daemon=True)
        self._reader.start()
        try:
            self._message(("start", client, what, retry_s, end_timeout_s, None if fallback is None else str(fallback)))
        except OSError as exc:  # the process died at once: the forwarder warns, and close() writes the records down
            log.warning("%s: the tracker's process did not start (%s); training goes on", what, exc)
        self._forwarder = Sender(self._forward, what, retry_s=retry_s, every_s=every_s)

    @property
    def failing(self) -> BaseException | None:
        return self._forwarder.failing

    def put(self, record: Record) -> None:
        self._forwarder.put(record)

    def flush(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` (None: no bound) until the client has sent what was put; True if it has."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._forwarder.flush(timeout_s):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        reply = self._ask("flush", left, left)
        return bool(reply and reply[0])

    def close(self, timeout_s: float | None) -> int:
        """Send the rest within ``timeout_s`` (None: no bound) and end the child; the number of records unsent.

        The child writes what it could not send to the fallback file given when it started.
        """
        unsent = self._forwarder.close(None if self._alive else 0.0, None)  # into the pipe: not the network
        if unsent:  # the child is gone: what did not reach it is written here
            self._write_unsent(unsent)
        reply = self._ask("close", timeout_s, timeout_s) if self._alive else None
        try:
            self._process.stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout=_START_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=5.0)
        if not self._reader.is_alive():  # the reader is done with the replies' pipe
            self._process.stdout.close()
        return len(unsent) + (reply[0] if reply else 0)

    # --------------------------------------------------------------------- the pipe
    def _forward(self, records: list[Record]) -> None:
        self._message(("records", list(records)))
        records.clear()

    def _message(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._write_lock:
            self._process.stdin.write(data)
            self._process.stdin.flush()

    def _ask(self, kind: str, bound: float | None, wait_s: float | None) -> Any:
        """Send ``(kind, id, bound)`` and wait for the child's reply (None: none came in ``wait_s`` + start-up)."""
        ident = next(self._ids)
        try:
            self._message((kind, ident, bound))
        except OSError:
            return None
        deadline = time.monotonic() + (wait_s if wait_s is not None else float("inf")) + _START_S
        with self._answered:
            while ident not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self._alive:
                    return None
                self._answered.wait(min(left, 1.0))
            return self._replies.pop(ident)

    def _read(self) -> None:
        stream = self._process.stdout
        while True:
            try:
                message = pickle.load(stream)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            kind = message[0]
            if kind == "log":
                log.log(message[1], "%s", message[2])
            elif kind == "state":
                self.state.update(message[1])
            elif kind == "reply":
                with self._answered:
                    self._replies[message[1]] = message[2]
                    self._answered.notify_all()
        with self._answered:
            self._alive = False
            self._answered.notify_all()

    def _write_unsent(self, unsent: list[Record]) -> None:
        if self._fallback is None:
            return
        path = Path(str(self._fallback).replace("{run_id}", self.state.get("run_id") or "unstarted-run"))
        write_fallback(path, unsent)
        log.warning("%s: %d records could not be sent; written to %s (one JSON record a line)", self.what,
                    len(unsent), path)


# ------------------------------------------------------------------------- the child's side
def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process ends its tracker, not a terminal's ^C
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the client prints goes to stderr, not into the replies
    requests = sys.stdin.buffer
    lock = threading.Lock()

    def reply(message: tuple) -> None:
        with lock:
            pickle.dump(message, replies, protocol=pickle.HIGHEST_PROTOCOL)
            replies.flush()

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reply(("log", record.levelno, record.getMessage()))

    log.addHandler(Forward(logging.INFO))
    log.setLevel(logging.INFO)
    log.propagate = False
    _, client, what, retry_s, end_timeout_s, fallback = pickle.load(requests)
    if hasattr(client, "prepare"):
        try:
            client.prepare()
        except Exception as exc:  # the sends meet it again, with their retries, warnings and fallback file
            log.warning("%s: %s: %s", what, type(exc).__name__, exc)

    def send(records: list[Record]) -> None:
        try:
            client.send(records)
        finally:
            reply(("state", client.state()))

    sender = Sender(send, what, retry_s=retry_s)

    def end(timeout_s: float | None) -> int:
        path = None
        if fallback is not None:
            path = Path(fallback.replace("{run_id}", client.state().get("run_id") or "unstarted-run"))
        unsent = sender.close(timeout_s, path)
        if hasattr(client, "close"):
            client.close()
        return len(unsent)

    ended = False  # the run's end came
    while True:
        try:
            message = pickle.load(requests)
        except (EOFError, OSError, pickle.UnpicklingError):  # the training process is gone, unannounced
            if not ended:  # a killed run is not a finished one (W&B's teardown would record exit code 0)
                sender.put({"kind": "end", "state": "failed", "failure": LOST, "time_ms": int(time.time() * 1000)})
            end(end_timeout_s)
            return
        kind = message[0]
        if kind == "records":
            for record in message[1]:
                ended = ended or record["kind"] == "end"
                sender.put(record)
        elif kind == "flush":
            reply(("reply", message[1], (sender.flush(message[2]), client.state())))
        elif kind == "close":
            reply(("reply", message[1], (end(message[2]), client.state())))
            return


if __name__ == "__main__":
    main()
