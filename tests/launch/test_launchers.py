"""initialize_ddp under the real launchers: torchrun, mpirun and srun, as subprocesses."""

import os
import shutil
import sys

import pytest

from helpers import parse_results, run_command
from nn_handler.utils.ddp import find_free_port

pytestmark = pytest.mark.slow
SCRIPT = "tests/scripts/allreduce.py"


def _check_two_ranks(result, launcher):
    assert result.returncode == 0, result.stdout[-3000:]
    rows = parse_results(result.stdout)
    assert [r["rank"] for r in rows] == [0, 1], result.stdout[-3000:]
    for row in rows:
        assert row["launcher"] == launcher
        assert row["distributed"] is True and row["world_size"] == 2
        assert row["local_rank"] == row["rank"] and row["device"] == "cpu"
        assert row["sum"] == 3.0


def test_torchrun_two_processes():
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={find_free_port()}", SCRIPT], timeout=120)
    _check_two_ranks(result, "torchrun")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_mpirun_two_processes():
    result = run_command(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, SCRIPT],
                         timeout=120)
    _check_two_ranks(result, "openmpi")


def test_srun_two_tasks(slurm_env):
    result = run_command(["srun", "-N1", "-n2", "--time=2", sys.executable, SCRIPT], env=slurm_env, timeout=150)
    _check_two_ranks(result, "slurm")


_FAKE_CLUSTER = """#!/bin/bash
# Stands in for local-slurm.sh: records each command; `status` answers as told.
echo "$1" >> "$FAKE_SLURM_LOG"
case "$1" in
  status) exit "$FAKE_SLURM_STATUS" ;;
  start) echo "export SLURM_CONF=/fake/slurm.conf" ;;
esac
"""

_USES_CLUSTER = """
def test_one(slurm_env):
    assert slurm_env == {"SLURM_CONF": "/fake/slurm.conf"}

def test_two(slurm_env):
    assert slurm_env["SLURM_CONF"] == "/fake/slurm.conf"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the slurm_env fixture needs root")
@pytest.mark.parametrize("running_before, calls", [(False, ["status", "start", "stop"]), (True, ["status", "start"])])
def test_a_session_stops_the_cluster_it_started(tmp_path, running_before, calls):
    """A pytest session in a subprocess, with a fake cluster script: it stops the cluster once, at its end,
    and only when the cluster was not running before it."""
    from helpers import REPO

    (tmp_path / "bin").mkdir()
    script, srun = tmp_path / "local-slurm.sh", tmp_path / "bin" / "srun"
    script.write_text(_FAKE_CLUSTER)
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    (tmp_path / "test_uses_cluster.py").write_text(_USES_CLUSTER)
    log = tmp_path / "calls.log"
    env = {"LOCAL_SLURM_SCRIPT": str(script), "FAKE_SLURM_LOG": str(log),
           "FAKE_SLURM_STATUS": "0" if running_before else "3",
           "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    result = run_command([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "test_uses_cluster.py"], env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-3000:]
    assert log.read_text().split() == calls
