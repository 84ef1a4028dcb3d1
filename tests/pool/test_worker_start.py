"""How a worker starts and what it inherits (nn_handler/utils/_workers/server.py, worker.inherit): never a fork of
the caller, the caller's sys.path, environment and main module as they are when it starts, its own random streams.

Each case runs in a fresh caller process: what a worker would inherit from a fork depends on everything that
process did before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import REPO, kill_group, pids_alive, run_command

pytestmark = pytest.mark.timeout(150)


def _run(tmp_path, code: str, *args, env=None, cwd=None, timeout=120):
    """Run ``code`` as a script in a fresh process; what it printed after ``RESULT``, parsed."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(code))
    result = run_command([sys.executable, str(script), *map(str, args)], timeout=timeout,
                         env={"PYTHONPATH": str(REPO), **(env or {})}, cwd=cwd)
    assert result.returncode == 0, result.stdout[-4000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


# ----------------------------------------------------------------------------- never a fork of the caller
_NO_FORK = """
    import json, os, sys
    import torch
    from nn_handler import ParallelExecutor

    def where(device):
        return os.getpid(), os.getppid()

    if __name__ == "__main__":
        marks = sys.argv[1]
        # What torch does once the CUDA driver was queried (device_count(), as a pool with a GPU does): a process
        # forked from here is marked, and CUDA fails in it. Here a Python process forked from the caller leaves
        # a file behind, and os.fork in the caller fails outright.
        torch.cuda.device_count()
        os.register_at_fork(after_in_child=lambda: open(os.path.join(marks, f"forked-{os.getpid()}"), "w").close())
        def no_fork():
            raise AssertionError("the caller forked")
        os.fork = no_fork
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            first = ex.run(where)
        with ParallelExecutor(device_ids=["cpu"], max_tasks_per_worker=1) as ex:
            second = [ex.submit(where).result() for _ in range(2)]
        print("RESULT", json.dumps({"first": first, "second": second, "me": os.getpid()}))
"""


def test_no_worker_or_server_is_a_fork_of_a_caller_that_queried_cuda(tmp_path):
    out = _run(tmp_path, _NO_FORK, tmp_path)
    assert not list(tmp_path.glob("forked-*")), "a process was forked from the caller"
    workers = out["first"] + out["second"]
    assert len({pid for pid, _ in workers}) == 4  # the replacements are new processes too
    for pid, parent in workers:
        assert parent != out["me"]  # from the server, which is no fork of the caller either (no mark above)


def test_the_start_context_is_never_fork(monkeypatch):
    import multiprocessing as mp

    import torch

    from nn_handler.utils._workers import server

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # whatever the caller did with CUDA
    assert server.context().get_start_method() in ("forkserver", "spawn")
    monkeypatch.setattr(server, "_user", -1)  # a child made with os.fork(): its parent's server is not its own
    assert server.context().get_start_method() == "spawn"
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["fork", "spawn"])  # no forkserver on this system
    monkeypatch.setattr(server, "_user", None)
    assert server.context().get_start_method() == "spawn"


# ----------------------------------------------------------------------------- sys.path, environment, main module
_PATH_AND_ENV = """
    import json, os, sys, threading
    SEEN_AT_IMPORT = os.environ.get("NNH_TEST_LATE")  # the worker imports this script: with which environment?
    import torch
    from nn_handler import ParallelExecutor

    def report(device):
        import nn_handler
        main = sys.modules["__mp_main__"]
        return {"nn_handler": nn_handler.__file__, "decoy": getattr(nn_handler, "DECOY", False),
                "late": os.environ.get("NNH_TEST_LATE"), "at_import": main.SEEN_AT_IMPORT,
                "gone": os.environ.get("NNH_TEST_GONE"), "cwd": os.getcwd()}

    if __name__ == "__main__":
        stop = threading.Event()
        threading.Thread(target=stop.wait).start()  # most programs run a thread or two
        os.environ["NNH_TEST_GONE"] = "set before the first pool"
        with ParallelExecutor(device_ids=["cpu"]) as ex:
            first = ex.run(report)
        del os.environ["NNH_TEST_GONE"]
        os.environ["NNH_TEST_LATE"] = "set before the second pool"
        os.chdir(sys.argv[1])
        with ParallelExecutor(device_ids=["cpu"]) as ex:
            second = ex.run(report)
        stop.set()
        print("RESULT", json.dumps({"first": first, "second": second}))
"""


