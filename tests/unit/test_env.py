"""Launch-environment parsing, on plain dicts (no processes)."""

import pytest

from nn_handler.errors import LaunchEnvironmentError
from nn_handler.utils._env import (
    derive_port,
    detect_launch_env,
    expand_nodelist,
    missing_rendezvous_message,
    slurm_job_without_srun,
)


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
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK must be in \[0, 2\).*got '2'"),
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


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "x"}
MPIEXEC = {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "environ, name, value, launcher, expected",
    [
        # set but empty, not an integer, negative, out of range: one message style for every variable
        ({**TORCHRUN, "RANK": ""}, "RANK", "", "torchrun", "must be an integer"),
        ({**TORCHRUN, "RANK": "-1"}, "RANK", "-1", "torchrun", "must be >= 0"),
        ({**TORCHRUN, "WORLD_SIZE": ""}, "WORLD_SIZE", "", "torchrun", "must be an integer"),
        ({**TORCHRUN, "LOCAL_RANK": ""}, "LOCAL_RANK", "", "torchrun", "must be an integer"),
        ({**TORCHRUN, "LOCAL_RANK": "-1"}, "LOCAL_RANK", "-1", "torchrun", "must be >= 0"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK", "2", "torchrun", "must be in [0, 2) because WORLD_SIZE=2"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1", "RANK": "1"}, "LOCAL_RANK", "1", "torchrun",
         "must be in [0, 1) because LOCAL_WORLD_SIZE=1"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE", "0", "torchrun", "must be >= 1"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE", "3", "torchrun",
         "must be in [1, 2] because WORLD_SIZE=2"),
        ({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT", "-1", "torchrun",
         "must be >= 0"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT", "70000", "torchrun", "must be a TCP port in 1..65535"),
        ({**TORCHRUN, "MASTER_PORT": "-5"}, "MASTER_PORT", "-5", "torchrun", "must be a TCP port in 1..65535"),
        ({**TORCHRUN, "MASTER_PORT": "0"}, "MASTER_PORT", "0", "torchrun", "must be a TCP port in 1..65535"),
        ({**TORCHRUN, "MASTER_PORT": ""}, "MASTER_PORT", "", "torchrun", "must be a TCP port in 1..65535"),
        ({**TORCHRUN, "MASTER_ADDR": " "}, "MASTER_ADDR", " ", "torchrun", "must be a host name or address"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE", "2", "torchrun", "is set but RANK is not"),
        ({"WORLD_SIZE": ""}, "WORLD_SIZE", "", "torchrun", "is set but RANK is not"),
        ({**SRUN, "SLURM_PROCID": ""}, "SLURM_PROCID", "", "SLURM", "must be an integer"),
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS", "0", "SLURM", "must be >= 1"),
        ({**SRUN, "SLURM_LOCALID": "-1"}, "SLURM_LOCALID", "-1", "SLURM", "must be >= 0"),
        ({**SRUN, "MASTER_PORT": "70000"}, "MASTER_PORT", "70000", "SLURM", "must be a TCP port in 1..65535"),
        ({**MPIRUN, "OMPI_COMM_WORLD_RANK": ""}, "OMPI_COMM_WORLD_RANK", "", "Open MPI", "must be an integer"),
        ({**MPIRUN, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK", "2", "Open MPI",
         "must be in [0, 2)"),
        ({**MPIRUN, "MASTER_PORT": "-5"}, "MASTER_PORT", "-5", "Open MPI", "must be a TCP port in 1..65535"),
        ({**MPIEXEC, "PMI_RANK": "-1"}, "PMI_RANK", "-1", "PMI", "must be >= 0"),
        ({**MPIEXEC, "PMI_SIZE": "two"}, "PMI_SIZE", "two", "PMI", "must be an integer"),
        ({**MPIEXEC, "MASTER_PORT": "70000"}, "MASTER_PORT", "70000", "PMI", "must be a TCP port in 1..65535"),
    ],
)
def test_wrong_launch_variables_name_the_variable_value_and_launcher(environ, name, value, launcher, expected):
    with pytest.raises(LaunchEnvironmentError) as info:
        detect_launch_env(environ)
    message = str(info.value)
    assert message.startswith(f"{name} ") and f"{name} {expected}" in message, message
    assert f"got {value!r}" in message or f"{name}={value!r}" in message, message
    assert f"The launcher looks like {launcher} " in message, message
    # and what to do: the launch command that sets the variable, or which variable to unset or fix
    assert "unset" in message or "export" in message or "start " in message, message


def test_launch_variables_that_are_right_still_pass():
    assert detect_launch_env({**TORCHRUN, "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "65535"}).master_port == 65535
    assert detect_launch_env({**TORCHRUN, "MASTER_PORT": "1"}).master_port == 1
    assert detect_launch_env({"WORLD_SIZE": "1"}).launcher == "none"  # a world of one is what runs
    # An sbatch script that exports WORLD_SIZE for its srun tasks: SLURM's variables decide.
    env = detect_launch_env({**SRUN, "WORLD_SIZE": "2"})
    assert (env.launcher, env.world_size) == ("slurm", 2)
    # sbatch --ntasks-per-node=4 then `srun -n 2`: the allocation's count bounds nothing in the step.
    assert detect_launch_env({**SRUN, "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "1"}).rank == 1


def test_a_plain_process_in_a_multi_task_allocation_is_detected():
    # `python train.py` typed in an sbatch script (sbatch -n 4): the batch step's variables, as the
    # local SLURM cluster sets them (no SLURM_STEP_* variables; SLURM_PROCID=0, SLURM_NTASKS=4).
    batch = {"SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "vm"}
    assert detect_launch_env(batch).launcher == "none"  # still a single process
    assert slurm_job_without_srun(batch) == ("77", 4)
    # srun tasks, one-task allocations, torchrun or mpirun inside the allocation, no SLURM at all: nothing to say
    assert slurm_job_without_srun({**batch, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0"}) is None
    assert slurm_job_without_srun({**batch, "SLURM_NTASKS": "1"}) is None
    assert slurm_job_without_srun({k: v for k, v in batch.items() if k != "SLURM_NTASKS"}) is None
    assert slurm_job_without_srun({**batch, **TORCHRUN}) is None
    assert slurm_job_without_srun({**batch, **MPIRUN}) is None
    assert slurm_job_without_srun({}) is None


def test_derive_port_is_stable_and_in_range():
    assert derive_port("123") == derive_port("123")
    assert derive_port("123") != derive_port("124")
    assert all(12000 <= derive_port(j) < 32000 for j in ["1", "999999", "abc@1"])
