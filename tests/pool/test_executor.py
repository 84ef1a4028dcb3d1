"""ParallelExecutor and @parallelize_on_gpus on CPU workers standing in for GPUs."""

from __future__ import annotations

import functools
import glob
import os
import pickle
import re
import signal
import sys
import textwrap
import threading
import time
import traceback
import typing
import warnings

import pytest
import torch

from helpers import kill_group, pids_alive, run_command
from nn_handler import ParallelExecutionError, ParallelExecutor, WorkerDiedError, parallelize_on_gpus
from nn_handler.errors import ConfigurationError, DeviceError
from nn_handler.utils._workers import executor as _executor
from nn_handler.utils._workers import pipes
from nn_handler.utils._workers import reusable as _reusable

CPU2 = ["cpu", "cpu"]


def _shm_files() -> list[str]:
    return glob.glob(f"/dev/shm/nnh-{os.getpid()}-*")


@pytest.fixture(scope="session")
def pool(request):
    """One warm 2-worker CPU pool for the happy paths (spawning costs seconds)."""
    executor = ParallelExecutor(device_ids=CPU2).start()
    pids = executor.run(lambda device: os.getpid())
    request.config._nn_handler_session_pids = set(pids)
    yield executor
    executor.shutdown()
    assert not pids_alive(pids)


# ----------------------------------------------------------------------------- happy paths
def test_run_returns_one_result_per_device_in_order(pool):
    results = pool.run(lambda x, device: (str(device), x * 2), 21)
    assert results == [("cpu", 42), ("cpu", 42)]
    assert pool.devices == CPU2 and pool.num_workers == 2


def test_closures_lambdas_and_kwargs(pool):
    offset = 10

    def add(a, *, b, device):
        return a + b + offset

    assert pool.run(add, 1, b=2) == [13, 13]


def test_seed_style_device_first_parameter(pool):
    def process_on_gpu(device, data):
        return data.to(device) * 2

    def another_gpu_function(device, x, y):
        return (x + y).to(device)

    def matrix_multiply(device, size=4, iterations=2):
        a = torch.eye(size, device=device)
        for _ in range(iterations):
            a = a @ a
        return a.cpu().numpy()

    assert all(torch.equal(r, torch.tensor([2, 4, 6])) for r in pool.run(process_on_gpu, torch.tensor([1, 2, 3])))
    assert all(torch.equal(r, torch.tensor([4, 6])) for r in pool.run(another_gpu_function, torch.tensor([1, 2]),
                                                                      torch.tensor([3, 4])))
    assert pool.run(matrix_multiply, size=3, iterations=2)[0].shape == (3, 3)
    assert list(pool.map(lambda device, x: x + 1, [1, 2])) == [2, 3]
    assert pool.run(lambda x, **kw: str(kw["device"]), 1) == ["cpu", "cpu"]


def test_function_without_device_parameter_is_a_clear_error(pool):
    with pytest.raises(TypeError, match="takes no `device` argument but pass_device=True") as raised:
        pool.run(lambda x: x, 1)
    # The error stands alone: its traceback shows no internal cache miss ("During handling of ... KeyError").
    assert raised.value.__context__ is None


def test_a_wrapper_that_takes_the_device_itself_is_given_it(pool):
    # The check followed __wrapped__ to the inner (x) and refused the wrapper, whose own signature takes it.
    def scale(x):
        return x * 2

    @functools.wraps(scale)
    def on_device(x, device):
        return scale(x.to(device))

    def seed_style(device, x):
        return str(device), x

    @functools.wraps(seed_style)  # a transparent decorator around a seed-style function: device first, as before
    def timed(*args, **kwargs):
        return seed_style(*args, **kwargs)

    assert [r.tolist() for r in pool.run(on_device, torch.tensor([1]))] == [[2], [2]]
    assert pool.submit(timed, 3).result(timeout=60) == ("cpu", 3)


def test_pass_device_false():
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as ex:
        assert ex.run(lambda: "no device") == ["no device"]


def test_tensors_come_back_detached_on_cpu_nested(pool):
    def make(device):
        w = torch.ones(3, requires_grad=True)
        y = w * 2
        return {"y": y, "pair": (w, [y + 1])}

    out = pool.run(make)[1]
    assert not out["y"].requires_grad and out["y"].device.type == "cpu"
    assert torch.equal(out["pair"][1][0], torch.full((3,), 3.0))
    assert not out["pair"][0].requires_grad


def test_large_tensors_round_trip_through_shared_memory(pool):
    big = torch.arange(1 << 20, dtype=torch.float64)  # 8 MiB: above the shared-memory threshold

    def touch(x, device):
        before = x.clone()
        x += 1  # in place: must not leak into the other worker's copy or the caller's
        return before, x * 2

    results = pool.run(touch, big)
    for before, doubled in results:
        assert torch.equal(before, big)
        assert torch.equal(doubled, (big + 1) * 2)
    assert torch.equal(big, torch.arange(1 << 20, dtype=torch.float64))
    assert _shm_files() == []  # every shared-memory file was unlinked


def test_map_keeps_input_order_and_balances_load(pool):
    def work(x, device):
        time.sleep(0.02 if x % 3 == 0 else 0.0)
        return x * x, os.getpid()

    out = list(pool.map(work, range(40), chunksize=3))
    assert [v for v, _ in out] == [x * x for x in range(40)]
    assert len({pid for _, pid in out}) == 2  # both workers took chunks
    assert list(pool.map(lambda x, device: x, [])) == []


def test_map_tensors_in_chunks(pool):
    items = [torch.full((4,), float(i)) for i in range(100)]
    out = list(pool.map(lambda t, device: t.sum(), items, chunksize=16))
    assert [float(v) for v in out] == [4.0 * i for i in range(100)]


def test_pool_is_warm_module_state_survives(pool):
    def bump(device):
        import builtins

        builtins._nnh_counter = getattr(builtins, "_nnh_counter", 0) + 1
        return os.getpid(), builtins._nnh_counter

    first = pool.run(bump)
    second = pool.run(bump)
    assert [p for p, _ in first] == [p for p, _ in second]  # same processes
    assert [c for _, c in second] == [c + 1 for _, c in first]