def test_workers_import_with_the_callers_path_and_get_its_present_environment(tmp_path):
    import shutil

    cwd = tmp_path / "cwd"  # the caller runs from here: a copy of nn_handler lies in it, not on the caller's path
    shutil.copytree(REPO / "nn_handler", cwd / "nn_handler", ignore=shutil.ignore_patterns("__pycache__"))
    with open(cwd / "nn_handler" / "__init__.py", "a") as f:
        f.write("\nDECOY = True\n")
    later = tmp_path / "later"
    later.mkdir()
    out = _run(tmp_path, _PATH_AND_ENV, later, cwd=cwd)
    first, second = out["first"][0], out["second"][0]
    for worker in (first, second):
        assert not worker["decoy"] and worker["nn_handler"] == str(REPO / "nn_handler" / "__init__.py"), worker
    assert first["gone"] == "set before the first pool" and second["gone"] is None
    assert second["late"] == "set before the second pool"
    assert second["at_import"] == "set before the second pool"  # the main script's top level saw it too
    assert second["cwd"] == str(later)


# ----------------------------------------------------------------------------- start-up has its own bound
_SLOW_START = """
    import os, sys, time
    if __name__ == "__mp_main__":  # this script's top level, as each worker imports it
        time.sleep(float(os.environ.get("NNH_TEST_IMPORT_TAKES", "0")))  # `import transformers` and friends
        if os.environ.get("NNH_TEST_IMPORT_DIES"):
            os._exit(3)

    def f(x):
        return x + 1

    def load(seconds):
        time.sleep(seconds)

    def die():
        os._exit(3)

    if __name__ == "__main__":
        import json
        from nn_handler import ParallelExecutor, ParallelExecutionError

        def error_of(**kwargs):
            try:
                with ParallelExecutor(max_workers=1, **kwargs) as ex:
                    ex.submit(f, 1).result()
            except ParallelExecutionError as exc:
                return [type(exc).__name__, str(exc)]

        out = {}
        os.environ["NNH_TEST_IMPORT_TAKES"] = "3"
        with ParallelExecutor(max_workers=1, timeout=2) as ex:  # the task timeout is per task
            out["slow_top_level"] = ex.submit(f, 1).result()
        out["slow_start"] = error_of(start_timeout=1)  # the start-up's own bound
        os.environ["NNH_TEST_IMPORT_TAKES"] = "0"
        out["slow_initializer"] = error_of(initializer=load, initargs=(30,), start_timeout=1)
        out["initializer_dies"] = error_of(initializer=die)
        os.environ["NNH_TEST_IMPORT_DIES"] = "1"
        out["start_dies"] = error_of()
        print("RESULT", json.dumps(out))
"""


def test_start_up_has_its_own_bound_and_errors_say_which_part_failed(tmp_path):
    out = _run(tmp_path, _SLOW_START, timeout=140)
    assert out["slow_top_level"] == 2  # timeout=2 with a 3 s top level: the call succeeds
    kind, message = out["slow_start"]
    assert kind == "ExecutorTimeoutError" and "worker start-up" in message and "initializer" not in message, message
    assert "did not start within 1s" in message and "killed" in message, message
    assert "ParallelExecutor(start_timeout=...)" in message, message
    kind, message = out["slow_initializer"]
    assert kind == "ExecutorTimeoutError" and "initializer did not finish within 1s" in message, message
    kind, message = out["initializer_dies"]
    assert kind == "WorkerDiedError" and "died during start-up, in its initializer (exit code 3)" in message, message
    kind, message = out["start_dies"]
    assert kind == "WorkerDiedError" and "died during start-up (exit code 3)" in message, message
    assert "initializer" not in message, message


# ----------------------------------------------------------------------------- threads
_NOT_IMPORTABLE = """
    import json, sys
    from nn_handler import ParallelExecutionError, ParallelExecutor

    if __name__ == "__main__":
        sys.path.insert(0, sys.argv[1])  # a broken nn_handler first on the path the workers get
        try:
            with ParallelExecutor(max_workers=1) as ex:
                ex.submit(abs, 1).result()
        except ParallelExecutionError as exc:
            print("RESULT", json.dumps([type(exc).__name__, str(exc)]))
"""


