"""The one device grammar (nn_handler.utils._devices) and its adoption: one bad id, one message, at every entry point.

CUDA is faked by monkeypatching ``torch.cuda.is_available`` and
``torch.cuda.device_count``, as the other test modules do; nothing here
allocates on a GPU or starts a process.
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
from torch import nn

from nn_handler import ParallelExecutor
from nn_handler.errors import DeviceError, NNHandlerError
from nn_handler.utils.parallel import (
    MultiGPUConfig,
    dispatch_model,
    parallel_predict,
    prepare_model,
    validate_data_parallel_setup,
)
from nn_handler.utils.ddp import resolve_device
from nn_handler.utils.ddp_decorators import parallel_on_all_devices, parallelize_on_gpus

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "nn_handler"
LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
          "OMPI_COMM_WORLD_RANK", "PMI_RANK")
UNKNOWN = "use a GPU index, 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"


def fake_gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def two_gpus(monkeypatch):
    fake_gpus(monkeypatch, 2)


@pytest.fixture
def no_gpu(monkeypatch):
    fake_gpus(monkeypatch, 0)


def _devices():
    # Imported late: the grammar module is what is under test.
    from nn_handler.utils import _devices
    return _devices


# ----------------------------------------------------------------------------- one device
def test_cuda_count_follows_torch(monkeypatch):
    devices = _devices()
    fake_gpus(monkeypatch, 3)
    assert devices.cuda_count() == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a driver torch cannot use
    assert devices.cuda_count() == 0


def test_the_process_group_module_keeps_its_private_alias(monkeypatch):
    from nn_handler.utils import ddp
    fake_gpus(monkeypatch, 3)
    assert ddp._cuda_count() == 3 and ddp._cuda_count.__module__ == "nn_handler.utils._devices"


@pytest.mark.parametrize("spec, expected", [
    ("cpu", "cpu"), (" CPU ", "cpu"), (torch.device("cpu"), "cpu"),
    (0, "cuda:0"), (1, "cuda:1"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1"), ("gpu", "cuda:0"), ("GPU:1", "cuda:1"),
    (torch.device("cuda"), "cuda:0"), (torch.device("cuda", 1), "cuda:1"), ("meta", "meta"),
])
def test_parse_device_normalises(two_gpus, spec, expected):
    assert _devices().parse_device(spec) == torch.device(expected)


def test_bare_cuda_means_the_index_given():
    assert _devices().parse_device("cuda", cuda_index=3, exists=False) == torch.device("cuda", 3)


@pytest.mark.parametrize("spec, message", [
    (True, "device must be a GPU index, a string such as 'cuda:0' or a torch.device, got bool True"),
    (1.5, "device must be a GPU index, a string such as 'cuda:0' or a torch.device, got float 1.5"),
    (None, "device must be a GPU index, a string such as 'cuda:0' or a torch.device, got NoneType None"),
    (-1, "device must be a GPU index >= 0, got -1"),
    ("tpu", f"unknown device 'tpu'; {UNKNOWN}"),
    ("cuda:x", f"unknown device 'cuda:x'; {UNKNOWN}"),
    ("", f"unknown device ''; {UNKNOWN}"),
    (2, "device 2 does not exist: this machine has 2 CUDA devices (valid ids 0..1)"),
    ("cuda:7", "device 'cuda:7' does not exist: this machine has 2 CUDA devices (valid ids 0..1)"),
    (torch.device("cuda", 7), "device 'cuda:7' does not exist: this machine has 2 CUDA devices (valid ids 0..1)"),
])
def test_parse_device_rejects(two_gpus, spec, message):
    with pytest.raises(DeviceError) as info:
        _devices().parse_device(spec)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError) and isinstance(info.value, NNHandlerError)


def test_without_cuda_a_gpu_does_not_exist_unless_the_caller_falls_back(no_gpu):
    devices = _devices()
    with pytest.raises(DeviceError, match=r"^device 0 does not exist: CUDA is not available on this machine$"):
        devices.parse_device(0)
    assert devices.parse_device(0, exists=False) == torch.device("cuda", 0)


@pytest.mark.parametrize("types, spec, message", [
    (("cuda",), "cpu", "device 'cpu' is not a CUDA device; use a GPU index or 'cuda:N'"),
    (("cpu", "cuda"), "mps", "device 'mps' is not supported here; use a GPU index, 'cpu' or 'cuda:N'"),
])
def test_types_accepted_here(types, spec, message):
    with pytest.raises(DeviceError) as info:
        _devices().parse_device(spec, types=types)
    assert str(info.value) == message


def test_what_names_the_argument(two_gpus):
    with pytest.raises(DeviceError, match=r"^output_device 4 does not exist: this machine has 2 CUDA devices"):
        _devices().parse_device(4, what="output_device")


# ----------------------------------------------------------------------------- lists of ids
def test_parse_device_ids(two_gpus):
    devices = _devices()
    assert devices.parse_device_ids([1, "cuda:0"]) == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert devices.parse_device_ids(["cpu", "cpu", 1], types=("cpu", "cuda")) == [
        torch.device("cpu"), torch.device("cpu"), torch.device("cuda", 1)]


@pytest.mark.parametrize("ids, message", [
    ([], "device_ids must be a non-empty list such as [0, 1], or None for every GPU; got []"),
    (0, "device_ids must be a non-empty list such as [0, 1], or None for every GPU; got 0"),
    ("cuda:0", "device_ids must be a non-empty list such as [0, 1], or None for every GPU; got 'cuda:0'"),
    ([1, "cuda:1"], "device_ids lists cuda:1 twice: [1, 'cuda:1']; give each GPU once"),
    (["cuda", 0], "device_ids lists cuda:0 twice: ['cuda', 0]; give each GPU once"),
    ([0, 5, 7], "device 5 does not exist: this machine has 2 CUDA devices (valid ids 0..1)"),  # the first problem
    (["cpu", 0], "device 'cpu' is not a CUDA device; use a GPU index or 'cuda:N'"),
])
def test_parse_device_ids_rejects(two_gpus, ids, message):
    with pytest.raises(DeviceError) as info:
        _devices().parse_device_ids(ids)
    assert str(info.value) == message


def test_device_problems_reports_every_problem_without_raising(two_gpus):
    devices = _devices()
    assert devices.device_problems([0, 1]) == []
    assert devices.device_problems(["tpu", 5, 1, "cuda:1", "cpu"]) == [
        f"unknown device 'tpu'; {UNKNOWN}",
        "device 5 does not exist: this machine has 2 CUDA devices (valid ids 0..1)",
        "device_ids lists cuda:1 twice: ['tpu', 5, 1, 'cuda:1', 'cpu']; give each GPU once",
        "device 'cpu' is not a CUDA device; use a GPU index or 'cuda:N'",
    ]
    assert devices.device_problems(3) == [
        "device_ids must be a non-empty list such as [0, 1], or None for every GPU; got 3"]
    assert devices.split_device_ids([1, 9]) == ([torch.device("cuda", 1)], [
        "device 9 does not exist: this machine has 2 CUDA devices (valid ids 0..1)"])


# ----------------------------------------------------------------------------- one bad id, one message
def _double(x):
    return x * 2


def _executor(ids):
    ParallelExecutor(device_ids=ids).shutdown()


def _prepare_model_config(ids):
    prepare_model(nn.Linear(2, 2), MultiGPUConfig(mode="dataparallel", device_ids=ids))


def _data_parallel(ids):
    parallel_on_all_devices(device_ids=ids)(_double)(torch.ones(2, 1))


def _predict(ids):
    parallel_predict(nn.Linear(2, 2), torch.ones(4, 2), batch_size=2, device_ids=ids)


def _dispatch(ids):
    dispatch_model(nn.Sequential(*(nn.Linear(2, 2) for _ in ids)), {str(i): d for i, d in enumerate(ids)})


def _prepare_model_device(ids):
    prepare_model(nn.Linear(2, 2), MultiGPUConfig(mode="none"), device=ids[-1])


def _parallelize_on_gpus(ids):
    parallelize_on_gpus(device_ids=ids)(_double)  # refused at decoration, before any worker starts


def _resolve_device(ids):
    resolve_device(ids[-1])


ENTRY_POINTS = {
    "ParallelExecutor": _executor,
    "prepare_model(config)": _prepare_model_config,
    "prepare_model(device)": _prepare_model_device,
    "parallel_on_all_devices": _data_parallel,
    "parallel_predict": _predict,
    "dispatch_model": _dispatch,
    "parallelize_on_gpus": _parallelize_on_gpus,
    "resolve_device": _resolve_device,
}
BAD_IDS = {
    5: "device 5 does not exist: this machine has 2 CUDA devices (valid ids 0..1)",
    "cuda:5": "device 'cuda:5' does not exist: this machine has 2 CUDA devices (valid ids 0..1)",
    torch.device("cuda", 5): "device 'cuda:5' does not exist: this machine has 2 CUDA devices (valid ids 0..1)",
    -1: "device must be a GPU index >= 0, got -1",
    "tpu": f"unknown device 'tpu'; {UNKNOWN}",
    True: "device must be a GPU index, a string such as 'cuda:0' or a torch.device, got bool True",
    1.5: "device must be a GPU index, a string such as 'cuda:0' or a torch.device, got float 1.5",
}


@pytest.mark.parametrize("bad", list(BAD_IDS), ids=repr)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_the_same_bad_device_gives_the_same_message_everywhere(two_gpus, entry, bad):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back or starts: the id is refused up front
        with pytest.raises(DeviceError) as info:
            ENTRY_POINTS[entry]([0, bad])
    assert str(info.value) == BAD_IDS[bad]


@pytest.mark.parametrize("entry", ["ParallelExecutor", "prepare_model(config)", "parallel_on_all_devices",
                                   "parallel_predict"])
def test_a_gpu_listed_twice_gives_the_same_message_everywhere(two_gpus, entry):
    with pytest.raises(DeviceError) as info:
        ENTRY_POINTS[entry]([1, "cuda:1"])
    assert str(info.value) == "device_ids lists cuda:1 twice: [1, 'cuda:1']; give each GPU once"


@pytest.mark.parametrize("entry", ["prepare_model(config)", "parallel_on_all_devices"])
def test_a_cpu_id_where_gpus_are_needed(two_gpus, entry):
    with pytest.raises(DeviceError) as info:
        ENTRY_POINTS[entry](["cpu", 0])
    assert str(info.value) == "device 'cpu' is not a CUDA device; use a GPU index or 'cuda:N'"


def test_validate_reports_what_the_entry_points_raise(two_gpus):
    problems = validate_data_parallel_setup([0, 5])
    with pytest.raises(DeviceError) as info:
        ParallelExecutor(device_ids=[0, 5])
    assert problems[0] == str(info.value)


# ----------------------------------------------------------------------------- legitimate differences stay
def test_the_executor_still_falls_back_to_cpu_without_cuda(no_gpu):
    with pytest.warns(RuntimeWarning, match="CUDA is not available: running 2 workers on the CPU"):
        ex = ParallelExecutor(device_ids=[0, "cuda:1"])
    assert ex.devices == ["cpu", "cpu"]
    ex.shutdown()
    with pytest.raises(DeviceError, match="must be a GPU index >= 0, got -1"):
        ParallelExecutor(device_ids=[-1])  # malformed is malformed, CUDA or not


def test_no_module_imports_the_private_cuda_count():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name == "_cuda_count" for a in node.names):
                offenders.append(str(path.relative_to(PACKAGE)))
            elif isinstance(node, ast.Attribute) and node.attr == "_cuda_count":
                offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []
