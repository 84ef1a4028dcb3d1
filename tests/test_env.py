"""Launch-environment parsing, on plain dicts (no processes)."""

import pytest

from nn_handler.errors import LaunchEnvironmentError
from nn_handler.utils._env import derive_port, detect_launch_env, expand_nodelist, missing_rendezvous_message


def test_plain_python_is_not_distributed():
    env = detect_launch_env({})
    assert (env.launcher, env.rank, env.world_size, env.is_distributed) == ("none", 0, 1, False)


def test_torchrun_variables():
    env = detect_launch_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
         "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    )
    assert env.launcher == "torchrun"
    assert (env.rank, env.local_rank, env.world_size) == (3, 1, 4)
    assert (env.master_addr, env.master_port) == ("node0", 29500)
    assert env.restart_count == 2 and env.uses_agent_store


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("node1", ["node1"]),
        ("a1,b[8-10]", ["a1", "b8", "b9", "b10"]),
        ("n[009-011]", ["n009", "n010", "n011"]),
        ("r[1-2]-g[1,3]", ["r1-g1", "r1-g3", "r2-g1", "r2-g3"]),
    ],
)
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


def test_expand_nodelist_rejects_garbage():
    with pytest.raises(LaunchEnvironmentError, match="cannot parse SLURM node list"):
        expand_nodelist("gpu[a-b]")


def test_slurm_srun_task_derives_master_from_nodelist_and_job_id():
    base = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "81234"}
    env = detect_launch_env(base)
    assert env.launcher == "slurm"
    assert (env.rank, env.local_rank, env.world_size) == (1, 1, 4)
    assert env.master_addr == "gpu03"
    assert env.master_port == derive_port("81234")
    # every task of the job computes the same port
    assert detect_launch_env({**base, "SLURM_PROCID": "0"}).master_port == env.master_port


def test_slurm_master_addr_variable_wins():
    env = detect_launch_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
                             "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "7",
                             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


def test_python_in_a_batch_script_is_single_process():
    # sbatch -n 2 script.sh running `python train.py` without srun: one process.
    env = detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"})
    assert env.launcher == "none" and env.world_size == 1


def test_torchrun_inside_slurm_wins():
    env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                             "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env.launcher == "torchrun" and env.rank == 1


def test_openmpi_single_node_defaults_to_loopback_and_job_port():
    base = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "prterun-host-1234@1"}
    env = detect_launch_env(base)
    assert env.launcher == "openmpi"
    assert (env.rank, env.local_rank, env.world_size) == (1, 1, 2)
    assert env.master_addr == "127.0.0.1"
    assert env.master_port == derive_port("prterun-host-1234@1")
    legacy = dict(base)
    del legacy["PMIX_NAMESPACE"]
    legacy["OMPI_MCA_ess_base_jobid"] = "99"
    assert detect_launch_env(legacy).master_port == derive_port("99")


def test_openmpi_multi_node_needs_master_variables():
    env = detect_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "x"})
    assert env.master_addr is None and env.master_port is None
    message = missing_rendezvous_message(env)
    assert "MASTER_ADDR" in message and "MASTER_PORT" in message and "mpirun -x" in message


def test_pmi_variables():
    env = detect_launch_env({"PMI_RANK": "2", "PMI_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("pmi", 2, 3, "h")


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK must be in \[0, 2\).*got 2"),
        ({"RANK": "zero", "WORLD_SIZE": "2"}, r"RANK must be an integer, got 'zero'"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, r"WORLD_SIZE must be an integer, got 'two'"),
        ({"RANK": "0"}, r"WORLD_SIZE is not"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE must be >= 1"),
        ({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2"}, r"SLURM_PROCID must be an integer, got 'x'"),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "2"}, r"OMPI_COMM_WORLD_RANK must be in \[0, 2\)"),
    ],
)
def test_bad_launch_variables_are_named(environ, match):
    with pytest.raises(LaunchEnvironmentError, match=match):
        detect_launch_env(environ)
    assert issubclass(LaunchEnvironmentError, ValueError)


def test_derive_port_is_stable_and_in_range():
    assert derive_port("123") == derive_port("123")
    assert derive_port("123") != derive_port("124")
    assert all(12000 <= derive_port(j) < 32000 for j in ["1", "999999", "abc@1"])
