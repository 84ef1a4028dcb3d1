"""On a device the training loop reads nothing back per step: host reads are a constant per epoch.

The loop reads device values according to a ``HostReads`` policy; these
tests force the policy used on a GPU onto the CPU and count every read a
host makes of a tensor (``item``, ``bool``, ``float``, ``cpu``, ``tolist``),
and how the batches are copied to the device, so the CPU suite covers what
a GPU run does. The ``gpu`` test checks the same
on a real GPU with ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nn_handler import NNHandler
from nn_handler import _tree
from nn_handler._training import batches, progress
from nn_handler._training.readout import HostReads, PendingValue
from nn_handler.callbacks import Callback
from nn_handler.errors import NonFiniteLossError
from scripts.handler_case import mae, make_data, make_handler, make_model

READS = ("item", "__bool__", "__float__", "cpu", "tolist")


@pytest.fixture
def device_reads(monkeypatch):
    """The policy of a GPU run, on the CPU."""
    monkeypatch.setattr(HostReads, "for_device", classmethod(lambda cls, device: cls(free=False)))


def _count_reads(train) -> int:
    count = [0]
    with pytest.MonkeyPatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, __original=original, **kwargs):
                count[0] += 1
                return __original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        train()
    return count[0]


def _reads_in_an_epoch(batches: int, stop_early: bool = False, **kwargs) -> int:
    X, y = make_data(8 * batches)
    handler = make_handler(clip_grad_norm=1.0, **kwargs)  # with a metric (mae) and a scheduler
    handler.set_train_loader((X, y), batch_size=8)
    handler.set_val_loader(make_data(16, seed=1), batch_size=8)
    limit = {"max_steps": batches - 2} if stop_early else {}  # a step limit, part-way through the epoch
    return _count_reads(lambda: handler.train(1, progress=False, **limit))


@pytest.mark.parametrize("kwargs", [{}, {"amp": "bf16", "grad_accum_steps": 2}, {"stop_early": True},
                                    {"amp": "fp16"}])
def test_host_reads_per_epoch_do_not_grow_with_the_steps_on_a_device(device_reads, kwargs):
    few, many = (_reads_in_an_epoch(n, **kwargs) for n in (8, 32))
    if kwargs.get("amp") != "fp16":
        assert few == many, (few, many)
    else:  # the GradScaler reads its found-inf flag at each step (the one read a hand-written fp16 loop has)
        assert many - few <= 32 - 8, (few, many)


def test_a_logger_reads_the_step_values_at_its_log_interval_only(device_reads, tmp_path):
    from nn_handler.callbacks import CSVLogger

    def reads(batches):
        X, y = make_data(8 * batches)
        logger = CSVLogger(tmp_path / f"{batches}.csv", log_every_n_steps=8)
        handler = make_handler(callbacks=[logger])  # the loss and one metric (mae) per step
        handler.set_train_loader((X, y), batch_size=8)
        return _count_reads(lambda: handler.train(1, progress=False))

    few, many = reads(8), reads(32)  # 1 and 4 logged steps
    assert many - few == (4 - 1) * 2, (few, many)  # 2 values a logged step, nothing at the others


def test_batches_go_to_a_device_without_waiting(monkeypatch, device_reads):
    copies = []

    def to_device(obj, device, non_blocking=False):
        copies.append(non_blocking)  # a blocking host-to-device copy waits for the GPU
        return _tree.to_device(obj, device, non_blocking)

    monkeypatch.setattr(batches, "to_device", to_device)  # every batch moves through batches.move
    X, y = make_data(32)
    handler = make_handler()
    # A DataLoader's batches are moved one by one, as a GPU's are from the host.
    handler.set_train_loader(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=8))
    handler.train(1, progress=False)
    assert copies == [True] * 4
    # Tensors given in memory are gathered where they are: on the device already, nothing is moved.
    copies.clear()
    handler.set_train_loader((X, y), batch_size=8)
    handler.train(2, progress=False)
    assert copies == []


def test_a_single_cpu_process_checks_each_loss_on_the_host(monkeypatch):
    # The counter sees the reads: the CPU policy checks each loss before its backward pass.
    few, many = (_reads_in_an_epoch(n) for n in (8, 32))
    assert many - few == 32 - 8


def test_non_finite_loss_on_a_device_names_its_batch_at_epoch_end(device_reads):
    X, y = make_data(96)
    y[8 * 2] = float("nan")  # batch 2 (unshuffled); every later loss is NaN too
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, device="cpu")
    handler.set_train_loader((X, y), batch_size=8, shuffle=False)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at epoch 1, step 2;"):
        handler.train(1, progress=False)
    assert handler.global_step == 12  # found at epoch end, not before the bad step


def test_a_shuffled_loader_reports_the_batch_the_bad_sample_landed_in(device_reads):
    # The GPU test that reported "step 10" for a NaN "in the third batch" shuffled its loader:
    # step is the index of the batch that holds the sample.
    X, y = make_data(96)
    y[8 * 2] = float("nan")
    seen = []
    mse = nn.MSELoss()

    def loss_fn(outputs, targets):
        seen.append(bool(torch.isnan(targets).any()))
        return mse(outputs, targets)

    handler = NNHandler(make_model(), torch.optim.SGD, loss_fn, optimizer_kwargs={"lr": 0.05}, device="cpu")
    handler.set_train_loader((X, y), batch_size=8)
    with pytest.raises(NonFiniteLossError) as info:
        handler.train(1, progress=False)
    assert info.value.step == seen.index(True)


def test_the_bar_shows_the_loss_of_a_landed_copy(monkeypatch):
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)
    bar = progress.EpochBar(1, 1, total=2, done=0, world_size=1, disable=True)
    bar.advance([torch.tensor(0.5)], [4])
    assert bar._bar.postfix.startswith("loss=0.5")
    bar.advance([torch.tensor(0.5), torch.tensor(1.5)], [4, 4])
    assert bar._bar.postfix.startswith("loss=1.5")
    bar.close()
    assert PendingValue(torch.tensor(2.0)).get() == 2.0


class _NoSyncInSteps(Callback):
    """Sync debug mode "error" from the first batch's start to the last batch's end (epoch-end sums may sync)."""

    def __init__(self, last: int):
        self.last = last

    def on_batch_begin(self, handler, batch):
        if batch == 0:
            torch.cuda.set_sync_debug_mode("error")

    def on_batch_end(self, handler, batch, loss):
        if batch == self.last:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("amp", [False, "bf16"])
def test_no_host_device_sync_in_the_steps_of_an_epoch_on_cuda(monkeypatch, amp):
    if amp == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)  # the bar refreshes at every step: still no sync
    X, y = make_data(256)
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, device="cuda",
                        amp=amp, clip_grad_norm=1.0, metrics={"mae": mae}, grad_accum_steps=2,
                        callbacks=[_NoSyncInSteps(last=256 // 8 - 1)])
    handler.set_train_loader((X, y), batch_size=8)
    try:
        history = handler.train(2, progress=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert history["train_loss"][1] < history["train_loss"][0]
