"""Helpers for tests that launch real processes (importable: tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
               "OMPI_COMM_WORLD_RANK", "PMI_RANK")


REPO = Path(__file__).resolve().parent.parent
# The folder of the suite's sitecustomize (see its docstring): last on the PYTHONPATH of every process it starts.
QUICK_EXIT = REPO / "tests" / "scripts" / "quick_exit"


def with_quick_exit(pythonpath: str | None, quick_exit: bool = True) -> str:
    """``pythonpath`` (a ``PYTHONPATH`` value, or None) with :data:`QUICK_EXIT` at its end, once
    (``quick_exit=False``: without it).

    Last, so that a test's own ``sitecustomize`` earlier on the path is the one Python runs.
    """
    entries = [p for p in (pythonpath or "").split(os.pathsep) if p and p != str(QUICK_EXIT)]
    return os.pathsep.join([*entries, str(QUICK_EXIT)] if quick_exit else entries)


def run_command(cmd, *, timeout: float = 120, env: dict | None = None, cwd=None,
                input: str | None = None, quick_exit: bool = True) -> subprocess.CompletedProcess:
    """Run a launcher command in its own process group; on timeout kill the whole group and fail.

    ``input`` is fed to its stdin (a script for ``python -``). ``quick_exit=False``: its processes exit as any
    program does, last garbage collection included (for a test of what happens at exit; see :data:`QUICK_EXIT`).
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env["PYTHONPATH"] = with_quick_exit(full_env.get("PYTHONPATH"), quick_exit)
    for name in LAUNCH_VARS:  # the test process's own variables must not leak into the job
        if env is None or name not in env:
            full_env.pop(name, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            cwd=cwd or REPO, start_new_session=True,
                            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE)
    try:
        out, _ = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish within {timeout}s; output:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the launcher left behind
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def open_files(containing: str) -> set[str]:
    """What this process's descriptors are open on, as ``/proc/self/fd`` shows it (``<name> (deleted)`` for a
    file whose name went), where that contains ``containing``."""
    links = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return {link for link in links if containing in link}


def pids_alive(pids) -> list[int]:
    """The pids in ``pids`` that are running (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    alive.append(pid)
        except OSError:
            pass
    return alive


def wait_gone(pids, timeout: float = 30.0) -> list[int]:
    """Wait until none of ``pids`` runs (a process closes its files a moment before it is gone); those still
    running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_alive(pids)


def child_commands(pid: int | None = None) -> list[str]:
    """The command lines of the live children of ``pid`` (None: this process), from ``/proc``."""
    pid = os.getpid() if pid is None else pid
    commands = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state not in ("Z", "X"):
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    commands.append(f.read().replace(b"\0", b" ").decode(errors="replace").strip())
        except OSError:
            pass
    return commands


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session=True``) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def parse_results(output: str) -> list[dict]:
    """Rows printed as ``RESULT {json}`` by the launched scripts, sorted by rank."""
    # Ranks share one stdout, so lines may interleave: match the flat JSON objects.
    rows = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", output)]
    return sorted(rows, key=lambda r: r.get("rank", 0))



# A sitecustomize that makes the optional packages unimportable, as on a
# machine with only ``pip install torch -e .``: every process started with
# this PYTHONPATH (spawned workers and ranks too) runs it first.
_NO_EXTRAS_SITECUSTOMIZE = '''\
import sys

# None in sys.modules: `import numpy` raises ModuleNotFoundError and
# importlib.util.find_spec("numpy") returns None, as when it is not installed.
for name in ("numpy", "matplotlib", "ray"):
    sys.modules[name] = None
'''


def without_extras_env(tmp_path: Path) -> dict:
    """Environment for a subprocess where numpy, matplotlib and ray cannot be imported (nor in its children)."""
    site = tmp_path / "no_extras_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_NO_EXTRAS_SITECUSTOMIZE)
    path = [str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}


def driver_path_env() -> dict:
    """A Ray ``runtime_env`` giving its workers this process's ``sys.path`` (as the local pool's workers get it)."""
    import sys

    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}


def check_ranks(results: list) -> list:
    """The ranks' results, unchanged; where one is an exception, the test fails with that rank's remote traceback."""
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            pytest.fail(f"rank {rank} raised {r!r}\n{getattr(r, 'remote_traceback', '')}")
    return results


def needs(package: str, reason: str | None = None) -> pytest.MarkDecorator:
    """Skips the tests it marks where ``package`` (a top-level name) is not installed, without importing it.

    ``pytest.importorskip`` at a module's top imports the package when the module is collected, and every
    pytest-xdist worker collects every module: seconds each for MLflow or Ray Train, paid by all four workers
    for tests that run on one. Import the package where the tests use it.
    """
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=reason or f"needs {package}: pip install -e '.[test]'")
