"""Ray clusters for the tests of backend="ray": one Ray per test module, nothing of Ray left at the end.

The directory is skipped where Ray is not installed (each module asks for it
with ``pytest.importorskip``). It is not called ``tests/ray``: ``tests`` is on
``sys.path``, and a ``ray`` directory there would shadow the ``ray`` package.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import driver_path_env

# Ray 2.5x asks for a token unless told otherwise; these clusters live inside the test process.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Every ray.init without an address (the modules', their scripts', the executor's) starts a Ray of its own, as on a
# machine with no other Ray: by default it joins the cluster last made by `ray start` or ray.cluster_utils (the
# two-node test's, or one a developer left running) when that is still up.
os.environ["RAY_ADDRESS"] = "local"

# The suite's hard deadline for a test here that names none (setup.cfg: 120 s). A Ray actor's start or restart is a
# new Python that imports torch: on 2 cores shared with three other pytest workers, one took 78 s in CI, and a test
# that starts two and restarts one ran past 120 s. The bound is there against hangs, never as a speed promise.
CLUSTER_TIMEOUT = 360

RAY_DAEMONS = (b"raylet", b"gcs_server", b"dashboard", b"log_monitor", b"monitor.py", b"runtime_env_agent",
               b"default_worker", b"ray::")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.path).startswith(here + os.sep) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CLUSTER_TIMEOUT))


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in ("Z", "X"):
                parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ray_processes(pid: int | None = None) -> list[str]:
    """Command lines of the Ray daemons and workers below this process."""
    out = []
    for child in descendants(os.getpid() if pid is None else pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if any(name in cmdline for name in RAY_DAEMONS):
            out.append(f"{child}: {cmdline[:120].decode(errors='replace')}")
    return out


@pytest.fixture(scope="session", autouse=True)
def _no_ray_left():
    """At the end of the session no Ray daemon or worker started by it is still running."""
    yield
    deadline = time.monotonic() + 15
    left = ray_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ray_processes()
    assert not left, f"Ray processes left running after the tests: {left}"


@pytest.fixture(scope="module", autouse=True)
def _signal_handlers_as_before_ray():
    """ray.init gives the driver a SIGTERM handler of its own and leaves it: the tests that a pytest-xdist
    worker runs after a Ray module (SIGTERM and Ctrl-C ones) must find the handlers the module found."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        if handler is not None:  # None: installed from C, nothing Python can put back
            signal.signal(sig, handler)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray with 4 CPUs and 2 fake GPUs for the module, shut down after it."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized(), "a previous module left Ray initialised"
    # The workers find the tests' modules through the variable the Ray daemons inherit from this process: a
    # runtime_env would start each worker through Ray's setup_worker (0.4 s of CPU more a worker).
    path_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = driver_path_env()["env_vars"]["PYTHONPATH"]
    try:
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        if path_before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = path_before
    try:
        yield ray
    finally:
        ray.shutdown()
