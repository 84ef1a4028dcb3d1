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
import errno
import gc
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import textwrap
import threading
import weakref
import time

import pytest
import torch

from futures_calls import (CodedError, ErrorAtPickle, add, divide, exits, fail_on, interrupts, make_dummy,  # noqa: F401
                           pid_of, raise_as, sleep_then, square, touch, unpicklable_result, value_once_there)
from helpers import pids_alive, run_command
from nn_handler import ParallelExecutionError, ParallelExecutor, WorkerDiedError
from nn_handler.errors import ConfigurationError

CPU2 = ["cpu", "cpu"]
pytestmark = pytest.mark.timeout(120)


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


@pytest.mark.parametrize("timeout", [0, -1])
def test_a_map_timeout_of_zero_or_less_gives_the_results_ready_when_read(executor, timeout):
    # As concurrent.futures: the deadline is past at once; a result ready when read comes back, one not
    # ready raises TimeoutError without waiting.
    for attempt in range(1, 21):
        results = executor.map(square, [2, 3], timeout=timeout)
        time.sleep(0.2 * attempt)  # (both done by then, however loaded the machine)
        try:
            assert list(results) == [4, 9]
            break
        except TimeoutError:
            continue
    else:
        pytest.fail(f"map(timeout={timeout}) never gave results that were ready")
    begin = time.monotonic()
    late = executor.map(sleep_then, [1.0], [1], timeout=timeout)
    with pytest.raises(TimeoutError):
        next(late)
    assert time.monotonic() - begin < 0.9  # did not wait for it
    time.sleep(max(0.0, begin + 1.5 - time.monotonic()))  # the late task ends before the next test


def test_a_result_the_worker_cannot_pickle_raises_the_pickling_error(executor):
    with pytest.raises(pickle.PicklingError, match="error at pickle"):
        executor.submit(unpicklable_result).result(timeout=60)
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
        executor.submit(threading.Lock).result(timeout=60)
    assert executor.submit(square, 4).result(timeout=60) == 16


def unpicklable_for(x):
    return ErrorAtPickle() if x == "bad" else x


def test_each_item_gets_its_own_outcome_as_each_task_of_the_standard_pool_does(executor):
    # The standard's map has no return_exceptions: a future per item gives each its own outcome. Ours, with
    # return_exceptions, gives the same whatever the chunksize (a chunk of 3 lost its good items).
    items = [1, "bad", 3, 4, "bad", 6]
    if isinstance(executor, ParallelExecutor):
        outcomes = list(executor.map(unpicklable_for, items, chunksize=3, return_exceptions=True))
    else:
        outcomes = [f.exception(timeout=60) or f.result() for f in [executor.submit(unpicklable_for, x) for x in items]]
    assert [o for i, o in enumerate(outcomes) if i not in (1, 4)] == [1, 3, 4, 6], outcomes
    for i in (1, 4):
        assert isinstance(outcomes[i], pickle.PicklingError) and "error at pickle" in str(outcomes[i]), outcomes[i]


def test_map_of_no_iterables_is_empty(executor):
    assert list(executor.map(square)) == []


