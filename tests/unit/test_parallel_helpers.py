"""nn_handler.utils.parallel: the seed's wrapping helpers and the device/memory reports."""

import sys
import types

import pytest
import torch
from torch import nn

import nn_handler
import nn_handler.utils._models.wrap as wrap
from nn_handler.errors import ConfigurationError, DeviceError
from nn_handler.utils.parallel import (
    get_device_count,
    get_gpu_memory_info,
    get_gpu_stats,
    get_recommended_batch_size,
    is_parallel_available,
    parallelize_if_available,
    print_gpu_memory_info,
    setup_parallel_model,
)

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
          "OMPI_COMM_WORLD_RANK", "PMI_RANK")
GIB = 1024**3


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def fake_gpus(monkeypatch, n, allocated=(), reserved=()):
    """Pretend ``n`` CUDA devices exist, with the given memory use (GiB)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=(40 + i) * GIB, uuid=f"uuid-{i}"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: int(allocated[i] * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: int(reserved[i] * GIB))


@pytest.fixture
def no_gpu(monkeypatch, clean_env):
    fake_gpus(monkeypatch, 0)


@pytest.fixture
def two_gpus(monkeypatch, clean_env):
    fake_gpus(monkeypatch, 2, allocated=(12.5, 8.25), reserved=(15.0, 10.0))


@pytest.fixture
def recorder(monkeypatch):
    calls = []
    monkeypatch.setattr(wrap, "DataParallel", lambda module, **kw: ("dp", module, kw))
    monkeypatch.setattr(wrap, "DistributedDataParallel", lambda module, **kw: ("ddp", module, kw))
    monkeypatch.setattr(wrap, "_move", lambda model, device: calls.append(device) or model)
    return calls


def test_public_names_are_reexported():
    for name in ("get_device_count", "is_parallel_available", "get_gpu_memory_info", "print_gpu_memory_info",
                 "get_recommended_batch_size", "parallelize_if_available", "setup_parallel_model",
                 "unwrap_parallel_model", "MultiGPUConfig", "prepare_model", "prepare_dataloader", "get_gpu_stats",
                 "ConfigurationError"):
        assert name in nn_handler.__all__ and getattr(nn_handler, name) is not None


# --- counts and batch sizes ----------------------------------------------------------------------


@pytest.mark.parametrize("n, parallel", [(0, False), (1, False), (2, True), (8, True)])
def test_counts(monkeypatch, n, parallel):
    fake_gpus(monkeypatch, n)
    assert get_device_count() == n
    assert is_parallel_available() is parallel


def test_count_is_zero_when_cuda_is_unusable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # driver sees GPUs torch cannot use
    assert get_device_count() == 0


@pytest.mark.parametrize("n, scale, expected", [(4, True, 32), (4, False, 8), (0, True, 8), (1, True, 8)])
def test_recommended_batch_size(monkeypatch, clean_env, n, scale, expected):
    fake_gpus(monkeypatch, n)
    assert get_recommended_batch_size(8, scale_with_gpus=scale) == expected


def test_recommended_batch_size_default_and_ddp(monkeypatch, clean_env):
    fake_gpus(monkeypatch, 4)
    assert get_recommended_batch_size() == 4
    import nn_handler.utils._models.reports as reports

    monkeypatch.setattr(reports, "is_distributed", lambda: True)
    assert get_recommended_batch_size(8) == 8  # each DDP process feeds its own GPU


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_recommended_batch_size_rejects_bad_base(bad):
    with pytest.raises(ConfigurationError, match=rf"base_batch_size must be an int >= 1, got {bad!r}"):
        get_recommended_batch_size(bad)


# --- memory reports ------------------------------------------------------------------------------


def test_gpu_memory_info(two_gpus):
    assert get_gpu_memory_info() == [
        {"device_id": 0, "name": "Fake GPU 0", "total_memory": 40 * GIB, "allocated": int(12.5 * GIB),
         "cached": 15 * GIB},
        {"device_id": 1, "name": "Fake GPU 1", "total_memory": 41 * GIB, "allocated": int(8.25 * GIB),
         "cached": 10 * GIB},
    ]


def test_gpu_memory_info_without_cuda(no_gpu):
    assert get_gpu_memory_info() == []


def test_print_gpu_memory_info(two_gpus, capsys):
    print_gpu_memory_info()
    assert capsys.readouterr().out.splitlines() == [
        "GPU 0 (Fake GPU 0): 12.50 GiB / 40.00 GiB (allocated), 15.00 GiB (cached)",
        "GPU 1 (Fake GPU 1): 8.25 GiB / 41.00 GiB (allocated), 10.00 GiB (cached)",
    ]


def test_print_gpu_memory_info_without_cuda(no_gpu, capsys):
    print_gpu_memory_info()
    assert capsys.readouterr().out == "No CUDA devices available\n"


def _fake_nvml(by_uuid, init_error=None):
    """A stand-in for the pynvml module: utilisation by NVML handle, handles by UUID."""
    nvml = types.ModuleType("pynvml")
    nvml.shut = []
    nvml.nvmlInit = lambda: (_ for _ in ()).throw(init_error) if init_error else None
    nvml.nvmlShutdown = lambda: nvml.shut.append(True)
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: by_uuid[uuid]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: pytest.fail("matched by index: CUDA and NVML number GPUs apart")
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=handle["util"])
    return nvml


def test_gpu_stats_without_nvidia_ml_py(two_gpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    stats = get_gpu_stats()
    assert (stats["device_count"], stats["distributed"], stats["rank"], stats["world_size"]) == (2, False, 0, 1)
    first = stats["gpu_memory"][0]
    assert first == {"device": 0, "name": "Fake GPU 0", "total_mb": 40 * 1024.0, "allocated_mb": 12.5 * 1024,
                     "reserved_mb": 15 * 1024.0, "free_mb": 25 * 1024.0}
    assert all("utilization" not in gpu for gpu in stats["gpu_memory"])


def test_gpu_stats_with_nvidia_ml_py_matches_devices_by_uuid(two_gpus, monkeypatch):
    nvml = _fake_nvml({"GPU-uuid-0": {"util": 70}, "GPU-uuid-1": {"util": 15}})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    stats = get_gpu_stats()
    assert [gpu["utilization"] for gpu in stats["gpu_memory"]] == [70, 15]
    assert nvml.shut == [True]


def test_gpu_stats_when_nvml_cannot_start(two_gpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({}, init_error=RuntimeError("NVML driver not loaded")))
    stats = get_gpu_stats()
    assert len(stats["gpu_memory"]) == 2 and all("utilization" not in g for g in stats["gpu_memory"])


def test_gpu_stats_one_device_unknown_to_nvml(two_gpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({"GPU-uuid-1": {"util": 5}}))
    gpus = get_gpu_stats()["gpu_memory"]
    assert "utilization" not in gpus[0] and gpus[1]["utilization"] == 5


def test_gpu_stats_leaves_utilisation_unknown_without_a_uuid(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=GIB))
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({}))
    assert all("utilization" not in g for g in get_gpu_stats()["gpu_memory"])


def test_gpu_stats_without_cuda(no_gpu):
    assert get_gpu_stats()["gpu_memory"] == [] and get_gpu_stats()["device_count"] == 0


# --- setup_parallel_model / parallelize_if_available ---------------------------------------------


def test_setup_parallel_model_below_two_gpus_is_unchanged(monkeypatch, clean_env, recorder):
    for n in (0, 1):
        fake_gpus(monkeypatch, n)
        model = nn.Linear(2, 2)
        assert setup_parallel_model(model) is model
    assert recorder == []  # not even moved


def test_setup_parallel_model_dataparallel(two_gpus, recorder):
    model = nn.Linear(2, 2)
    assert setup_parallel_model(model) == ("dp", model, {"device_ids": [0, 1], "output_device": 0})
    assert setup_parallel_model(model, device_ids=[1, 0], output_device=0) == (
        "dp", model, {"device_ids": [1, 0], "output_device": 0})
    assert recorder == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert setup_parallel_model(model, device_ids=[1]) is model  # one GPU: nothing to split over


def test_setup_parallel_model_validates_ids(two_gpus):
    with pytest.raises(DeviceError, match=r"^device 3 does not exist: this machine has 2 CUDA devices \(valid ids 0..1\)$"):
        setup_parallel_model(nn.Linear(2, 2), device_ids=[0, 3])
    with pytest.raises(ConfigurationError, match=r"output_device 1 is not one of device_ids \[0\]"):
        setup_parallel_model(nn.Linear(2, 2), device_ids=[0], output_device=1)


def test_setup_parallel_model_returns_wrapped_models_unchanged(no_gpu):
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    assert setup_parallel_model(wrapped) is wrapped
    assert setup_parallel_model(wrapped, distributed=True) is wrapped


def test_setup_parallel_model_distributed_needs_a_group(two_gpus):
    with pytest.raises(ConfigurationError) as info:
        setup_parallel_model(nn.Linear(2, 2), distributed=True)
    message = str(info.value)
    assert message.startswith("setup_parallel_model(distributed=True) needs a torch.distributed process group")
    assert "torchrun" in message and "initialize_ddp()" in message


def test_setup_parallel_model_distributed_needs_a_group_even_under_a_launcher(two_gpus, clean_env):
    # The seed requires an initialized group; the launcher's variables alone are not one.
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match="needs a torch.distributed process group"):
        setup_parallel_model(nn.Linear(2, 2), distributed=True)


def test_setup_parallel_model_distributed(two_gpus, clean_env, recorder, monkeypatch):
    monkeypatch.setattr(wrap, "is_distributed", lambda: True)
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        clean_env.setenv(name, value)
    model = nn.Linear(2, 2)
    kind, module, kwargs = setup_parallel_model(model, distributed=True, find_unused_parameters=True)
    assert (kind, module, kwargs["device_ids"], kwargs["find_unused_parameters"]) == ("ddp", model, [1], True)
    kind, _, kwargs = setup_parallel_model(model, device_ids=[0], distributed=True)
    assert kwargs["device_ids"] == [0] and kwargs["output_device"] == 0
    with pytest.raises(ConfigurationError, match=r"one GPU per process, got device_ids=\[0, 1\]"):
        setup_parallel_model(model, device_ids=[0, 1], distributed=True)


def test_parallelize_if_available(monkeypatch, clean_env, recorder):
    fake_gpus(monkeypatch, 2)
    model = nn.Linear(2, 2)
    assert parallelize_if_available(model, min_gpus=3) is model
    assert parallelize_if_available(model)[0] == "dp"
    assert parallelize_if_available(model, min_gpus=2, device_ids=[1, 0])[2]["device_ids"] == [1, 0]
    fake_gpus(monkeypatch, 1)
    assert parallelize_if_available(model, min_gpus=1) is model  # one GPU: setup leaves it alone


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_parallelize_if_available_rejects_bad_min_gpus(bad):
    with pytest.raises(ConfigurationError, match=rf"min_gpus must be an int >= 1, got {bad!r}"):
        parallelize_if_available(nn.Linear(1, 1), min_gpus=bad)


@pytest.mark.gpu
def test_memory_report_on_a_real_gpu():
    before = get_gpu_memory_info()[0]["allocated"]
    x = torch.empty(64, 1024, 1024, device="cuda:0")  # 256 MiB
    info = get_gpu_memory_info()[0]
    assert info["allocated"] - before >= x.numel() * 4 and info["cached"] >= info["allocated"]
    assert info["total_memory"] == torch.cuda.get_device_properties(0).total_memory
    del x


@pytest.mark.gpu
def test_setup_parallel_model_on_real_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model = setup_parallel_model(nn.Linear(4, 2), device_ids=[0, 1])
    assert isinstance(model, nn.DataParallel) and model(torch.randn(6, 4, device="cuda:0")).shape == (6, 2)
