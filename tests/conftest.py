"""Shared fixtures: hygiene checks that every test leaves no process group,
no launcher variables and no child process behind."""

from __future__ import annotations

import compileall
import importlib.util
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from helpers import LAUNCH_VARS, REPO, with_quick_exit

import pytest

_LAUNCH_VARS = LAUNCH_VARS

# A suite started in the background of a non-interactive shell (`cmd &`, nohup in a script) inherits Ctrl-C
# ignored, and so would every process a test starts (an ignored signal stays ignored across exec): the tests that
# send Ctrl-C to a caller would wait on one that never sees it. Python's own handler, as in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _is_mp_infrastructure(pid: str) -> bool:
    # multiprocessing starts one resource tracker and one forkserver per parent
    # on first use and keeps them for the parent's lifetime: infrastructure,
    # not leaks (the forkserver's own children are still checked).
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"resource_tracker" in cmdline or b"forkserver" in cmdline


def _all_children(pid: int | None = None) -> list[int]:
    pid = os.getpid() if pid is None else pid
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def live_children(pid: int | None = None) -> list[int]:
    """Living processes started by this one (directly, or by its forkserver), infrastructure excluded."""
    direct = _all_children(pid)
    servers = [p for p in direct if _is_mp_infrastructure(str(p))]
    found = [p for p in direct if p not in servers]
    for server in servers:
        found += _all_children(server)
    return found


@pytest.fixture(scope="session", autouse=True)
def _stall_reports_out_of_the_repo(tmp_path_factory):
    # A test whose rank dies writes a stall report (tests/ranks/test_on_rank.py, the elastic restarts); the
    # ranks' cwd is the repository, so send the reports to a temporary directory (rank processes inherit it).
    os.environ["NN_HANDLER_STALL_DIR"] = str(tmp_path_factory.mktemp("stall-reports"))
    yield
    os.environ.pop("NN_HANDLER_STALL_DIR", None)


@pytest.fixture(autouse=True)
def _hygiene(request):
    before_env = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    before_children = set(live_children())
    yield
    import torch.distributed as dist

    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    changed = {k for k in _LAUNCH_VARS if os.environ.get(k) != before_env[k]}
    for k in changed:
        if before_env[k] is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = before_env[k]
    # Children may take a moment to be reaped after a kill.
    deadline = time.monotonic() + 5
    extra = set(live_children()) - before_children
    while extra and time.monotonic() < deadline:
        time.sleep(0.05)
        extra = set(live_children()) - before_children
    # Session-scoped pools (marked as such) are allowed to outlive a test.
    extra -= set(getattr(request.config, "_nn_handler_session_pids", set()))
    assert not leaked_group, "test left a torch.distributed process group behind"
    assert not changed, f"test left launch variables changed: {sorted(changed)}"
    assert not extra, f"test left child processes running: {sorted(extra)}"


# Every test in these folders starts processes (workers, ranks, launchers, Ray): all are marked slow.
SLOW_FOLDERS = {"pool", "ranks", "launch", "cluster"}


def _shared_with_other_tests(item) -> set[str]:
    """What ``item`` shares with other tests: the fixtures wider than a test that ``tests/`` defines, and Ray."""
    shared = {"ray"} if Path(item.path).is_relative_to(REPO / "tests" / "cluster") else set()
    info = getattr(item, "_fixtureinfo", None)
    for name, definitions in (info.name2fixturedefs.items() if info else ()):
        fixture = definitions[-1]
        if fixture.scope == "function" or getattr(fixture, "_autouse", False):  # autouse: every test has it
            continue
        where = Path(inspect.getsourcefile(fixture.func) or "")
        if where.is_relative_to(REPO / "tests"):  # not pytest's own (tmp_path_factory, ...)
            shared.add(f"{where.stem}.{name}")
    return shared


