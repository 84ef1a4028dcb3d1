"""nn_handler.utils.parallel: plan_device_map (pure) and dispatch_model (CPU + meta here, 2 GPUs when marked)."""

import collections
import itertools
import random

import pytest
import torch
from torch import nn

import nn_handler.utils._models.placement as placement
from nn_handler.errors import ConfigurationError, DeviceError
from nn_handler.utils.parallel import DEVICE_MAP_ATTR, dispatch_model, parse_memory_size, plan_device_map

CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# --- parse_memory_size ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [(1024, 1024), ("10GiB", 10 * 2**30), ("10GB", 10**10), ("512 MiB", 2**29),
                                            ("1.5kb", 1500), ("7", 7), ("3B", 3), ("2tib", 2 * 2**40), (0, 0)])
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("bad", ["ten GB", "10 GX", "-1GB", "", -5, 1.5, None, True])
def test_parse_memory_size_rejects(bad):
    with pytest.raises(ConfigurationError, match="memory size"):
        parse_memory_size(bad)


# --- plan_device_map -----------------------------------------------------------------------------


def _brute_force_best(sizes, caps):
    """Smallest sum of squared loads over every contiguous split into len(caps) runs that fits the caps."""
    n, d = len(sizes), len(caps)
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), d - 1):
        bounds = (0, *cuts, n)
        loads = [sum(sizes[bounds[k]:bounds[k + 1]]) for k in range(d)]
        if all(c is None or load <= c for load, c in zip(loads, caps)):
            score = sum(load * load for load in loads)
            best = score if best is None else min(best, score)
    return best


def _loads(plan, sizes, devices):
    return [sum(sizes[n] for n, dev in plan.items() if dev == d) for d in devices]


def test_balanced_splits_equal_children_evenly():
    sizes = {str(i): 100 for i in range(6)}
    assert list(plan_device_map(sizes, ["a", "b", "c"]).values()) == ["a", "a", "b", "b", "c", "c"]


def test_balanced_puts_a_big_child_alone():
    sizes = dict(zip("abcde", [100, 1, 1, 1, 1]))
    assert plan_device_map(sizes, ["d0", "d1", "d2"]) == {"a": "d0", "b": "d1", "c": "d1", "d": "d2", "e": "d2"}


def test_balanced_keeps_parameterless_children_with_the_layer_before():
    sizes = {"0": 100, "1": 0, "2": 100, "3": 0}  # Linear, ReLU, Linear, ReLU
    assert plan_device_map(sizes, ["cuda:0", "cuda:1"]) == {"0": "cuda:0", "1": "cuda:0", "2": "cuda:1", "3": "cuda:1"}


def test_balanced_model_without_parameters_stays_on_the_first_device():
    assert set(plan_device_map({"0": 0, "1": 0}, ["x", "y"]).values()) == {"x"}


def test_balanced_respects_budgets():
    sizes = dict(zip("abcd", [4, 4, 4, 4]))
    assert plan_device_map(sizes, ["x", "y"], max_memory={"x": 4}) == {"a": "x", "b": "y", "c": "y", "d": "y"}


@pytest.mark.parametrize("seed", range(40))
def test_balanced_is_contiguous_fits_and_is_optimal(seed):
    rng = random.Random(seed)
    n, d = rng.randint(1, 7), rng.randint(1, 4)
    sizes = {f"c{i}": rng.choice([0, 1, 5, 10, 50, 100]) for i in range(n)}
    devices = [f"dev{k}" for k in range(d)]
    caps = [rng.choice([None, None, 60, 120, 200]) for _ in range(d)]
    budgets = {dev: cap for dev, cap in zip(devices, caps) if cap is not None}
    best = _brute_force_best(list(sizes.values()), caps)
    if best is None:
        with pytest.raises(ConfigurationError, match="does not fit"):
            plan_device_map(sizes, devices, max_memory=budgets)
        return
    plan = plan_device_map(sizes, devices, max_memory=budgets)
    assert list(plan) == list(sizes)
    order = [devices.index(dev) for dev in plan.values()]
    assert order == sorted(order)  # contiguous runs, in device order
    loads = _loads(plan, sizes, devices)
    assert all(c is None or load <= c for load, c in zip(loads, caps))
    assert sum(load * load for load in loads) == best


def test_sequential_fills_devices_in_order_and_never_goes_back():
    sizes = dict(zip("abc", [6, 3, 2]))
    plan = plan_device_map(sizes, ["cuda:0", "cuda:1"], "sequential", {"cuda:0": 8})
    assert plan == {"a": "cuda:0", "b": "cuda:1", "c": "cuda:1"}  # c would fit on cuda:0 but comes after b


def test_sequential_without_budgets_uses_the_first_device():
    assert set(plan_device_map(dict(zip("abc", [6, 3, 2])), ["x", "y"], "sequential").values()) == {"x"}


def test_sequential_skips_a_device_too_small_for_the_next_child():
    plan = plan_device_map({"a": 5, "b": 5}, ["x", "y", "z"], "sequential", {"x": 4, "y": 6, "z": 6})
    assert plan == {"a": "y", "b": "z"}