def _wait_gone(pids, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_alive(pids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pending", ["map kept unread", "map dropped unread", "submit"])
def test_a_dropped_executor_runs_what_was_submitted_then_its_workers_end(kind, pending):
    # As ProcessPoolExecutor: nothing of what the executor handed out (a future, a map's iterator) keeps its
    # workers; dropped without shutdown(), it finishes the tasks submitted, then they end.
    ex = _make(kind)
    pids = sorted(_pids(ex))
    if pending == "submit":
        kept = ex.submit(sleep_then, 0.5, 7)
    else:
        kept = ex.map(sleep_then, [0.5, 0.5, 0.5], [1, 2, 3])
    del ex
    if pending == "map dropped unread":
        del kept
    gc.collect()
    assert not _wait_gone(pids, within=20), f"{pending}: the workers of a dropped {kind} are still up"
    if pending == "submit":
        assert kept.result(timeout=0) == 7  # it ran to the end before they went
    elif pending == "map kept unread":
        assert list(kept) == [1, 2, 3]


def _slow_load(x):
    time.sleep(0.05)
    return x


class SlowToLoad:
    """A result the caller takes a while to unpickle (outside the pool's lock)."""

    def __init__(self, x):
        self.x = x

    def __reduce__(self):
        return _slow_load, (self.x,)


def test_a_map_read_at_once_from_a_dropped_executor_gets_every_result():
    # The executor goes as map() returns, while the reader drives: its shutdown (in a thread of its own)
    # lets every task finish and every result reach the reader, slow to unpickle as they are.
    results = ParallelExecutor(device_ids=CPU2, pass_device=False).map(SlowToLoad, range(20))
    assert list(results) == list(range(20))


def test_a_lazy_map_keeps_its_dropped_executor_until_it_is_read_or_dropped():
    # It submits as it is read (buffersize): its executor lives as long as it may.
    ex = ParallelExecutor(device_ids=CPU2, pass_device=False)
    pids = sorted(_pids(ex))
    results = ex.map(square, range(6), buffersize=1)
    del ex
    gc.collect()
    assert list(results) == [x * x for x in range(6)]
    assert not _wait_gone(pids, within=20)
    ex = ParallelExecutor(device_ids=CPU2, pass_device=False)
    pids = sorted(_pids(ex))
    results = ex.map(square, range(6), buffersize=1)
    del ex
    assert next(results) == 0
    del results  # abandoned half-way: its executor goes with it
    gc.collect()
    assert not _wait_gone(pids, within=20)


@pytest.mark.parametrize("chunksize", [1, 3])
def test_map_holds_no_result_it_has_yielded(executor, chunksize):
    # CPython #14406 (test_free_reference): the caller's loop decides how long a result lives.
    for obj in executor.map(make_dummy, range(10), chunksize=chunksize):
        ref = weakref.ref(obj)
        del obj
        gc.collect()
        assert ref() is None


def test_wait_and_as_completed(executor):
    slow = executor.submit(sleep_then, 1.5, "slow")
    fast = executor.submit(sleep_then, 0.0, "fast")
    done, not_done = cf.wait([slow, fast], timeout=60, return_when=cf.FIRST_COMPLETED)
    assert fast in done
    assert [f.result() for f in cf.as_completed([slow, fast], timeout=60)][-1] == "slow" or slow in done
    done, not_done = cf.wait([slow, fast], timeout=60)
    assert done == {slow, fast} and not not_done


def test_a_tasks_exception_comes_back_as_itself(executor):
    """Its type (the OSError family too), args, attributes and notes: ``except`` and ``e.code`` work as written."""
    with pytest.raises(KeyError) as info:
        executor.submit(raise_as, "key").result(timeout=60)
    assert info.value.args == ("weights",) and str(info.value) == "'weights'"
    with pytest.raises(FileNotFoundError) as info:
        list(executor.map(raise_as, ["missing"]))
    assert (info.value.errno, info.value.filename) == (errno.ENOENT, "/nonexistent/weights.pt")
    assert info.value.strerror == os.strerror(errno.ENOENT)
    with pytest.raises(TimeoutError, match="the device did not answer"):
        executor.submit(raise_as, "timeout").result(timeout=60)
    with pytest.raises(ConnectionResetError) as info:
        executor.submit(raise_as, "reset").result(timeout=60)
    assert info.value.errno == errno.ECONNRESET and info.value.args == (errno.ECONNRESET, "peer went away")
    with pytest.raises(CodedError) as info:
        executor.submit(raise_as, "coded").result(timeout=60)
    assert info.value.code == 429 and info.value.args == ("too many",) and info.value.__notes__[0] == "retry later"
    with pytest.raises(ExceptionGroup) as info:
        executor.submit(raise_as, "group").result(timeout=60)
    assert [type(e) for e in info.value.exceptions] == [ValueError, KeyError]
    assert info.value.message == "two failures"
    for kind, kind_type in (("runtime", RuntimeError), ("plain", Exception)):
        with pytest.raises(kind_type) as info:
            executor.submit(raise_as, kind).result(timeout=60)
        assert info.value.args == (123,) and info.value.code == 7 and info.value.__notes__[0] == "mine"


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


def test_a_slow_done_callback_holds_up_no_other_caller(executor):
    slow_callback = threading.Event()
    future = executor.submit(square, 2)
    future.add_done_callback(lambda f: (slow_callback.set(), time.sleep(5)))
    assert slow_callback.wait(60)  # it sleeps now, in the thread that settled the future
    begin = time.monotonic()
    other = executor.submit(square, 3)
    assert time.monotonic() - begin < 2.5  # (ProcessPoolExecutor: at once)
    assert other.result(timeout=60) == 9
    time.sleep(max(0.0, begin + 5 - time.monotonic()))  # the callback is over before the next test


def test_a_done_callback_may_submit_more(executor):
    submitted = []
    done = threading.Event()

    def callback(future):
        submitted.append(executor.submit(add, future.result(), 1))
        done.set()

    executor.submit(sleep_then, 0.5, 9).add_done_callback(callback)
    assert done.wait(60) and submitted[0].result(timeout=60) == 10
    assert executor.submit(square, 4).result(timeout=60) == 16  # and the executor is not wedged


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


def test_map_runs_every_item_though_its_results_are_never_read(fresh, tmp_path):
    paths = [str(tmp_path / f"{i}") for i in range(50)]
    fresh.map(touch, paths)  # for its side effects
    fresh.shutdown(wait=True)
    assert sorted(os.listdir(tmp_path), key=int) == [str(i) for i in range(50)]


def test_map_results_can_be_read_after_the_with_block(fresh):
    with fresh as ex:
        results = ex.map(square, range(50), chunksize=3)
    assert list(results) == [x * x for x in range(50)]


def test_map_read_while_another_thread_shuts_the_executor_down(fresh):
    results = fresh.map(sleep_then, [0.01] * 200, range(200))
    got = [next(results) for _ in range(5)]
    closer = threading.Thread(target=fresh.shutdown, kwargs={"wait": True})
    closer.start()
    got += list(results)
    closer.join(60)
    assert got == list(range(200)) and not closer.is_alive()


_SUBMIT_THEN_EXIT = textwrap.dedent("""
    import concurrent.futures as cf, multiprocessing as mp, sys, threading, time
    from nn_handler import ParallelExecutor

    def touch(path):
        time.sleep(0.3)
        open(path, "w").close()

    if __name__ == "__main__":
        kind, how, folder = sys.argv[1:]
        if kind == "ProcessPoolExecutor":
            ex = cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"))
        else:
            ex = ParallelExecutor(device_ids=["cpu", "cpu"], pass_device=False)
        def submit_all():
            for i in range(6):
                ex.submit(touch, f"{folder}/s{i}")
            return ex.map(touch, [f"{folder}/m{i}" for i in range(4)])

        if how == "from-a-daemon-thread":  # never joined: its tasks still run
            submitted = threading.Event()
            threading.Thread(target=lambda: (submit_all(), submitted.set(), time.sleep(3600)), daemon=True).start()
            submitted.wait()
        else:
            submit_all()
        if how == "shutdown-without-waiting":
            ex.shutdown(wait=False)
        print("MAIN RETURNS", flush=True)
""")


@pytest.mark.parametrize("how", ["no-shutdown", "shutdown-without-waiting", "from-a-daemon-thread"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_program_does_not_exit_before_the_submitted_tasks_are_done(kind, how, tmp_path):
    # "Regardless of the value of wait, the entire Python program will not exit until all pending futures
    # are done executing." (CPython's test_interpreter_shutdown, test_hang_gh83386)
    script = tmp_path / "submit_then_exit.py"
    script.write_text(_SUBMIT_THEN_EXIT)
    (tmp_path / "out").mkdir()
    result = run_command([sys.executable, str(script), kind, how, str(tmp_path / "out")], timeout=90,
                         quick_exit=False)
    assert result.returncode == 0 and "MAIN RETURNS" in result.stdout, result.stdout[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == [f"m{i}" for i in range(4)] + [f"s{i}" for i in range(6)]


def test_context_manager(fresh):
    with fresh as ex:
        assert ex is fresh
        assert ex.submit(square, 5).result(timeout=60) == 25
    with pytest.raises(RuntimeError):
        fresh.submit(square, 1)


@pytest.mark.parametrize("fn, args, kind", [(exits, (3,), SystemExit), (interrupts, (), KeyboardInterrupt)])
def test_systemexit_or_keyboardinterrupt_from_a_task_is_a_plain_parallel_execution_error(fn, args, kind):
    # Where ParallelExecutor differs from the standard, as docs/executor.md says: raised in the caller, either
    # would end its program (or read as its own Ctrl-C) for what happened in a worker, which is replaced.
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, timeout=60) as ex:
        for call in (lambda: ex.submit(fn, *args).result(timeout=60), lambda: ex.run(fn, *args)):
            before = ex.run(pid_of)
            with pytest.raises(ParallelExecutionError) as info:
                call()
            assert type(info.value) is ParallelExecutionError and not isinstance(info.value, kind)
            assert info.value.failures[0].exc_type == kind.__name__
            assert f"{fn.__name__} failed on rank 0" in str(info.value) and kind.__name__ in str(info.value)
            assert isinstance(info.value.exceptions[0], kind)  # the task's own exception, kept
            assert ex.run(pid_of) != before  # its worker ended, and was replaced


# ----------------------------------------------------------------------------- what ParallelExecutor adds
@pytest.fixture(scope="module")
def ours(request):
    ex = ParallelExecutor(device_ids=CPU2, pass_device=False, timeout=60).start()
    pids = set(ex.run(pid_of))
    request.config._nn_handler_session_pids = getattr(request.config, "_nn_handler_session_pids", set()) | pids
    yield ex
    ex.shutdown()
    assert not pids_alive(list(pids))


def test_map_reads_its_input_lazily(ours):
    consumed = []

    def numbers():
        for i in range(1_000_000):
            consumed.append(i)
            yield i

    results = ours.map(square, numbers(), chunksize=4, buffersize=5)
    assert [next(results) for _ in range(10)] == [i * i for i in range(10)]
    assert len(consumed) <= 4 * (3 + 5)  # the 3 chunks read, 5 ahead of them: not the million
    results.close()  # abandoned: the chunks not started are cancelled
    assert ours.submit(square, 3).result(timeout=60) == 9


def test_map_buffersize_bounds_the_chunks_in_flight(ours):
    consumed = []

    def numbers():
        for i in range(1_000_000):
            consumed.append(i)
            yield i

    results = ours.map(square, numbers(), buffersize=3)
    for i in range(20):
        assert next(results) == i * i
        assert len(consumed) <= i + 1 + 3  # read, plus at most 3 in flight
    results.close()
    with pytest.raises(ConfigurationError, match="buffersize"):
        ours.map(square, [1], buffersize=0)


def test_map_first_result_before_the_last_item_is_done(ours, tmp_path):
    gate = tmp_path / "gate"  # the last item runs until the test opens it (20 s at most)
    results = ours.map(wait_for_file, [str(tmp_path)] * 3 + [str(gate)], [1, 2, 3, 4], timeout=60)
    begin = time.monotonic()
    assert next(results) == 1
    assert time.monotonic() - begin < 15  # did not wait for the last item
    gate.touch()  # it ends now: the next test's run() does not wait for it (it waited out a 30 s sleep)
    results.close()


def test_map_progress_off_a_terminal_writes_plain_lines(ours, capsys, monkeypatch):
    monkeypatch.setattr("nn_handler._progress.INTERVAL_S", 0.0)  # a line per chunk (every few seconds by default)
    assert list(ours.map(square, range(5), progress=True)) == [0, 1, 4, 9, 16]
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 6, err  # one per item, and the last
    assert lines[-1].startswith("square: 5/5 items (100%)") and "elapsed" in lines[-1]


def wait_for_file(path, value):
    """Return ``value`` once ``path`` exists (``"late"`` after 20 s): an item as slow as the test wants."""
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return "late"
        time.sleep(0.01)
    return value


class _Log:
    """Stands for stderr off a terminal; calls ``when(line)`` as each progress line is written."""

    def __init__(self, when):
        self.lines, self.when = [], when

    def write(self, text):
        for line in text.splitlines():
            self.lines.append(line)
            self.when(line)

    def flush(self):
        pass


def test_map_progress_counts_items_as_they_finish_not_as_they_are_read(monkeypatch, tmp_path):
    # A slow first item: the others finish meanwhile, and the progress lines say so while it still runs
    # (they said "0/6" until the first item was done, then jumped). A pool of its own: both workers free.
    gate = tmp_path / "gate"
    log = _Log(lambda line: "5/6 items" in line and gate.touch())  # the 5 quick ones counted: let the first end
    monkeypatch.setattr("nn_handler._progress.INTERVAL_S", 0.0)
    with ParallelExecutor(max_workers=2) as ex:
        ex.run(pid_of)  # both started before the bar is drawn to stderr
        monkeypatch.setattr(sys, "stderr", log)
        out = list(ex.map(wait_for_file, [str(gate)] + [str(tmp_path)] * 5, ["first", 1, 2, 3, 4, 5], progress=True))
    assert out == ["first", 1, 2, 3, 4, 5], (out, log.lines)
    assert [line.split(" items")[0] for line in log.lines] == [f"wait_for_file: {n}/6" for n in range(1, 7)] + \
        ["wait_for_file: 6/6"], log.lines  # named after the function; one line per item done, and the last


def test_map_progress_of_a_failed_map_ends_on_a_line_that_says_so(ours, monkeypatch):
    log = _Log(lambda line: None)
    monkeypatch.setattr(sys, "stderr", log)
    with pytest.raises(ZeroDivisionError):
        list(ours.map(divide, [1, 2, 3, 4, 5], [1, 1, 0, 1, 1], progress=True))
    last = log.lines[-1]
    assert last.startswith("divide: ") and "failed at item 2: ZeroDivisionError: division by zero" in last, last
    assert "left" not in last, last  # no time left to promise
    log.lines.clear()
    out = list(ours.map(divide, [1, 2, 3], [1, 0, 1], progress=True, return_exceptions=True))
    assert isinstance(out[1], ZeroDivisionError)
    assert log.lines[-1].startswith("divide: 3/3 items (100%)") and log.lines[-1].endswith(", 1 failed"), log.lines


def test_map_progress_bar_on_a_terminal(ours, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(ours.map(square, range(50), chunksize=5, progress=True)) == [x * x for x in range(50)]
    out = stream.getvalue()
    assert "50/50" in out and "item/s" in out


def test_run_raises_an_error_of_the_original_type(ours):
    with pytest.raises(ZeroDivisionError) as info:
        ours.run(divide, 1, 0)
    assert isinstance(info.value, ParallelExecutionError) and info.value.args == ("division by zero",)
    assert "divide failed on rank 0 (cpu, pid" in info.value.__notes__[0]  # with rank 1's, root cause first
    assert "raise" not in str(info.value) and "return a / b" in str(info.value.__cause__)


def test_the_error_is_also_a_parallel_execution_error_with_where_it_failed(ours):
    error = ours.submit(raise_as, "coded").exception(timeout=60)
    assert isinstance(error, CodedError) and isinstance(error, ParallelExecutionError)
    assert error.__notes__[0] == "retry later" and re.match(r"raise_as failed on rank \d \(cpu, pid \d+\): "
                                                            r"CodedError: too many", error.__notes__[1])
    assert "raise error" in str(error.__cause__)  # the remote traceback, printed above the local one
    assert error.failures[0].exc_type == "CodedError" and isinstance(error.exceptions[error.failures[0].rank], CodedError)
    again = pickle.loads(pickle.dumps(error))  # it crosses process boundaries as what it is
    assert type(again) is type(error) and again.args == error.args and again.code == 429
    group = ours.submit(raise_as, "group").exception(timeout=60)
    assert isinstance(group, ParallelExecutionError) and group.subgroup(ValueError).exceptions[0].args == (1,)


def _mixed_call(ex, thread, i):
    """One of five kinds of call; returns (what was expected, what came back)."""
    x = thread * 1000 + i
    kind = i % 5
    if kind == 0:
        return [x + 1, x + 1], ex.run(add, x, 1)
    if kind == 1:
        return x * x, ex.submit(square, x).result(timeout=60)
    if kind == 2:
        return [x + j for j in range(7)], list(ex.map(add, [x] * 7, range(7), chunksize=2))
    if kind == 3:
        try:
            ex.submit(fail_on, x, x).result(timeout=60)
        except KeyError as exc:  # its own error, not another caller's
            return f"'item {x}'", str(exc).splitlines()[0].rsplit("KeyError: ", 1)[-1]
        return f"'item {x}'", "no error"
    try:  # a map whose 3rd item fails: the first two come back, then the error
        got = []
        for value in ex.map(fail_on, range(x, x + 5), [x + 2] * 5):
            got.append(value)
    except KeyError:
        got.append("KeyError")
    return [x, x + 1, "KeyError"], got


@pytest.mark.timeout(300)
def test_many_threads_share_the_workers_and_keep_their_results(ours):
    """8 threads x 50 mixed calls (run, submit, map, failing submit, failing map): every result checked."""
    problems, lock = [], threading.Lock()

    def caller(thread):
        for i in range(50):
            try:
                expected, got = _mixed_call(ours, thread, i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                expected, got = "no exception", repr(exc)
            if expected != got:
                with lock:
                    problems.append((thread, i, expected, got))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads)
    assert not problems, problems[:5]


def _die(_=None):
    os._exit(7)


@pytest.mark.timeout(120)
def test_a_worker_that_dies_fails_only_its_task_and_queued_tasks_go_on():
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        before = ex.submit(sleep_then, 0.5, "before")
        doomed = ex.submit(_die)
        queued = [ex.submit(square, i) for i in range(20)]
        with pytest.raises(WorkerDiedError, match="exit code 7"):
            doomed.result(timeout=60)
        assert before.result(timeout=60) == "before"
        assert [f.result(timeout=60) for f in queued] == [i * i for i in range(20)]
        assert len(ex.run(pid_of)) == 2  # replaced


@pytest.mark.timeout(120)
def test_a_timeout_in_one_callers_task_leaves_the_others_alone():
    with ParallelExecutor(device_ids=CPU2, pass_device=False, timeout=3) as ex:
        stuck = ex.submit(sleep_then, 60, "never")
        others = []

        def other_caller():
            others.extend(ex.submit(add, i, 1).result(timeout=60) for i in range(30))

        thread = threading.Thread(target=other_caller)
        thread.start()
        with pytest.raises(TimeoutError, match="3s timeout"):
            stuck.result(timeout=60)
        thread.join(60)
        assert others == [i + 1 for i in range(30)]
        assert ex.run(square, 4) == [16, 16]  # the stuck worker was replaced


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_thread_waiting_on_run_ends_the_other_threads_calls_too():
    # The thread waiting on run() reads the workers' replies itself (no hand-off to the engine thread):
    # Ctrl-C there ends the pool, and a call of another thread fails instead of waiting for ever.
    ex = ParallelExecutor(device_ids=CPU2, pass_device=False)
    try:
        pids = ex.run(pid_of)
        other = ex.submit(sleep_then, 60, "never")
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # to the process: the main thread
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            ex.run(sleep_then, 60, "never")
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerDiedError):
            other.result(timeout=20)
        assert not pids_alive(pids)
    finally:
        ex.shutdown()


def test_result_reads_the_reply_in_the_waiting_thread():
    # A future's result() waited on without a timeout does the engine's work itself, as run() does: the
    # reply is read, and the future settled (its done-callbacks run), in the waiting thread.
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        ex.run(pid_of)
        settled_in = []
        future = ex.submit(sleep_then, 0.5, 7)
        future.add_done_callback(lambda f: settled_in.append(threading.get_ident()))
        assert future.result() == 7
        assert settled_in == [threading.get_ident()]
        timed = ex.submit(sleep_then, 1.0, 8)  # with a timeout too, and it raises on time
        started = time.monotonic()
        with pytest.raises(cf.TimeoutError):
            timed.result(timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 0.9
        assert timed.result(timeout=30) == 8


def test_a_task_nobody_waited_for_is_done_when_looked_at():
    # A submit whose task went straight to a worker calls no other thread in: whoever looks at the
    # future reads the reply. done() after the task has ended says so at once, as does a callback
    # added later, and a wait() or as_completed() over it.
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        ex.run(pid_of)
        future = ex.submit(sleep_then, 0.1, 1)
        time.sleep(1.0)
        assert future.done() and future.result() == 1
        called = threading.Event()
        later = ex.submit(sleep_then, 0.1, 2)
        time.sleep(0.5)
        later.add_done_callback(lambda f: called.set())
        assert called.wait(10)
        pair = [ex.submit(sleep_then, 0.1, 3), ex.submit(sleep_then, 0.1, 4)]
        assert cf.wait(pair, timeout=10).not_done == set()
        more = [ex.submit(sleep_then, 0.1, 5), ex.submit(sleep_then, 0.1, 6)]
        assert sorted(f.result() for f in cf.as_completed(more, timeout=10)) == [5, 6]
        assert isinstance(ex.submit(divide, 1, 0).exception(timeout=10), ZeroDivisionError)


@pytest.mark.timeout(120)
def test_as_completed_while_the_engine_starts_a_queued_task(monkeypatch):
    # as_completed() adds its waiter under each future's lock while the engine starts a queued task (that
    # future's lock, under the pool's): calling the engine in from there must not take the pool lock.
    from nn_handler.utils._workers.calls import CallFuture

    slow = threading.Event()

    def set_running_slowly(future):
        if slow.is_set():
            time.sleep(0.3)  # holding the pool lock: as_completed() below takes the futures' locks meanwhile
        return cf.Future.set_running_or_notify_cancel(future)

    monkeypatch.setattr(CallFuture, "set_running_or_notify_cancel", set_running_slowly)
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        ex.run(pid_of)
        for round_ in range(3):
            first = [ex.submit(sleep_then, 0.2, i) for i in range(2)]  # on the workers: nobody drives yet
            slow.set()
            queued = ex.submit(square, 3)  # started once a reply frees a worker, at about 0.2 s
            time.sleep(0.35)  # the engine is starting it, slowly
            got = sorted(f.result() for f in cf.as_completed([*first, queued], timeout=30))
            slow.clear()
            assert got == [0, 1, 9], round_


def test_ctrl_c_while_result_waits_leaves_the_executor_and_the_task_alone(tmp_path):
    # Ctrl-C reaches the main thread while it waits in the driver's poll, where nothing is half-read:
    # the task goes on, its result can still be had, and the workers are the same.
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        pids = ex.run(pid_of)
        go = tmp_path / "go"
        # The task ends once the Ctrl-C was seen: on a loaded machine the timer may fire late, never after it.
        future = ex.submit(value_once_there, str(go), 7)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            future.result()
        go.touch()
        assert future.result() == 7
        assert ex.run(pid_of) == pids


def test_shutdown_while_another_thread_waits_on_a_result():
    # That thread drives; shutdown(wait=True) waits for the task, the engine thread ends, nothing hangs.
    ex = ParallelExecutor(device_ids=CPU2, pass_device=False)
    pids = ex.run(pid_of)
    future = ex.submit(sleep_then, 1.0, 7)
    got = []
    waiter = threading.Thread(target=lambda: got.append(future.result()), daemon=True)
    waiter.start()
    time.sleep(0.2)  # it is in result(), driving
    ex.shutdown(wait=True)
    waiter.join(30)
    assert got == [7]
    assert ex._pool._engine is None or not ex._pool._engine.is_alive()
    assert not pids_alive(pids)


@pytest.mark.timeout(120)
def test_the_engine_thread_lets_go_once_nothing_is_outstanding():
    # The engine thread, called in by a submit while a caller drives, may get the driver lock only once that
    # caller has settled everything. It must not then poll the idle pool, holding the lock: every later run()
    # would wait on it instead of reading its replies itself.
    # (Which thread gets there first varies: a few rounds make the hand-over happen.)
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        pool = ex._pool
        for round_ in range(4):
            assert ex.run(square, round_) == [round_ ** 2] * 2
            with pool._driver:  # this thread drives, as a caller of run() does
                future = ex.submit(square, 3)  # calls the engine thread in: it waits for the lock
                time.sleep(0.3)  # (the task is outstanding until its reply is read: the engine thread sees it so)
                while not future.done():
                    assert pool._drive_once()
            assert future.result() == 9
            deadline = time.monotonic() + 5
            while _held(pool._driver) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not _held(pool._driver), f"round {round_}"


def test_a_done_callback_may_call_run_and_wait_for_it(ours):
    got = []
    done = threading.Event()

    def callback(future):
        got.append(ours.run(add, future.result(), 1))  # in the thread that settled the future
        done.set()

    future = ours.submit(sleep_then, 0.5, 9)
    future.add_done_callback(callback)
    assert not future.done() or done.wait(0)  # (the callback runs in the engine's thread, not this one)
    assert done.wait(60) and got == [[10, 10]]
    assert ours.run(square, 4) == [16, 16]  # and the executor is not wedged


@pytest.mark.timeout(90)
def test_a_done_callback_may_wait_on_another_futures_result():
    # The callback runs in the thread that reads replies; waiting there on another task's result() reads
    # that task's reply too, instead of waiting for itself.
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        later = ex.submit(sleep_then, 1.0, 5)
        first = ex.submit(sleep_then, 0.1, 1)
        got, done = [], threading.Event()
        first.add_done_callback(lambda f: (got.append(later.result()), done.set()))
        assert done.wait(30) and got == [5]


def _tensor_after(seconds):
    time.sleep(seconds)
    return torch.ones(2)


@pytest.mark.timeout(90)
def test_a_done_callback_calling_run_loses_no_reply_read_in_the_same_round():
    # Two replies read in one round of the engine: a number (its future settled at once, its callback
    # calls run(), which drives from inside the round) and a tensor (loaded after). The tensor's future
    # must still be settled. (Whether both land in one round varies: a few rounds make it happen.)
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        ex.run(pid_of)
        for _ in range(8):
            done = threading.Event()
            number = ex.submit(sleep_then, 0.3, 1)
            tensor = ex.submit(_tensor_after, 0.3)
            number.add_done_callback(lambda f: (ex.run(_tensor_after, 0), done.set()))
            assert cf.wait([number, tensor], timeout=30).not_done == set()
            assert done.wait(30)
            assert tensor.result(timeout=1).tolist() == [1.0, 1.0]


def _held(lock) -> bool:
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


def test_submit_passes_the_device():
    with ParallelExecutor(device_ids=CPU2) as ex:
        assert str(ex.submit(lambda x, device: (x, device), 1).result(timeout=60)[1]) == "cpu"
        assert [str(d) for d in ex.map(lambda device, x: device, [1, 2])] == ["cpu", "cpu"]  # seed style


def test_submit_bad_input_fails_at_the_call():
    ex = ParallelExecutor(device_ids=CPU2)
    with pytest.raises(TypeError, match=r"positional argument 0 of .* \(lock\) cannot be pickled"):
        ex.submit(lambda a, device: a, threading.Lock())
    with pytest.raises(TypeError, match="expected a callable"):
        ex.submit(42)
    assert all(s.process is None for s in ex._pool._slots)
    ex.shutdown()


def test_parallel_predict_draws_its_progress_on_a_terminal(monkeypatch):
    import io
    import sys

    import torch

    from nn_handler.utils.parallel import parallel_predict

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    model = torch.nn.Linear(3, 2)
    x = torch.randn(20, 3)
    out = parallel_predict(model, x, batch_size=4, device_ids=CPU2, progress=True)
    assert torch.allclose(out, model(x), atol=1e-6)
    assert "item/s" in stream.getvalue()


def test_many_cancelled_tasks_are_skipped(tmp_path):
    gate = tmp_path / "gate"
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as ex:
        # The one worker stays busy until every future was cancelled (a fixed sleep ran out under load).
        blocker = ex.submit(wait_for_file, str(gate), "blocker")
        cancelled = [ex.submit(square, i) for i in range(3000)]
        last = ex.submit(square, 12)
        assert all(f.cancel() for f in cancelled)
        gate.touch()
        assert blocker.result(timeout=60) == "blocker" and last.result(timeout=60) == 144


def test_a_run_that_failed_early_leaves_no_task_behind_a_busy_worker():
    with ParallelExecutor(device_ids=CPU2, pass_device=False) as ex:
        busy = ex.submit(sleep_then, 1.5, "busy")  # worker 0: the run's share there waits in the queue
        time.sleep(0.3)
        with pytest.raises(WorkerDiedError, match="exit code 7"):
            ex.run(_die)  # worker 1 dies: the run fails now, its queued share is dropped
        assert busy.result(timeout=60) == "busy"
        assert [ex.submit(square, i).result(timeout=60) for i in range(4)] == [0, 1, 4, 9]
        assert len(ex.run(pid_of)) == 2


def test_a_map_task_past_the_executors_timeout_says_so():
    from nn_handler.errors import ExecutorTimeoutError

    with ParallelExecutor(device_ids=CPU2, pass_device=False, timeout=2) as ex:
        with pytest.raises(ExecutorTimeoutError, match="still running after the 2s timeout"):
            list(ex.map(sleep_then, [0.0, 60.0, 0.0], [1, 2, 3]))
        assert list(ex.map(square, range(4))) == [0, 1, 4, 9]


_SLOW_TO_IMPORT = textwrap.dedent("""
    import time
    time.sleep(4)  # a heavy import (torch, a model zoo) on a loaded machine

    def quick(x):
        return x + 1
""")


def _add_to_path(path):
    sys.path.insert(0, path)


@pytest.mark.timeout(120)
def test_the_timeout_counts_from_when_the_function_starts_not_from_its_modules_first_import(tmp_path):
    (tmp_path / "nnh_slow_to_import.py").write_text(_SLOW_TO_IMPORT)
    sys.path.insert(0, str(tmp_path))
    try:
        import nnh_slow_to_import  # (the caller pays the import too, once)

        with ParallelExecutor(device_ids=["cpu"], pass_device=False, timeout=3, initializer=_add_to_path,
                              initargs=(str(tmp_path),)) as ex:
            assert ex.submit(nnh_slow_to_import.quick, 1).result(timeout=60) == 2  # its first import: 4 s
            with pytest.raises(TimeoutError, match="still running after the 3s timeout"):
                ex.submit(sleep_then, 30, "late").result(timeout=60)  # the function's own time still counts
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("nnh_slow_to_import", None)
