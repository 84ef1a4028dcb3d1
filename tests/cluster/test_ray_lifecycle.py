"""The Ray backend when things around it go wrong: the same outcome as the local backend, never a hang.

Each test that applies to both backends runs the same body on each. The
scripts run in a process of their own: they shut Ray down under an open
executor, or leave one open at exit.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from helpers import run_command  # noqa: E402
from nn_handler import ExecutorTimeoutError, ParallelExecutor, WorkerDiedError  # noqa: E402

BACKENDS = ["local", "ray"]
STARTED = "Started a local Ray instance"  # what ray.init logs each time it starts a Ray


@pytest.fixture(scope="module")
def cluster(local_ray):
    return local_ray


# Bound on a call that starts or restarts an actor (a new Python importing torch): one start took 78 s in CI, on 2
# cores shared with three other pytest workers. Against hangs only.
STARTS = 150


def within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run in a daemon thread: its result or exception; the test fails if it hangs."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def target():
        try:
            outcome.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            outcome.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    try:
        return outcome.result(timeout=seconds)
    except TimeoutError:
        if outcome.done():
            raise  # fn's own timeout error
        pytest.fail(f"{getattr(fn, '__qualname__', fn)} did not return within {seconds}s")


def _exit_when_restarted(marker: str, device):
    """An initializer that works the first time and ends its process every time after (a GPU still held...)."""
    if os.path.exists(marker):
        os._exit(3)
    with open(marker, "w"):
        pass


@pytest.mark.timeout(360)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_initializer_that_kills_the_restarted_worker_fails_the_next_calls(cluster, backend, tmp_path):
    marker = str(tmp_path / "started")
    ex = ParallelExecutor(device_ids=["cpu"], backend=backend, initializer=_exit_when_restarted,
                          initargs=(marker,), timeout=5)
    try:
        assert within(STARTS, ex.run, lambda device: os.getpid())
        with pytest.raises(WorkerDiedError):
            within(STARTS, ex.run, lambda device: os._exit(4))
        # The worker's next start ends its process: the call fails with it at once (no endless restarts),
        # and the executor is broken for good, as a pool whose replacement cannot start.
        with pytest.raises(WorkerDiedError, match="start-up"):
            within(STARTS, ex.run, lambda device: 1)
        with pytest.raises(RuntimeError, match="shut down"):
            within(60, ex.submit, lambda device: 2)
    finally:
        within(60, ex.shutdown)


def numbers(device):
    yield 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_result_that_cannot_be_pickled_is_a_clear_type_error(cluster, backend):
    with ParallelExecutor(device_ids=["cpu"], backend=backend, timeout=60) as ex:
        with pytest.raises(TypeError, match=r"result of <lambda> could not be pickled .*lock") as info:
            ex.run(lambda device: threading.Lock())
        assert "\x1b[" not in str(info.value)  # no terminal colour codes from Ray's own messages
        with pytest.raises(TypeError, match=r"result of numbers could not be pickled .*generator") as info:
            ex.submit(numbers).result(timeout=60)
        assert "\x1b[" not in str(info.value)
        assert ex.run(lambda device: 1) == [1]  # the worker is still there


def test_a_cluster_short_of_resources_is_a_timeout_naming_them(cluster):
    with ParallelExecutor(num_gpus=2, backend="ray") as holder:  # every GPU of the cluster taken
        holder.run(lambda device: None)
        ex = ParallelExecutor(num_gpus=1, backend="ray", timeout=2, start_timeout=5)
        try:
            with pytest.raises(ExecutorTimeoutError, match=r"did not start within 5s.*GPU") as info:
                within(60, ex.start)
            assert "died" not in str(info.value)
        finally:
            ex.shutdown()


RAY_INIT = """
import os
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import ray
from nn_handler import ParallelExecutor
"""


@pytest.mark.timeout(360)
def test_ray_shut_down_under_an_open_executor_is_a_clear_error_and_starts_no_ray():
    script = RAY_INIT + """
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
ex = ParallelExecutor(device_ids=["cpu"], backend="ray")
print("ran", ex.run(lambda device: 1))
ray.shutdown()
for name, attempt in [("submit", lambda: ex.submit(lambda device: 2)), ("run", lambda: ex.run(lambda device: 3))]:
    try:
        attempt()
        print(name, "raised nothing")
    except RuntimeError as exc:
        print(name, "RuntimeError:", exc)
    except Exception as exc:
        print(name, "other:", type(exc).__name__, exc)
