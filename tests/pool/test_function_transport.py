"""Functions travel like arguments: large tensors they hold go through shared memory, and a worker that already
holds a function gets only its digest.

What travels is measured by the size of every task message the caller writes (a hook on ``pipes.send``), never by
timing.
"""

from __future__ import annotations

import functools
import glob
import os
import signal
import threading
import time

import pytest
import torch

from helpers import pids_alive
from nn_handler import ParallelExecutionError, ParallelExecutor, WorkerDiedError
from nn_handler.utils._workers import pipes
from nn_handler.utils._workers.executor import _pickle_call
from nn_handler.utils._workers import transport as _transport

CPU2 = ["cpu", "cpu"]
BIG = 2 << 20  # float32 elements: 8 MiB, above the shared-memory threshold
STATE = 300_000  # bytes of small state (no tensor): travels inside the function's own bytes
SMALL_MESSAGE = 16 << 10  # a task message without the function's body, nor any tensor, is smaller than this


def _files() -> list[str]:
    return sorted(glob.glob(f"/dev/shm/nnh-{os.getpid()}-*"))


@pytest.fixture(scope="module")
def ex():
    """One warm 2-worker pool for the tests that do not kill workers."""
    executor = ParallelExecutor(device_ids=CPU2).start()
    yield executor
    executor.shutdown()


@pytest.fixture
def sent(monkeypatch):
    """``(worker pid, bytes)`` of every message the caller writes to a worker, in order."""
    log = []
    real = pipes.send

    def send(conn, process, data, deadline):
        log.append((process.pid, len(data)))
        return real(conn, process, data, deadline)

    monkeypatch.setattr(pipes, "send", send)
    return log


def _sizes(log: list) -> list[int]:
    sizes = [size for _, size in log]
    log.clear()
    return sizes


# ----------------------------------------------------------------------------- large tensors: shared memory
def _sum(w, device):
    return float(w.sum())


def test_large_tensors_in_closures_and_defaults_travel_through_shared_memory(ex, sent):
    big = torch.arange(BIG, dtype=torch.float32)
    model = torch.nn.Linear(1024, 2048)  # an 8 MiB Parameter
    expected = float(big.sum())

    def closure(device):
        return float(big.sum())

    def default(device, w=big):
        return float(w.sum())

    def keyword_default(device, *, w=big):
        return float(w.sum())

    def captured_module(device):
        return isinstance(model.weight, torch.nn.Parameter), model.weight.requires_grad, float(model.weight.detach().sum())

    for fn in (closure, default, keyword_default, functools.partial(_sum, big)):
        assert ex.run(fn) == [expected] * 2, fn
        assert max(_sizes(sent)) < SMALL_MESSAGE, fn  # the 8 MiB went through a file, not the pipe
    weight_sum = float(model.weight.detach().sum())
    # Summed with another number of threads there: a sum of 2M terms near 0 differs in its last bits
    # relative to the terms' size, not to the sum's.
    close = pytest.approx(weight_sum, abs=1e-6 * float(model.weight.detach().abs().sum()))
    assert ex.run(captured_module) == [(True, True, close)] * 2
    assert max(_sizes(sent)) < SMALL_MESSAGE
    assert list(ex.map(lambda x, device: x + float(big[1]), range(4))) == [1.0, 2.0, 3.0, 4.0]
    assert max(_sizes(sent)) < SMALL_MESSAGE
    assert _files() == []  # every file of those calls is gone


def test_each_call_sees_the_tensors_as_they_are_when_it_is_made(ex):
    big, small = torch.zeros(BIG), torch.zeros(4)

    def read_then_scribble(device):
        seen = float(big[0]), float(small[0])
        big.add_(100)  # in the worker: stays in this call, never reaches the caller nor the next call
        small.add_(100)
        return seen

    for i in range(3):
        big[0], small[0] = i, -i  # in place, between calls: the next call must see it
        assert ex.run(read_then_scribble) == [(i, -i)] * 2
    assert float(big[1]) == 0 and float(small[1]) == 0
    big[0] = 7
    assert list(ex.map(lambda x, device: float(big[0]) + x, range(6))) == [7.0 + x for x in range(6)]
    big = torch.full((BIG,), 5.0)  # rebinding the closure's variable: the new tensor travels
    assert ex.run(read_then_scribble) == [(5.0, -2.0)] * 2
    assert _files() == []


def _mapped_files(caller: int, device=None) -> int:
    """In a worker: how many of the caller's files it still maps (unlinked ones too: they hold shared memory)."""
    with open("/proc/self/maps") as f:
        return len({line.split()[-1] for line in f if f"nnh-{caller}-" in line})


def test_a_calls_files_leave_the_workers_memory_even_when_its_function_is_in_a_reference_cycle(ex):
    caller, big = os.getpid(), torch.ones(BIG)

    def ping(device):  # ping and pong refer to each other: a reference cycle holds `big` in the worker
        return pong(device)

    def pong(device):
        assert ping is not None and float(big[0]) == 1.0
        return _mapped_files(caller)

    assert [ex.run(ping) for _ in range(5)] == [[1, 1]] * 5  # its own call's file only, never the earlier ones
    assert ex.run(_mapped_files, caller) == [0, 0]  # the next function's call lets it go


