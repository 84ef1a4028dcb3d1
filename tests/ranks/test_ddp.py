"""nn_handler.utils.ddp: device resolution, initialize_ddp and the rank helpers."""

import warnings
from datetime import timedelta

import pytest
import torch

import nn_handler.utils.ddp as ddp
from nn_handler.errors import ConfigurationError, DeviceError, LaunchEnvironmentError
from nn_handler.testing import run_distributed
from nn_handler.utils.ddp import (
    _resolve_device,
    _should_use_distributed,
    cleanup_ddp,
    find_free_port,
    initialize_ddp,
    resolve_device,
    should_use_distributed,
)


@pytest.fixture
def two_gpus(monkeypatch):
    """Pretend two CUDA devices exist (nothing is allocated on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_seed_aliases_are_the_public_functions():
    assert _resolve_device is resolve_device
    assert _should_use_distributed is should_use_distributed


@pytest.mark.parametrize("spec", ["cpu", "CPU", torch.device("cpu")])
def test_cpu(spec):
    assert resolve_device(spec) == torch.device("cpu")


@pytest.mark.parametrize(
    "spec, expected",
    [("cuda", "cuda:1"), ("gpu", "cuda:1"), ("auto", "cuda:1"), ("cuda:0", "cuda:0"), (0, "cuda:0"),
     (torch.device("cuda"), "cuda:1"), (torch.device("cuda", 0), "cuda:0")],
)
def test_cuda_specs_use_the_local_rank(two_gpus, clean_env, spec, expected):
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert resolve_device(spec) == torch.device(expected)


@pytest.mark.parametrize("spec", ["cuda", "gpu", "cuda:1", 0, "mps"])
def test_falls_back_to_cpu_with_one_warning(no_gpu, monkeypatch, spec):
    monkeypatch.setattr(ddp, "_mps_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_device(spec) == torch.device("cpu")
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1 and "falling back to CPU" in str(runtime[0].message)


def test_auto_without_gpu_is_quietly_cpu(no_gpu, monkeypatch):
    monkeypatch.setattr(ddp, "_mps_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_device("auto") == torch.device("cpu")


def test_missing_gpu_index_names_the_count(two_gpus):
    with pytest.raises(DeviceError, match=r"cuda:7.*has 2 CUDA devices"):
        resolve_device("cuda:7")
    with pytest.raises(DeviceError, match=r"has 2 CUDA devices"):
        resolve_device(5)


@pytest.mark.parametrize("spec", ["tpu0", "cuda:x", "", "banana"])
def test_unknown_device_string(spec):
    with pytest.raises(DeviceError) as info:
        resolve_device(spec)
    assert str(info.value) == f"unknown device {spec!r}; use a GPU index, 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"


@pytest.mark.parametrize("spec", [-1, 1.5, None, True])
def test_bad_device_types(spec):
    with pytest.raises(DeviceError):
        resolve_device(spec)


def test_not_distributed_without_a_launcher(clean_env, no_gpu):
    assert initialize_ddp() == (False, 0, 0, 1, torch.device("cpu"))
    assert should_use_distributed(None) is False
    with pytest.warns(RuntimeWarning, match="running single-process"):
        assert should_use_distributed(True) is False
    assert should_use_distributed(False) is False
    assert ddp.get_rank() == 0 and ddp.get_world_size() == 1 and ddp.is_main_process()
    ddp.barrier()  # no group: a no-op
    cleanup_ddp()
    cleanup_ddp()  # twice is harmless


def test_should_use_distributed_follows_the_launcher(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    assert should_use_distributed(None) is True
    assert should_use_distributed(False) is False


@pytest.mark.parametrize("timeout", [-1, timedelta(seconds=-5), 0])
def test_non_positive_timeout(clean_env, timeout):
    with pytest.raises(ConfigurationError, match=r"timeout must be a timedelta or a number of seconds > 0, got "):
        initialize_ddp(timeout=timeout)


def test_world_size_without_master_variables(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchEnvironmentError) as info:
        initialize_ddp()
    message = str(info.value)
    assert "MASTER_ADDR and MASTER_PORT" in message and "torchrun" in message


def test_rank_not_below_world_size(clean_env):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchEnvironmentError, match=r"RANK must be in \[0, 2\)"):
        initialize_ddp()


def test_non_integer_rank_variable(clean_env):
    clean_env.setenv("RANK", "first")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchEnvironmentError, match="RANK must be an integer, got 'first'"):
        initialize_ddp()


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK must be an integer, got ''"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
     "MASTER_PORT must be a TCP port in 1..65535, got '70000'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "-5"},
     "MASTER_PORT must be a TCP port in 1..65535, got '-5'"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
])
def test_wrong_launch_variables_stop_initialize_ddp_before_torch(clean_env, no_gpu, environ, message):
    for name, value in environ.items():
        clean_env.setenv(name, value)
    with pytest.raises(LaunchEnvironmentError) as info:
        initialize_ddp()
    assert str(info.value).startswith(message) and "torchrun" in str(info.value)


def test_a_plain_process_in_a_multi_task_allocation_warns_once(clean_env, no_gpu, caplog, monkeypatch):
    # `python train.py` in an sbatch script with 4 tasks: runs alone (as before), and says so once.
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}.items():
        clean_env.setenv(name, value)
    clean_env.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    monkeypatch.setattr(ddp, "_warned_alone_in_slurm_job", False)
    monkeypatch.setattr("sys.argv", ["train.py", "--epochs", "3"])
    with caplog.at_level("WARNING", logger="nn_handler.utils.ddp"):
        assert initialize_ddp() == (False, 0, 0, 1, torch.device("cpu"))
        assert initialize_ddp() == (False, 0, 0, 1, torch.device("cpu"))
    warned = [r for r in caplog.records if "SLURM job 4242" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    text = warned[0].getMessage()
    assert "SLURM job 4242 with 4 tasks" in text and "runs alone" in text
    assert "`srun python train.py --epochs 3` starts the 4 tasks" in text


def test_local_rank_without_a_gpu_of_its_own(clean_env, two_gpus):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("LOCAL_RANK", "2")
    clean_env.setenv("WORLD_SIZE", "3")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "1")
    with pytest.raises(DeviceError, match="local rank 2 has no GPU: this node has 2 CUDA devices"):
        initialize_ddp()


def test_find_free_port_can_be_bound():
    import socket

    port = find_free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def _init_body(rank):
    import torch
    import torch.distributed as dist

    from nn_handler.utils import ddp

    first = ddp.initialize_ddp(timeout=30)
    again = ddp.initialize_ddp()
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return first, again, int(t), ddp.get_rank(), ddp.get_world_size(), ddp.is_main_process(), dist.get_backend()


def test_initialize_ddp_under_spawned_ranks():
    results = run_distributed(_init_body, nprocs=2, init=False, timeout=90)
    for rank, (first, again, total, r, ws, main, backend) in enumerate(results):
        assert first == (True, rank, rank, 2, torch.device("cpu"))
        assert again is None  # a group exists: nothing to do
        assert total == 3 and r == rank and ws == 2 and main == (rank == 0)
        assert backend == "gloo"


def _init_with_rank_1_slow_to_finish_its_group(rank):
    import time

    import torch.distributed as dist

    from nn_handler.utils import ddp

    if rank == 1:
        real_init = dist.init_process_group

        def slow_init(*args, **kwargs):
            # Rank 1 still finishing its group (gloo's handshake, a loaded machine) after rank 0's is up.
            real_init(*args, **kwargs)
            time.sleep(2)
            slow_init.finished = time.time()

        dist.init_process_group = slow_init
    ddp.initialize_ddp(timeout=20)
    returned = time.time()
    return returned, getattr(dist.init_process_group, "finished", None)


def test_no_rank_leaves_initialize_ddp_before_every_rank_has_its_group():
    # A rank that returned at once, ran a short function and tore its group down cut off a peer still
    # connecting: that peer failed with gloo's "Connection closed by peer" (seen in NNHandler.launch).
    results = run_distributed(_init_with_rank_1_slow_to_finish_its_group, nprocs=2, init=False, timeout=90)
    assert not any(isinstance(result, BaseException) for result in results), results
    (returned_0, _), (returned_1, finished_1) = results
    assert finished_1 is not None
    assert returned_0 >= finished_1, f"rank 0 left initialize_ddp {finished_1 - returned_0:.2f} s before rank 1 was up"
    assert returned_1 >= finished_1


def test_helper_reports_exceptions_per_rank():
    def body(rank):
        # Both ranks connected first: a rank 0 that returned at once could end the group while rank 1 was still
        # connecting under load (its result was then gloo's "Connection closed by peer").
        torch.distributed.barrier()
        if rank == 1:
            raise ValueError("boom on one")
        return "fine"

    results = run_distributed(body, nprocs=2, timeout=90)
    assert results[0] == "fine"
    assert isinstance(results[1], ValueError) and "boom on one" in str(results[1])
    # The body travels by value: the traceback still names this file, its line and its text.
    line = body.__code__.co_firstlineno + 5
    assert f'File "{__file__}", line {line}, in body\n    raise ValueError' in results[1].remote_traceback


def test_helper_names_ranks_that_hang_and_kills_them():
    from nn_handler.testing import DistributedTimeoutError

    def body(rank):
        import time

        if rank == 1:
            time.sleep(600)
        return rank

    # The deadline covers spawning and importing torch too: 8 s was not enough for
    # rank 0 to finish on a loaded 2-core machine.
    with pytest.raises(DistributedTimeoutError, match=r"ranks \[1\] did not finish") as info:
        run_distributed(body, nprocs=2, init=False, timeout=20)
    assert info.value.unfinished == [1] and info.value.results[0] == 0


def _cleanup_body(rank):
    import gc
    import weakref

    from nn_handler.utils import _collectives
    from nn_handler.utils.ddp import cleanup_ddp, is_distributed
    from nn_handler.utils.ddp_decorators import any_rank

    any_rank(False)  # creates the side gloo group
    side = weakref.ref(_collectives._side.group)
    cleanup_ddp()
    gc.collect()
    return _collectives._side is None, side() is None, is_distributed()


def test_cleanup_releases_the_side_group_before_destroying():
    # No group object may outlive cleanup_ddp into interpreter shutdown.
    for released, freed, still_distributed in run_distributed(_cleanup_body, nprocs=2, timeout=90):
        assert released and freed and not still_distributed