ex.shutdown()
print("Ray initialized after:", ray.is_initialized())
"""
    out = run_command([sys.executable, "-c", script], timeout=180).stdout
    assert "ran [1]" in out, out
    assert "submit RuntimeError: Ray was shut down" in out and "run RuntimeError: Ray was shut down" in out, out
    assert "Ray initialized after: False" in out, out
    assert out.count(STARTED) == 1, out  # no Ray started behind the user's back
    assert "Traceback" not in out, out  # nor a thread's traceback printed


@pytest.mark.timeout(360)
def test_an_executor_left_open_at_exit_starts_no_second_ray():
    # Ray's exit hook runs first when something registered its own before Ray was imported (here a
    # temporary directory; nn_handler imports Ray only when an executor asks for it).
    script = """
import os
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import tempfile
scratch = tempfile.TemporaryDirectory()
from nn_handler import ParallelExecutor
ex = ParallelExecutor(device_ids=["cpu"], backend="ray")  # imports Ray and starts a local one
print("ran", ex.run(lambda device: 1), flush=True)
import ray
started = ray.init
def counted_init(*args, **kwargs):
    print("ray.init called again", flush=True)
    return started(*args, **kwargs)
ray.init = counted_init
"""
    result = run_command([sys.executable, "-c", script], timeout=180, quick_exit=False)
    assert result.returncode == 0 and "ran [1]" in result.stdout, result.stdout
    assert "ray.init called again" not in result.stdout and result.stdout.count(STARTED) == 1, result.stdout


def _pid(device):
    return os.getpid()


def test_an_actor_restarted_unseen_is_sent_the_function_again(cluster):
    with ParallelExecutor(device_ids=["cpu"], backend="ray", timeout=60) as ex:
        first = ex.run(_pid)[0]
        os.kill(first, signal.SIGKILL)  # while idle: Ray restarts it and the pool does not see it
        actor, deadline = ex._pool._slots[0].actor, time.monotonic() + 60
        while time.monotonic() < deadline:  # until Ray has the new process answering (asked past the pool)
            try:
                if ray.get(actor.ready.remote(), timeout=10)[1][0] != first:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)
        # The pool sends only the function's digest, which the new process lacks: it asks for the body.
        second = within(STARTS, ex.run, _pid)[0]
        assert second != first and within(STARTS, ex.run, _pid) == [second]


def _draw(device):
    import random

    import torch

    return float(torch.rand(1)), random.random()


@pytest.mark.timeout(360)
def test_actors_are_seeded_as_local_workers_and_the_callers_stream_stays(cluster, monkeypatch):
    import itertools

    import torch

    from nn_handler.utils._workers import server

    def draws(seed: int):
        monkeypatch.setattr(server, "_pools_seeded", itertools.count(), raising=False)  # as a fresh process
        torch.manual_seed(seed)
        with ParallelExecutor(device_ids=["cpu", "cpu"], backend="ray") as ex:
            out = within(120, ex.run, _draw)
        return out, float(torch.rand(1))

    first, after = draws(0)
    assert first[0] != first[1]  # each actor its own stream
    again, _ = draws(0)
    assert again == first  # after the same torch.manual_seed, the same numbers
    other, _ = draws(1)
    assert other[0] != first[0] and other[1] != first[1]
    torch.manual_seed(0)
    assert after == float(torch.rand(1))  # the caller's own stream did not move


def _draw_and_stderr(device):
    """This actor's draws, and what it wrote to its stderr (a log file of Ray's) so far."""
    import random

    import torch

    sys.stderr.flush()
    path = os.readlink("/proc/self/fd/2")
    text = open(path, errors="replace").read() if os.path.isfile(path) else ""
    return (float(torch.rand(1)), random.random()), text


@pytest.mark.timeout(360)
def test_actors_are_seeded_after_their_initializers_imports_without_a_ray_deprecation_warning(cluster):
    import seeds_at_import  # seeds at its top level, in every actor that loads the initializer too

    with ParallelExecutor(device_ids=["cpu", "cpu"], backend="ray", initializer=seeds_at_import.nothing) as ex:
        (first, err_first), (second, err_second) = within(120, ex.run, _draw_and_stderr)
    assert first[0] != second[0] and first[1] != second[1]  # each actor its own streams
    # The seeding read Ray's deprecated actor_id at every actor start ("Use get_actor_id() instead").
    assert "get_actor_id" not in err_first + err_second, err_first + err_second
