"""parallel_on_all_devices: the CPU fallback, the wrapper's construction, input checks, and the real GPU path."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nn_handler.utils._models.data_parallel as dp_module
from nn_handler.errors import DeviceError
from nn_handler.utils.ddp_decorators import parallel_on_all_devices


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend there are N GPUs and record every DataParallel built (which runs the module in place)."""
    built = []

    class FakeDataParallel(nn.Module):
        def __init__(self, module, device_ids, output_device):
            super().__init__()
            self.module, self.device_ids, self.output_device = module, device_ids, output_device
            built.append(self)

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    def install(count):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(dp_module, "DataParallel", FakeDataParallel)
        return built

    return install


def _runtime_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_bare_without_gpus_runs_as_is_with_one_warning(no_gpu):
    @parallel_on_all_devices
    def double(batch):
        """Doubles."""
        return batch * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = double(torch.ones(4, 3))
        second = double(batch=torch.full((2,), 3.0))
    assert torch.equal(first, torch.full((4, 3), 2.0)) and torch.equal(second, torch.full((2,), 6.0))
    messages = _runtime_warnings(caught)
    assert len(messages) == 1, messages  # once per function, not per call
    assert "double" in messages[0] and "CUDA is not available" in messages[0] and "at least 2 GPUs" in messages[0]
    assert caught[0].filename == __file__  # points at the caller
    assert double.__name__ == "double" and double.__doc__ == "Doubles."


def test_with_arguments_and_one_gpu_names_why(fake_gpus):
    built = fake_gpus(1)

    @parallel_on_all_devices(device_ids=None)
    def f(x):
        return x + 1

    with pytest.warns(RuntimeWarning, match="only 1 CUDA device"):
        assert f(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert built == []


def test_a_single_device_id_runs_as_is(fake_gpus):
    fake_gpus(2)

    @parallel_on_all_devices(device_ids=[1])
    def f(x):
        return x

    with pytest.warns(RuntimeWarning, match=r"device_ids \[1\] name a single GPU"):
        f(torch.zeros(1))


def test_the_wrapper_is_built_once_and_runs_the_function_as_forward(fake_gpus):
    built = fake_gpus(2)
    seen = []

    @parallel_on_all_devices
    def f(x, scale=1):
        seen.append(x.shape)
        return x * scale

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # two GPUs: no warning
        for _ in range(3):
            assert f(torch.ones(4), scale=3).tolist() == [3.0] * 4
    assert len(built) == 1 and built[0].device_ids == [0, 1] and built[0].output_device == 0
    assert isinstance(built[0].module, nn.Module) and list(built[0].module.parameters()) == []
    assert seen == [torch.Size([4])] * 3


def test_device_ids_accept_indices_strings_and_devices(fake_gpus):
    built = fake_gpus(4)

    @parallel_on_all_devices(device_ids=["cuda:2", torch.device("cuda", 3), 1])
    def f(x):
        return x

    f(torch.zeros(1))
    assert built[0].device_ids == [2, 3, 1] and built[0].output_device == 2


def test_inputs_on_a_wrong_device_get_a_clear_error(fake_gpus):
    fake_gpus(2)

    @parallel_on_all_devices
    def f(x, extra=None):
        return x

    f(torch.zeros(2), extra={"a": [torch.zeros(1)]})  # CPU inputs are scattered from the host
    with pytest.raises(DeviceError, match=r"argument 'extra'\['a'\]\[1\] is on meta.*cuda:0, cuda:1.*\.to\('cuda:0'\)"):
        f(torch.zeros(2), extra={"a": [torch.zeros(1), torch.empty(1, device="meta")]})
    with pytest.raises(ValueError, match="argument 0 is on meta"):  # DeviceError is a ValueError
        f(torch.empty(2, device="meta"))


def test_a_device_id_that_does_not_exist(fake_gpus):
    fake_gpus(2)

    @parallel_on_all_devices(device_ids=[0, 5])
    def f(x):
        return x

    with pytest.raises(DeviceError, match=r"^device 5 does not exist: this machine has 2 CUDA devices \(valid ids 0..1\)$"):
        f(torch.zeros(1))


@pytest.mark.parametrize(
    "device_ids, message",
    [([], "must be a non-empty list"), (0, "must be a non-empty list"), ("cuda:0", "must be a non-empty list"),
     ([0, 0], r"lists cuda:0 twice: \[0, 0\]"), ([-1, 0], ">= 0, got -1"), ([True, 1], "got bool True"),
     ([0, 1.5], "got float 1.5"), (["cpu", 0], "'cpu' is not a CUDA device"), (["tpu:1", 0], "unknown device 'tpu:1'"),
     (["cuda", 0], r"lists cuda:0 twice: \['cuda', 0\]")],
)
def test_bad_device_ids_fail_when_decorating(device_ids, message):
    with pytest.raises(DeviceError, match=message):
        parallel_on_all_devices(device_ids=device_ids)


def test_positional_device_ids_are_a_clear_error():
    with pytest.raises(TypeError, match=r"write @parallel_on_all_devices\(device_ids=\[0, 1\]\)"):
        parallel_on_all_devices([0, 1])


@pytest.mark.gpu
def test_real_data_parallel_on_every_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    count = torch.cuda.device_count()

    @parallel_on_all_devices
    def where(batch):
        return batch * 2, torch.full((batch.shape[0],), batch.device.index, device=batch.device)

    batch = torch.arange(4.0 * count, device="cuda:0").reshape(2 * count, 2)
    doubled, devices = where(batch)
    assert doubled.device == torch.device("cuda:0") and torch.equal(doubled, batch * 2)
    assert sorted(set(devices.tolist())) == list(range(count))  # every GPU got a chunk
    with pytest.raises(DeviceError):
        where(torch.zeros(2, device="meta"))


@pytest.mark.gpu
def test_one_gpu_or_a_single_device_id_runs_on_the_inputs_device():
    @parallel_on_all_devices(device_ids=[0])
    def f(x):
        return x + 1

    with pytest.warns(RuntimeWarning, match="single GPU"):
        out = f(torch.zeros(2, device="cuda:0"))
    assert out.device == torch.device("cuda:0")