def test_a_worker_that_cannot_import_nn_handler_gets_no_main_guard_hint(tmp_path):
    (tmp_path / "shadow" / "nn_handler").mkdir(parents=True)
    (tmp_path / "shadow" / "nn_handler" / "__init__.py").write_text("raise ImportError('a broken install')\n")
    kind, message = _run(tmp_path, _NOT_IMPORTABLE, tmp_path / "shadow")
    assert kind == "WorkerDiedError" and "died during start-up" in message, message
    assert "__main__" not in message and "import nn_handler" in message, message  # not the main guard's hint


_EXEC = """
    import glob, json, os, sys, time

    def big(go):
        import torch

        while not os.path.exists(go):  # the caller is about to exec
            time.sleep(0.005)
        return torch.ones(1 << 22)  # 16 MiB: a file of its own in /dev/shm

    def gone(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    if __name__ == "__main__":
        if sys.argv[1] == "after-exec":  # the same process, a new program: nobody reads the workers' pipes now
            deadline = time.monotonic() + 60
            while not gone(int(sys.argv[2])) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = glob.glob(f"/dev/shm/nnh-{os.getpid()}-*")
            print("RESULT", json.dumps({"gone": gone(int(sys.argv[2])), "left": left}))
        else:
            from nn_handler import ParallelExecutor  # (the program after the exec does without torch)

            go = sys.argv[2]
            ex = ParallelExecutor(max_workers=1)
            worker = ex.submit(os.getpid).result()
            ex.submit(big, go)
            open(go, "w").close()
            os.execv(sys.executable, [sys.executable, __file__, "after-exec", str(worker)])
"""


def test_an_exec_of_the_caller_while_a_call_is_in_flight_leaves_no_result_file(tmp_path):
    out = _run(tmp_path, _EXEC, "before", tmp_path / "go")
    assert out["gone"] and out["left"] == [], out  # the worker removed the file of a reply nobody reads


_THREADS = """
    import os
    def threads(*_):
        import torch
        return torch.get_num_threads()

    if __name__ == "__main__":
        import concurrent.futures, json, multiprocessing
        from nn_handler import ParallelExecutor

        def standard():
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as p:
                return p.submit(threads).result()

        def ours(n=1):
            with ParallelExecutor(max_workers=n) as ex:
                return ex.run(threads)

        out = {"cores": len(os.sched_getaffinity(0))}
        os.environ["OMP_NUM_THREADS"] = "1"  # before the first executor (its server starts with it)
        out["one"] = [standard(), ours()]
        os.environ["OMP_NUM_THREADS"] = "3"  # set later: the workers started since see it too
        out["three"] = [standard(), ours()]
        del os.environ["OMP_NUM_THREADS"]
        out["share"] = ours(2)
        print("RESULT", json.dumps(out))
"""


