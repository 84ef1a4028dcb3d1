"""Device results go straight into a worker's result files, through mappings page-locked once per file.

On the CPU a stand-in for :class:`lending.CudaHostMemory` names the CPU as
the device that copies directly, so the worker's bookkeeping (one
registration per file, reuse across calls, unregistration when a file is
dropped) runs here through the real encoder and the real caller's side; the
`gpu` tests cover the copy from a CUDA device.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from nn_handler.utils._workers import lending, transport

MiB = 1 << 20


class FakeHost:
    """Records what would be page-locked; ``devices`` says which tensors take the direct path."""

    def __init__(self, devices=("cpu",), fail: bool = False):
        self.devices = frozenset(devices)
        self.fail = fail
        self.locked: dict[int, int] = {}  # address -> bytes, page-locked now
        self.registrations = 0
        self.syncs = 0

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError("Registering memory failed with cudaError: 1.")
        assert ptr not in self.locked, "the same memory was page-locked twice"
        self.locked[ptr] = nbytes
        self.registrations += 1

    def unregister(self, ptr: int) -> None:
        del self.locked[ptr]  # KeyError: unlocked what was never locked

    def synchronize(self, tensor) -> None:
        self.syncs += 1


def _mapped_files(prefix: str) -> int:
    """Mappings in this process of files that were named under ``prefix``."""
    with open("/proc/self/maps") as maps:
        return sum(prefix in line for line in maps)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A worker's result encoder (lending, page-locking with a FakeHost) in this process, and the host."""
    host = FakeHost()
    monkeypatch.setattr(lending, "HOST_MEMORY", host)
    prefix = f"{tmp_path}/nnh-{os.getpid()}-w0.1-"
    encoder = transport.Encoder(prefix, to_cpu=True, lend=True)
    yield encoder, host
    lending.forget(prefix)
    for key in list(encoder.lent._files):
        encoder.lent._drop(key)


def _round_trip(encoder, obj):
    """Send ``obj`` as a worker's result, after telling the worker what the caller gave back; what arrives."""
    encoder.lent.update(*lending.settle(encoder.prefix))
    data, created = encoder.dumps(obj)
    return transport.loads(data), created


@pytest.mark.slow
def test_a_file_is_page_locked_once_and_written_again_by_later_results(worker):
    encoder, host = worker
    first = torch.arange(MiB, dtype=torch.float32)  # 4 MiB
    got, created = _round_trip(encoder, first)
    assert torch.equal(got, first) and len(created) == 1
    assert list(host.locked.values()) == [first.nbytes] and host.syncs == 1
    del got
    gc.collect()

    for step in range(1, 4):  # the caller dropped the last result: its file is written again, still locked
        value = torch.full((MiB,), float(step))
        got, created = _round_trip(encoder, value)
        assert torch.equal(got, value)
        assert created == [] and host.registrations == 1 and len(host.locked) == 1
        del got
        gc.collect()
    assert host.syncs == 4

    # Another size needs its own file, locked once too; a result still held keeps its file out of reach.
    kept, _ = _round_trip(encoder, torch.ones(2 * MiB))
    again, created = _round_trip(encoder, torch.ones(2 * MiB) * 3)
    assert len(created) == 1 and host.registrations == 3
    assert float(kept[0]) == 1.0 and float(again[0]) == 3.0  # the held result is never overwritten


def test_a_dropped_file_is_unlocked_and_unmapped_in_the_worker(worker, monkeypatch):
    encoder, host = worker
    monkeypatch.setattr(lending, "SPARE_FILES", 0)  # the caller keeps no spare: each freed file is dropped
    got, _ = _round_trip(encoder, torch.ones(MiB))
    assert len(host.locked) == 1 and _mapped_files(encoder.prefix) == 2  # the worker's mapping and the caller's
    del got
    gc.collect()
    encoder.lent.update(*lending.settle(encoder.prefix))
    assert host.locked == {} and _mapped_files(encoder.prefix) == 0
    assert encoder.lent._files == {}


def test_a_file_whose_memory_cannot_be_unlocked_still_goes(worker, monkeypatch):
    encoder, host = worker
    monkeypatch.setattr(lending, "SPARE_FILES", 0)
    got, _ = _round_trip(encoder, torch.ones(MiB))
    del got
    gc.collect()

    def broken(ptr):
        raise AssertionError("Unpinning shared memory failed with error-code: 1")

    monkeypatch.setattr(host, "unregister", broken)
    with pytest.warns(RuntimeWarning, match="could not unregister"):
        encoder.lent.update(*lending.settle(encoder.prefix))  # the worker goes on to its next task
    assert _mapped_files(encoder.prefix) == 0 and encoder.lent._files == {}
    host.locked.clear()


