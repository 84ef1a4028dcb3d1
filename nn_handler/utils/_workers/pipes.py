"""Framed messages over a worker's pipe, read and written without blocking, with a deadline.

A worker that is frozen, dead, or killed half-way through a large message must
not hold the caller past its timeout, so every read and write here polls the
pipe together with the worker's sentinel and the deadline. The framing is
``multiprocessing.Connection``'s, so the worker side uses the plain
``Connection.recv_bytes`` / ``send_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import threading
import time

LATE = object()  # receive: the deadline passed in the middle of a reply


def _poller(fd: int, events: int, process):
    poller = select.poll()
    poller.register(fd, events)
    poller.register(process.sentinel, select.POLLIN)
    return poller


def _read_exact(fd: int, n: int, deadline: float | None, process):
    """``n`` bytes (a bytearray) from the non-blocking ``fd``; ``None`` when the worker is gone, ``LATE`` past ``deadline``."""
    data = bytearray(n)
    view, got, poller = memoryview(data), 0, None
    while got < n:
        try:
            chunk = os.readv(fd, [view[got:]])
        except BlockingIOError:
            if poller is None:  # only now: most messages are there in full when the caller comes to read
                poller = _poller(fd, select.POLLIN, process)
            if not process.is_alive():
                # Dead, and nothing more to read; no EOF to wait for when a
                # process it forked still holds its end of the pipe.
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return LATE
            poller.poll(None if left is None else max(1, int(left * 1000)))
            continue
        if chunk == 0:
            return None
        got += chunk
    return data


def receive(conn, process, deadline: float | None = None):
    """The next message from ``process`` on ``conn``; ``None`` when its pipe is closed (it died), ``LATE`` past ``deadline``.

    Read without blocking, for the reason given at :func:`send`: a worker
    frozen half-way through a large reply must not hold the call past its
    timeout. (A late reply's worker is then killed with the call.)
    """
    fd = conn.fileno()  # non-blocking: the pool sets it so once per worker
    try:
        header = _read_exact(fd, 4, deadline, process)
        if header == b"\xff\xff\xff\xff":  # Connection's framing of a message over 2 GiB
            header = _read_exact(fd, 8, deadline, process)
        if not isinstance(header, bytearray):
            return header
        size = struct.unpack("!Q" if len(header) == 8 else "!i", header)[0]
        body = _read_exact(fd, size, deadline, process)
        return pickle.loads(body) if isinstance(body, bytearray) else body
    except OSError:
        return None


def send(conn, process, data: bytes, deadline: float | None) -> bool:
    """Write one message in ``Connection.send_bytes``' framing; True when the worker read none of it.

    Why not ``send_bytes``: it blocks until the worker has read all but the
    last few hundred KB of a large argument, so a frozen worker would hold
    the call past its timeout and a worker killed while reading would
    surface as a raw ``BrokenPipeError``. Here the writes are non-blocking
    and we wait for room together with the worker's sentinel and the
    deadline. A worker that stops reading (dead, or closed its end) simply
    ends the write; the caller's wait on its sentinel reports it.
    """
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7fffffff else struct.pack("!iQ", -1, n)
    # A small message goes in one write (one syscall); a large one is not copied to prepend its header.
    parts = (header + data,) if n < 65536 else (header, data)
    fd = conn.fileno()  # non-blocking: the pool sets it so once per worker
    poller = None
    waited = read_some = False  # the worker made room: it was reading this message
    for part in parts:
        view = memoryview(part)
        while view:
            try:
                view = view[os.write(fd, view):]
                read_some = read_some or waited
                continue
            except BlockingIOError:
                pass
            except OSError:  # EPIPE, ECONNRESET: its end is closed
                return not read_some
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return not read_some  # the wait loop raises the timeout
            poller = poller or _poller(fd, select.POLLOUT, process)
            events = poller.poll(None if left is None else max(1, int(left * 1000)))
            if any(handle == process.sentinel for handle, _ in events):
                return not read_some  # died; the wait loop reports it
            waited = True
    return not read_some


def signal_kill(process) -> None:
    """SIGKILL a worker that another thread is using; harmless if that thread has just closed it."""
    try:
        process.kill()  # only sends the signal: the other thread reaps it
    except (ValueError, AttributeError, OSError):
        pass


@contextlib.contextmanager
def sigint_deferred():
    """Hold Ctrl-C back while workers are killed and reaped, then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run in the main thread only
        return
    received = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    except (ValueError, TypeError):  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[0])  # the default one raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