def test_workers_honour_omp_num_threads_as_processpoolexecutors_do(tmp_path):
    out = _run(tmp_path, _THREADS, env={"OMP_NUM_THREADS": ""})
    standard, ours = out["one"]
    assert standard == 1 and ours == [standard]
    standard, ours = out["three"]
    assert standard == min(3, os.cpu_count()) and ours == [standard]  # (torch takes no more than the cores)
    assert out["share"] == [max(1, out["cores"] // 2)] * 2  # unset: an equal share of the cores each


# ----------------------------------------------------------------------------- random streams
_SEEDS = """
    import json, random, sys
    import numpy
    import torch
    from nn_handler import ParallelExecutor

    # Seeded at the top level: each worker imports this script again (and the initializer's module, which seeds
    # too), and must still draw numbers of its own.
    torch.manual_seed(0); random.seed(0); numpy.random.seed(0)

    def draw(*_, device=None):
        return [float(torch.rand(1)), random.random(), float(numpy.random.rand())]

    if __name__ == "__main__":
        import seeds_at_import
        torch.manual_seed(int(sys.argv[1]))
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            a = ex.run(draw)
        with ParallelExecutor(device_ids=["cpu", "cpu"], initializer=seeds_at_import.nothing) as ex:
            b = ex.run(draw)
        with ParallelExecutor(device_ids=["cpu"], max_tasks_per_worker=1, pass_device=False) as ex:
            c = [ex.submit(draw).result() for _ in range(2)]  # a replacement for each task
        print("RESULT", json.dumps({"draws": a + b + c, "caller": draw()}))
"""

_SEEDS_AT_IMPORT = """
    import random, torch
    torch.manual_seed(0); random.seed(0)

    def nothing(device):
        pass
"""


def test_every_worker_draws_its_own_random_numbers_the_same_run_to_run(tmp_path):
    (tmp_path / "seeds_at_import.py").write_text(textwrap.dedent(_SEEDS_AT_IMPORT))
    out = _run(tmp_path, _SEEDS, 0)
    draws = out["draws"] + [out["caller"]]
    for stream in range(3):  # torch, random, numpy: no two workers (pools, replacements) nor the caller alike
        values = [d[stream] for d in draws]
        assert len(set(values)) == len(values), (stream, values)
    assert _run(tmp_path, _SEEDS, 0)["draws"] == out["draws"]  # torch.manual_seed in the caller: the same numbers again
    assert _run(tmp_path, _SEEDS, 1)["draws"] != out["draws"]


def test_the_callers_random_streams_do_not_move_when_executors_are_made_started_used_or_expire():
    import random

    import torch

    from nn_handler import ParallelExecutor, parallelize_on_gpus

    @parallelize_on_gpus(device_ids=["cpu"], pass_device=False, keep_alive=0)  # a fresh pool for every call
    def decorated():
        return float(torch.rand(1))

    def draws(use_executors: bool) -> list[float]:
        torch.manual_seed(0)
        random.seed(0)
        out = [float(torch.rand(1)), random.random()]
        if use_executors:
            ParallelExecutor(device_ids=["cpu"]).shutdown()  # made, never started
        out += [float(torch.rand(1)), random.random()]
        if use_executors:
            with ParallelExecutor(device_ids=["cpu", "cpu"], pass_device=False) as ex:
                ex.run(torch.rand, 1)
                ex.submit(torch.rand, 1).result()
        out += [float(torch.rand(1)), random.random()]
        if use_executors:
            decorated()
            decorated()  # its pool expired after the first call: a new one
        out += [float(torch.rand(1)), random.random()]
        return out

    assert draws(True) == draws(False)  # as with ProcessPoolExecutor, which draws nothing from the caller


# ----------------------------------------------------------------------------- what a fork of the caller carried
# Each case: what the caller did before its first pool (`before`), then what a later pool's worker does (`check`,
# returning True when it worked). A worker forked from the caller inherited each of these; a fresh one none.
_CASES = {
    # torch's inter-op pool used by the caller: a forked worker's own jit.fork waits for threads it does not have
    "jit_fork": ("use_interop()", "sys.modules['__main__'].use_interop() == 4"),
    # a lock held by a thread the threading module does not know of, taken by the worker too
    "raw_thread_lock": ("import _thread, held; _thread.start_new_thread(held.hold, ()); held.taken.wait()",
                        "__import__('held').LOCK.acquire(timeout=10)"),
    # a pool started while a module is being imported: that module, half-imported, in every later worker
    "pool_during_import": ("import halfway", "__import__('halfway').square(3) == 9"),
    # the caller's memory (1 GiB) counted in a worker: replaced after every task under a 600 MiB limit
    "caller_memory": ("big = torch.ones(1 << 28)", None),
    # the caller's open file, its flock released by the caller, held on by the server
    "flock": ("f = open('locked', 'w'); fcntl.flock(f, fcntl.LOCK_EX)", None),
    # a copy of the caller (its command line) left running as its child after shutdown()
    "copy_left_running": ("", None),
}

_TABLE = """
    import fcntl, json, os, sys, time
    import torch
    from nn_handler import ParallelExecutor

    def use_interop():  # a scripted jit.fork runs on torch's inter-op pool
        @torch.jit.script
        def twice(x):
            return x * 2

        @torch.jit.script
        def forked(x):
            return torch.jit.wait(torch.jit.fork(twice, x))

        return float(forked(torch.ones(2)).sum())

    def check(device=None):
        import torch
        return bool(eval(sys.argv[2])), os.getpid()

    if __name__ == "__main__":
        case, before = sys.argv[1], sys.argv[3]
        os.chdir(os.path.dirname(os.path.abspath(__file__)))
        exec(before)
        with ParallelExecutor(device_ids=["cpu"], timeout=30) as ex:  # the first pool: where a fork would be made
            ex.run(lambda device: 1)
        out = {}
        if case == "caller_memory":
            with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=600 << 20) as ex:
                out["ok"] = len({ex.submit(os.getpid).result(timeout=30) for _ in range(3)}) == 1
        elif case == "flock":
            f.close()  # lets the lock go, unless another process holds the file open
            with open("locked", "w") as again:
                try:
                    fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    out["ok"] = True
                except BlockingIOError:
                    out["ok"] = False
        elif case == "copy_left_running":
            def read(path, mode="r"):
                try:
                    with open(path, mode) as f:
                        return f.read()
                except OSError:  # the process ended between the listing and the read
                    return None

            me = read("/proc/self/cmdline", "rb")
            stats = {p: read(f"/proc/{p}/stat") for p in os.listdir("/proc") if p.isdigit()}
            children = [p for p, stat in stats.items() if stat and stat.rsplit(")", 1)[1].split()[1] == str(os.getpid())]
            out["ok"] = not [p for p in children if read(f"/proc/{p}/cmdline", "rb") == me]
        else:
            with ParallelExecutor(device_ids=["cpu"], timeout=30) as ex:
                try:
                    [(out["ok"], _)] = ex.run(check)
                except TimeoutError:
                    out["ok"] = "timed out"
        print("RESULT", json.dumps(out))
"""

_HELD = """
import threading, time
LOCK = threading.Lock()
taken = threading.Event()

def hold():
    with LOCK:
        taken.set()
        time.sleep(3600)
"""

_HALFWAY = """
import multiprocessing
from nn_handler import ParallelExecutor

if multiprocessing.parent_process() is None:  # in the caller, not in a worker that imports it to find square
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as ex:
        ex.run(int)


def square(x):
    return x * x
"""


@pytest.mark.parametrize("case", list(_CASES))
def test_nothing_the_caller_did_before_reaches_a_worker(tmp_path, case):
    (tmp_path / "held.py").write_text(_HELD)
    (tmp_path / "halfway.py").write_text(_HALFWAY)
    before, check = _CASES[case]
    out = _run(tmp_path, _TABLE, case, check or "True", before, timeout=100)
    assert out["ok"] is True, out



# ----------------------------------------------------------------------------- the server dies
_SERVER_KILLED = """
    import json, os, signal, sys, threading, time
    from nn_handler import ParallelExecutor, WorkerDiedError
    from helpers import pids_alive

    def slow(markers, device):
        open(os.path.join(markers, str(os.getpid())), "w").close()
        time.sleep(60)

    if __name__ == "__main__":
        markers = sys.argv[1]
        out = {}
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            workers = ex.run(lambda device: (os.getpid(), os.getppid()))
            old, server = [pid for pid, _ in workers], workers[0][1]

            def kill_the_server():  # once both workers run the call
                while len(os.listdir(markers)) < 2:
                    time.sleep(0.01)
                os.kill(server, signal.SIGKILL)

            threading.Thread(target=kill_the_server, daemon=True).start()
            try:
                ex.run(slow, markers)
            except WorkerDiedError as exc:
                out["error"] = str(exc)
            out["server"] = server
            out["after"] = ex.run(lambda device: (os.getpid(), os.getppid()))
            deadline = time.monotonic() + 10
            while pids_alive(old) and time.monotonic() < deadline:
                time.sleep(0.05)
            out["left"] = pids_alive(old)
        print("RESULT", json.dumps(out))
"""


def test_a_killed_server_is_named_in_the_error_and_its_workers_do_not_outlive_it(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    out = _run(tmp_path, _SERVER_KILLED, markers, env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert f"forkserver (pid {out['server']})" in out["error"] and "killed by signal SIGKILL" in out["error"], out
    assert "exit code 255" not in out["error"], out["error"]
    assert all(server != out["server"] for _, server in out["after"])  # new workers, from a new server
    assert out["left"] == [], "workers cut off from the caller kept running"


# ----------------------------------------------------------------------------- isolation, lifetime, nesting
_HOLDS = """
    import json, os, socket, sys
    import torch
    from nn_handler import ParallelExecutor

    def fds(device):
        held = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return sorted(held)

    def nested(device):
        from nn_handler import ParallelExecutor
        with ParallelExecutor(device_ids=["cpu"]) as inner:
            return inner.run(lambda device: 7)

    if __name__ == "__main__":
        held = [socket.socket(), *os.pipe(), open(os.path.join(sys.argv[1], "log.txt"), "w")]
        mine = [os.readlink(f"/proc/self/fd/{fd}") for fd in (held[0].fileno(), held[1], held[2], held[3].fileno())]
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            workers = ex.run(fds)
            inner = ex.run(nested)
        print("RESULT", json.dumps({"mine": mine, "workers": workers, "nested": inner}))
"""


def test_workers_hold_none_of_the_callers_files_and_may_start_their_own_executor(tmp_path):
    out = _run(tmp_path, _HOLDS, tmp_path)
    for held in out["workers"]:
        assert not set(held) & set(out["mine"]), f"a worker holds the caller's {set(held) & set(out['mine'])}"
    assert out["nested"] == [[7], [7]]


_KILLED = """
    import os, time
    import torch
    from nn_handler import ParallelExecutor
    if __name__ == "__main__":
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            big = torch.ones(8 << 20)
            print("PIDS", *[f"{p}:{s}" for p, s in ex.run(lambda x, device: (os.getpid(), os.getppid()), big)],
                  flush=True)
            ex.run(lambda x, device: time.sleep(300), big)
"""


def test_a_killed_caller_takes_its_server_and_workers_with_it(tmp_path):
    import glob

    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(_KILLED))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + (proc.stdout.read() if proc.poll() is not None else "")
        pairs = [p.split(":") for p in line.split()[1:]]
        workers, servers = {int(p) for p, _ in pairs}, {int(s) for _, s in pairs}
        assert len(servers) == 1 and proc.pid not in servers
        time.sleep(0.5)  # the second call's argument is in shared memory
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while (pids_alive(workers | servers) or glob.glob(f"/dev/shm/nnh-{proc.pid}-*")) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pids_alive(workers | servers), "the workers or their server outlived the caller"
        assert glob.glob(f"/dev/shm/nnh-{proc.pid}-*") == []
    finally:
        kill_group(proc)


# ----------------------------------------------------------------------------- the caller's __main__ is left alone
_MAIN_WATCHED = """
    import os, sys, threading, time

    def f(x):  # found by ProcessPoolExecutor's spawned workers, which import this script
        return x * 2

    def stop_here(device=None):
        raise SystemExit(3)  # the worker ends: the next call starts a replacement

    if __name__ == "__main__":
        import concurrent.futures, json, multiprocessing
        from nn_handler import ParallelExecutor, parallelize_on_gpus

        done, misses, reads, spawned = threading.Event(), [], [0], []

        def read_main_file():  # what a thread of the caller does: its own module's __file__, over and over
            while not done.is_set():
                try:
                    os.path.dirname(__file__)
                    sys.modules["__main__"].__spec__  # (None for a script: that it is there is what counts)
                except (NameError, AttributeError) as exc:
                    misses.append(repr(exc))
                reads[0] += 1
                time.sleep(0)  # lets the other threads have the interpreter between reads

        def use_a_process_pool():  # the standard's pool, spawning a process per task meanwhile
            spawn = multiprocessing.get_context("spawn")
            while not done.is_set():
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, max_tasks_per_child=1) as pool:
                    try:
                        spawned.append(pool.submit(f, 21).result(timeout=60))
                    except Exception as exc:
                        spawned.append(repr(exc))

        threads = [threading.Thread(target=read_main_file), threading.Thread(target=use_a_process_pool)]
        for t in threads:
            t.start()
        try:
            with ParallelExecutor(device_ids=["cpu", "cpu"], pass_device=False) as ex:  # the first start
                for _ in range(2):
                    try:
                        ex.submit(stop_here).result()
                    except Exception:
                        pass
                    ex.run(f, 1)  # a replacement starts
            with ParallelExecutor(max_workers=1, max_tasks_per_worker=1) as ex:  # recycling
                [ex.submit(f, i).result() for i in range(3)]

            @parallelize_on_gpus(device_ids=["cpu"], pass_device=False, keep_alive=0)
            def decorated(x):  # a fresh pool for every call
                return x + 1

            [decorated(i) for i in range(2)]
        finally:
            done.set()
            for t in threads:
                t.join()
        print("RESULT", json.dumps({"misses": misses[:5], "n_misses": len(misses), "reads": reads[0],
                                    "spawned": spawned}))
"""


def test_starting_workers_leaves_the_callers_main_module_alone(tmp_path):
    # Another thread of the caller reads its module's __file__ while workers start (first start, replacements,
    # recycling, a decorator's pools), and uses ProcessPoolExecutor(spawn), whose children import __main__ by
    # the name the caller's __main__ gives at that moment.
    out = _run(tmp_path, _MAIN_WATCHED, timeout=140)
    assert out["reads"] > 0
    assert out["n_misses"] == 0, out["misses"]
    assert out["spawned"] and set(out["spawned"]) == {42}, out["spawned"]