def test_cpu_workers_split_the_cores(pool):
    cores = len(os.sched_getaffinity(0))
    assert pool.run(lambda device: torch.get_num_threads()) == [max(1, cores // 2)] * 2


def test_many_calls_leave_nothing_behind(pool):
    for i in range(1000):
        assert pool.run(lambda x, device: x, i) == [i, i]
    assert _shm_files() == []


def test_initializer_runs_once_per_worker_with_its_device():
    def init(tag, device):
        import builtins

        builtins._nnh_model = (tag, str(device), os.getpid())

    def use(device):
        import builtins

        return builtins._nnh_model

    with ParallelExecutor(device_ids=CPU2, initializer=init, initargs=("m",)) as ex:
        a, b = ex.run(use)
        assert a[:2] == ("m", "cpu") and b[:2] == ("m", "cpu") and a[2] != b[2]
        assert ex.run(use) == [a, b]


def test_worker_state_carries_initializer_state_to_later_calls():
    from nn_handler import worker_state

    def load(scale, device):
        worker_state()["model"] = (scale, os.getpid())

    def use(x, device):
        scale, pid = worker_state()["model"]
        return x * scale, pid == os.getpid()

    with ParallelExecutor(device_ids=CPU2, initializer=load, initargs=(3,)) as ex:
        assert ex.run(use, 2) == [(6, True), (6, True)]
        assert list(ex.map(use, [1, 2, 3])) == [(3, True), (6, True), (9, True)]


def test_notebook_style_function_defined_in_main():
    code = textwrap.dedent("""
        import torch
        from nn_handler import ParallelExecutor, worker_state
        FACTOR = {}
        def load(device):              # lives in __main__, like a notebook cell
            worker_state()['factor'] = 3
            FACTOR['f'] = 3            # a copy of the globals: later calls will not see this
        def scale(x, device):
            return x * worker_state()['factor'], FACTOR.get('f')
        with ParallelExecutor(device_ids=['cpu', 'cpu'], initializer=load) as ex:
            out, seen = ex.run(scale, torch.tensor([1, 2]))[1]
            print('RESULT', out.tolist(), seen, list(ex.map(lambda v, device: v + 1, [1, 2])))
    """)
    result = run_command([sys.executable, "-c", code], timeout=90)
    assert result.returncode == 0, result.stdout
    assert "RESULT [3, 6] None [2, 3]" in result.stdout


def _cpu_seconds(device=None):
    return time.process_time()


def test_an_idle_pool_stops_polling_once_the_calls_stop(pool):
    """After a reply, the workers and the waiting caller poll their pipes for a moment instead of
    sleeping at once (a loop of warm calls then wakes no sleeping process); once the calls stop, every
    one of them sleeps: half a second idle costs a fraction of the CPU time a poll left on would."""
    for _ in range(300):
        pool.submit(_cpu_seconds).result()
        pool.run(_cpu_seconds)
    workers, caller = pool.run(_cpu_seconds), time.process_time()
    time.sleep(0.5)
    workers_after, caller_after = pool.run(_cpu_seconds), time.process_time()
    assert caller_after - caller < 0.1
    assert all(after - before < 0.1 for before, after in zip(workers, workers_after)), (workers, workers_after)


# ----------------------------------------------------------------------------- failures
class _CustomInitError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")


class _BadOnLoad:
    def __reduce__(self):
        return (_raise_on_load, ())


def _raise_on_load():
    raise RuntimeError("cannot rebuild me here")


def _raise_value_error(device):
    raise ValueError("bad value in worker")


class _ExitsTheCallerOnLoad:
    def __init__(self, caller):
        self.caller = caller

    def __reduce__(self):
        return (_exit_if_caller, (self.caller,))


def _exit_if_caller(caller):
    if os.getpid() == caller:
        raise SystemExit("unpickled in the caller")
    return _ExitsTheCallerOnLoad(caller)


FAILURES = [
    ("raise", _raise_value_error, (), ParallelExecutionError, "ValueError: bad value in worker"),
    ("custom-init-exception", lambda device: (_ for _ in ()).throw(_CustomInitError(7, "x")), (),
     ParallelExecutionError, "_CustomInitError: code 7: x"),
    ("error-at-unpickle", lambda obj, device: obj, (_BadOnLoad(),), ParallelExecutionError, "cannot rebuild me here"),
    ("unpicklable-result", lambda device: threading.Lock(), (), ParallelExecutionError, "could not be pickled"),
    ("result-exits-at-unpickle", lambda caller, device: _ExitsTheCallerOnLoad(caller), (os.getpid(),), ParallelExecutionError,
     "could not be unpickled in the caller: unpickled in the caller"),
    ("os-exit", lambda device: os._exit(3), (), WorkerDiedError, "exit code 3"),
    ("sigkill", lambda device: os.kill(os.getpid(), signal.SIGKILL), (), WorkerDiedError, "SIGKILL"),
]


@pytest.mark.parametrize("name, fn, args, error, text", FAILURES, ids=[f[0] for f in FAILURES])
def test_failures_raise_in_the_caller_and_the_pool_recovers(name, fn, args, error, text):
    with ParallelExecutor(device_ids=CPU2) as ex:
        with pytest.raises(error) as info:
            ex.run(fn, *args)
        assert isinstance(info.value, RuntimeError)
        assert text in _story(info.value)
        assert re.search(r"rank \d \(cpu, pid \d+\)", _story(info.value))
        assert info.value.failures and info.value.failures[0].device == "cpu"
        pickle.loads(pickle.dumps(info.value))  # the error itself crosses process boundaries
        assert ex.run(lambda device: "still usable") == ["still usable", "still usable"]
    assert _shm_files() == []


def _story(err: BaseException) -> str:
    """What Python prints for the error: its own message and its notes (where, on which process)."""
    return "".join(traceback.format_exception_only(err))


def _result_bad_on_load(_=None, device=None):
    return _BadOnLoad()  # built in the worker; rebuilding it in the caller raises


@pytest.mark.parametrize("how", ["run", "submit", "map"])
def test_a_result_that_cannot_be_unpickled_in_the_caller_is_an_unpickling_error(pool, how):
    # The other side of an argument the worker cannot load (its own error type): catchable as
    # pickle.UnpicklingError, naming the function, and the pool serves the next call.
    calls = {"run": lambda: pool.run(_result_bad_on_load),
             "submit": lambda: pool.submit(_result_bad_on_load).result(timeout=60),
             "map": lambda: list(pool.map(_result_bad_on_load, [0, 1], chunksize=2))}
    with pytest.raises(pickle.UnpicklingError) as info:
        calls[how]()
    err = info.value
    assert isinstance(err, ParallelExecutionError), type(err)
    assert "the result of _result_bad_on_load could not be unpickled in the caller: cannot rebuild me here" \
        in str(err), str(err)
    assert "_raise_on_load" in str(err.__cause__)  # where the load failed
    assert pool.run(lambda device: "still usable") == ["still usable", "still usable"]
    item = list(pool.map(_result_bad_on_load, [0], return_exceptions=True))[0]
    assert isinstance(item, pickle.UnpicklingError) and isinstance(item, ParallelExecutionError), item


class _CountsItsInit(Exception):
    made = 0  # in this process only: the worker counts in its own

    def __init__(self, *args):
        _CountsItsInit.made += 1
        super().__init__(*args)


def _raise_counted(_=None, device=None):
    raise _CountsItsInit("once")


@pytest.mark.parametrize("how", ["run", "submit", "map"])
def test_a_task_exception_is_built_once_in_the_caller(pool, how):
    # ProcessPoolExecutor unpickles a task's exception once: its __init__ runs once in the caller (it ran twice).
    calls = {"run": lambda: pool.run(_raise_counted),
             "submit": lambda: pool.submit(_raise_counted).result(timeout=60),
             "map": lambda: list(pool.map(_raise_counted, [0], return_exceptions=True))[0]}
    _CountsItsInit.made = 0
    try:
        err = calls[how]()
    except _CountsItsInit as raised:
        err = raised
    assert isinstance(err, _CountsItsInit) and err.args == ("once",), err
    assert _CountsItsInit.made == (2 if how == "run" else 1)  # (run: one exception from each worker)


def test_remote_exception_objects_and_tracebacks_are_kept():
    with ParallelExecutor(device_ids=CPU2) as ex:
        with pytest.raises(ParallelExecutionError) as info:
            ex.run(_raise_value_error)
    err = info.value
    assert set(err.exceptions) == {0, 1} and all(isinstance(e, ValueError) for e in err.exceptions.values())
    assert "raise ValueError" in err.failures[0].traceback and "raise ValueError" in str(err.__cause__)
    assert f"--- remote traceback of rank {err.failures[1].rank} ---" in _story(err)  # the other rank's: a note


def test_the_remote_traceback_is_the_cause_of_the_error(pool):
    with pytest.raises(ParallelExecutionError) as info:
        pool.run(_raise_value_error)
    text = "".join(traceback.format_exception(info.value))
    cause, found, own = text.partition("The above exception was the direct cause of the following exception")
    assert found, text
    # The worker's frame, as Python prints it, above the caller's own traceback.
    assert 'raise ValueError("bad value in worker")' in cause and "RemoteTraceback" in cause
    assert "in _raise_value_error" in cause and "ParallelExecutionError" in own
    back = pickle.loads(pickle.dumps(info.value))
    assert isinstance(back.__cause__, type(info.value.__cause__)) and str(back.__cause__) == str(info.value.__cause__)


def test_the_remote_traceback_of_a_function_sent_by_value_names_its_file_line_and_source(pool):
    # A local function travels by value; cloudpickle >= 3.1 renames its file "<dynamic-code>".
    def check(device):
        assert device is None, "no device"  # the failing line

    line = check.__code__.co_firstlineno + 1
    with pytest.raises(ParallelExecutionError) as info:
        pool.run(check)
    text = info.value.failures[0].traceback
    assert f'File "{__file__}", line {line}, in check' in text, text
    assert 'assert device is None, "no device"  # the failing line' in text and "<dynamic-code>" not in text


def test_a_worker_that_died_has_no_remote_traceback_to_show():
    from nn_handler.errors import RankFailure

    err = WorkerDiedError([RankFailure(rank=0, device="cpu", message="worker died (exit code 3)", exitcode=3)])
    assert err.__cause__ is None and "direct cause" not in "".join(traceback.format_exception(err))


def test_death_is_reported_while_other_workers_still_run_and_worker_restarts():
    with ParallelExecutor(device_ids=CPU2) as ex:
        pids = ex.run(lambda device: os.getpid())

        def one_dies(victim, device):
            if os.getpid() == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(2)  # the other keeps working: the error must not wait for it
            return "late"

        with pytest.raises(WorkerDiedError, match=r"rank 0 .*SIGKILL"):
            ex.run(one_dies, pids[0])
        new_pids = ex.run(lambda device: os.getpid())
        # the dead one restarted; the survivor's share of the failed call was stopped with it
        assert new_pids[0] != pids[0] and new_pids[1] != pids[1]
        assert not pids_alive(pids)


class _KillsItsWorkerWhenPickled:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def _a_result_that_kills_its_sender(device):
    # The large tensor's file is written first (a size no earlier result had: a new file, not a spare of theirs).
    return torch.ones((1 << 18) + 4099), _KillsItsWorkerWhenPickled()


def test_a_worker_killed_while_sending_a_result_leaves_no_file_once_its_death_is_handled():
    with ParallelExecutor(device_ids=["cpu"]) as ex:
        with pytest.raises(WorkerDiedError, match="SIGKILL"):
            ex.submit(_a_result_that_kills_its_sender).result(timeout=60)
        # Dropped when the death was handled, not at the pool's next start or shutdown (a hard kill leaked it).
        assert _shm_files() == []


def test_map_worker_killed_mid_call():
    with ParallelExecutor(device_ids=CPU2) as ex:
        def maybe_die(x, device):
            if x == 5:
                os._exit(9)
            return x

        with pytest.raises(WorkerDiedError, match="exit code 9"):
            list(ex.map(maybe_die, range(20)))
        assert list(ex.map(lambda x, device: -x, range(6), chunksize=2)) == [0, -1, -2, -3, -4, -5]


def test_timeout_raises_and_replaces_the_stuck_worker():
    with ParallelExecutor(device_ids=CPU2, timeout=3) as ex:
        pids = ex.run(lambda device: os.getpid())

        def stuck_on_first(first, device):
            if os.getpid() == first:
                time.sleep(120)
            return "ok"

        with pytest.raises(TimeoutError) as info:
            ex.run(stuck_on_first, pids[0])
        assert isinstance(info.value, ParallelExecutionError)
        assert "rank 0" in str(info.value) and "3s timeout" in str(info.value)
        new_pids = ex.run(lambda device: os.getpid())
        assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
        assert not pids_alive([pids[0]])


def test_initializer_failure_raises_and_leaves_nothing():
    def bad_init(device):
        raise OSError("model file missing")

    ex = ParallelExecutor(device_ids=CPU2, initializer=bad_init)
    with pytest.raises(ParallelExecutionError, match="model file missing"):
        ex.start()


def test_exception_in_with_block_ends_workers():
    with pytest.raises(KeyError):
        with ParallelExecutor(device_ids=CPU2) as ex:
            pids = ex.run(lambda device: os.getpid())
            raise KeyError("user error")
    assert not pids_alive(pids)


def test_dropped_executor_is_cleaned_up():
    ex = ParallelExecutor(device_ids=["cpu"])
    pids = ex.run(lambda device: os.getpid())
    del ex
    import gc

    gc.collect()
    assert not pids_alive(pids)


def test_using_a_shut_down_executor_is_a_clear_error():
    ex = ParallelExecutor(device_ids=["cpu"])
    ex.shutdown()
    ex.shutdown()  # twice is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        ex.run(lambda device: 1)


# ----------------------------------------------------------------------------- calls that fail in awkward ways
# Each case: a fresh pool, a hard deadline, then the next call must work and
# nothing may be left behind (processes: the autouse fixture; /dev/shm: here).
def _wait_dead(pid, within=10.0):
    deadline = time.monotonic() + within
    while pids_alive([pid]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pids_alive([pid]), f"pid {pid} still alive"


def _exit_from_a_thread_once_idle(device):
    # Ends the worker from a thread once the worker's main loop waits for the
    # next call: it dies between calls, however fast the next call comes.
    main = threading.main_thread().ident

    def exit_when_idle():
        while sys._current_frames()[main].f_code.co_name != "receive":  # its Inbox, waiting in os.read
            pass
        os._exit(0)

    threading.Thread(target=exit_when_idle, daemon=True).start()
    return os.getpid()


def _sys_exit(device):
    sys.exit("bye")  # the worker reports it, then ends as asked


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["sys-exit", "os-exit-from-thread"])
def test_worker_that_ends_after_replying_is_replaced_before_the_next_call(how):
    ended = []
    with ParallelExecutor(device_ids=CPU2) as ex:
        pids = ex.run(lambda device: os.getpid())
        for _ in range(3):
            if how == "sys-exit":
                with pytest.raises(ParallelExecutionError, match="SystemExit: bye"):
                    ex.run(_sys_exit)
                ended += pids
            else:
                ended += ex.run(_exit_from_a_thread_once_idle)
            pids = ex.run(lambda device: os.getpid())  # at once: no sleep to let the old ones go
            assert len(pids) == 2
            if how == "sys-exit":  # reported as ending: replaced before the next call, every time
                assert not set(pids) & set(ended) and not pids_alive(ended)
        for pid in ended:
            _wait_dead(pid)
        assert len(ex.run(lambda device: os.getpid())) == 2
    assert _shm_files() == []


def _before_the_first_write(ex, after):
    """Run ``after(pids)`` once, right before the next call's first task message is written (after every
    liveness check the call makes)."""
    pool, done = ex._pool, []
    real = pipes.send

    def send(conn, process, data, deadline):
        if not done:
            done.append(True)
            after([s.process.pid for s in pool._slots])
        return real(conn, process, data, deadline)

    pipes.send = send
    return lambda: setattr(pipes, "send", real)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["dead-before-the-write", "dies-with-the-task-unread"])
def test_worker_that_dies_after_the_liveness_check_gets_a_replacement(how):
    with ParallelExecutor(device_ids=CPU2) as ex:
        pids = ex.run(lambda device: os.getpid())

        def kill_first(pids):
            if how == "dead-before-the-write":
                os.kill(pids[0], signal.SIGKILL)
                while pids_alive([pids[0]]):
                    time.sleep(0.01)  # a zombie now: its pipe is closed, nobody has reaped it yet
            else:
                # Frozen now, killed once the call's message sits unread in its pipe.
                os.kill(pids[0], signal.SIGSTOP)
                threading.Timer(1.0, os.kill, (pids[0], signal.SIGKILL)).start()

        restore = _before_the_first_write(ex, kill_first)
        try:
            runs = ex.run(lambda device: os.getpid())  # each worker ran it once, the dead one's share on its replacement
        finally:
            restore()
        assert runs[0] not in pids and runs[1] == pids[1]
        _wait_dead(pids[0])
        assert ex.run(lambda device: os.getpid()) == runs
        restore = _before_the_first_write(ex, lambda pids: os.kill(pids[1], signal.SIGKILL))
        try:  # map: every item still comes back once
            assert list(ex.map(lambda x, device: x * 10, range(6))) == [0, 10, 20, 30, 40, 50]
        finally:
            restore()
        _wait_dead(runs[1])
    assert _shm_files() == []


_WORKER_ONLY_MODULE = """
class WorkerOnlyError(Exception):
    pass

def fail(device):
    raise WorkerOnlyError("raised by a class this caller cannot import")
"""


def _add_to_path(path, device):
    sys.path.insert(0, path)


def _fail_with_worker_only_class(device):
    import nnh_worker_only

    return nnh_worker_only.fail(device)


class _UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("str() of this error fails")


def _raise_unprintable(device):
    raise _UnprintableError("hidden")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["class-only-in-the-worker", "str-raises"])
