"""nn_handler.utils.parallel: parallel_predict (on CPU workers here) and the data-parallel introspection."""

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from nn_handler.errors import ConfigurationError, ParallelExecutionError
from nn_handler.utils.parallel import get_data_parallel_info, parallel_predict, validate_data_parallel_setup

CPUS = ["cpu", "cpu"]


def fake_gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def _linear():
    torch.manual_seed(0)
    return nn.Linear(3, 2)


# --- parallel_predict on two CPU workers ---------------------------------------------------------


def test_outputs_match_a_plain_forward_in_input_order():
    model = _linear()
    x = torch.randn(23, 3)  # 23 = 5 batches of 5, the last one short
    out = parallel_predict(model, x, batch_size=5, device_ids=CPUS)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected)
    assert model.training  # the caller's model is untouched (eval() happened in the workers)


def test_factory_is_built_once_per_worker_and_both_workers_take_batches(tmp_path):
    marks = str(tmp_path)

    def factory(device):
        import os

        import torch
        from torch import nn

        open(os.path.join(marks, f"built-{os.getpid()}"), "x").close()  # "x": fails if built twice here

        class WhoRan(nn.Module):
            def forward(self, x):
                return torch.cat([x, torch.full((len(x), 1), float(os.getpid()))], dim=1)

        assert device == torch.device("cpu")
        return WhoRan()

    x = torch.arange(40.0).unsqueeze(1)
    out = parallel_predict(factory, x, batch_size=2, device_ids=CPUS)
    assert torch.equal(out[:, 0], x[:, 0])  # in input order
    built = {name.split("-")[1] for name in os.listdir(marks)}
    ran = {str(int(p)) for p in out[:, 1].tolist()}
    assert len(built) == 2 and ran == built  # two workers, each built one model and served batches


class _DictInputs(Dataset):
    def __len__(self):
        return 7

    def __getitem__(self, i):
        return {"a": torch.tensor([float(i)]), "b": torch.tensor([10.0 * i])}


class _AddKw(nn.Module):
    def forward(self, a, b):
        return {"sum": a + b, "diff": b - a}


class _Pair(nn.Module):
    def forward(self, x, y):
        return x * 2, y.sum(dim=1)


def test_dict_batches_go_in_as_keywords_and_dict_outputs_are_joined():
    out = parallel_predict(_AddKw(), _DictInputs(), batch_size=3, device_ids=CPUS)
    assert out["sum"].squeeze(1).tolist() == [11.0 * i for i in range(7)]
    assert out["diff"].squeeze(1).tolist() == [9.0 * i for i in range(7)]


def test_tuple_batches_go_in_positionally_and_tuple_outputs_are_joined():
    x, y = torch.arange(6.0).unsqueeze(1), torch.ones(6, 4)
    doubled, sums = parallel_predict(_Pair(), TensorDataset(x, y), batch_size=4, device_ids=CPUS)
    assert doubled.squeeze(1).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0] and sums.tolist() == [4.0] * 6


def _halve_collate(rows):
    return torch.stack([r[0] for r in rows]) / 2


def test_dataloader_input_uses_its_collate_fn_and_loader_threads():
    x = torch.arange(50.0).unsqueeze(1)
    loader = DataLoader(TensorDataset(x), batch_size=999, shuffle=True, collate_fn=_halve_collate)
    out = parallel_predict(nn.Identity(), loader, batch_size=2, device_ids=CPUS, num_workers=1)
    assert torch.equal(out, x / 2)  # dataset order, not the loader's shuffle


class _ThreadNames(Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, i):
        import threading

        return i, threading.current_thread().name


def test_loader_threads_read_ahead_in_the_caller_in_order():
    from nn_handler._inference.sources import Source

    items = list(Source.of(_ThreadNames()).items(done=lambda i: i % 3 == 0, num_workers=2))
    assert [i for i, _ in items] == [i for i in range(200) if i % 3] == [s[0] for _, s in items]
    assert all(name.startswith("nn_handler-load") for _, (_, name) in items)


