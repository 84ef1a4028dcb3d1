"""NNHandler.launch under a launch that already started every rank: fn runs once per rank, in that process.

Before, each rank of a torchrun job started a local group of its own, whose
ranks inherited TORCHELASTIC_USE_AGENT_STORE and all waited, as clients, for a
rendezvous store that nobody hosted (silently, until the group's 60-minute
timeout, before any watchdog runs); under srun each task trained alone.
"""

import shutil
import sys

import pytest

from helpers import parse_results, run_command
from nn_handler.utils.ddp import find_free_port

pytestmark = pytest.mark.slow
SCRIPT = "tests/scripts/launch_anywhere.py"
RUN_S = 120  # a launch takes ~10 s; a hang is cut here


def _check_ran_in_the_launchers_processes(result, launcher):
    assert result.returncode == 0, result.stdout[-3000:]
    rows = parse_results(result.stdout)
    assert [r["rank"] for r in rows] == [0, 1], result.stdout[-3000:]
    for row in rows:
        assert row["pid"] == row["caller"], "fn ran in a process of its own, not in the launcher's rank"
        assert row["world_size"] == 2 and row["sum"] == 3.0 and row["tag"] == "from the script"
        assert row["group_left"]  # launch joined the launcher's group for fn, and left it
    lines = [line for line in result.stdout.splitlines() if "NNHandler.launch:" in line]
    assert len(lines) == 2, result.stdout[-3000:]
    for rank in (0, 1):  # one line per rank, saying what happened
        assert sum(f"running body here, as rank {rank} of 2 started by {launcher} (timeout=60s is the launcher's "
                   "to enforce)" in line for line in lines) == 1, lines


def test_under_torchrun_each_rank_runs_fn_once_in_its_own_process():
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={find_free_port()}", SCRIPT, "2"], timeout=RUN_S)
    _check_ran_in_the_launchers_processes(result, "torchrun")


def test_under_srun_each_task_runs_fn_once_in_its_own_process(slurm_env):
    result = run_command(["srun", "-N1", "-n2", "--time=2", sys.executable, SCRIPT, "2"], env=slurm_env,
                         timeout=RUN_S + 30)
    _check_ran_in_the_launchers_processes(result, "slurm")


def _launch_inside_a_rank(rank):
    import os

    import torch.distributed as dist

    from nn_handler import ConfigurationError, NNHandler

    def inner(tag):
        return dist.get_rank(), os.getpid(), tag

    ran = NNHandler.launch(inner, "here", nprocs=2, timeout=30)
    try:
        NNHandler.launch(inner, "never", nprocs=3)
        wrong = "no error"
    except ConfigurationError as exc:
        wrong = str(exc)
    return ran, os.getpid(), dist.is_initialized(), wrong


def test_a_group_already_up_runs_fn_here_and_refuses_another_nprocs():
    from nn_handler.testing import run_distributed

    results = run_distributed(_launch_inside_a_rank, nprocs=2, timeout=60)
    for rank, (ran, pid, still_up, wrong) in enumerate(results):
        assert ran == (rank, pid, "here")  # this rank's own result, from this process
        assert still_up  # the group is the caller's: launch leaves it up
        assert wrong.startswith(f"NNHandler.launch(fn, nprocs=3): this process is rank {rank} of 2 in a process "
                                "group already up"), wrong
        assert "pass nprocs=2 or leave it out" in wrong


def test_a_launchers_single_process_starts_the_group_its_agent_does_not_host(monkeypatch):
    """torchrun --nproc_per_node=1 (or srun -n1 in a job with several GPUs): launch starts its ranks, and they
    do not wait for torchrun's agent store (they used to inherit TORCHELASTIC_USE_AGENT_STORE and all hang)."""
    from nn_handler import NNHandler

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}.items():
        monkeypatch.setenv(name, value)

    def world():
        import torch.distributed as dist

        return dist.get_world_size()

    assert NNHandler.launch(world, nprocs=2, timeout=60) == 2