def assign_xdist_groups(items) -> None:
    """Put the tests that share something wider than a test on one pytest-xdist worker, in one group.

    The suite runs on several workers (``-n`` and ``--dist loadgroup`` in
    setup.cfg's addopts); each worker is a pytest session of its own, running
    its tests one after another. Tests that share a module- or session-scoped
    fixture (a warm pool, a reference run, the local SLURM cluster of
    ``slurm_env``) or Ray (``tests/cluster/``: one Ray at a time, never two side
    by side) form one group, so the fixture is made once and a machine-wide
    resource has one owner; two groups that a test joins are one. A test with
    its own ``xdist_group`` mark keeps it.
    """
    root: dict[str, str] = {}

    def find(key: str) -> str:
        while root.setdefault(key, key) != key:
            key = root[key]
        return key

    grouped = []
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            shared = sorted(_shared_with_other_tests(item))
            for key in shared[1:]:
                root[find(key)] = find(shared[0])
            if shared:
                grouped.append((item, shared[0]))
    for item, key in grouped:  # every worker collects the same items in the same order: the same names
        item.add_marker(pytest.mark.xdist_group(find(key)))


def pytest_configure(config):
    """Compile the package, the tests and the examples to bytecode once, before any test process starts.

    Where PYTHONDONTWRITEBYTECODE is set (as on this project's machines and CI)
    nothing is ever written, so each of the suite's thousand-odd processes
    (workers, ranks, scripts) compiled nn_handler from source again: about
    0.3 s of CPU a process. Bytecode is still read where the variable is set.

    Then every process the suite starts gets the suite's ``sitecustomize`` (see :data:`helpers.QUICK_EXIT`).
    """
    # Every process started from here on (pytest-xdist's workers, the tests' scripts, ranks, executor servers)
    # skips the last garbage collection at its exit: tests/scripts/quick_exit/sitecustomize.py.
    os.environ["PYTHONPATH"] = with_quick_exit(os.environ.get("PYTHONPATH"))
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # the controller: its workers start after this
        _compile_site_packages_if_pip_did_not()
        for folder in ("nn_handler", "tests", "examples"):
            compileall.compile_dir(REPO / folder, quiet=1)
    _preload_dynamo_in_this_process_s_worker_server()


def _preload_dynamo_in_this_process_s_worker_server() -> None:
    """Have the worker server of this pytest process import ``torch._dynamo`` once, for every rank it forks.

    torch imports ``torch._dynamo`` (with sympy and FSDP) the first time an optimizer is made: about 3 s of CPU,
    as much as ``import torch``, in every rank and worker that trains. The suite's processes fork some hundred
    of them from their server; imported there once, each fork has it. The module is torch's own and would be
    imported by the same ranks anyway; nothing of the caller reaches a worker. Only here, in the test processes
    (a script that a test starts has a server of its own, as a user's has), and only without CUDA: a module
    imported in the server is in every worker, and this one is not checked there for initialising CUDA.
    """
    if os.environ.get("NN_HANDLER_TEST_NO_PRELOAD"):
        return
    import torch

    from nn_handler.utils._workers import server

    if not torch.cuda.is_available() and "torch._dynamo" not in server.PRELOAD:
        server.PRELOAD = [*server.PRELOAD, "torch._dynamo"]