def test_autocast_on_cpu_workers():
    x = torch.randn(4, 3)
    assert parallel_predict(_linear(), x, batch_size=2, device_ids=CPUS, autocast=True).dtype == torch.bfloat16
    assert parallel_predict(_linear(), x, batch_size=2, device_ids=CPUS).dtype == torch.float32


def test_a_list_of_samples_and_non_tensor_outputs():
    class Describe(nn.Module):
        def forward(self, x):
            return f"{len(x)} rows"

    samples = [torch.tensor([float(i)]) for i in range(5)]
    assert parallel_predict(Describe(), samples, batch_size=2, device_ids=CPUS) == ["2 rows", "2 rows", "1 rows"]


def test_scalar_outputs_are_joined():
    class Total(nn.Module):
        def forward(self, x):
            return x.sum()

    out = parallel_predict(Total(), torch.ones(6, 2), batch_size=4, device_ids=CPUS)
    assert out.tolist() == [8.0, 4.0]


def test_a_failing_model_raises_with_the_remote_traceback():
    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("shape mismatch in layer 3")

    with pytest.raises(ParallelExecutionError, match="shape mismatch in layer 3") as info:
        parallel_predict(Broken(), torch.ones(4, 2), batch_size=2, device_ids=CPUS)
    assert "in forward\n    raise ValueError" in str(info.value.__cause__)  # the worker's traceback, source and all


def test_a_factory_that_returns_no_model():
    with pytest.raises(ParallelExecutionError, match="the model factory returned dict, not a torch.nn.Module"):
        parallel_predict(lambda: {"weights": 1}, torch.ones(2, 2), batch_size=1, device_ids=CPUS)


def test_without_cuda_it_runs_on_one_cpu_worker_with_a_warning(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        out = parallel_predict(nn.Identity(), torch.arange(5.0), batch_size=2)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"batch_size": 0}, ConfigurationError, "batch_size must be an int >= 1 or None, got 0"),
    ({"batch_size": True}, ConfigurationError, "batch_size must be an int >= 1 or None, got True"),
    ({"batch_size": "8"}, ConfigurationError, "batch_size must be an int >= 1 or None, got '8'"),
    ({"num_workers": -1}, ConfigurationError, "num_workers must be an int >= 0, got -1"),
    ({"autocast": "fp16"}, ConfigurationError, "autocast must be True, False or a torch.dtype, got 'fp16'"),
    ({"model_or_factory": 3}, TypeError, "model_or_factory must be an nn.Module or a callable"),
    ({"batch_size": None}, ConfigurationError, "needs batch_size=N, or max_tokens=N with length=fn"),
    ({"max_tokens": 8}, ConfigurationError, "max_tokens needs length=fn"),
    ({"on_error": "skip"}, ConfigurationError, "on_error='skip' needs output_dir="),
    ({"on_error": "ignore"}, ConfigurationError, "on_error must be one of"),
    ({"length": 3}, ConfigurationError, "length must be a function or None, got 3"),
    ({"data": torch.empty(0, 3)}, ConfigurationError, "data is empty: there is nothing to predict"),
    ({"data": []}, ConfigurationError, "data is empty"),
    ({"data": torch.tensor(1.0)}, ConfigurationError, "0-dimensional tensor"),
    ({"data": 42}, TypeError, "data must be a tensor, a map-style Dataset"),
    ({"data": "text"}, TypeError, "data must be a tensor"),
])
def test_bad_arguments_fail_before_any_worker_starts(kwargs, error, message):
    args = {"model_or_factory": nn.Identity(), "data": torch.ones(4, 2), "batch_size": 2, "device_ids": CPUS, **kwargs}
    with pytest.raises(error, match=message):
        parallel_predict(args.pop("model_or_factory"), args.pop("data"), **args)


class _LockedModel(nn.Identity):
    def __init__(self):
        super().__init__()
        import threading

        self.lock = threading.Lock()


