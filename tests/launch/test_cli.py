"""``python -m nn_handler info | check``: traps and report on plain data; the real commands as subprocesses."""

from __future__ import annotations

import io
import json
import re
import socket
import sys

import pytest
import torch

import nn_handler
from helpers import run_command
from nn_handler import _cli
from nn_handler.utils._env import LaunchEnv, detect_launch_env

NO_TRAPS = dict(cuda_initialized=False, cuda_count=0, nccl=False, interfaces={"lo", "eth0"}, shm_bytes=8 << 30)


@pytest.fixture
def busy_port():
    """A port with a server listening on it, as a running job's rendezvous store would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    return nn_handler.find_free_port()


# ----------------------------------------------------------------------------- traps, on plain data
def test_no_traps_in_a_clean_environment():
    environ = {"MASTER_PORT": str(_free_port())}
    assert _cli.find_traps(environ, detect_launch_env({}), None, **NO_TRAPS) == []


def test_master_port_in_use_is_reported_with_the_remedy(busy_port):
    traps = _cli.find_traps({"MASTER_PORT": str(busy_port)}, LaunchEnv(), None, **NO_TRAPS)
    assert len(traps) == 1
    assert f"MASTER_PORT {busy_port} is already in use" in traps[0] and "find_free_port" in traps[0]


def test_torchrun_default_port_is_checked_when_no_port_is_set(monkeypatch):
    monkeypatch.setattr(_cli, "port_in_use", lambda port: port == 29500)
    traps = _cli.find_traps({}, LaunchEnv(), None, **NO_TRAPS)
    assert len(traps) == 1 and "torchrun's default port 29500" in traps[0] and "--master_port" in traps[0]


def test_port_held_by_the_torchrun_agent_is_not_a_trap(busy_port):
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy_port),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert _cli.find_traps(environ, detect_launch_env(environ), None, **NO_TRAPS) == []


def test_port_only_matters_on_the_rank_that_listens(busy_port):
    environ = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(busy_port)}
    assert _cli.find_traps(environ, detect_launch_env(environ), None, **NO_TRAPS) == []
    environ["SLURM_PROCID"] = "0"
    traps = _cli.find_traps(environ, detect_launch_env(environ), None, **NO_TRAPS)
    assert len(traps) == 1 and f"MASTER_PORT {busy_port} is already in use" in traps[0]


def test_launch_problems_are_traps():
    environ = {"MASTER_PORT": str(_free_port())}
    traps = _cli.find_traps(environ, None, "RANK is set but WORLD_SIZE is not", **NO_TRAPS)
    assert traps == ["the launch environment is invalid: RANK is set but WORLD_SIZE is not"]
    env = LaunchEnv(launcher="pmi", rank=0, world_size=2)
    (trap,) = _cli.find_traps(environ, env, None, **NO_TRAPS)
    assert "needs MASTER_ADDR and MASTER_PORT" in trap


@pytest.mark.parametrize("settings, expected", [
    ({"cuda_initialized": True}, "CUDA is already initialised in this process"),
    ({"cuda_count": 2, "nccl": False}, "2 CUDA devices but torch has no nccl backend"),
    ({"shm_bytes": 64 << 20}, "/dev/shm holds only 64 MiB"),
])
def test_process_traps(settings, expected):
    environ = {"MASTER_PORT": str(_free_port())}
    traps = _cli.find_traps(environ, LaunchEnv(), None, **{**NO_TRAPS, **settings})
    assert len(traps) == 1 and expected in traps[0]


@pytest.mark.parametrize("variable, value, is_trap", [
    ("GLOO_SOCKET_IFNAME", "eth0", False),
    ("GLOO_SOCKET_IFNAME", "eth0,ib0", True),       # gloo wants exact names, every one must exist
    ("NCCL_SOCKET_IFNAME", "eth", False),           # nccl matches prefixes
    ("NCCL_SOCKET_IFNAME", "=eth", True),           # ... or exact names after "="
    ("NCCL_SOCKET_IFNAME", "ib", True),
    ("NCCL_SOCKET_IFNAME", "^docker", False),       # an exclusion list names what not to use
])
def test_socket_interface_names_are_checked(variable, value, is_trap):
    environ = {variable: value, "MASTER_PORT": str(_free_port())}
    traps = _cli.find_traps(environ, LaunchEnv(), None, **NO_TRAPS)
    assert bool(traps) is is_trap, traps
    if is_trap:
        assert traps[0].startswith(f"{variable}={value}") and "eth0, lo" in traps[0]


# ----------------------------------------------------------------------------- report
def test_collect_info_reads_the_given_environment():
    environ = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
    info = _cli.collect_info(environ)
    assert info["versions"]["nn_handler"] == nn_handler.__version__
    assert info["versions"]["torch"] == str(torch.__version__)
    assert info["launch"]["launcher"] == "torchrun" and info["launch"]["rank"] == 1
    assert info["launch"]["world_size"] == 4 and info["launch"]["master_addr"] == "10.0.0.7"
    assert info["backends"]["gloo"] is torch.distributed.is_gloo_available()
    assert len(info["cuda"]["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    json.dumps(info)  # plain data all the way down

    broken = _cli.collect_info({"RANK": "0"})
    assert broken["launch"]["error"].startswith("RANK is set but WORLD_SIZE is not")
    assert any(w.startswith("the launch environment is invalid") for w in broken["warnings"])


def test_info_reports_ray_and_the_cluster_it_would_join_without_starting_it(monkeypatch):
    had_ray = "ray" in sys.modules
    info = _cli.collect_info({"RAY_ADDRESS": "ray://head:10001"})
    assert info["ray"]["address"] == "ray://head:10001"
    assert ("ray" in sys.modules) == had_ray  # looked up among the installed packages, not imported
    text = _cli.format_info(info)
    if info["ray"]["version"] is None:
        assert "ray            not installed" in text and "nn_handler[ray]" in text
    else:
        assert f"ray            {info['ray']['version']}; joins the cluster at RAY_ADDRESS=ray://head:10001" in text
    assert _cli.collect_info({})["ray"]["address"] is None
    monkeypatch.setattr(_cli._sysinfo, "ray_report", lambda environ: {"version": None, "address": None})
    assert "backend='ray' needs pip install 'nn_handler[ray]'" in _cli.format_info(_cli.collect_info({}))


@pytest.mark.parametrize("environ, variable", [
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK must be an integer, got ''"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "MASTER_PORT must be a TCP port in 1..65535, got '70000'"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
])
def test_info_reports_wrong_launch_variables_instead_of_crashing(environ, variable, monkeypatch):
    info = _cli.collect_info(environ)
    assert info["launch"]["error"].startswith(variable) and "torchrun" in info["launch"]["error"]
    assert f"the launch environment is invalid: {variable}" in info["warnings"][0]
    assert f"launch         invalid: {variable}" in _cli.format_info(info)
    # The command itself: the report is printed, and the exit status says the environment is wrong.
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    assert _cli.main(["info"], out=out) == 1
    assert f"launch         invalid: {variable}" in out.getvalue()
    out = io.StringIO()
    assert _cli.main(["info", "--json"], out=out) == 1
    assert json.loads(out.getvalue())["launch"]["error"].startswith(variable)


def test_python_m_info_with_an_empty_rank_exits_1_with_the_report():
    result = run_command([sys.executable, "-m", "nn_handler", "info"], env={"RANK": "", "WORLD_SIZE": "2"},
                         timeout=120)
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stdout
    assert "launch         invalid: RANK must be an integer, got ''" in result.stdout


BATCH_STEP = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_JOB_NODELIST": "node1"}


def test_info_inside_an_allocation_without_srun_says_so(monkeypatch):
    info = _cli.collect_info(BATCH_STEP)
    assert info["launch"]["launcher"] == "none"
    assert info["launch"]["slurm_job_without_srun"] == {"job_id": "4242", "tasks": 4}
    (warning,) = [w for w in info["warnings"] if "SLURM" in w]
    assert "SLURM job 4242 with 4 tasks" in warning and "runs alone" in warning
    assert "`srun python train.py` starts the 4 tasks" in warning
    text = _cli.format_info(info)
    assert "launch         none: a plain process (rank 0 of 1) in SLURM job 4242 with 4 tasks, not started by srun" \
        in text
    # An srun task of the same job is not warned about.
    step = _cli.collect_info({**BATCH_STEP, "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1"})
    assert step["launch"]["launcher"] == "slurm" and not any("srun python" in w for w in step["warnings"])
    # The command: reported, but the environment is valid (exit 0).
    for name, value in BATCH_STEP.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    out = io.StringIO()
    assert _cli.main(["info"], out=out) == 0
    assert "SLURM job 4242 with 4 tasks" in out.getvalue()


def test_format_info_shows_devices_launch_and_warnings():
    info = {
        "versions": {"nn_handler": "9.9", "python": "3.11.0", "torch": "2.13.0", "cloudpickle": "3.1", "numpy": None},
        "platform": {"system": "Linux", "executable": "python", "hostname": "node7", "cpus": 64},
        "cuda": {"available": True, "build": "12.8", "devices": [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_memory_gib": 79.19, "capability": "9.0"}]},
        "backends": {"nccl": True, "gloo": True, "mpi": False},
        "launch": {"launcher": "slurm", "rank": 3, "local_rank": 1, "world_size": 8, "master_addr": "gpu01",
                   "master_port": 21234},
        "workers": {"start_method": "forkserver", "shm_gib": 0.06},
        "warnings": ["/dev/shm holds only 64 MiB: ..."],
    }
    text = _cli.format_info(info)
    assert "numpy        not installed" in text
    assert "cuda:0  NVIDIA H100 80GB HBM3  79.2 GiB  compute capability 9.0" in text
    assert "nccl: yes  gloo: yes  mpi: no" in text
    assert "slurm: rank 3 of 8, local rank 1, master gpu01:21234" in text
    assert text.endswith("warnings\n  - /dev/shm holds only 64 MiB: ...")


# ----------------------------------------------------------------------------- check, without processes
def test_run_checks_reports_every_step_and_fails_when_one_fails():
    def broken():
        raise RuntimeError("a bug in a step\nsecond line")

    steps = [
        lambda: [_cli.CheckResult("executor", True, 1.25, "2 workers on cpu, cpu")],
        lambda: [_cli.CheckResult("process group (gloo)", False, 3.0, "rank 0: RuntimeError: no route"),
                 _cli.CheckResult("all-reduce (gloo)", None, 0.0, "skipped")],
        broken,
    ]
    out = io.StringIO()
    assert _cli.run_checks(steps, out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["PASS", "executor", "1.25", "s", "2", "workers", "on", "cpu,", "cpu"]
    assert lines[1].split()[:4] == ["FAIL", "process", "group", "(gloo)"]
    assert lines[2].split()[:2] == ["SKIP", "all-reduce"]
    assert lines[3].split()[0] == "FAIL" and lines[3].endswith("RuntimeError: a bug in a step")
    assert lines[4].startswith("2 of 4 checks FAILED")

    out = io.StringIO()
    assert _cli.run_checks(steps[:1], out) == 0
    assert out.getvalue().splitlines()[-1].startswith("all 1 checks passed")


@pytest.mark.parametrize("nprocs, cuda_count, nccl, headline, n_steps", [
    (None, 0, False, "2 CPU workers (no CUDA device)", 2),
    (3, 0, False, "3 CPU workers (no CUDA device)", 2),
    (None, 4, True, "4 of 4 CUDA devices", 3),
    (2, 4, True, "2 of 4 CUDA devices", 3),
    (8, 1, False, "1 of 1 CUDA device", 2),
])
def test_plan_checks(nprocs, cuda_count, nccl, headline, n_steps):
    got, steps = _cli.plan_checks(nprocs, 30.0, cuda_count, nccl)
    assert got == headline and len(steps) == n_steps


# ----------------------------------------------------------------------------- command line
@pytest.mark.parametrize("argv, message", [
    (["frob"], "invalid choice: 'frob'"),
    ([], "the following arguments are required"),
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
    (["check", "--nprocs", "0"], "--nprocs: must be an int >= 1, got 0"),
    (["check", "--nprocs", "two"], "--nprocs: must be an int >= 1, got 'two'"),
    (["check", "--timeout", "-1"], "--timeout: must be a number of seconds > 0, got -1"),
])
def test_usage_errors_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        _cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m nn_handler") and message in err


def test_info_in_process_text_and_json():
    out = io.StringIO()
    assert _cli.main(["info"], out=out) == 0
    assert out.getvalue().startswith(f"nn_handler {nn_handler.__version__}\n")
    out = io.StringIO()
    assert _cli.main(["info", "--json"], out=out) == 0
    assert set(json.loads(out.getvalue())) == {"versions", "extras", "threads", "settings", "platform", "cuda",
                                               "backends", "launch", "ray", "workers", "warnings"}


def test_python_m_info_json_reports_the_launch_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "29400"}
    result = run_command([sys.executable, "-m", "nn_handler", "info", "--json"], env=env, timeout=120)
    assert result.returncode == 0, result.stdout
    info = json.loads(result.stdout)
    assert info["launch"]["launcher"] == "torchrun" and info["launch"]["rank"] == 1
    assert info["versions"]["torch"] == str(torch.__version__)


def test_info_reports_the_extras_threads_and_nn_handler_settings_a_bug_report_needs():
    from importlib import metadata

    environ = {"NN_HANDLER_STALL_TIMEOUT": "60", "NN_HANDLER_DEBUG": "1", "OMP_NUM_THREADS": "3", "PATH": "/bin"}
    info = _cli.collect_info(environ)
    assert info["extras"]["tqdm"] == metadata.version("tqdm")  # installed with the library
    assert set(info["extras"]) >= {"tensorboard", "matplotlib", "tqdm", "ray", "transformers", "numpy"}
    assert info["threads"]["torch"] == torch.get_num_threads() and info["threads"]["OMP_NUM_THREADS"] == "3"
    assert info["threads"]["interop"] == torch.get_num_interop_threads()
    assert info["settings"] == {"NN_HANDLER_DEBUG": "1", "NN_HANDLER_STALL_TIMEOUT": "60"}
    text = _cli.format_info(info)
    assert f"tqdm {metadata.version('tqdm')}" in text
    assert f"threads        torch {torch.get_num_threads()}, interop" in text and "OMP_NUM_THREADS=3" in text
    assert "NN_HANDLER_DEBUG=1, NN_HANDLER_STALL_TIMEOUT=60" in text


def test_python_m_info_under_torchrun_prints_one_report_per_node_not_per_rank():
    from nn_handler.utils.ddp import find_free_port

    result = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={find_free_port()}", "-m", "nn_handler", "info"], timeout=120)
    assert result.returncode == 0, result.stdout
    assert result.stdout.count(f"nn_handler {nn_handler.__version__}\n") == 1, result.stdout
    assert "launch         torchrun: rank 0 of 2, local rank 0" in result.stdout, result.stdout


def test_python_m_unknown_command_exits_2():
    result = run_command([sys.executable, "-m", "nn_handler", "train"], timeout=120)
    assert result.returncode == 2
    assert "invalid choice: 'train' (choose from 'info', 'check')" in result.stdout


def test_python_m_check_passes_on_this_machine():
    result = run_command([sys.executable, "-m", "nn_handler", "check", "--nprocs", "2", "--timeout", "90"],
                         timeout=200)
    assert result.returncode == 0, result.stdout
    passed = re.findall(r"^  PASS  (.+?) +\d+\.\d+ s", result.stdout, flags=re.M)
    if not torch.cuda.is_available():
        assert passed == ["executor", "process group (gloo)", "all-reduce (gloo)", "DDP step (gloo)"]
    elif torch.distributed.is_nccl_available():
        assert passed[0] == "executor" and passed[-1] == "DDP step (nccl)"
    assert "FAIL" not in result.stdout and "checks passed" in result.stdout


def test_python_m_check_fails_with_a_bad_socket_interface():
    # A real cluster mistake: GLOO_SOCKET_IFNAME naming an interface this node lacks. One rank, so
    # that no peer is left retrying to reach a store that the failed rank never opened.
    result = run_command([sys.executable, "-m", "nn_handler", "check", "--nprocs", "1", "--timeout", "90"],
                         env={"GLOO_SOCKET_IFNAME": "nosuchif0"}, timeout=200)
    assert result.returncode == 1, result.stdout
    assert "warning: GLOO_SOCKET_IFNAME=nosuchif0 names nosuchif0" in result.stdout
    assert "FAIL  process group (gloo)" in result.stdout and "nosuchif0" in result.stdout.split("FAIL")[1]
    assert "checks FAILED" in result.stdout