def test_exception_the_caller_cannot_rebuild_or_render_keeps_the_worker(tmp_path, how):
    (tmp_path / "nnh_worker_only.py").write_text(_WORKER_ONLY_MODULE)
    fn = _fail_with_worker_only_class if how == "class-only-in-the-worker" else _raise_unprintable
    with ParallelExecutor(device_ids=CPU2, initializer=_add_to_path, initargs=(str(tmp_path),)) as ex:
        pids = ex.run(lambda device: os.getpid())
        with pytest.raises(ParallelExecutionError) as info:
            ex.run(fn)
        err = info.value
        if how == "class-only-in-the-worker":
            assert type(err) is ParallelExecutionError  # nothing here to derive from
        else:  # rebuilt here: the error is one too; its notes tell the story though its own __str__ fails
            assert isinstance(err, _UnprintableError) and isinstance(err, ParallelExecutionError)
        text = _story(err) + str(err.__cause__)
        if how == "class-only-in-the-worker":
            assert "WorkerOnlyError: raised by a class this caller cannot import" in text
            assert err.exceptions == {}  # it cannot be rebuilt here; the record stands in for it
        else:
            assert "_UnprintableError: <str() failed: RuntimeError: str() of this error fails>" in text
        assert "Traceback" in str(err.__cause__)
        if type(err) is ParallelExecutionError:  # the traceback is its __cause__, not in its message too: printed once
            assert "--- remote traceback of rank 0 ---" not in str(err)
        assert f"in {fn.__name__}" in text
        assert [f.pid for f in err.failures] == pids
        assert ex.run(lambda device: os.getpid()) == pids  # the same workers serve the next call
    assert _shm_files() == []