def test_an_unpicklable_model_is_named_before_any_worker_starts():
    with pytest.raises(TypeError, match=r"the model cannot be pickled .*pass a factory"):
        parallel_predict(_LockedModel(), torch.ones(2, 1), batch_size=1, device_ids=CPUS)


def test_a_dispatched_model_is_refused():
    from nn_handler.utils.parallel import dispatch_model

    model = dispatch_model(nn.Sequential(nn.Linear(2, 2)), {"0": "cpu"})
    with pytest.raises(ConfigurationError, match="spread over several devices by dispatch_model"):
        parallel_predict(model, torch.ones(2, 2), batch_size=1, device_ids=CPUS)


def test_a_wrapped_model_is_unwrapped():
    model = _linear()
    x = torch.randn(5, 3)
    out = parallel_predict(nn.DataParallel(model), x, batch_size=2, device_ids=CPUS)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


# --- introspection -------------------------------------------------------------------------------


def test_info_and_validation_without_cuda(monkeypatch):
    fake_gpus(monkeypatch, 0)
    assert get_data_parallel_info() == {"enabled": False, "device_count": 1, "devices": ["cpu"], "primary_device": "cpu"}
    assert validate_data_parallel_setup() == [
        "CUDA is not available: inference would run on the CPU, without data parallelism"]
    problems = validate_data_parallel_setup([0])
    assert problems[1] == "device 0 does not exist: CUDA is not available on this machine"


def test_info_and_validation_with_one_gpu(monkeypatch):
    fake_gpus(monkeypatch, 1)
    assert get_data_parallel_info() == {"enabled": False, "device_count": 1, "devices": ["cuda:0"],
                                        "primary_device": "cuda:0"}
    assert validate_data_parallel_setup() == ["only 1 CUDA device is available; data parallelism needs at least 2"]


def test_info_and_validation_with_two_gpus(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert get_data_parallel_info() == {"enabled": True, "device_count": 2, "devices": ["cuda:0", "cuda:1"],
                                        "primary_device": "cuda:0"}
    assert get_data_parallel_info([1, 7]) == {"enabled": False, "device_count": 1, "devices": ["cuda:1"],
                                              "primary_device": "cuda:1"}
    assert get_data_parallel_info(["cuda:1", 0])["primary_device"] == "cuda:1"
    assert validate_data_parallel_setup() == []
    assert validate_data_parallel_setup([1, "cuda:0"]) == []


@pytest.mark.parametrize("ids, problems", [
    ([0, 5], ["device 5 does not exist: this machine has 2 CUDA devices (valid ids 0..1)",
              "device_ids [0, 5] select 1 usable GPU; data parallelism needs at least 2"]),
    ([1, "cuda:1"], ["device_ids lists cuda:1 twice: [1, 'cuda:1']; give each GPU once",
                     "device_ids [1, 'cuda:1'] select 1 usable GPU; data parallelism needs at least 2"]),
    (["cpu", 0, 1], ["device 'cpu' is not a CUDA device; use a GPU index or 'cuda:N'"]),
    ([-1, 0, 1], ["device must be a GPU index >= 0, got -1"]),
    (0, ["device_ids must be a non-empty list such as [0, 1], or None for every GPU; got 0"]),
])
def test_validation_names_each_bad_id(monkeypatch, ids, problems):
    fake_gpus(monkeypatch, 2)
    assert validate_data_parallel_setup(ids) == problems


# --- on real GPUs --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_parallel_predict_on_two_gpus_with_a_model_on_the_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")

    class WhereRan(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x), torch.full((len(x),), x.device.index)

    model = WhereRan().to("cuda:0")
    x = torch.randn(64, 8)
    out, where = parallel_predict(model, x, batch_size=4, device_ids=[0, 1])
    with torch.no_grad():
        expected = model(x.to("cuda:0"))[0].cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert set(where.tolist()) == {0, 1} and next(model.parameters()).device.index == 0
    half = parallel_predict(model, x, batch_size=8, device_ids=[0, 1], autocast=True)[0]
    assert half.dtype == torch.float16
