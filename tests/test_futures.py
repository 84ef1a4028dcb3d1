"""ParallelExecutor as a concurrent.futures.Executor.

The conformance tests are written against the Executor contract and run
against ProcessPoolExecutor (spawn, 2 workers) too, so that they test the
contract and not our reading of it. Then what only ParallelExecutor promises:
lazy map, many caller threads, a worker's death or timeout touching only its
own task.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing as mp
import os
import threading
import time

import pytest

from helpers import pids_alive
from nn_handler import ParallelExecutionError, ParallelExecutor, WorkerDiedError

CPU2 = ["cpu", "cpu"]
pytestmark = pytest.mark.timeout(120)


# Module-level: ProcessPoolExecutor pickles functions by reference.
def square(x):
    return x * x


def add(a, b=0):
    return a + b


def divide(a, b):
    return a / b


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def fail_on(x, bad):
    if x == bad:
        raise KeyError(f"item {x}")
    return x


def pid_of(_=None):
    return os.getpid()


def _make(kind):
    if kind == "ProcessPoolExecutor":
        return cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"))
    return ParallelExecutor(device_ids=CPU2, pass_device=False)


def _pids(executor) -> set[int]:
    if isinstance(executor, ParallelExecutor):
        return set(executor.run(pid_of))
    list(executor.map(sleep_then, [0.2, 0.2], [0, 0]))  # both workers exist
    return set(executor._processes)


KINDS = ["ProcessPoolExecutor", "ParallelExecutor"]


@pytest.fixture(scope="module", params=KINDS)
def executor(request):
    """One warm executor of each kind for the tests that leave its workers as they were."""
    ex = _make(request.param)
    pids = _pids(ex)
    request.config._nn_handler_session_pids = getattr(request.config, "_nn_handler_session_pids", set()) | pids
    yield ex
    ex.shutdown(wait=True)
    assert not pids_alive(list(pids))


@pytest.fixture(params=KINDS)
def fresh(request):
    """A new executor of each kind, for the tests that shut it down."""
    ex = _make(request.param)
    yield ex
    ex.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- the Executor contract
def test_is_an_executor(executor):
    assert isinstance(executor, cf.Executor)


def test_submit_returns_a_future_with_the_result(executor):
    future = executor.submit(add, 2, b=3)
    assert isinstance(future, cf.Future)
    assert future.result(timeout=60) == 5
    assert future.done() and not future.cancelled() and future.exception() is None


def test_exception_reaches_the_future_as_its_own_type(executor):
    future = executor.submit(divide, 1, 0)
    with pytest.raises(ZeroDivisionError):
        future.result(timeout=60)
    assert isinstance(future.exception(), ZeroDivisionError)
    assert executor.submit(divide, 6, 3).result(timeout=60) == 2  # still usable


def test_map_yields_in_input_order(executor):
    results = executor.map(sleep_then, [0.3, 0.0, 0.1, 0.0], ["a", "b", "c", "d"])
    assert not isinstance(results, list)
    assert list(results) == ["a", "b", "c", "d"]
    assert list(executor.map(square, range(20), chunksize=3)) == [x * x for x in range(20)]
    assert list(executor.map(square, [])) == []


def test_map_stops_at_the_shortest_iterable(executor):
    assert list(executor.map(add, [1, 2, 3], [10, 20])) == [11, 22]


def test_map_raises_at_the_failing_item(executor):
    results = executor.map(fail_on, range(6), [3] * 6)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="item 3"):
        next(results)


def test_map_timeout(executor):
    begin = time.monotonic()
    results = executor.map(sleep_then, [0.0, 1.5], [1, 2], timeout=0.5)
    with pytest.raises(TimeoutError):
        list(results)
    assert executor.submit(square, 3).result(timeout=60) == 9
    time.sleep(max(0.0, begin + 2.0 - time.monotonic()))  # the late task ends before the next test


def test_wait_and_as_completed(executor):
    slow = executor.submit(sleep_then, 1.5, "slow")
    fast = executor.submit(sleep_then, 0.0, "fast")
    done, not_done = cf.wait([slow, fast], timeout=60, return_when=cf.FIRST_COMPLETED)
    assert fast in done
    assert [f.result() for f in cf.as_completed([slow, fast], timeout=60)][-1] == "slow" or slow in done
    done, not_done = cf.wait([slow, fast], timeout=60)
    assert done == {slow, fast} and not not_done


def test_add_done_callback(executor):
    seen = threading.Event()
    got = []

    def callback(future):
        got.append(future.result())
        seen.set()

    future = executor.submit(square, 7)
    future.add_done_callback(callback)
    assert seen.wait(60) and got == [49]
    future.add_done_callback(lambda f: got.append("again"))  # on a done future: called at once
    assert got == [49, "again"]


def test_cancel_a_queued_task(executor):
    blockers = [executor.submit(sleep_then, 1.0, i) for i in range(2)]
    queued = [executor.submit(square, i) for i in range(8)]
    assert queued[-1].cancel()
    assert queued[-1].cancelled()
    with pytest.raises(cf.CancelledError):
        queued[-1].result()
    assert [f.result(timeout=60) for f in blockers + queued[:-1]] == [0, 1] + [i * i for i in range(7)]
    assert not blockers[0].cancel()  # done: too late to cancel


def test_asyncio(executor):
    async def main():
        loop = asyncio.get_running_loop()
        a = await loop.run_in_executor(executor, square, 4)
        b = await asyncio.wrap_future(executor.submit(add, 1, 2))
        c = await asyncio.gather(*(loop.run_in_executor(executor, square, i) for i in range(5)))
        return a, b, c

    assert asyncio.run(asyncio.wait_for(main(), 60)) == (16, 3, [0, 1, 4, 9, 16])


def test_shutdown_waits_for_pending_futures(fresh):
    futures = [fresh.submit(sleep_then, 0.2, i) for i in range(5)]
    fresh.shutdown(wait=True)
    assert [f.result(timeout=0) for f in futures] == list(range(5))
    with pytest.raises(RuntimeError):
        fresh.submit(square, 1)


def test_shutdown_cancel_futures(fresh):
    blockers = [fresh.submit(sleep_then, 1.0, i) for i in range(2)]
    time.sleep(0.3)  # the workers (started on demand) hold the blockers
    queued = [fresh.submit(square, i) for i in range(10)]
    fresh.shutdown(wait=True, cancel_futures=True)
    assert queued[-1].cancelled()
    assert all(f.done() for f in blockers + queued)
    assert [f.result() for f in blockers] == [0, 1]


def test_shutdown_without_waiting(fresh):
    futures = [fresh.submit(sleep_then, 0.2, i) for i in range(3)]
    fresh.shutdown(wait=False)
    with pytest.raises(RuntimeError):
        fresh.submit(square, 1)
    assert [f.result(timeout=60) for f in futures] == [0, 1, 2]  # what was submitted still runs


def test_context_manager(fresh):
    with fresh as ex:
        assert ex is fresh
        assert ex.submit(square, 5).result(timeout=60) == 25
    with pytest.raises(RuntimeError):
        fresh.submit(square, 1)
