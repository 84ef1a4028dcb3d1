"""ParallelExecutor and @parallelize_on_gpus on CPU workers standing in for GPUs."""

from __future__ import annotations

import glob
import os
import pickle
import re
import signal
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

from helpers import run_command
from nn_handler import ParallelExecutionError, ParallelExecutor, WorkerDiedError, parallelize_on_gpus
from nn_handler.errors import DeviceError
from nn_handler.utils import _executor

CPU2 = ["cpu", "cpu"]


def _pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    alive.append(pid)
        except OSError:
            pass
    return alive


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
    assert not _pids_alive(pids)


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
    assert pool.map(lambda device, x: x + 1, [1, 2]) == [2, 3]
    assert pool.run(lambda x, **kw: str(kw["device"]), 1) == ["cpu", "cpu"]


def test_function_without_device_parameter_is_a_clear_error(pool):
    with pytest.raises(TypeError, match="takes no `device` argument but pass_device=True"):
        pool.run(lambda x: x, 1)


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

    out = pool.map(work, range(40), chunksize=3)
    assert [v for v, _ in out] == [x * x for x in range(40)]
    assert len({pid for _, pid in out}) == 2  # both workers took chunks
    assert pool.map(lambda x, device: x, []) == []


def test_map_tensors_in_chunks(pool):
    items = [torch.full((4,), float(i)) for i in range(100)]
    out = pool.map(lambda t, device: t.sum(), items, chunksize=16)
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
        assert ex.map(use, [1, 2, 3]) == [(3, True), (6, True), (9, True)]


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
            print('RESULT', out.tolist(), seen, ex.map(lambda v, device: v + 1, [1, 2]))
    """)
    result = run_command([sys.executable, "-c", code], timeout=90)
    assert result.returncode == 0, result.stdout
    assert "RESULT [3, 6] None [2, 3]" in result.stdout


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


FAILURES = [
    ("raise", _raise_value_error, (), ParallelExecutionError, "ValueError: bad value in worker"),
    ("custom-init-exception", lambda device: (_ for _ in ()).throw(_CustomInitError(7, "x")), (),
     ParallelExecutionError, "_CustomInitError: code 7: x"),
    ("error-at-unpickle", lambda obj, device: obj, (_BadOnLoad(),), ParallelExecutionError, "cannot rebuild me here"),
    ("unpicklable-result", lambda device: threading.Lock(), (), ParallelExecutionError, "could not be pickled"),
    ("os-exit", lambda device: os._exit(3), (), WorkerDiedError, "exit code 3"),
    ("sigkill", lambda device: os.kill(os.getpid(), signal.SIGKILL), (), WorkerDiedError, "SIGKILL"),
]


@pytest.mark.parametrize("name, fn, args, error, text", FAILURES, ids=[f[0] for f in FAILURES])
def test_failures_raise_in_the_caller_and_the_pool_recovers(name, fn, args, error, text):
    with ParallelExecutor(device_ids=CPU2) as ex:
        with pytest.raises(error) as info:
            ex.run(fn, *args)
        assert isinstance(info.value, RuntimeError)
        assert text in str(info.value)
        assert re.search(r"rank \d \(cpu, pid \d+\)", str(info.value))
        assert info.value.failures and info.value.failures[0].device == "cpu"
        pickle.loads(pickle.dumps(info.value))  # the error itself crosses process boundaries
        assert ex.run(lambda device: "still usable") == ["still usable", "still usable"]
    assert _shm_files() == []


def test_remote_exception_objects_and_tracebacks_are_kept():
    with ParallelExecutor(device_ids=CPU2) as ex:
        with pytest.raises(ParallelExecutionError) as info:
            ex.run(_raise_value_error)
    err = info.value
    assert set(err.exceptions) == {0, 1} and all(isinstance(e, ValueError) for e in err.exceptions.values())
    assert "raise ValueError" in err.failures[0].traceback and "--- remote traceback of rank 0 ---" in str(err)


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
        assert new_pids[0] != pids[0] and new_pids[1] == pids[1]  # only the dead one restarted
        assert not _pids_alive([pids[0]])


def test_map_worker_killed_mid_call():
    with ParallelExecutor(device_ids=CPU2) as ex:
        def maybe_die(x, device):
            if x == 5:
                os._exit(9)
            return x

        with pytest.raises(WorkerDiedError, match="exit code 9"):
            ex.map(maybe_die, range(20))
        assert ex.map(lambda x, device: -x, range(6), chunksize=2) == [0, -1, -2, -3, -4, -5]


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
        assert not _pids_alive([pids[0]])


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
    assert not _pids_alive(pids)


def test_dropped_executor_is_cleaned_up():
    ex = ParallelExecutor(device_ids=["cpu"])
    pids = ex.run(lambda device: os.getpid())
    del ex
    import gc

    gc.collect()
    assert not _pids_alive(pids)


def test_using_a_shut_down_executor_is_a_clear_error():
    ex = ParallelExecutor(device_ids=["cpu"])
    ex.shutdown()
    ex.shutdown()  # twice is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        ex.run(lambda device: 1)


# ----------------------------------------------------------------------------- bad input, before any process starts
def _init_with(resource, device):
    pass


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"num_gpus": 0}, ValueError, "num_gpus must be a positive integer, got 0"),
        ({"num_gpus": -2}, ValueError, "num_gpus must be a positive integer"),
        ({"num_gpus": "2"}, ValueError, "num_gpus must be a positive integer"),
        ({"device_ids": []}, DeviceError, "non-empty list"),
        ({"device_ids": "cpu"}, DeviceError, "non-empty list"),
        ({"device_ids": ["tpu"]}, DeviceError, "unknown device id 'tpu'"),
        ({"device_ids": [-1]}, DeviceError, "GPU index must be >= 0"),
        ({"device_ids": ["cpu"], "num_gpus": 2}, ValueError, "disagrees with 1 device_ids"),
        ({"device_ids": ["cpu"], "timeout": -1}, ValueError, "timeout must be a positive number"),
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
        ex.map(lambda x, device: x, [1, 2, lock])
    with pytest.raises(ValueError, match="chunksize must be a positive integer, got 0"):
        ex.map(lambda x, device: x, [1], chunksize=0)
    assert all(s.process is None for s in ex._pool._slots)  # nothing was started
    ex.shutdown()


@pytest.fixture
def fake_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_more_gpus_than_exist(fake_two_gpus):
    with pytest.raises(DeviceError, match="num_gpus=3 but this machine has 2 CUDA devices"):
        ParallelExecutor(num_gpus=3)
    with pytest.raises(DeviceError, match="device id 5 does not exist: this machine has 2 CUDA devices"):
        ParallelExecutor(device_ids=[0, 5])
    with pytest.raises(DeviceError, match="lists a GPU twice"):
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
        assert not _pids_alive([p for p, _ in first]) and len(_executor._warm_pools) == 0
        third = where(torch.tensor([1]))  # and a later call starts a fresh one
        assert [p for p, _ in third] != [p for p, _ in first]
    finally:
        _executor._warm_pools.shutdown_all()
    assert not _pids_alive([p for p, _ in third])


def test_decorator_keep_alive_zero_gives_a_fresh_pool_per_call():
    @parallelize_on_gpus(device_ids=["cpu"], keep_alive=0)
    def pid(device):
        return os.getpid()

    a, b = pid(), pid()
    assert a != b and not _pids_alive(a + b)
    assert len(_executor._warm_pools) == 0


def test_decorator_pool_shuts_down_after_keep_alive():
    @parallelize_on_gpus(device_ids=["cpu"], keep_alive=0.5)
    def pid(device):
        return os.getpid()

    pids = pid()
    deadline = time.monotonic() + 20
    while _pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pids_alive(pids) and len(_executor._warm_pools) == 0


def test_decorator_bare_and_bad_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        @parallelize_on_gpus
        def bare(device):
            return str(device)
    try:
        assert bare() == ["cpu"]
    finally:
        _executor._warm_pools.shutdown_all()
    with pytest.raises(ValueError, match="keep_alive must be >= 0"):
        parallelize_on_gpus(device_ids=CPU2, keep_alive=-1)
    with pytest.raises(ValueError, match="num_gpus must be a positive integer"):
        parallelize_on_gpus(num_gpus=0)


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
        while _pids_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pids_alive(pids), f"workers {pids} outlived their caller ({how})"
        if how == "sigint":
            assert "KeyboardInterrupt" in proc.stdout.read()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def test_missing_main_guard_gets_the_snippet(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("from nn_handler import ParallelExecutor\n"
                      "ParallelExecutor(device_ids=['cpu']).run(lambda device: 1)\n")
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
            print('MAP', ex.map(double, [1, 2, 3]), ex.run(double, torch.ones(1 << 19))[1].sum().item())
        print('WHERE', where())
        where.shutdown()
    """)
    result = run_command([sys.executable, "-"], input=code, timeout=90, cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert "MAP [2, 4, 6] 1048576.0" in result.stdout and "WHERE ['cpu', 'cpu']" in result.stdout, result.stdout


def test_main_module_hidden_restores_the_main_module():
    from nn_handler.utils._worker import main_module_hidden

    main = sys.modules["__main__"]
    before = (getattr(main, "__file__", None), main.__spec__)
    with main_module_hidden():
        assert getattr(main, "__file__", None) is None and main.__spec__ is None
    assert (getattr(main, "__file__", None), main.__spec__) == before
    with main_module_hidden(always=False):  # pytest's main is a real file or module: left alone
        assert (getattr(main, "__file__", None), main.__spec__) == before


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
        assert ex.map(lambda x, device: (x * 2).to(device).sum().item(), [torch.ones(3)] * 4) == [6.0] * 4
