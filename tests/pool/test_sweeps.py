"""Sweeps as people run them: ``max_workers``, ``map(return_exceptions=True)`` and ``fn.map`` of the decorator."""

from __future__ import annotations

import functools
import os
import threading

import pytest

from helpers import pids_alive
from nn_handler import ParallelExecutionError, ParallelExecutor, WorkerDiedError, parallelize_on_gpus
from nn_handler.errors import ConfigurationError, RemoteTraceback

pytestmark = pytest.mark.timeout(120)


def pid_of():
    return os.getpid()


def score(lr):
    if lr < 0:
        raise ValueError(f"negative learning rate {lr}")
    return lr * 10


def score_or_die(lr):
    if lr == 13:
        os._exit(3)
    return score(lr)


def where(x, device):
    return x, str(device)


def lock_for(x):
    return threading.Lock() if x == "lock" else x  # a result no worker can pickle


def ends_on(x, how):
    if x == "end":
        raise how("the task ends its worker")
    return x, os.getpid()


def takes_a_device(x, device):
    return x, str(device)


def takes_a_device_by_keyword(x, *, device):
    return x, str(device)


def has_a_default_device(x, device="cpu"):
    return x, str(device)


def with_device(fn):
    """A decorator that supplies the device itself (as gin's @configurable or a hand-written one would)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, device="cpu", **kwargs)
    return wrapper


@with_device
def given_its_device_by_a_wrapper(x, device):
    return x, str(device)


@pytest.fixture(scope="module")
def pool():
    ex = ParallelExecutor(max_workers=2, timeout=60).start()
    pids = ex.run(pid_of)
    yield ex
    ex.shutdown()
    assert not pids_alive(pids)


# ----------------------------------------------------------------------------- max_workers
def test_max_workers_is_n_cpu_workers_whose_functions_take_no_device(pool):
    assert pool.devices == ["cpu", "cpu"] and pool.num_workers == 2 and not pool.pass_device
    assert pool.submit(pow, 2, 10).result() == 1024  # pow takes no device
    assert list(pool.map(score, [1, 2, 3])) == [10, 20, 30]


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_workers=2, num_gpus=2), ["max_workers=2", "num_gpus=2"]),
    (dict(max_workers=3, device_ids=["cpu", "cpu"]), ["max_workers=3", "device_ids=['cpu', 'cpu']"]),
])
def test_max_workers_with_another_pool_size_is_a_configuration_error(kwargs, words):
    with pytest.raises(ConfigurationError) as info:
        ParallelExecutor(**kwargs)
    assert all(word in str(info.value) for word in words) and "give" in str(info.value)


def test_max_workers_agreeing_with_device_ids_passes_the_device_as_before():
    ex = ParallelExecutor(max_workers=2, device_ids=["cpu", "cpu"])  # (nothing started)
    assert ex.devices == ["cpu", "cpu"] and ex.pass_device
    ex.shutdown()


@pytest.mark.parametrize("bad", [0, -1])
def test_max_workers_below_one_says_what_the_standard_says(bad):
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):  # ProcessPoolExecutor's words
        ParallelExecutor(max_workers=bad)


@pytest.mark.parametrize("fn, call", [
    (takes_a_device, lambda pool, fn: pool.map(fn, [1, 2], return_exceptions=True)),
    (takes_a_device, lambda pool, fn: pool.map(fn, [1, 2], chunksize=2)),
    (takes_a_device_by_keyword, lambda pool, fn: pool.map(fn, [1, 2], ["cpu", "cpu"])),
    (takes_a_device, lambda pool, fn: pool.submit(fn, 1)),
    (takes_a_device_by_keyword, lambda pool, fn: pool.submit(fn, 1, "cpu")),
    (takes_a_device, lambda pool, fn: pool.run(fn, 1)),
], ids=["map-return_exceptions", "map", "map-keyword-only", "submit", "submit-keyword-only", "run"])
def test_a_function_that_needs_a_device_in_a_pool_that_passes_none_is_told_so_at_the_call(pool, fn, call):
    # max_workers alone calls functions without a device (as ProcessPoolExecutor does): a sweep function written
    # for device_ids=[...] failed on every item with the bare "missing 1 required positional argument: 'device'".
    with pytest.raises(TypeError) as info:
        call(pool, fn)
    text = str(info.value)
    assert f"{fn.__name__} needs a `device` argument" in text and "pass_device=True" in text, text
    assert "device_ids" in text and "default" in text, text


def test_a_wrapper_that_supplies_the_device_is_not_refused(pool):
    # The check read the wrapped function's signature (x, device) through __wrapped__ and refused the call,
    # which works: the wrapper's own (*args, **kwargs) is what the worker calls.
    assert pool.submit(given_its_device_by_a_wrapper, 1).result(timeout=60) == (1, "cpu")
    assert list(pool.map(given_its_device_by_a_wrapper, [1, 2])) == [(1, "cpu"), (2, "cpu")]
    assert list(pool.map(given_its_device_by_a_wrapper, [3], return_exceptions=True)) == [(3, "cpu")]


def test_a_function_given_its_device_by_the_caller_or_by_default_runs_without_one(pool):
    assert pool.submit(takes_a_device, 1, "cpu").result(timeout=60) == (1, "cpu")
    assert pool.submit(takes_a_device, 1, device="cpu").result(timeout=60) == (1, "cpu")
    assert list(pool.map(takes_a_device, [1, 2], ["cpu", "cpu"])) == [(1, "cpu"), (2, "cpu")]
    assert list(pool.map(has_a_default_device, [1], return_exceptions=True)) == [(1, "cpu")]
    assert pool.run(takes_a_device_by_keyword, 1, device="cpu") == [(1, "cpu"), (1, "cpu")]


# ----------------------------------------------------------------------------- return_exceptions
@pytest.mark.parametrize("chunksize", [1, 3])
def test_return_exceptions_yields_each_items_result_or_its_error_in_order(pool, chunksize):
    out = list(pool.map(score, [1, -2, 3, 4, -5, 6], chunksize=chunksize, return_exceptions=True))
    assert [o for i, o in enumerate(out) if i not in (1, 4)] == [10, 30, 40, 60]  # the rest of a chunk too
    for i, lr in ((1, -2), (4, -5)):
        err = out[i]
        assert isinstance(err, ValueError) and isinstance(err, ParallelExecutionError), err
        assert err.args == (f"negative learning rate {lr}",)
        assert isinstance(err.__cause__, RemoteTraceback) and "score" in err.__cause__.tb
    with pytest.raises(ValueError):  # without it: the first failure ends the map, as before
        list(pool.map(score, [1, -2, 3]))


@pytest.mark.parametrize("chunksize", [1, 3])
def test_return_exceptions_a_result_that_cannot_be_pickled_fails_only_its_item(pool, chunksize):
    # As ProcessPoolExecutor gives it per item: the pickling error for that one, the others' results.
    out = list(pool.map(lock_for, ["lock", 3, 4, "lock", 5], chunksize=chunksize, return_exceptions=True))
    assert out[1:3] == [3, 4] and out[4] == 5, out
    for err in (out[0], out[3]):
        assert isinstance(err, TypeError) and isinstance(err, ParallelExecutionError), err
        assert "the result of lock_for could not be pickled" in str(err), str(err)  # the function's own name


def test_return_exceptions_an_item_that_ends_its_worker_fails_only_that_item():
    # SystemExit or KeyboardInterrupt raised by one item of a chunk: that item's error (a plain
    # ParallelExecutionError, as without chunks), the rest of the chunk its results; the worker is replaced.
    with ParallelExecutor(max_workers=1, timeout=60) as ex:
        for how in (SystemExit, KeyboardInterrupt):
            out = list(ex.map(ends_on, [1, "end", 3], [how] * 3, chunksize=3, return_exceptions=True))
            (first, pid), err, (third, same) = out
            assert (first, third) == (1, 3) and pid == same, out
            assert type(err) is ParallelExecutionError and err.failures[0].exc_type == how.__name__, err
            assert isinstance(err.exceptions[0], how) and "ends_on failed on rank 0" in str(err)
            assert ex.submit(os.getpid).result(timeout=60) != pid  # it ended its worker: a fresh one now
            assert not pids_alive([pid])


@pytest.mark.parametrize("option", ["return_exceptions", "progress"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_map_switches_must_be_true_or_false(pool, option, value):
    with pytest.raises(ConfigurationError, match=f"{option} must be True or False, got {value!r}"):
        pool.map(score, [1, 2], **{option: value})


def test_return_exceptions_over_several_iterables(pool):
    out = list(pool.map(divmod, [7, 1], [2, 0], return_exceptions=True))
    assert out[0] == (3, 1) and isinstance(out[1], ZeroDivisionError)


def test_return_exceptions_a_dead_worker_fails_only_its_item():
    with ParallelExecutor(max_workers=2, timeout=60) as ex:
        out = list(ex.map(score_or_die, [1, 13, 2, 3], return_exceptions=True))
        assert out[0] == 10 and out[2:] == [20, 30]
        assert isinstance(out[1], WorkerDiedError) and "exit code 3" in str(out[1])


# ----------------------------------------------------------------------------- fn.map
def test_decorated_function_map_spreads_one_call_per_item_over_its_warm_workers(capsys, monkeypatch):
    monkeypatch.setattr("nn_handler._progress.INTERVAL_S", 0.0)

    @parallelize_on_gpus(device_ids=["cpu", "cpu"], keep_alive=30)
    def trial(x, device):
        if x == 3:
            raise KeyError(x)
        return x * x, str(device), os.getpid()

    try:
        out = list(trial.map(range(6), chunksize=2, progress=True, return_exceptions=True))
        assert [o[0] for i, o in enumerate(out) if i != 3] == [0, 1, 4, 16, 25]
        assert {o[1] for i, o in enumerate(out) if i != 3} == {"cpu"}
        assert isinstance(out[3], KeyError) and isinstance(out[3], ParallelExecutionError)
        err = capsys.readouterr().err
        assert "trial: 6/6 items (100%), " in err and ", 1 failed" in err.splitlines()[-1], err
        pids = {o[2] for i, o in enumerate(out) if i != 3}
        assert pids <= {p for _, _, p in trial(0)}  # the decorator's own warm workers
        with pytest.raises(KeyError):
            list(trial.map([1, 3]))
    finally:
        trial.shutdown()
    assert not pids_alive(list(pids))


def test_decorated_function_map_with_a_fresh_pool_each_time():
    fresh = parallelize_on_gpus(device_ids=["cpu"], keep_alive=0)(where)
    assert list(fresh.map([1, 2])) == [(1, "cpu"), (2, "cpu")]