def _compile_site_packages_if_pip_did_not() -> None:
    """After ``pip install --no-compile`` (the README's test command), compile the environment's packages on
    every core at once: pip compiles them one file after another, about 45 s of a 2-core machine's install.

    Checked by torch's own bytecode; a separate process, so that compileall's process pool starts no
    multiprocessing server in this one (the executor's workers come from a server of their own making).
    """
    spec = importlib.util.find_spec("torch")  # found, not imported
    if spec is None or spec.origin is None or os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return
    # Left out, never imported here: the packages' own test suites (a sixth of the files), the transformers
    # models other than the three the tests build (nine tenths of transformers' code), and Ray's RLlib, Serve
    # and LLM libraries; about a quarter of the CPU time. Whatever is imported anyway compiles as it is.
    # Exit status ignored: a file or two of the packages' own is not valid Python 3.11 (pip skips those too).
    never_imported = r"/tests/|/transformers/models/(?!__init__|auto/|bert/|esm/|gpt2/)|/ray/(rllib|serve|llm)/"
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "-x", never_imported,
                    sysconfig.get_paths()["purelib"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Modules whose tests mostly wait (a stall timeout running out, a rank asleep on purpose): a few CPU seconds in
# a minute of waiting.
MOSTLY_WAITING = {REPO / "tests" / "ranks" / "test_stall.py"}


def spread_waiting_tests(items: list, head: int) -> list:
    """``items`` with the tests of MOSTLY_WAITING spread evenly over the first ``head`` (the slow tests).

    Run one after another, they came to the workers together: for half a minute every worker waited and the
    2-core machine was half idle. Spread out, one worker waits while the others keep the cores busy.
    """
    waiting = [item for item in items[:head] if Path(item.path) in MOSTLY_WAITING]
    if not waiting:
        return items
    spread = [item for item in items[:head] if Path(item.path) not in MOSTLY_WAITING]
    gaps = len(spread)
    for k in reversed(range(len(waiting))):  # from the back, so that the places before stay where they were
        spread.insert((2 * k + 1) * gaps // (2 * len(waiting)), waiting[k])
    return spread + items[head:]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    assign_xdist_groups(items)
    for item in items:  # what starts processes is slow: the quick subset (-m "not slow") is the rest
        path = Path(item.path)
        if path.is_relative_to(REPO / "tests") and path.relative_to(REPO / "tests").parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
    # The modules with slow tests first, the quick ones after: pytest-xdist hands tests out in this order, so
    # the quick ones fill the workers' last minutes instead of a long test running alone at the end.
    with_slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in with_slow)  # stable: each module's order stays
    items[:] = spread_waiting_tests(items, len([item for item in items if item.path in with_slow]))
    import torch  # here, not at the top: the controller compiles the packages before anything imports them

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_xdist_node_collection_finished(node, ids):
    # pytest-xdist hands a test's group to its scheduler as a suffix of the node id. Where a pytest
    # release drops that suffix (9.2: pytest-dev/pytest-xdist#1386, hence pytest<9.2 in the test extra),
    # the groups would be spread over the workers without a word, two SLURM clusters or Rays at once: stop.
    if node.config.getvalue("dist") == "loadgroup":
        lost = [nodeid for nodeid in ids if nodeid.startswith("tests/cluster/") and "@" not in nodeid]
        if lost:
            pytest.exit(f"pytest-xdist did not apply the xdist_group of {lost[0]} (and {len(lost) - 1} more) "
                        f"with pytest {pytest.__version__}: install the test extra (pip install -e '.[test]') "
                        f"or run with -n 0", returncode=pytest.ExitCode.USAGE_ERROR)


def local_slurm_script() -> Path:
    """The script that runs a local SLURM cluster: $LOCAL_SLURM_SCRIPT, else ../shared/tools/local-slurm.sh."""
    return Path(os.environ.get("LOCAL_SLURM_SCRIPT") or REPO.parent / "shared" / "tools" / "local-slurm.sh")


@pytest.fixture(scope="session")
def slurm_env():
    """Environment of a real single-node SLURM cluster (started by local-slurm.sh, see local_slurm_script).

    The cluster's daemons (munged, slurmctld, slurmd) outlive any test, so the
    session stops them at its end, unless they were running before it started
    (another session, or a person, is using them).
    """
    script = local_slurm_script()
    if not script.exists():
        pytest.skip(f"no SLURM cluster script at {script} (set LOCAL_SLURM_SCRIPT)")
    if os.geteuid() != 0:
        pytest.skip("local-slurm.sh needs root")
    # `status` exits 0 only when all three daemons run.
    was_running = subprocess.run(["bash", str(script), "status"], capture_output=True, timeout=60).returncode == 0
    try:
        proc = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.skip(f"local SLURM cluster did not start: {proc.stderr[-500:]}")
        env = dict(line.removeprefix("export ").split("=", 1) for line in proc.stdout.split("\n") if "=" in line)
        if not shutil.which("srun"):
            pytest.skip("srun not on PATH after starting the cluster")
        yield env
    finally:
        if not was_running:  # what this session started (or half-started), it stops
            subprocess.run(["bash", str(script), "stop"], capture_output=True, timeout=120)