def test_a_message_that_fails_lets_its_files_go(worker):
    encoder, host = worker
    with pytest.raises(Exception):
        encoder.dumps([torch.ones(MiB), threading.Lock()])  # the tensor is written, then the lock fails
    assert host.locked == {} and _mapped_files(encoder.prefix) == 0 and encoder.lent._files == {}


def test_results_on_other_devices_take_the_usual_path(tmp_path, monkeypatch):
    host = FakeHost(devices=("cuda",))
    monkeypatch.setattr(lending, "HOST_MEMORY", host)
    encoder = transport.Encoder(f"{tmp_path}/nnh-{os.getpid()}-w1.1-", to_cpu=True, lend=True)
    value = torch.ones(MiB, requires_grad=True) * 2  # a CPU result, and small ones, are written with pwrite
    got, _ = _round_trip(encoder, [value, torch.ones(10)])
    assert torch.equal(got[0], value.detach()) and not got[0].requires_grad
    assert host.registrations == 0 and _mapped_files(encoder.prefix) == 1  # only the caller maps it
    del got
    lending.forget(encoder.prefix)


@pytest.mark.slow
def test_a_cpu_result_goes_into_a_spare_through_a_mapping_the_worker_keeps(tmp_path, monkeypatch):
    """Only device results are page-locked; a CPU result written into a file given back is copied into a
    mapping the worker keeps (not written with pwrite), and every value arrives, whatever the layout."""
    host = FakeHost(devices=("cuda",))
    monkeypatch.setattr(lending, "HOST_MEMORY", host)
    encoder = transport.Encoder(f"{tmp_path}/nnh-{os.getpid()}-w2.1-", to_cpu=True, lend=True)
    got, created = _round_trip(encoder, torch.zeros(MiB))  # a new file: written with pwrite, mapped by the caller only
    assert len(created) == 1 and _mapped_files(encoder.prefix) == 1
    del got
    gc.collect()
    sources = [torch.arange(MiB, dtype=torch.float32), torch.arange(MiB, dtype=torch.float32).view(1024, 1024).t(),
               torch.full((MiB // 2,), -3.0, dtype=torch.float64), torch.ones(MiB, dtype=torch.int32) * 7]
    for source in sources:  # the same file each time: 4 MiB, contiguous or not, of any dtype
        got, created = _round_trip(encoder, source)
        assert torch.equal(got, source) and got.dtype == source.dtype and created == []
        assert _mapped_files(encoder.prefix) == 2  # the worker's mapping and the caller's
        del got
        gc.collect()
    assert host.registrations == 0 and host.syncs == 0
    lending.forget(encoder.prefix)
    for key in list(encoder.lent._files):
        encoder.lent._drop(key)
    assert _mapped_files(encoder.prefix) == 0


def test_a_page_locked_file_given_to_a_cpu_result_waits_on_no_stream(worker):
    encoder, host = worker
    got, _ = _round_trip(encoder, torch.ones(MiB))  # "from a device": mapped and page-locked
    del got
    gc.collect()
    host.devices = frozenset({"cuda"})  # the next result of that size is a CPU one: same file, same mapping
    got, created = _round_trip(encoder, torch.full((MiB,), 2.0))
    assert float(got.min()) == float(got.max()) == 2.0 and created == []
    assert host.registrations == 1 and host.syncs == 1  # no stream of the CPU's to wait on
    del got


def test_a_file_that_cannot_be_page_locked_is_still_written(worker, monkeypatch):
    encoder, host = worker
    host.fail = True
    monkeypatch.setattr(lending, "_register_warned", False)
    with pytest.warns(RuntimeWarning, match="could not page-lock"):
        got, _ = _round_trip(encoder, torch.ones(MiB) * 5)
    assert float(got.sum()) == 5 * MiB and host.syncs == 0  # a pageable copy blocks: nothing to wait for
    del got
    gc.collect()
    encoder.lent.update(*lending.settle(encoder.prefix))
    got, _ = _round_trip(encoder, torch.ones(MiB) * 6)
    assert float(got[-1]) == 6.0
    del got


@pytest.mark.gpu
def test_cuda_results_are_copied_into_page_locked_files(tmp_path):
    """The real copy: non-contiguous, half precision and views of CUDA tensors arrive equal, file reused."""
    encoder = transport.Encoder(f"/dev/shm/nnh-{os.getpid()}-gputest-", to_cpu=True, lend=True)
    try:
        for step in range(3):
            base = torch.randn(1024, 2048, device="cuda")
            result = {"t": base.t(), "half": base.half() * step, "col": base[:, 3:1027]}
            got, _ = _round_trip(encoder, result)
            for name, value in result.items():
                assert got[name].device.type == "cpu" and torch.equal(got[name], value.cpu()), name
            del got
            gc.collect()
        assert len(encoder.lent._mapped) == 3 and all(locked for _, locked in encoder.lent._mapped.values())
    finally:
        lending.forget(encoder.prefix)
        for key in list(encoder.lent._files):
            encoder.lent._drop(key)