@pytest.mark.parametrize("strategy", ["balanced", "sequential"])
def test_plan_that_does_not_fit_names_sizes_and_budgets(strategy):
    with pytest.raises(ConfigurationError) as info:
        plan_device_map({"small": 10, "huge": 3 * 2**20}, ["cuda:0", "cuda:1"], strategy,
                        {"cuda:0": 2**20, "cuda:1": 2**20})
    message = str(info.value)
    assert f"does not fit in max_memory ({strategy})" in message
    assert "the largest ('huge') 3.0 MiB" in message and "cuda:0 1.0 MiB, cuda:1 1.0 MiB" in message


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "auto"}, "strategy must be one of 'balanced', 'sequential', got 'auto'"),
    ({"devices": []}, "no devices to place the model on"),
    ({"devices": ["x", "x"]}, r"devices must not repeat, got \['x', 'x'\]"),
    ({"max_memory": {"z": 5}}, r"max_memory names devices \['z'\] that are not among \['x', 'y'\]"),
    ({"sizes": {"a": -1}}, r"sizes must be byte counts >= 0, got \{'a': -1\}"),
])
def test_plan_rejects_bad_input(kwargs, message):
    args = {"sizes": {"a": 1}, "devices": ["x", "y"], **kwargs}
    with pytest.raises(ConfigurationError, match=message):
        plan_device_map(**args)


def test_plan_of_no_children_is_empty():
    assert plan_device_map({}, ["x"]) == {}


# --- dispatch_model on CPU and the meta device ---------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def test_dispatch_with_a_dict_keeps_the_output(no_gpu):
    model = _mlp()
    x = torch.randn(5, 4)
    expected = model(x)
    out = dispatch_model(model, {str(i): "cpu" for i in range(5)})
    assert out is model and getattr(model, DEVICE_MAP_ATTR) == {str(i): "cpu" for i in range(5)}
    assert torch.equal(model(x), expected)


def test_dispatch_moves_children_and_activations(no_gpu):
    model = _mlp()
    dispatch_model(model, {"0": "cpu", "1": "cpu", "2": "meta", "3": "meta", "4": "meta"})
    assert model[0].weight.device == CPU and model[2].weight.device == META and model[4].bias.device == META
    out = model(torch.randn(3, 4))  # the hook of child 2 carried the activation from cpu to meta
    assert out.device == META and out.shape == (3, 2)


def test_dispatch_balanced_over_cpu_and_meta(no_gpu):
    model = _mlp()  # parameter sizes 80, 0, 272, 0, 34 floats
    dispatch_model(model, "balanced", max_memory={"cpu": None, "meta": None})
    assert model.nn_handler_device_map == {"0": "cpu", "1": "cpu", "2": "meta", "3": "meta", "4": "meta"}
    assert model(torch.randn(2, 4)).device == META


def test_dispatch_sequential_honours_max_memory(no_gpu):
    model = _mlp()
    dispatch_model(model, "sequential", max_memory={"cpu": 400, "meta": "1MiB"})
    assert model.nn_handler_device_map == {"0": "cpu", "1": "cpu", "2": "meta", "3": "meta", "4": "meta"}


def test_dispatch_defaults_to_the_cpu_without_gpus(no_gpu):
    model = _mlp()
    for strategy in ("balanced", "sequential", "auto"):
        assert set(dispatch_model(model, strategy).nn_handler_device_map.values()) == {"cpu"}


def test_dispatch_defaults_to_every_gpu_with_90_percent_of_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: ((1000, 2000) if dev.index == 0 else (500, 2000)))
    seen = {}

    class Planned(Exception):
        pass

    def fake_plan(sizes, devices, strategy, budgets):
        seen.update(devices=devices, strategy=strategy, budgets=budgets)
        raise Planned

    monkeypatch.setattr(placement, "plan_device_map", fake_plan)
    with pytest.raises(Planned):
        dispatch_model(_mlp(), "sequential")
    assert seen == {"devices": ["cuda:0", "cuda:1"], "strategy": "sequential",
                    "budgets": {"cuda:0": 900, "cuda:1": 450}}
    with pytest.raises(Planned):
        dispatch_model(_mlp(), max_memory={1: "1GiB", "cuda:0": None})
    assert seen["devices"] == ["cuda:1", "cuda:0"] and seen["budgets"] == {"cuda:1": 2**30, "cuda:0": 900}


def test_redispatch_replaces_the_hooks(no_gpu):
    model = _mlp()
    dispatch_model(model, {str(i): "cpu" for i in range(5)})
    dispatch_model(model, {str(i): "meta" for i in range(5)})
    assert all(len(child._forward_pre_hooks) == 1 for child in model)
    assert model(torch.randn(1, 4)).device == META