def _size(data, device):
    return len(data)


def _throttle_then_kill(pid, stop):
    """Let a frozen worker read a little of its message now and then; kill it once it has read some."""
    def rchar():
        with open(f"/proc/{pid}/io") as f:
            return int(f.readline().split()[1])

    start = rchar()
    while not stop.is_set() and rchar() < start + (4 << 20):
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
def test_worker_killed_while_it_receives_a_large_argument():
    big = b"x" * (64 << 20)  # bytes travel through the pipe (tensors would go through /dev/shm)
    with ParallelExecutor(device_ids=CPU2) as ex:
        pids = ex.run(lambda device: os.getpid())
        os.kill(pids[0], signal.SIGSTOP)
        stop = threading.Event()
        killer = threading.Thread(target=_throttle_then_kill, args=(pids[0], stop))
        killer.start()
        try:
            with pytest.raises(WorkerDiedError, match=r"_size died on rank 0 \(cpu, pid \d+\): worker died during the "
                                                      r"transfer of the call's arguments \(killed by signal SIGKILL"):
                ex.run(_size, big)
        finally:
            stop.set()
            killer.join()
        assert not pids_alive([pids[0]])
        new = ex.run(lambda device: os.getpid())
        assert new[0] != pids[0]
    assert _shm_files() == []


@pytest.mark.timeout(90)
def test_large_argument_to_a_frozen_worker_respects_the_timeout():
    big = b"x" * (64 << 20)
    with ParallelExecutor(device_ids=CPU2, timeout=3) as ex:
        pids = ex.run(lambda device: os.getpid())
        os.kill(pids[0], signal.SIGSTOP)
        begin = time.monotonic()
        with pytest.raises(TimeoutError, match=r"_size died on rank 0 .*had not taken the call's arguments within the 3s timeout; worker replaced"):
            ex.run(_size, big)
        assert time.monotonic() - begin < 3 + 10
        assert not pids_alive([pids[0]])
        assert ex.run(_size, b"abc") == [3, 3]
    assert _shm_files() == []


def _freeze_while_replying(device):
    # Stops this worker in the middle of writing its (large, non-tensor) reply.
    main = threading.main_thread().ident

    def freeze():
        while sys._current_frames()[main].f_code.co_name != "write_message":
            pass
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=freeze, daemon=True).start()
    return b"y" * (128 << 20)


