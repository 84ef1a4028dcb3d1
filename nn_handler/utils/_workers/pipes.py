"""Framed messages over a worker's pipes, read and written without blocking, with a deadline.

A worker that is frozen, dead, or killed half-way through a large message must
not hold the caller past its timeout, so every read and write here polls the
pipe together with the worker's sentinel and the deadline. The framing is
``multiprocessing.Connection``'s. The worker's end blocks (it has nothing
else to do): it reads through an :class:`Inbox` too, and writes with
:func:`write_message`, a system call each way for a small message where
``Connection.recv_bytes`` makes two and both wrap them in Python buffers.
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

LATE = object()  # Inbox.receive: the deadline passed in the middle of a reply
# How long the caller waiting for a reply, or a worker for its next task, polls its pipes before it sleeps
# in the kernel: a message within it costs no wake-up of a sleeping process (on a VM 20-30 us each way, as
# much as the rest of a warm call). Each side spins only while its messages come quickly (see the
# scheduler and the worker), so a wait behind long tasks, or an idle pool, costs no core.
SPIN = 50e-6


def spin(poller) -> list:
    """What ``poller`` finds ready within :data:`SPIN`, polled without sleeping; ``[]`` if nothing came."""
    end = time.perf_counter() + SPIN
    while not (ready := poller.poll(0)) and time.perf_counter() < end:
        os.sched_yield()  # another process on this core (a worker, the caller) runs now, not after the spin
    return ready


class Channel:
    """One side of a worker's two one-way pipes: the messages it reads (``fileno()``, what a poll watches) and
    the end it writes to (``writer``). Made in pairs by :func:`channel`.

    Two pipes rather than ``multiprocessing.Pipe()``'s socket pair: a read from
    a socket frees room charged to the socket that wrote, and the kernel then
    wakes whatever sleeps on that socket, which is the peer blocked reading its
    next message. That wake-up of an idle core came with every reply the caller
    read (a 20-byte read took 9.6 us instead of 0.9 on a 2-core VM).

    Example:
        >>> import multiprocessing as mp
        >>> caller, worker = channel(mp.get_context("spawn"))
        >>> worker.send_bytes(b"ready"); caller.reader.recv_bytes()
        b'ready'
        >>> caller.close(); worker.close()
    """

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    def fileno(self) -> int:
        return self.reader.fileno()

    def send_bytes(self, data: bytes) -> None:
        self.writer.send_bytes(data)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


def channel(ctx) -> tuple[Channel, Channel]:
    """``(caller's side, worker's side)`` of a new pair of one-way pipes (``ctx``: a multiprocessing context)."""
    to_worker, to_worker_end = ctx.Pipe(duplex=False)  # (read end, write end)
    from_worker, from_worker_end = ctx.Pipe(duplex=False)
    return Channel(from_worker, to_worker_end), Channel(to_worker, from_worker_end)


def _poller(fd: int, events: int, process):
    poller = select.poll()
    poller.register(fd, events)
    poller.register(process.sentinel, select.POLLIN)
    return poller


def _read_exact(fd: int, n: int, deadline: float | None, process, data: bytearray | None = None, got: int = 0):
    """``n`` bytes (a bytearray) from the non-blocking ``fd``; ``None`` when the worker is gone, ``LATE`` past ``deadline``.

    ``data``, ``got``: fill the rest of this bytearray of ``n`` bytes, whose first ``got`` are there already.
    """
    data = bytearray(n) if data is None else data
    view = memoryview(data)
    while got < n:
        try:
            chunk = os.readv(fd, [view[got:]])
        except BlockingIOError:
            waited = _wait_readable(fd, deadline, process)
            if waited is not True:
                return waited
            continue
        if chunk == 0:
            return None
        got += chunk
    return data


class Inbox:
    """The messages of one worker, read without blocking, with a deadline; a small reply costs one system call.

    Read without blocking for the reason given at :func:`send`: a worker
    frozen half-way through a large reply must not hold the call past its
    timeout (a late reply's worker is then killed with the call). One read
    takes whatever the pipe holds (a reply, and a memory probe's behind it)
    rather than a header, then a body; a message larger than a read is
    finished straight into a buffer of its own.
    """

    READ_SIZE = 1 << 16

    def __init__(self, conn, process=None):
        # The caller's end is non-blocking (the pool sets it so once per
        # worker) and ``process`` is its worker; the worker's own end blocks
        # and has no process to watch (``None``): a read waits for the message.
        self._fd = conn.fileno()
        self._process = process
        self._buffer = bytearray()
        self._start = 0  # where the next message begins in the buffer
        self.drained = True  # the last read took all the pipe held (as far as it could tell)

    def has_message(self) -> bool:
        """Whether a whole message is in the buffer already."""
        return bool(self._buffer) and self._frame(take=False) is not None

    def receive(self, deadline: float | None = None):
        """The next message; ``None`` when the worker is gone (or its pipe closed), ``LATE`` past ``deadline``."""
        if not self._buffer:  # the common case: one read brings exactly one small message
            try:
                chunk = os.read(self._fd, self.READ_SIZE)
            except BlockingIOError:
                pass
            except OSError:
                return None
            else:
                if not chunk:
                    return None  # EOF: its end is closed
                self.drained = len(chunk) < self.READ_SIZE
                if len(chunk) >= 4 and int.from_bytes(chunk[:4], "big", signed=True) == len(chunk) - 4:
                    return pickle.loads(memoryview(chunk)[4:])
                self._buffer += chunk
        while True:
            body = self._frame()
            if body is not None:
                return pickle.loads(body)
            frame = self._frame_size()
            if frame is not None and frame[1] > self.READ_SIZE:
                return self._receive_large(*frame, deadline)
            try:
                chunk = os.read(self._fd, self.READ_SIZE)
            except BlockingIOError:
                self.drained = True
                chunk = _wait_readable(self._fd, deadline, self._process)
                if chunk is not True:
                    return chunk  # None (gone) or LATE
                continue
            except OSError:
                return None
            if not chunk:
                return None  # EOF: its end is closed
            self.drained = len(chunk) < self.READ_SIZE
            self._buffer += chunk

    def _frame_size(self) -> tuple[int, int] | None:
        """``(header bytes, body bytes)`` of the message the buffer begins, or ``None`` while its header is incomplete."""
        have = len(self._buffer) - self._start
        if have < 4:
            return None
        size = struct.unpack_from("!i", self._buffer, self._start)[0]
        if size != -1:
            return 4, size
        if have < 12:  # Connection's framing of a message over 2 GiB
            return None
        return 12, struct.unpack_from("!Q", self._buffer, self._start + 4)[0]

    def _frame(self, take: bool = True) -> bytearray | bool | None:
        """The body of the next whole message in the buffer (``take=False``: only whether there is one), or ``None``."""
        frame = self._frame_size()
        if frame is None or len(self._buffer) - self._start < frame[0] + frame[1]:
            return None
        if not take:
            return True
        begin = self._start + frame[0]
        self._start = begin + frame[1]
        body = self._buffer[begin:self._start]
        if self._start == len(self._buffer):
            self._buffer.clear()
            self._start = 0
        return body

    def _receive_large(self, head: int, size: int, deadline: float | None):
        """Finish a message larger than a read in a buffer of its own (the buffer holds only its beginning)."""
        have = self._buffer[self._start + head:]
        self._buffer.clear()
        self._start = 0
        body = bytearray(size)
        body[:len(have)] = have
        try:
            body = _read_exact(self._fd, size, deadline, self._process, data=body, got=len(have))
        except OSError:
            return None
        self.drained = True
        return pickle.loads(body) if isinstance(body, bytearray) else body


def _wait_readable(fd: int, deadline: float | None, process):
    """Wait until ``fd`` has something to read: ``True``; ``None`` once the worker is gone; ``LATE`` past ``deadline``."""
    if not process.is_alive():
        # Dead, and nothing more to read; no EOF to wait for when a process
        # it forked still holds its end of the pipe.
        return None
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        return LATE
    _poller(fd, select.POLLIN, process).poll(None if left is None else max(1, int(left * 1000)))
    return True


def _framed(data: bytes) -> tuple:
    """``data`` with ``Connection``'s header, as the parts to write: one for a small message (one system call),
    two for a large one (not copied to put the header in front)."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7fffffff else struct.pack("!iQ", -1, n)
    return (header + data,) if n < 65536 else (header, data)


def write_message(fd: int, data: bytes) -> None:
    """Write one message on the blocking ``fd`` (the worker's end); ``OSError`` when the caller's end is closed."""
    for part in _framed(data):
        written = os.write(fd, part)  # the common case: all of it at once
        if written < len(part):
            view = memoryview(part)[written:]
            while view:
                view = view[os.write(fd, view):]


def reader_gone(fd: int) -> bool:
    """Whether nobody holds the reading end of the pipe whose writing end is ``fd`` (a write would fail).

    Example:
        >>> r, w = os.pipe(); alive = reader_gone(w); os.close(r)
        >>> alive, reader_gone(w)
        (False, True)
        >>> os.close(w)
    """
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def send(fd: int, process, data: bytes, deadline: float | None) -> bool:
    """Write one message in ``Connection.send_bytes``' framing; True when the worker read none of it.

    Why not ``send_bytes``: it blocks until the worker has read all but the
    last few hundred KB of a large argument, so a frozen worker would hold
    the call past its timeout and a worker killed while reading would
    surface as a raw ``BrokenPipeError``. Here the writes are non-blocking
    and we wait for room together with the worker's sentinel and the
    deadline. A worker that stops reading (dead, or closed its end) simply
    ends the write; the caller's wait on its sentinel reports it.
    """
    parts = _framed(data)  # ``fd`` is non-blocking: the pool sets it so once per worker
    if len(parts) == 1:  # the common case: a small message goes whole into the empty pipe, at once
        try:
            written = os.write(fd, parts[0])
        except BlockingIOError:
            written = 0
        except OSError:  # EPIPE, ECONNRESET: its end is closed
            return True
        if written == len(parts[0]):
            return True
        parts = (memoryview(parts[0])[written:],)
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