def test_input_hook_moves_nested_tensors():
    Pair = collections.namedtuple("Pair", "a b")
    tree = {"x": [torch.ones(1), (torch.ones(2), "tag")], "p": Pair(torch.ones(3), 4)}
    (moved,), _ = placement._input_mover(META)(None, (tree,), {})
    assert moved["x"][0].device == META and moved["x"][1][0].device == META and moved["x"][1][1] == "tag"
    assert isinstance(moved["p"], Pair) and moved["p"].a.device == META and moved["p"].b == 4


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, *, scale):
        return self.lin(x) * scale


class _TwoStage(nn.Module):
    """Not a Sequential: its own parameter, keyword inputs, children called in order."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(2))
        self.first = _Scaled()
        self.second = _Scaled()

    def forward(self, x):
        return self.second(self.first(x + self.offset, scale=torch.tensor(2.0)), scale=torch.tensor(3.0))


def test_dispatch_moves_keyword_inputs_and_the_top_modules_own_parameters(no_gpu):
    model = dispatch_model(_TwoStage(), {"first": "meta", "second": "meta"})
    assert model.offset.device == META  # goes with the first child
    assert model(torch.ones(1, 2).to(META)).device == META  # scale tensors (cpu) were moved to meta


def test_dispatch_measures_shared_tensors_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert placement._child_sizes(nn.Sequential(emb, head)) == {"0": 160, "1": 0}


def test_dispatch_refuses_to_split_tied_weights(no_gpu):
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    with pytest.raises(ConfigurationError, match=r"children \['0', '1'\] share a parameter or buffer \(tied weights\) but were placed on \['cpu', 'meta'\]"):
        dispatch_model(model, {"0": "cpu", "1": "meta"})
    assert emb.weight.device == CPU and not hasattr(model, DEVICE_MAP_ATTR)  # nothing moved
    dispatch_model(model, {"0": "meta", "1": "meta"})  # together is fine
    assert head.weight is emb.weight and emb.weight.device == META


def test_dispatch_checks_ties_with_the_models_own_parameters(no_gpu):
    model = _TwoStage()
    model.second.lin.weight = nn.Parameter(torch.zeros(2, 2))
    model.extra = model.second.lin.weight  # registered on the model itself too
    with pytest.raises(ConfigurationError, match=r"\['\(the model itself\)', 'second'\] share"):
        dispatch_model(model, {"first": "cpu", "second": "meta"})


@pytest.mark.parametrize("device_map, message", [
    ({"0": "cpu"}, r"must name every top-level child of the model exactly: missing \['1', '2'\]"),
    ({"0": "cpu", "1": "cpu", "2": "cpu", "head": "cpu"}, r"not children \['head'\]"),
    ("pipeline", "device_map must be 'balanced', 'sequential', 'auto' or a dict"),
])
def test_dispatch_rejects_bad_maps(no_gpu, device_map, message):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match=message):
        dispatch_model(model, device_map)


def test_dispatch_rejects_missing_devices(no_gpu):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(DeviceError, match=r"^device 'cuda:1' does not exist: CUDA is not available on this machine$"):
        dispatch_model(model, {"0": "cpu", "1": "cuda:1"})
    with pytest.raises(DeviceError, match=r"^device 0 does not exist"):
        dispatch_model(model, max_memory={0: "1GiB"})
    with pytest.raises(DeviceError, match="unknown device 'gpu9'"):
        dispatch_model(model, {"0": "cpu", "1": "gpu9"})


def test_dispatch_rejects_bad_models_and_budgets(no_gpu):
    with pytest.raises(ConfigurationError, match="Linear has no child modules to place"):
        dispatch_model(nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match=r"cannot split a DataParallel.*unwrap_parallel_model"):
        dispatch_model(nn.DataParallel(nn.Sequential(nn.Linear(2, 2))))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        dispatch_model("model")
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match="max_memory must be a non-empty dict"):
        dispatch_model(model, max_memory={})
    with pytest.raises(ConfigurationError, match="cannot read memory size 'lots'"):
        dispatch_model(model, max_memory={"cpu": "lots"})
    with pytest.raises(ConfigurationError, match="max_memory names device cpu twice"):
        dispatch_model(model, max_memory={"cpu": 1, torch.device("cpu"): 2})


@pytest.mark.gpu
def test_dispatch_over_two_real_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model = _mlp()
    x = torch.randn(8, 4)
    expected = model(x)
    dispatch_model(model, "balanced", max_memory={0: None, 1: None})
    assert model.nn_handler_device_map == {"0": "cuda:0", "1": "cuda:0", "2": "cuda:1", "3": "cuda:1", "4": "cuda:1"}
    assert model[0].weight.device.index == 0 and model[2].weight.device.index == 1
    out = model(x)  # starts on the CPU; hooks carry it to cuda:0 then cuda:1
    assert out.device == torch.device("cuda", 1)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
    out.sum().backward()  # gradients flow back across the device boundary
    assert model[0].weight.grad.device.index == 0


@pytest.mark.gpu
def test_dispatch_sequential_on_real_gpus_with_a_budget():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 257 KiB each
    dispatch_model(model, "sequential", max_memory={0: "600KiB", 1: "10MiB"})
    assert list(model.nn_handler_device_map.values()) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert model(torch.randn(2, 256, device="cuda:0")).device.index == 1