@pytest.mark.timeout(90)
def test_worker_frozen_in_the_middle_of_a_large_reply_respects_the_timeout():
    with ParallelExecutor(device_ids=["cpu"], timeout=3) as ex:
        pids = ex.run(lambda device: os.getpid())
        begin = time.monotonic()
        with pytest.raises(TimeoutError, match=r"_freeze_while_replying died on rank 0 .*3s timeout.*replaced"):
            ex.run(_freeze_while_replying)
        assert time.monotonic() - begin < 3 + 10
        assert not pids_alive(pids)
        assert ex.run(_size, b"abc") == [3]
    assert _shm_files() == []


def _fork_then_die(pid_file, device):
    child = os.fork()
    if child == 0:  # holds a copy of the worker's end of the pipe: no EOF when the worker dies
        time.sleep(60)
        os._exit(0)
    with open(pid_file, "w") as f:
        f.write(str(child))
    os._exit(3)


@pytest.mark.timeout(90)
def test_worker_that_dies_leaving_a_forked_child_is_reported_at_once(tmp_path):
    pid_file = tmp_path / "child.pid"
    with ParallelExecutor(device_ids=["cpu"], timeout=30) as ex:
        try:
            begin = time.monotonic()
            with pytest.raises(WorkerDiedError, match=r"_fork_then_die died on rank 0 .*exit code 3"):
                ex.run(_fork_then_die, str(pid_file))
            assert time.monotonic() - begin < 15  # seen on the sentinel, not by waiting for the pipe's EOF
            assert ex.run(_size, b"ab") == [2]
        finally:
            if pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert _shm_files() == []


def _die_or_linger(victim, marker, device):
    if os.getpid() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(5)
    open(marker, "w").close()  # must never happen: the call failed, this work is stopped


def _raise_or_linger(victim, marker, device):
    if os.getpid() == victim:
        raise ValueError("first")
    time.sleep(5)
    open(marker, "w").close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["worker-died", "fail-fast"])
def test_failed_call_stops_what_it_started_before_the_next_call(tmp_path, how):
    marker = tmp_path / "survivor-finished"
    with ParallelExecutor(device_ids=CPU2, timeout=30) as ex:
        pids = ex.run(lambda device: os.getpid())
        if how == "worker-died":
            with pytest.raises(WorkerDiedError, match=r"^_die_or_linger died on rank 0"):
                ex.run(_die_or_linger, pids[0], str(marker))
        else:  # what NNHandler.launch does: the first error ends the call
            with pytest.raises(ParallelExecutionError, match=r"_raise_or_linger failed on rank 0"):
                ex._run(_raise_or_linger, (pids[0], str(marker)), {}, fail_fast=True)
        _wait_dead(pids[1], within=3)  # the survivor is stopped with its call, not left to finish
        begin = time.monotonic()
        assert len(ex.run(lambda device: os.getpid())) == 2
        assert time.monotonic() - begin < 15  # did not wait behind the failed call's work
    time.sleep(6)
    assert not marker.exists()
    assert _shm_files() == []


@pytest.mark.timeout(90)
def test_initializer_that_hangs_past_the_start_up_bound_is_a_timeout_error():
    from nn_handler.utils._workers.executor import ExecutorTimeoutError

    # start-up's own bound; the task timeout is not it
    ex = ParallelExecutor(device_ids=CPU2, timeout=1, start_timeout=3, initializer=lambda device: time.sleep(120))
    begin = time.monotonic()
    with pytest.raises(ExecutorTimeoutError, match=r"^initializer failed .* its initializer did not finish within "
                                                   r"3s \(the executor's start_timeout") as info:
        ex.start()
    assert isinstance(info.value, TimeoutError) and time.monotonic() - begin < 3 + 20
    assert all(s.process is None for s in ex._pool._slots)
    with ParallelExecutor(device_ids=CPU2, timeout=30) as again:  # a pool of the same kind starts fine
        assert again.run(lambda device: 1) == [1, 1]
    assert _shm_files() == []


# ----------------------------------------------------------------------------- bad input, before any process starts
def _init_with(resource, device):
    pass


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"num_gpus": 0}, ConfigurationError, "num_gpus must be an int >= 1 or None, got 0"),
        ({"num_gpus": -2}, ConfigurationError, "num_gpus must be an int >= 1 or None, got -2"),
        ({"num_gpus": "2"}, ConfigurationError, "num_gpus must be an int >= 1 or None, got '2'"),
        ({"device_ids": []}, DeviceError, "non-empty list"),
        ({"device_ids": "cpu"}, DeviceError, "non-empty list"),
        ({"device_ids": ["tpu"]}, DeviceError, "unknown device 'tpu'"),
        ({"device_ids": [-1]}, DeviceError, "device must be a GPU index >= 0, got -1"),
        ({"device_ids": ["mps"]}, DeviceError, "device 'mps' is not supported here; use a GPU index, 'cpu' or 'cuda:N'"),
        ({"device_ids": ["cpu"], "num_gpus": 2}, ValueError, "disagrees with 1 device_ids"),
        ({"device_ids": ["cpu"], "timeout": -1}, ConfigurationError,
         "timeout must be a number of seconds > 0 or None, got -1"),
        ({"device_ids": ["cpu"], "initializer": 42}, TypeError, "initializer must be callable"),
        ({"device_ids": ["cpu"], "initializer": _init_with, "initargs": (threading.Lock(),)}, TypeError,
         "positional argument 0 of _init_with (lock) cannot be pickled"),
        ({"device_ids": ["cpu"], "initializer": lambda: None}, TypeError, "takes no `device` argument"),
    ],
)
def test_bad_configuration(kwargs, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        ParallelExecutor(**kwargs)


def test_bad_calls_fail_before_any_worker_starts():
    ex = ParallelExecutor(device_ids=CPU2)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="expected a callable"):
        ex.run(42)
    with pytest.raises(TypeError, match=r"positional argument 1 of .*<lambda> \(lock\) cannot be pickled"):
        ex.run(lambda a, b, device: a, 1, lock)
    with pytest.raises(TypeError, match=r"keyword argument 'k' .* cannot be pickled"):
        ex.run(lambda device, k: k, k=lock)
    with pytest.raises(TypeError, match="function .*<lambda>.* cannot be pickled"):
        ex.run(lambda device: lock)  # the closure holds a lock
    with pytest.raises(TypeError, match=r"item 2 \(lock\) cannot be pickled"):
        ex.map(lambda x, device: x, [1, 2, lock])  # the first chunks are pickled at the call
    with pytest.raises(ConfigurationError, match="chunksize must be an int >= 1, got 0"):
        ex.map(lambda x, device: x, [1], chunksize=0)
    for timeout in ("1", float("nan"), True):
        with pytest.raises(ConfigurationError, match=r"timeout must be None or a number of seconds \(0 or less"):
            ex.map(lambda x, device: x, [1], timeout=timeout)
    assert all(s.process is None for s in ex._pool._slots)  # nothing was started
    ex.shutdown()


