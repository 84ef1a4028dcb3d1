"""nn_handler.utils.parallel: MultiGPUConfig, mode selection, prepare_model, prepare_dataloader."""

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import nn_handler.utils._models.wrap as wrap
from nn_handler.errors import ConfigurationError, DeviceError, NNHandlerError
from nn_handler.testing import run_distributed
from nn_handler.utils.parallel import (
    MultiGPUConfig,
    MultiGPUMode,
    prepare_dataloader,
    prepare_model,
    resolve_parallel_mode,
    unwrap_parallel_model,
)

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
          "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def two_gpus(monkeypatch, clean_env):
    """Pretend two CUDA devices exist (nothing is allocated on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_gpu(monkeypatch, clean_env):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def rank1_of_2(clean_env):
    """A torchrun-style environment for rank 1 of 2, without forming a group."""
    clean_env.setenv("RANK", "1")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    return clean_env


class Recorder:
    """Stands in for DataParallel / DistributedDataParallel / _move and records the calls."""

    def __init__(self):
        self.calls = []

    def wrapper(self, kind):
        def build(module, **kwargs):
            self.calls.append((kind, module, kwargs))
            return (kind, module, kwargs)
        return build

    def move(self, model, device):
        self.calls.append(("move", model, device))
        return model


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(wrap, "DataParallel", rec.wrapper("dp"))
    monkeypatch.setattr(wrap, "DistributedDataParallel", rec.wrapper("ddp"))
    monkeypatch.setattr(wrap, "_move", rec.move)
    return rec


# --- MultiGPUConfig ------------------------------------------------------------------------------


def test_config_defaults(no_gpu):
    c = MultiGPUConfig()
    assert (c.mode, c.device_ids, c.output_device, c.backend) == ("auto", None, None, None)
    # broadcast_buffers=True is DDP's own default: not passed (torch 2.13 deprecates the argument)
    assert c.ddp_kwargs() == {"find_unused_parameters": False, "gradient_as_bucket_view": True,
                              "bucket_cap_mb": 25, "static_graph": False}
    assert c.sync_bn is False


@pytest.mark.parametrize("mode, expected", [(MultiGPUMode.DISTRIBUTED, "distributed"), ("DataParallel", "dataparallel"),
                                            (" none ", "none"), ("auto", "auto")])
def test_config_mode_spellings(no_gpu, mode, expected):
    assert MultiGPUConfig(mode=mode).mode == expected


@pytest.mark.parametrize("mode", ["hybrid", "ddp", "", 3, None])
def test_config_unknown_mode(no_gpu, mode):
    with pytest.raises(ConfigurationError) as info:
        MultiGPUConfig(mode=mode)
    assert isinstance(info.value, ValueError) and isinstance(info.value, NNHandlerError)
    assert str(info.value) == f"mode must be one of 'auto', 'none', 'dataparallel', 'distributed', got {mode!r}"


@pytest.mark.parametrize("cap", [-1, 0, -0.5, "25", True, None])
def test_config_bucket_size_must_be_positive(no_gpu, cap):
    with pytest.raises(ConfigurationError, match=rf"bucket_cap_mb must be a number of MiB > 0, got {cap!r}"):
        MultiGPUConfig(bucket_cap_mb=cap)


def test_config_device_ids_that_do_not_exist(two_gpus):
    with pytest.raises(DeviceError) as info:
        MultiGPUConfig(device_ids=[0, 2, 5])
    assert isinstance(info.value, ValueError)
    assert str(info.value) == "device 2 does not exist: this machine has 2 CUDA devices (valid ids 0..1)"


def test_config_device_ids_without_cuda(no_gpu):
    with pytest.raises(DeviceError, match=r"^device 0 does not exist: CUDA is not available on this machine$"):
        MultiGPUConfig(device_ids=[0])


def test_config_device_ids_accept_cuda_strings(two_gpus):
    c = MultiGPUConfig(device_ids=["cuda:1", torch.device("cuda", 0)], output_device="cuda:0")
    assert c.device_ids == [1, 0] and c.output_device == 0


@pytest.mark.parametrize("ids, error, message", [
    ([], DeviceError, r"device_ids must be a non-empty list such as \[0, 1\], or None for every GPU; got \[\]"),
    ([0, 0], DeviceError, r"device_ids lists cuda:0 twice: \[0, 0\]; give each GPU once"),
    (0, DeviceError, r"device_ids must be a non-empty list such as \[0, 1\], or None for every GPU; got 0"),
    ([-1], DeviceError, "device must be a GPU index >= 0, got -1"),
    (["cpu"], DeviceError, "device 'cpu' is not a CUDA device"),
    ([True], DeviceError, "device must be a GPU index, a string such as 'cuda:0' or a torch.device, got bool True"),
])
def test_config_malformed_device_ids(two_gpus, ids, error, message):
    with pytest.raises(error, match=message):
        MultiGPUConfig(device_ids=ids)


def test_config_output_device(two_gpus):
    with pytest.raises(ConfigurationError, match=r"output_device 1 is not one of device_ids \[0\]"):
        MultiGPUConfig(device_ids=[0], output_device=1)
    with pytest.raises(DeviceError, match=r"^output_device 4 does not exist: this machine has 2 CUDA devices"):
        MultiGPUConfig(output_device=4)
    with pytest.raises(DeviceError, match=r"^output_device 'cpu' is not a CUDA device"):
        MultiGPUConfig(output_device="cpu")


def test_config_backend(no_gpu):
    assert MultiGPUConfig(backend="GLOO").backend == "gloo"
    with pytest.raises(ConfigurationError, match=r"backend must be one of 'gloo', 'nccl'.* got 'tcp'"):
        MultiGPUConfig(backend="tcp")


@pytest.mark.parametrize("flag", ["find_unused_parameters", "gradient_as_bucket_view", "broadcast_buffers",
                                  "static_graph", "sync_bn"])
def test_config_flags_must_be_bools(no_gpu, flag):
    with pytest.raises(ConfigurationError, match=rf"{flag} must be True or False, got 'yes'"):
        MultiGPUConfig(**{flag: "yes"})


# --- mode selection ------------------------------------------------------------------------------


def test_auto_is_none_on_a_plain_cpu_run(no_gpu):
    assert resolve_parallel_mode() == "none"
    assert resolve_parallel_mode(MultiGPUConfig()) == "none"


def test_auto_picks_dataparallel_with_two_gpus(two_gpus):
    assert resolve_parallel_mode() == "dataparallel"
    assert resolve_parallel_mode(MultiGPUConfig(device_ids=[1])) == "none"  # one GPU chosen
    assert resolve_parallel_mode(MultiGPUConfig(), device="cpu") == "none"  # CPU chosen
    assert resolve_parallel_mode(MultiGPUConfig(mode="none")) == "none"


def test_auto_picks_distributed_from_the_launcher(no_gpu, rank1_of_2):
    assert resolve_parallel_mode() == "distributed"
    assert resolve_parallel_mode(MultiGPUConfig(mode="none")) == "none"


def test_auto_picks_distributed_when_a_group_exists(no_gpu, monkeypatch):
    monkeypatch.setattr(wrap, "is_distributed", lambda: True)
    assert resolve_parallel_mode() == "distributed"


def test_explicit_distributed_without_group_or_launcher(no_gpu):
    with pytest.raises(ConfigurationError) as info:
        resolve_parallel_mode(MultiGPUConfig(mode="distributed"))
    message = str(info.value)
    assert message.startswith("mode='distributed' needs a torch.distributed process group, but none exists")
    assert "torchrun --nproc_per_node=N" in message and "initialize_ddp()" in message


def test_config_type_is_checked(no_gpu):
    with pytest.raises(TypeError, match="config must be a MultiGPUConfig or None, got dict"):
        prepare_model(nn.Linear(1, 1), {"mode": "none"})


# --- prepare_model -------------------------------------------------------------------------------


def test_prepare_model_none_mode(no_gpu):
    model = nn.Linear(2, 2)
    assert prepare_model(model) is model
    assert prepare_model(model, MultiGPUConfig(mode="none"), device="cpu") is model
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        prepare_model("model")


def test_prepare_model_moves_to_the_device_in_none_mode(no_gpu):
    model = nn.Linear(2, 2).to(torch.float64)
    out = prepare_model(model, MultiGPUConfig(mode="none"), device=torch.device("meta"))
    assert out.weight.device.type == "meta"


def test_prepare_model_leaves_wrapped_models_alone(no_gpu, recorder):
    inner = nn.Linear(2, 2)
    wrapped = nn.DataParallel(inner)  # without CUDA, DataParallel is a plain holder
    assert prepare_model(wrapped) is wrapped
    assert recorder.calls == []


def test_prepare_model_dataparallel_on_all_gpus(two_gpus, recorder):
    model = nn.Linear(2, 2)
    kind, module, kwargs = prepare_model(model)
    assert (kind, module, kwargs) == ("dp", model, {"device_ids": [0, 1], "output_device": 0})
    assert recorder.calls[0] == ("move", model, torch.device("cuda", 0))


def test_prepare_model_dataparallel_puts_the_asked_device_first(two_gpus, recorder):
    model = nn.Linear(2, 2)
    kind, _, kwargs = prepare_model(model, device="cuda:1")
    assert kind == "dp" and kwargs == {"device_ids": [1, 0], "output_device": 1}
    assert recorder.calls[0] == ("move", model, torch.device("cuda", 1))


def test_prepare_model_dataparallel_keeps_config_ids(two_gpus, recorder):
    _, _, kwargs = prepare_model(nn.Linear(2, 2), MultiGPUConfig(device_ids=[1, 0], output_device=0))
    assert kwargs == {"device_ids": [1, 0], "output_device": 0}


def test_prepare_model_dataparallel_needs_cuda(no_gpu):
    with pytest.raises(ConfigurationError, match="mode='dataparallel' needs CUDA devices, but CUDA is not available"):
        prepare_model(nn.Linear(2, 2), MultiGPUConfig(mode="dataparallel"))


def test_prepare_model_dataparallel_rejects_a_cpu_device(two_gpus, recorder):
    with pytest.raises(ConfigurationError, match="runs on CUDA devices, but device=cpu was given"):
        prepare_model(nn.Linear(2, 2), MultiGPUConfig(mode="dataparallel"), device="cpu")
    with pytest.raises(ConfigurationError, match=r"device cuda:1 is not one of device_ids \[0\]"):
        prepare_model(nn.Linear(2, 2), MultiGPUConfig(mode="dataparallel", device_ids=[0]), device="cuda:1")


def test_prepare_model_ddp_on_the_local_rank_gpu(two_gpus, rank1_of_2, recorder, monkeypatch):
    monkeypatch.setattr(wrap, "is_distributed", lambda: True)
    config = MultiGPUConfig(find_unused_parameters=True, bucket_cap_mb=50, static_graph=True,
                            broadcast_buffers=False, gradient_as_bucket_view=False)
    model = nn.Linear(2, 2)
    kind, module, kwargs = prepare_model(model, config)
    assert kind == "ddp" and module is model
    assert recorder.calls[0] == ("move", model, torch.device("cuda", 1))
    assert kwargs == {"device_ids": [1], "output_device": 1, "find_unused_parameters": True,
                      "gradient_as_bucket_view": False, "broadcast_buffers": False, "bucket_cap_mb": 50,
                      "static_graph": True}


def test_prepare_model_ddp_on_cpu_passes_no_device_ids(no_gpu, rank1_of_2, recorder, monkeypatch):
    monkeypatch.setattr(wrap, "is_distributed", lambda: True)
    kind, _, kwargs = prepare_model(nn.Linear(2, 2))
    assert kind == "ddp" and "device_ids" not in kwargs and "output_device" not in kwargs
    assert recorder.calls[0][2] == torch.device("cpu")


def test_prepare_model_forms_the_group_when_only_the_launcher_says_distributed(no_gpu, rank1_of_2, recorder,
                                                                               monkeypatch):
    formed = []
    monkeypatch.setattr(wrap, "initialize_ddp", lambda **kw: formed.append(kw))
    prepare_model(nn.Linear(2, 2), MultiGPUConfig(backend="gloo"))
    assert formed == [{"backend": "gloo"}]


def test_prepare_model_sync_bn(no_gpu, rank1_of_2, recorder, monkeypatch):
    monkeypatch.setattr(wrap, "is_distributed", lambda: True)
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))
    _, module, _ = prepare_model(model, MultiGPUConfig(sync_bn=True))
    assert isinstance(module[1], nn.SyncBatchNorm)
    _, module, _ = prepare_model(nn.Sequential(nn.BatchNorm1d(4)), MultiGPUConfig())
    assert type(module[0]) is nn.BatchNorm1d


def test_unwrap_parallel_model_through_every_wrapper():
    inner = nn.Linear(2, 2)

    class Compiled(nn.Module):  # the shape of torch.compile's OptimizedModule
        def __init__(self, mod):
            super().__init__()
            self._orig_mod = mod

    assert unwrap_parallel_model(inner) is inner
    assert unwrap_parallel_model(nn.DataParallel(inner)) is inner
    assert unwrap_parallel_model(Compiled(nn.DataParallel(Compiled(inner)))) is inner


# --- prepare_dataloader --------------------------------------------------------------------------


def _collate(batch):
    return torch.stack([row[0] for row in batch]) * 10


def _init_worker(worker_id):
    pass


def _dataset(n=10):
    return TensorDataset(torch.arange(float(n)))


def test_prepare_dataloader_is_a_noop_when_not_distributed(no_gpu):
    loader = DataLoader(_dataset(), batch_size=2, shuffle=True)
    assert prepare_dataloader(loader) is loader
    assert prepare_dataloader(loader, MultiGPUConfig(mode="none")) is loader


def test_prepare_dataloader_gives_this_rank_its_shard(no_gpu, rank1_of_2):
    loader = DataLoader(_dataset(10), batch_size=2)
    out = prepare_dataloader(loader)
    assert isinstance(out.sampler, DistributedSampler)
    assert (out.sampler.rank, out.sampler.num_replicas, out.sampler.shuffle) == (1, 2, False)
    assert [b[0].tolist() for b in out] == [[1.0, 3.0], [5.0, 7.0], [9.0]]


def test_prepare_dataloader_keeps_the_loader_settings(no_gpu, rank1_of_2):
    gen = torch.Generator().manual_seed(3)
    loader = DataLoader(_dataset(12), batch_size=3, shuffle=True, num_workers=2, collate_fn=_collate,
                        pin_memory=True, drop_last=True, timeout=7, worker_init_fn=_init_worker,
                        multiprocessing_context="spawn", generator=gen, prefetch_factor=4, persistent_workers=True)
    out = prepare_dataloader(loader, seed=11)
    assert out is not loader and out.dataset is loader.dataset
    for name in ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                 "generator", "prefetch_factor", "persistent_workers"):
        assert getattr(out, name) == getattr(loader, name), name
    assert out.multiprocessing_context.get_start_method() == "spawn"
    assert out.sampler.shuffle is True and out.sampler.seed == 11  # shuffle follows the original loader


def test_prepare_dataloader_shuffle_override_and_collate(no_gpu, rank1_of_2):
    loader = DataLoader(_dataset(8), batch_size=4, shuffle=True, collate_fn=_collate)
    out = prepare_dataloader(loader, shuffle=False)
    assert out.sampler.shuffle is False
    assert [b.tolist() for b in out] == [[10.0, 30.0, 50.0, 70.0]]
    assert prepare_dataloader(DataLoader(_dataset(8)), shuffle=True).sampler.shuffle is True
    with pytest.raises(TypeError, match="shuffle must be True, False or None"):
        prepare_dataloader(loader, shuffle="yes")


def test_prepare_dataloader_shuffled_shards_partition_the_data(no_gpu, clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    seen = []
    for rank in (0, 1):
        clean_env.setenv("RANK", str(rank))
        loader = prepare_dataloader(DataLoader(_dataset(10), batch_size=5, shuffle=True), seed=4)
        seen.append([x for (b,) in loader for x in b.tolist()])
    assert sorted(seen[0] + seen[1]) == [float(i) for i in range(10)]
    assert seen[0] != sorted(seen[0]) or seen[1] != sorted(seen[1])  # actually shuffled


def test_prepare_dataloader_without_automatic_batching(no_gpu, rank1_of_2):
    out = prepare_dataloader(DataLoader(_dataset(4), batch_size=None))
    assert out.batch_size is None and [x[0].item() for x in out] == [1.0, 3.0]


def test_prepare_dataloader_leaves_distributed_loaders_alone(no_gpu, rank1_of_2):
    ds = _dataset()
    loader = DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=1))
    assert prepare_dataloader(loader) is loader


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_prepare_dataloader_iterable_dataset_warns(no_gpu, rank1_of_2):
    loader = DataLoader(_Stream(), batch_size=2)
    with pytest.warns(RuntimeWarning, match="IterableDataset cannot take a DistributedSampler"):
        assert prepare_dataloader(loader) is loader


def test_prepare_dataloader_refuses_samplers_it_would_change(no_gpu, rank1_of_2):
    ds = _dataset(4)
    weighted = DataLoader(ds, sampler=WeightedRandomSampler([1.0] * 4, 4), batch_size=2)
    with pytest.raises(ConfigurationError, match=r"sampler \(WeightedRandomSampler\) whose order or weights"):
        prepare_dataloader(weighted)
    with pytest.raises(ConfigurationError, match=r"sampler \(RandomSampler\)"):
        prepare_dataloader(DataLoader(ds, sampler=RandomSampler(ds, replacement=True)))

    class Buckets(BatchSampler):
        pass

    custom = DataLoader(ds, batch_sampler=Buckets(SequentialSampler(ds), 2, False))
    with pytest.raises(ConfigurationError, match=r"custom batch_sampler \(Buckets\)"):
        prepare_dataloader(custom)


def test_prepare_dataloader_type_check():
    with pytest.raises(TypeError, match="loader must be a torch.utils.data.DataLoader, got list"):
        prepare_dataloader([1, 2])


# --- on two real gloo ranks ----------------------------------------------------------------------


def _ddp_body(rank):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    from nn_handler.utils.parallel import MultiGPUConfig, prepare_dataloader, prepare_model, unwrap_parallel_model

    torch.manual_seed(0)  # same initial weights on both ranks (DDP also broadcasts them)
    model = prepare_model(nn.Linear(1, 1, bias=False), MultiGPUConfig(bucket_cap_mb=1))
    loader = prepare_dataloader(DataLoader(TensorDataset(torch.arange(8.0).unsqueeze(1)), batch_size=2,
                                           shuffle=True), seed=1)
    loader.sampler.set_epoch(0)
    seen = [x for (b,) in loader for x in b.squeeze(1).tolist()]
    (batch,) = next(iter(loader))
    model(batch).sum().backward()
    grad = unwrap_parallel_model(model).weight.grad.item()
    return (type(model) is DistributedDataParallel, model.device_ids, model.bucket_bytes_cap,
            loader.batch_size, seen, grad, float(batch.sum()))


@pytest.mark.slow
def test_prepare_model_and_loader_on_two_gloo_ranks():
    results = run_distributed(_ddp_body, nprocs=2, timeout=120)
    for r in results:
        assert not isinstance(r, BaseException), getattr(r, "remote_traceback", r)
    (ddp0, ids0, cap0, bs0, seen0, grad0, s0), (ddp1, _, _, bs1, seen1, grad1, s1) = results
    assert ddp0 and ddp1 and ids0 is None and cap0 == 1024 * 1024
    assert bs0 == bs1 == 2
    assert len(seen0) == len(seen1) == 4 and sorted(seen0 + seen1) == [float(i) for i in range(8)]
    # Gradients were averaged over the ranks: d(sum(w*x))/dw = sum(x), averaged.
    assert grad0 == grad1 == pytest.approx((s0 + s1) / 2)


@pytest.mark.gpu
def test_prepare_model_dataparallel_on_real_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model = prepare_model(nn.Linear(4, 2))
    assert isinstance(model, nn.DataParallel) and model.device_ids == list(range(torch.cuda.device_count()))
    out = model(torch.randn(8, 4, device="cuda:0"))
    assert out.shape == (8, 2) and out.device == torch.device("cuda", 0)


def _cuda_ddp_body(rank):
    import torch
    from torch import nn

    from nn_handler.utils.parallel import prepare_model

    model = prepare_model(nn.Linear(4, 2))
    out = model(torch.randn(3, 4, device=f"cuda:{rank}"))
    return model.device_ids, str(next(model.parameters()).device), str(out.device)


@pytest.mark.gpu
def test_prepare_model_ddp_on_real_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_distributed(_cuda_ddp_body, nprocs=2, timeout=180, backend="nccl")
    assert results == [([0], "cuda:0", "cuda:0"), ([1], "cuda:1", "cuda:1")]
