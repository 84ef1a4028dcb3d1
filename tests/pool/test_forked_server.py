"""The forkserver forked from the caller (nn_handler/utils/_workers/forked_server.py): when it is used, what it
keeps of the caller, and that it goes when the caller goes. Each case runs in a fresh process: whether the
caller may fork depends on everything that process did before."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from helpers import REPO, kill_group, pids_alive, run_command

_FORKED = sys.platform.startswith("linux") and os.uname().machine == "x86_64"
needs_fork_route = pytest.mark.skipif(not _FORKED, reason="the caller forks its server on x86-64 Linux only")

_CALLER = textwrap.dedent("""
    import json, os, socket, sys, threading, time
    import torch
    print("TOP LEVEL RAN", flush=True)  # outside the guard: counts who runs the script

    def report(device):
        import logging
        logging.getLogger("caller").warning("worker %d logged", os.getpid())
        fds = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        with open(f"/proc/{os.getppid()}/comm") as f:
            return {"pid": os.getpid(), "server": os.getppid(), "server_name": f.read().strip(), "fds": fds,
                    "sum": float(torch.ones(1 << 16).sum())}

    def nested(device):
        from nn_handler import ParallelExecutor
        with ParallelExecutor(device_ids=["cpu"]) as inner:
            return inner.run(lambda device: 7)

    if __name__ == "__main__":
        from nn_handler import ParallelExecutor
        how = sys.argv[1]
        held = [socket.socket(), *os.pipe(), open(os.path.join(sys.argv[2], "log.txt"), "w")]
        import logging
        logging.basicConfig(filename=os.path.join(sys.argv[2], "caller.log"))
        if how == "thread":
            stop = threading.Event()
            threading.Thread(target=stop.wait).start()
        elif how == "cuda":
            torch.cuda.is_initialized = lambda: True  # what a caller that used its GPU looks like
        elif how == "openmp":
            torch.set_num_threads(2)
            torch.randn(512, 512) @ torch.randn(512, 512)  # starts OpenMP's pool
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            first = ex.run(report)
            if how == "nested":
                print("NESTED", ex.run(nested), flush=True)
        if how == "server_killed":
            os.kill(first[0]["server"], 9)
            time.sleep(0.5)
        with ParallelExecutor(device_ids=["cpu"]) as ex:
            second = ex.run(report)
        if how == "thread":
            stop.set()
        caller = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in map(str, [held[0].fileno(), *held[1:3],
                                                                          held[3].fileno()])}
        print("RESULT", json.dumps({"caller": caller, "first": first, "second": second}), flush=True)
