"""A worker's messages as the caller reads them: whole, in order, however the bytes arrive; never blocking past a
deadline or on a worker that is gone.

The pool's own pair of one-way pipes carries the bytes, written raw here, and a stand-in process plays the worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import struct
import threading
import time

import pytest

from nn_handler.utils._workers import pipes


class FakeWorker:
    """A process as the inbox sees one: alive until ``die()``, which also makes its sentinel readable."""

    def __init__(self):
        self.sentinel, self._end = os.pipe()
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def die(self) -> None:
        self.alive = False
        os.close(self._end)


class RawEnd:
    """The worker's end of the pipe, for writing any bytes (a message in pieces, half a message)."""

    def __init__(self, side: pipes.Channel):
        self._side = side

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._side.writer.fileno(), view):]

    def close(self) -> None:
        self._side.close()


@pytest.fixture
def pipe():
    """``(inbox, worker's end, worker)``."""
    caller, worker_side = pipes.channel(mp.get_context("spawn"))
    os.set_blocking(caller.fileno(), False)  # as the pool sets it
    worker = FakeWorker()
    yield pipes.Inbox(caller, worker), RawEnd(worker_side), worker
    caller.close()
    worker_side.close()


def frame(obj, big_header: bool = False) -> bytes:
    body = pickle.dumps(obj)
    header = struct.pack("!iQ", -1, len(body)) if big_header else struct.pack("!i", len(body))
    return header + body


def test_several_messages_in_one_read_come_out_one_by_one(pipe):
    inbox, end, _ = pipe
    end.sendall(frame(("ok", 1, b"x")) + frame(("mem", 0, 123)))
    assert inbox.receive() == ("ok", 1, b"x")
    assert inbox.has_message() and inbox.drained  # the second is in the buffer; the pipe is empty
    assert inbox.receive() == ("mem", 0, 123)
    assert not inbox.has_message()


def test_a_message_arriving_in_pieces_is_waited_for(pipe):
    inbox, end, _ = pipe
    data = frame(list(range(100)))
    end.sendall(data[:2])
    threading.Timer(0.1, end.sendall, (data[2:10],)).start()
    threading.Timer(0.3, end.sendall, (data[10:],)).start()
    assert inbox.receive(deadline=time.monotonic() + 20) == list(range(100))


def test_a_message_larger_than_a_read_is_whole_and_leaves_the_next_one(pipe):
    inbox, end, _ = pipe
    big = os.urandom(3 * pipes.Inbox.READ_SIZE + 5)
    sender = threading.Thread(target=end.sendall, args=(frame(big) + frame("after"),))
    sender.start()
    assert inbox.receive(deadline=time.monotonic() + 20) == big
    assert inbox.receive(deadline=time.monotonic() + 20) == "after"
    sender.join(20)


def test_the_framing_of_a_message_over_2_gib_is_understood(pipe):
    inbox, end, _ = pipe
    end.sendall(frame({"a": 1}, big_header=True) + frame("next"))
    assert inbox.receive() == {"a": 1}
    assert inbox.receive() == "next"


def test_a_deadline_in_the_middle_of_a_message_is_late_not_a_hang(pipe):
    inbox, end, _ = pipe
    end.sendall(frame("never finished")[:6])
    started = time.monotonic()
    assert inbox.receive(deadline=started + 0.3) is pipes.LATE
    assert time.monotonic() - started < 10


def test_a_worker_that_is_gone_gives_none(pipe):
    inbox, end, worker = pipe
    end.sendall(frame("last words"))
    worker.die()
    assert inbox.receive() == "last words"  # what it sent before it died is still read
    started = time.monotonic()
    assert inbox.receive() is None  # then nothing: no wait for an EOF that a forked child may hold back
    assert time.monotonic() - started < 10


def test_a_closed_pipe_gives_none(pipe):
    inbox, end, _ = pipe
    end.sendall(frame("bye")[:3])
    end.close()
    assert inbox.receive() is None
