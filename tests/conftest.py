"""Shared fixtures: hygiene checks that every test leaves no process group,
no launcher variables and no child process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import LAUNCH_VARS, REPO

import pytest
import torch

_LAUNCH_VARS = LAUNCH_VARS


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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