@pytest.fixture
def fake_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_more_gpus_than_exist(fake_two_gpus):
    with pytest.raises(DeviceError, match="num_gpus=3 but this machine has 2 CUDA devices"):
        ParallelExecutor(num_gpus=3)
    with pytest.raises(DeviceError, match=r"device 5 does not exist: this machine has 2 CUDA devices \(valid ids 0..1\)"):
        ParallelExecutor(device_ids=[0, 5])
    with pytest.raises(DeviceError, match=r"lists cuda:1 twice: \[1, 'cuda:1'\]; give each GPU once"):
        ParallelExecutor(device_ids=[1, "cuda:1"])
    assert ParallelExecutor(device_ids=[1, "cuda:0", "cpu"]).devices == ["cuda:1", "cuda:0", "cpu"]
    assert ParallelExecutor().devices == ["cuda:0", "cuda:1"]


def test_without_cuda_falls_back_to_cpu_workers_with_one_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ParallelExecutor(num_gpus=2).devices == CPU2
        assert ParallelExecutor(device_ids=[0, 2]).devices == CPU2
        assert ParallelExecutor().devices == ["cpu"]
    assert sum(issubclass(w.category, RuntimeWarning) for w in caught) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ParallelExecutor(device_ids=CPU2).devices == CPU2  # asked for CPU: no warning


# ----------------------------------------------------------------------------- the decorator
def test_decorator_reuses_one_warm_pool():
    @parallelize_on_gpus(device_ids=CPU2, keep_alive=30)
    def where(device, data):
        return os.getpid(), data.to(device) * 2

    try:
        first = where(torch.tensor([1, 2, 3]))
        second = where(torch.tensor([1, 2, 3]))
        assert [p for p, _ in first] == [p for p, _ in second]
        assert all(torch.equal(t, torch.tensor([2, 4, 6])) for _, t in second)
        assert where.__name__ == "where"
        where.shutdown()  # ends this pool now, not after keep_alive
        assert not pids_alive([p for p, _ in first]) and len(_reusable._warm_pools) == 0
        third = where(torch.tensor([1]))  # and a later call starts a fresh one
        assert [p for p, _ in third] != [p for p, _ in first]
    finally:
        _reusable._warm_pools.shutdown_all()
    assert not pids_alive([p for p, _ in third])


def test_decorator_keep_alive_zero_gives_a_fresh_pool_per_call():
    @parallelize_on_gpus(device_ids=["cpu"], keep_alive=0)
    def pid(device):
        return os.getpid()

    a, b = pid(), pid()
    assert a != b and not pids_alive(a + b)
    assert len(_reusable._warm_pools) == 0


def test_decorator_pool_shuts_down_after_keep_alive():
    @parallelize_on_gpus(device_ids=["cpu"], keep_alive=0.5)
    def pid(device):
        return os.getpid()

    pids = pid()
    deadline = time.monotonic() + 20
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids_alive(pids) and len(_reusable._warm_pools) == 0


def test_decorator_bare_and_bad_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        @parallelize_on_gpus
        def bare(device):
            return str(device)
    try:
        assert bare() == ["cpu"]
    finally:
        _reusable._warm_pools.shutdown_all()
    with pytest.raises(ConfigurationError, match="keep_alive must be a number of seconds >= 0"):
        parallelize_on_gpus(device_ids=CPU2, keep_alive=-1)
    with pytest.raises(ConfigurationError, match="num_gpus must be an int >= 1 or None"):
        parallelize_on_gpus(num_gpus=0)


def test_decorator_is_typed_without_the_device_it_passes():
    # A type checker sees `f(device, x: int) -> float` decorated as `(x: int) -> list[float]` with .shutdown();
    # tests/launch/test_typing.py runs mypy on a user's script against the installed package.
    P, R, typed = _executor.P, _executor.R, _reusable.ParallelFunction
    hints = [typing.get_type_hints(o, localns={"torch": torch}) for o in typing.get_overloads(parallelize_on_gpus)]
    assert hints[0]["num_gpus"] == typing.Callable[typing.Concatenate[torch.device, P], R]
    assert hints[0]["return"] == typed[P, R]
    assert hints[2]["return"] is _reusable.DeviceDecorator  # the configured decorator, pass_device=True
    call = typing.get_type_hints(typed.__call__)
    assert (call["args"], call["kwargs"], call["return"]) == (P.args, P.kwargs, list[R])
    assert "shutdown" in dir(typed)


# ----------------------------------------------------------------------------- the caller goes away
_CALLER = textwrap.dedent("""
    import os, sys, time
    from nn_handler import ParallelExecutor
    if __name__ == "__main__":
        with ParallelExecutor(device_ids=['cpu', 'cpu']) as ex:
            print('PIDS', *ex.run(lambda device: os.getpid()), flush=True)
            ex.run(lambda device: time.sleep(300))
""")


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_caller_interrupted_or_killed_leaves_no_worker(tmp_path, how):
    import subprocess

    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2, line
        proc.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while pids_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pids_alive(pids), f"workers {pids} outlived their caller ({how})"
        if how == "sigint":
            assert "KeyboardInterrupt" in proc.stdout.read()
    finally:
        kill_group(proc)


