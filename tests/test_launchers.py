"""initialize_ddp under the real launchers: torchrun, mpirun and srun, as subprocesses."""

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