""")


def _run(tmp_path, how: str, **env) -> tuple[dict, str]:
    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    result = run_command([sys.executable, str(script), how, str(tmp_path)], timeout=150,
                         env={"PYTHONPATH": str(REPO), **env})
    assert result.returncode == 0, result.stdout[-4000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), result.stdout


@needs_fork_route
@pytest.mark.timeout(180)
def test_workers_come_from_a_fork_of_the_caller_that_holds_none_of_its_sockets_or_pipes(tmp_path):
    out, stdout = _run(tmp_path, "plain")
    caller = out["caller"]
    socket_, pipe_r, pipe_w, log = caller.values()
    for worker in out["first"] + out["second"]:
        assert worker["server_name"] == "nnh-forkserver", worker
        assert worker["sum"] == 1 << 16
        held = set(worker["fds"].values())
        assert not held & {socket_, pipe_r, pipe_w}, f"a worker holds the caller's {held & {socket_, pipe_r, pipe_w}}"
        assert log in held  # a regular file stays open: a logging handler keeps writing to it
        socket_fd = next(fd for fd, target in caller.items() if target == socket_)
        assert worker["fds"][socket_fd] == "/dev/null"  # its number is not reused for a pipe of the worker
    # one server for both executors, and the script ran once: the workers did not import it again
    assert len({w["server"] for w in out["first"] + out["second"]}) == 1
    assert stdout.count("TOP LEVEL RAN") == 1, stdout
    # the caller's logging handler, its lock and its file work in the workers
    logged = (tmp_path / "caller.log").read_text()
    assert all(f"worker {w['pid']} logged" in logged for w in out["first"] + out["second"]), logged


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how, env", [
    ("thread", {}),  # a Python thread runs: it may hold a lock the copy would need
    ("cuda", {}),  # CUDA is initialized: a fork of the caller could not use it
    ("openmp", {"OMP_NUM_THREADS": "2"}),  # OpenMP's pool started: a fork of it hangs on its first parallel op
    ("plain", {"NN_HANDLER_WORKER_SERVER": "forkserver"}),  # asked for
])
def test_an_unsafe_caller_gets_the_spawned_forkserver(tmp_path, how, env):
    out, stdout = _run(tmp_path, how, **env)
    for worker in out["first"] + out["second"]:
        assert worker["server_name"] != "nnh-forkserver", worker
        assert worker["sum"] == 1 << 16
    assert len({w["server"] for w in out["first"] + out["second"]}) == 1


@needs_fork_route
@pytest.mark.timeout(180)
def test_a_killed_forked_server_is_replaced_by_a_spawned_one(tmp_path):
    out, _ = _run(tmp_path, "server_killed")
    assert out["first"][0]["server_name"] == "nnh-forkserver"
    [second] = out["second"]
    assert second["server_name"] != "nnh-forkserver" and second["server"] != out["first"][0]["server"]
    assert second["sum"] == 1 << 16


@needs_fork_route
@pytest.mark.timeout(240)
def test_an_executor_inside_a_worker_of_the_forked_server(tmp_path):
    _, stdout = _run(tmp_path, "nested")
    assert "NESTED [[7], [7]]" in stdout, stdout[-3000:]


_KILLED = textwrap.dedent("""
    import os, time
    import torch
    from nn_handler import ParallelExecutor
    if __name__ == "__main__":
        with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
            big = torch.ones(8 << 20)
            print("PIDS", *[f"{p}:{s}" for p, s in ex.run(lambda x, device: (os.getpid(), os.getppid()), big)],
                  flush=True)
            ex.run(lambda x, device: time.sleep(300), big)
""")


@needs_fork_route
@pytest.mark.timeout(120)
def test_a_killed_caller_takes_its_forked_server_and_workers_with_it(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(_KILLED)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + (proc.stdout.read() if proc.poll() is not None else "")
        pairs = [p.split(":") for p in line.split()[1:]]
        workers, servers = {int(p) for p, _ in pairs}, {int(s) for _, s in pairs}
        [server] = servers
        with open(f"/proc/{server}/comm") as f:
            assert f.read().strip() == "nnh-forkserver"
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


# ----------------------------------------------------------------------------- the checks themselves
def test_the_reasons_not_to_fork(monkeypatch):
    from nn_handler.utils._workers import forked_server

    assert forked_server.unsafe_reason({"NN_HANDLER_WORKER_SERVER": "forkserver"}) is not None
    if not _FORKED:
        assert forked_server.unsafe_reason({}) == "not x86-64 Linux"
        return
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA" in forked_server.unsafe_reason({})
    monkeypatch.undo()
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert "process group" in forked_server.unsafe_reason({})
    monkeypatch.undo()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "thread" in forked_server.unsafe_reason({})
    finally:
        stop.set()
        thread.join()
    monkeypatch.setattr(forked_server, "_resident_bytes", lambda: forked_server.MAX_CALLER_RSS + 1)
    monkeypatch.setattr(forked_server, "_native_threads_unsafe", lambda: None)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    assert "GiB" in forked_server.unsafe_reason({})


@needs_fork_route
def test_a_native_thread_asleep_outside_the_c_library_forbids_the_fork():
    code = textwrap.dedent("""
        import torch
        from nn_handler.utils._workers import forked_server
        print("FRESH", forked_server.unsafe_reason())
        torch.set_num_threads(2)
        torch.randn(512, 512) @ torch.randn(512, 512)
        import time; time.sleep(1)  # OpenMP's threads spin a while before they sleep
        print("AFTER", forked_server.unsafe_reason())
    """)
    out = run_command([sys.executable, "-c", code], timeout=90,
                      env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}).stdout
    assert "FRESH None" in out, out
    assert "AFTER thread" in out and "OpenMP" in out, out