def test_missing_main_guard_gets_the_snippet(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("from nn_handler import ParallelExecutor\n"
                      "ParallelExecutor(device_ids=['cpu']).run(lambda device: 1)\n")
    # The workers import the main module, as spawned processes do.
    result = run_command([sys.executable, str(script)], timeout=90)
    assert result.returncode != 0
    # the worker's own error (raised while it imported the script) and the caller's hint
    assert "was started while a worker process was importing your main module" in result.stdout
    assert 'if __name__ == "__main__":' in result.stdout


def test_script_fed_on_stdin_starts_its_workers(tmp_path):
    # `python - < train.py`: __main__.__file__ is "<stdin>", a file the workers
    # cannot import, and need not: functions travel by value. No guard needed.
    code = textwrap.dedent("""
        import torch
        from nn_handler import ParallelExecutor, parallelize_on_gpus

        @parallelize_on_gpus(device_ids=['cpu', 'cpu'])
        def where(device):
            return str(device)

        def double(x, device):
            return x * 2

        with ParallelExecutor(device_ids=['cpu', 'cpu']) as ex:
            print('MAP', list(ex.map(double, [1, 2, 3])), ex.run(double, torch.ones(1 << 19))[1].sum().item())
        print('WHERE', where())
        where.shutdown()
    """)
    result = run_command([sys.executable, "-"], input=code, timeout=90, cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert "MAP [2, 4, 6] 1048576.0" in result.stdout and "WHERE ['cpu', 'cpu']" in result.stdout, result.stdout


def test_a_worker_is_told_the_main_module_to_import_and_the_callers_is_left_as_it_was(monkeypatch, tmp_path):
    from nn_handler.utils._workers import server

    main = sys.modules["__main__"]
    script = tmp_path / "train.py"  # a script run as `python train.py` (pytest's own __main__ may be none)
    script.write_text("")
    monkeypatch.setattr(main, "__file__", str(script), raising=False)
    monkeypatch.setattr(main, "__spec__", None)
    before = (getattr(main, "__file__", None), main.__spec__)
    module = server.inheritance(0, 0)[1]
    assert module and set(module) <= {"init_main_from_name", "init_main_from_path"}, module
    assert server.inheritance(0, 0, main=False)[1] == {}  # NNHandler.launch's ranks: fn travels by value
    assert (getattr(main, "__file__", None), main.__spec__) == before
    monkeypatch.setattr(main, "__spec__", None)
    monkeypatch.setattr(main, "__file__", "<stdin>", raising=False)  # python - < train.py: nothing to import
    assert server.inheritance(0, 0)[1] == {}


# ----------------------------------------------------------------------------- real GPUs
@pytest.mark.gpu
def test_workers_are_pinned_to_their_gpu_and_results_come_back_on_cpu():
    n = torch.cuda.device_count()

    def where(device):
        t = torch.ones(1 << 19, device=device, requires_grad=True) * 2  # 2 MiB: through shared memory
        return torch.cuda.current_device(), str(device), t

    with ParallelExecutor() as ex:
        results = ex.run(where)
        assert [(i, d) for i, d, _ in results] == [(i, f"cuda:{i}") for i in range(n)]
        assert all(t.device.type == "cpu" and not t.requires_grad and float(t[0]) == 2.0 for _, _, t in results)
        assert list(ex.map(lambda x, device: (x * 2).to(device).sum().item(), [torch.ones(3)] * 4)) == [6.0] * 4


# ----------------------------------------------------------------------------- life cycle: Ctrl-C, exit, fork, nesting
_CTRL_C_CALLER = textwrap.dedent("""
    import os, sys, threading, time
    from nn_handler import ParallelExecutor

    TMP = sys.argv[1]

    def mark(device):  # tells the test which worker is where
        open(os.path.join(TMP, str(os.getpid())), "w").close()

    def spin_init(device):  # a compute-bound initializer (loading a model)
        mark(device)
        while True:
            pass

    def spin(device):  # a compute-bound call
        mark(device)
        while True:
            pass

    def linger(device):  # a worker slow to leave: a non-daemon thread outlives "stop"
        threading.Thread(target=time.sleep, args=(300,)).start()
        mark(device)

    def phase(name, body):
        try:
            print(name, flush=True)
            body()
        except KeyboardInterrupt:  # a REPL or notebook lives on after Ctrl-C
            pass
        while True:  # wait for the test to look, whatever Ctrl-C's are still coming
            try:
                print("AFTER", name, flush=True)
                sys.stdin.readline()
                return
            except KeyboardInterrupt:
                pass

    def in_initializer():
        global ex  # a notebook's executor lives in a global: nothing collects it after Ctrl-C
        ex = ParallelExecutor(device_ids=["cpu", "cpu"], initializer=spin_init)
        with ex:  # Ctrl-C inside __enter__: __exit__ never runs
            ex.run(spin)

    def in_call():
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            ex.run(spin)

    def in_shutdown():
        with ParallelExecutor(device_ids=["cpu", "cpu"], initializer=linger) as ex:
            ex.run(lambda device: None)
            print("LEAVING", flush=True)

    def at_start():
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            ex.run(spin)

    if __name__ == "__main__":
        for name, body in [("init", in_initializer), ("call", in_call), ("shutdown", in_shutdown),
                           ("start", at_start)]:
            phase(name, body)
        print("DONE", flush=True)
""")


def _descendant_workers(pid: int) -> list[int]:
    from conftest import live_children

    return pids_alive(live_children(pid))


@pytest.mark.timeout(300)
def test_ctrl_c_at_any_moment_leaves_no_worker(tmp_path):
    """Ctrl-C (to the whole process group, as a terminal sends it) during the initializer, during a call
    (three in a row), during shutdown (twice) and during start-up: no worker survives while the caller
    lives on (a REPL), and the caller ends cleanly."""
    import subprocess

    script = tmp_path / "caller.py"
    script.write_text(_CTRL_C_CALLER)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(marks)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []

    def read_until(prefix, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith(prefix):
                return
        pytest.fail(f"caller never printed {prefix!r}; output:\n{''.join(seen)[-3000:]}")

    def wait_for_marks(n, timeout=90):
        deadline = time.monotonic() + timeout
        while len(os.listdir(marks)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir(marks)) >= n, "the workers never reached the function"
        pids = [int(p) for p in os.listdir(marks)]
        for p in pids:
            os.unlink(marks / str(p))
        return pids

    def ctrl_c(times=1, gap=0.05):
        for _ in range(times):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(gap)

    def check_nothing_left(name, pids):
        read_until(f"AFTER {name}")
        deadline = time.monotonic() + 10
        while (_descendant_workers(proc.pid) or pids_alive(pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = sorted(set(_descendant_workers(proc.pid)) | set(pids_alive(pids)))
        assert not left, f"Ctrl-C during {name}: workers {left} still alive while the caller lives"
        proc.stdin.write("\n")
        proc.stdin.flush()

    try:
        read_until("init")
        pids = wait_for_marks(2)  # both workers are in the initializer
        ctrl_c()
        check_nothing_left("init", pids)

        read_until("call")
        pids = wait_for_marks(2)
        ctrl_c(times=3)
        check_nothing_left("call", pids)

        read_until("shutdown")
        pids = wait_for_marks(2)
        read_until("LEAVING")
        time.sleep(0.5)  # inside __exit__, waiting for the lingering workers to leave
        ctrl_c(times=2, gap=0.3)
        check_nothing_left("shutdown", pids)

        read_until("start")
        time.sleep(0.3)  # while the workers are being created
        ctrl_c(times=4, gap=0.2)
        check_nothing_left("start", [])

        read_until("DONE")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, "".join(seen)[-3000:]
    finally:
        kill_group(proc)
    assert not _descendant_workers(proc.pid)


_EXIT_WITH_DAEMON_THREAD_IN_A_CALL = textwrap.dedent("""
    import os, threading, time
    from nn_handler import ParallelExecutor, parallelize_on_gpus

    @parallelize_on_gpus(device_ids=["cpu"], keep_alive=60)
    def decorated(seconds, device):
        time.sleep(seconds)
        return os.getpid()

    if __name__ == "__main__":
        ex = ParallelExecutor(device_ids=["cpu", "cpu"]).start()
        print("PIDS", *ex.run(lambda device: os.getpid()), *decorated(0), flush=True)
        threading.Thread(target=ex.run, args=(lambda device: time.sleep(300),), daemon=True).start()
        threading.Thread(target=decorated, args=(300,), daemon=True).start()
        time.sleep(1)  # both threads are inside their calls
        print("MAIN RETURNS", flush=True)
""")


def test_interpreter_exit_with_a_daemon_thread_in_a_call_ends_the_workers():
    start = time.monotonic()
    result = run_command([sys.executable, "-c", _EXIT_WITH_DAEMON_THREAD_IN_A_CALL], timeout=60, quick_exit=False)
    assert result.returncode == 0, result.stdout
    assert "MAIN RETURNS" in result.stdout
    pids = [int(p) for p in re.search(r"PIDS (.*)", result.stdout).group(1).split()]
    assert len(pids) == 3 and not pids_alive(pids)
    assert time.monotonic() - start < 45


def test_keep_alive_timer_never_shuts_a_pool_in_use():
    """Thread A's call ends (its release starts the idle timer) while thread B, which already holds the
    same warm pool, is still pickling its argument: the timer must not shut the pool under B."""
    a_returned = threading.Event()

    class SlowToPickle:
        def __reduce__(self):
            a_returned.wait(30)
            time.sleep(0.5)  # 10x keep_alive: the old timer fires here
            return (int, (7,))

    @parallelize_on_gpus(device_ids=["cpu"], keep_alive=0.05)
    def echo(x, seconds, device):
        time.sleep(seconds)
        return x, os.getpid()

    results, errors = {}, []

    def a():
        try:
            results["a"] = echo(1, 1.0)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        a_returned.set()

    def b():
        try:
            results["b"] = echo(SlowToPickle(), 0)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        ta = threading.Thread(target=a)
        ta.start()
        deadline = time.monotonic() + 30
        while len(_reusable._warm_pools) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # A holds the pool
        tb = threading.Thread(target=b)
        tb.start()
        ta.join(60)
        tb.join(60)
        assert not errors, errors
        assert results["a"][0][0] == 1 and results["b"][0][0] == 7
        assert results["a"][0][1] == results["b"][0][1]  # one pool served both
    finally:
        _reusable._warm_pools.shutdown_all()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _exit_in_init(device):
    os._exit(3)


def test_failed_starts_leave_no_fd_and_shutdown_works(monkeypatch):
    import multiprocessing.process

    real_start = multiprocessing.process.BaseProcess.start
    starts, started = [], []

    def second_start_fails(self):
        starts.append(self)
        if len(starts) % 2 == 0:
            raise OSError(11, "Resource temporarily unavailable")  # as fork() under a process limit
        real_start(self)
        started.append(self.pid)

    for attempt in range(4):
        ex = ParallelExecutor(device_ids=CPU2, initializer=_exit_in_init)
        with pytest.raises(WorkerDiedError, match="exit code 3"):
            ex.start()
        ex.shutdown()
        if attempt == 0:
            fds = _fds()
    # Not more: a pool an earlier test left to the garbage collector may close its own meanwhile.
    assert _fds() <= fds
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", second_start_fails)
    for attempt in range(4):
        ex = ParallelExecutor(device_ids=CPU2)
        with pytest.raises(OSError, match="Resource temporarily unavailable"):
            ex.start()
        ex.shutdown()  # no AttributeError
        assert len(started) == attempt + 1 and not pids_alive(started)  # the worker that did start is gone
        if attempt == 0:
            fds = _fds()
    assert _fds() <= fds, "file descriptors leaked by failed starts"


def test_executor_inside_a_worker():
    def nested(device):
        with ParallelExecutor(device_ids=CPU2) as inner:
            return os.getpid(), inner.run(lambda x, device: (x, os.getpid(), os.getppid()), 5)

    with ParallelExecutor(device_ids=["cpu"]) as ex:
        [(outer, inner)] = ex.run(nested)
        assert [x for x, _, _ in inner] == [5, 5]
        inner_pids = [p for _, p, _ in inner]
        assert outer not in inner_pids and len(set(inner_pids)) == 2
        assert not pids_alive(inner_pids)  # the with block inside the worker ended them
    # the worker's own forkserver ends with the worker
    servers = {server for _, _, server in inner}
    deadline = time.monotonic() + 10
    while pids_alive(servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids_alive(servers | {outer})


_FORK_CALLER = textwrap.dedent("""
    import os, sys, threading, time
    from nn_handler import ParallelExecutor, parallelize_on_gpus

    @parallelize_on_gpus(device_ids=["cpu", "cpu"], keep_alive=60)
    def pid(device):
        return os.getpid()

    if __name__ == "__main__":
        ex = ParallelExecutor(device_ids=["cpu"]).start()
        before = pid(), ex.run(lambda device: os.getpid())
        if sys.argv[1] == "busy":  # a thread holds the executor's lock at the fork
            busy = threading.Thread(target=ex.run, args=(lambda device: time.sleep(3),))
            busy.start()
            time.sleep(1)
        child = os.fork()
        if child == 0:
            if sys.argv[1] in ("call", "busy"):  # the child gets its own pool, never the parent's
                mine = pid()
                assert len(mine) == 2 and not set(mine) & set(before[0]), (mine, before)
                try:
                    ex.run(lambda device: 1)
                    sys.exit("the parent's executor ran in the child")
                except RuntimeError as exc:
                    assert "forked" in str(exc), exc
            sys.exit(0)  # a normal exit: atexit hooks and finalizers run in the child
        _, status = os.waitpid(child, 0)
        print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
        if sys.argv[1] == "busy":
            busy.join()
        after = pid(), ex.run(lambda device: os.getpid())
        print("SAME" if after == before else f"CHANGED {before} -> {after}", flush=True)
""")


@pytest.mark.parametrize("child", ["exit", "call", "busy"])
def test_forked_child_never_touches_the_parents_pools(child):
    result = run_command([sys.executable, "-c", _FORK_CALLER, child], timeout=90, quick_exit=False)
    assert result.returncode == 0, result.stdout
    assert "CHILD 0" in result.stdout, result.stdout
    assert "SAME" in result.stdout, result.stdout
    assert "Exception ignored" not in result.stdout and "Traceback" not in result.stdout, result.stdout


_MANY_FINALIZERS = textwrap.dedent("""
    import os, weakref
    from nn_handler import parallelize_on_gpus

    class Thing:
        pass

    @parallelize_on_gpus(device_ids=["cpu"], keep_alive=60)
    def pid(device):
        return os.getpid()

    if __name__ == "__main__":
        things = [Thing() for _ in range(300_000)]
        for thing in things:  # the program's own finalizers: weakref's exit hook walks them for a while
            weakref.finalize(thing, int)
        print("PID", pid(), flush=True)
""")


def test_a_warm_pool_ends_quietly_at_exit_beside_many_finalizers():
    # At exit the warm pool's keep-alive timer is cancelled; its thread, had it held the last reference to the
    # executor, would drop it (its finalizer leaving weakref's registry) while weakref's exit hook walks that
    # registry: "Exception ignored in atexit callback ... dictionary changed size during iteration".
    result = run_command([sys.executable, "-c", _MANY_FINALIZERS], timeout=90, quick_exit=False)
    assert result.returncode == 0 and "PID [" in result.stdout, result.stdout
    assert "Exception ignored" not in result.stdout and "Traceback" not in result.stdout, result.stdout


def test_busy_worker_ends_while_its_dead_caller_is_still_an_unreaped_zombie(tmp_path):
    """A killed caller stays a zombie until its parent (a shell, a notebook server, here the test)
    reaps it; signalling a zombie succeeds, so the worker must not take it for alive and spin on."""
    import subprocess

    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import os
        from nn_handler import ParallelExecutor

        def spin(device):
            print("WORKER", os.getpid(), flush=True)
            while True:
                pass

        if __name__ == "__main__":
            with ParallelExecutor(device_ids=["cpu"]) as ex:
                ex.run(spin)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("WORKER"), line
        worker = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)  # and not reaped: the caller stays a zombie
        deadline = time.monotonic() + 10
        while pids_alive([worker]) and time.monotonic() < deadline:
            time.sleep(0.1)
        with open(f"/proc/{proc.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"  # still unreaped
        assert not pids_alive([worker]), "the worker spins on while its caller is a zombie"
    finally:
        kill_group(proc)