# ----------------------------------------------------------------------------- a function is sent once per worker
def test_a_function_sent_once_is_not_sent_again(ex, sent):
    state = bytes(STATE)

    def f(x, device):
        return x + len(state)

    assert ex.run(f, 1) == [STATE + 1] * 2
    assert all(size > STATE for size in _sizes(sent))  # each worker got the function once
    for _ in range(3):
        assert ex.run(f, 2) == [STATE + 2] * 2
        assert max(_sizes(sent)) < SMALL_MESSAGE  # and now only its digest
    assert list(ex.map(f, range(8), chunksize=2)) == [STATE + x for x in range(8)]
    assert max(_sizes(sent)) < SMALL_MESSAGE


def test_a_different_function_or_a_changed_closure_is_sent_again(ex, sent):
    state = bytearray(STATE)

    def f(device):
        return state[0]

    def g(device):
        return state[0] + 1

    assert ex.run(f) == [0, 0]
    assert min(_sizes(sent)) > STATE
    assert ex.run(g) == [1, 1]  # a different function over the same state
    assert min(_sizes(sent)) > STATE
    state[0] = 9  # changed in place
    assert ex.run(f) == [9, 9]
    assert min(_sizes(sent)) > STATE
    state = bytearray(b"\x03" * STATE)  # rebound
    assert ex.run(f) == [3, 3]
    assert min(_sizes(sent)) > STATE
    assert ex.run(f) == [3, 3]
    assert max(_sizes(sent)) < SMALL_MESSAGE


def test_a_script_function_kept_pickled_still_sees_each_global_as_it_is_now(ex, sent):
    # Sent by value, as a function of a script is; its pickle is kept while its globals are the same objects.
    namespace = {"__name__": "a_script_nobody_can_import", "SCALE": 2, "LOG": []}
    exec("def f(x, device):\n    return x * SCALE\ndef g(device):\n    return len(LOG)", namespace)
    f, g = namespace["f"], namespace["g"]
    assert ex.run(f, 1) == [2, 2]
    assert ex.run(f, 1) == [2, 2]
    namespace["SCALE"] = 5  # rebound between calls
    assert ex.run(f, 1) == [5, 5]
    assert ex.run(g) == [0, 0]
    namespace["LOG"].append("x")  # changed in place
    assert ex.run(g) == [1, 1]
    assert max(_sizes(sent)) < SMALL_MESSAGE


def test_a_kept_function_starts_each_call_with_its_globals_and_cells_as_the_caller_has_them(ex):
    # Functions over nothing mutable are loaded once per worker and copied for each call: the copy must be
    # as fresh as a new load, whatever the previous call rebound.
    namespace = {"__name__": "a_script_nobody_can_import", "calls": 0}
    exec("def bump(device):\n    global calls\n    calls += 1\n    return calls", namespace)

    def counter():
        n = 0

        def step(device, *, by=1):
            nonlocal n
            n += by
            return n

        return step

    bump, step = namespace["bump"], counter()
    for _ in range(3):
        assert ex.run(bump) == [1, 1]
        assert ex.run(step) == [1, 1]
    assert namespace["calls"] == 0


def test_many_functions_are_kept_up_to_the_bound_oldest_out_first(ex, sent):
    def make(i):
        state = bytes([i % 256]) * STATE
        return lambda device: state[0]

    fns = [make(i) for i in range(_transport.FUNCTION_CACHE_SIZE + 8)]
    for i, fn in enumerate(fns):
        assert ex.run(fn) == [i % 256] * 2
    _sizes(sent)
    assert ex.run(fns[-1]) == [len(fns) - 1] * 2  # recent: still held
    assert max(_sizes(sent)) < SMALL_MESSAGE
    assert ex.run(fns[0]) == [0, 0]  # the oldest was dropped by the workers: sent again, and it works
    assert min(_sizes(sent)) > STATE


class _BadOnLoad:
    def __reduce__(self):
        return (_raise_on_load, ())


def _raise_on_load():
    raise RuntimeError("cannot rebuild me here")


def test_a_function_that_fails_to_load_fails_alike_when_only_its_digest_is_sent(ex, sent):
    bad = _BadOnLoad()

    def f(device):
        return bad

    for _ in range(2):
        with pytest.raises(ParallelExecutionError, match="cannot rebuild me here"):
            ex.run(f)
    sizes = _sizes(sent)
    assert len(sizes) == 4 and max(sizes[2:]) <= min(sizes[:2])
    assert ex.run(lambda device: "usable") == ["usable"] * 2


def _wait_dead(pid, within=10.0):
    deadline = time.monotonic() + within
    while pids_alive([pid]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pids_alive([pid]), f"pid {pid} still alive"


@pytest.mark.timeout(90)
def test_a_replaced_worker_gets_the_function_again(sent):
    state = bytes(STATE)
    with ParallelExecutor(device_ids=CPU2) as ex:

        def f(device):
            return os.getpid(), len(state)

        pids = [pid for pid, _ in ex.run(f)]
        os.kill(pids[0], signal.SIGKILL)
        _wait_dead(pids[0])
        sent.clear()
        out = ex.run(f)
        assert out[0][0] not in pids and out[1][0] == pids[1] and [n for _, n in out] == [STATE] * 2
        by_pid = dict(sent)
        assert by_pid[out[0][0]] > STATE  # the new worker holds nothing yet
        assert by_pid[pids[1]] < SMALL_MESSAGE


# ----------------------------------------------------------------------------- nothing left in shared memory
@pytest.mark.timeout(90)
def test_closure_files_are_removed_after_a_failure_a_death_a_timeout_and_shutdown():
    big = torch.ones(BIG)

    def raise_(device):
        raise ValueError(float(big[0]))

    def die(device):
        os._exit(int(big[0]) + 2)

    def hang(device):
        time.sleep(60 * float(big[0]))

    with ParallelExecutor(device_ids=CPU2, timeout=10) as ex:
        with pytest.raises(ParallelExecutionError, match="ValueError: 1.0"):
            ex.run(raise_)
        assert _files() == []
        with pytest.raises(WorkerDiedError, match="exit code 3"):
            ex.run(die)
        assert _files() == []
        with pytest.raises(TimeoutError):
            ex.run(hang)
        assert _files() == []
        with pytest.raises(WorkerDiedError):
            list(ex.map(lambda x, device: die(device), range(4)))
        assert _files() == []
        assert ex.run(lambda device: float(big.sum())) == [float(BIG)] * 2
    assert _files() == []


# ----------------------------------------------------------------------------- the pieces, without processes
def test_the_same_function_in_the_same_state_has_the_same_digest_and_fresh_files():
    encoder = _transport.Encoder(_transport.shm_prefix(f"{os.getpid()}-unit"), private=True)
    big, small = torch.zeros(BIG), torch.zeros(4)

    def f(device):
        return big, small

    first, second = encoder.pack_function(f), encoder.pack_function(f)
    try:
        assert first.digest == second.digest and len(first.body) < SMALL_MESSAGE
        assert len(first.files) == len(first.bindings) == 1 and first.files != second.files
        big[0] = 1  # a large tensor's values are in this call's file, not in the body
        third = encoder.pack_function(f)
        small[0] = 1  # a small tensor's values are in the body: a new function
        fourth = encoder.pack_function(f)
        assert third.digest == first.digest and fourth.digest != first.digest
        loaded = _transport.load_function(third.message(_transport.FunctionCache()), _transport.FunctionCache())
        assert float(loaded(None)[0][0]) == 1.0 and loaded(None)[0].shape == big.shape
    finally:
        for packed in (first, second, third, fourth):
            packed.release()
    assert _files() == []


def test_a_tensor_met_twice_is_one_file_and_one_tensor():
    encoder = _transport.Encoder(_transport.shm_prefix(f"{os.getpid()}-unit"), private=True)
    big = torch.zeros(BIG)
    packed = encoder.pack_function((big, [big]))
    try:
        assert len(packed.files) == 1
        a, (b,) = _transport.load_function(packed.message(_transport.FunctionCache()), _transport.FunctionCache())
        assert a is b
    finally:
        packed.release()


def test_the_twin_caches_agree_and_stay_bounded():
    worker = _transport.FunctionCache(max_functions=3, max_bytes=100)
    twin = _transport.FunctionCache(max_functions=3, max_bytes=100)
    bodies = {name: _transport.PackedFunction(name.encode(), b"x" * size, (), ())
              for name, size in [("a", 10), ("b", 10), ("c", 10), ("d", 10), ("huge", 101), ("e", 60), ("f", 50)]}
    sent_bodies = []
    for name in ["a", "b", "a", "c", "d", "a", "b", "huge", "huge", "e", "f", "a"]:
        message = bodies[name].message(twin)
        sent_bodies.append(name if message[1] is not None else "-")
        digest, body, _, _ = message
        if body is None:
            assert worker.get(digest) is not None, name  # the twin never claims what the worker lacks
        else:
            worker.put(digest, len(body), body)
        assert twin.digests() == worker.digests()
    # "d" evicts "b" (least recently used); "huge" is over the byte bound: never kept, sent every time;
    # "e" then "f" push the total past 100 bytes: the oldest go.
    assert sent_bodies == ["a", "b", "-", "c", "d", "-", "b", "huge", "huge", "e", "f", "a"]
    assert worker.digests() == [b"f", b"a"]


def test_a_digest_the_worker_does_not_hold_is_a_clear_internal_error():
    with pytest.raises(RuntimeError, match="does not hold it"):
        _transport.load_function((b"0" * 16, None, (), False), _transport.FunctionCache())


def test_a_function_that_cannot_be_pickled_leaves_no_file():
    encoder = _transport.Encoder(_transport.shm_prefix(f"{os.getpid()}-unit"), private=True)
    big, lock = torch.zeros(BIG), threading.Lock()

    def f(device):
        return big, lock  # the tensor is written before the lock fails

    with pytest.raises(TypeError, match="function .*f cannot be pickled to send to the workers"):
        _pickle_call(f, True, encoder)
    assert _files() == []
