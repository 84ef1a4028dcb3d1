"""Worker recycling for long-lived pools: max_tasks_per_worker and worker_memory_limit (on CPU workers)."""

from __future__ import annotations

import logging
import os
import re
import time

import pytest

from helpers import open_files, pids_alive
from nn_handler import ParallelExecutor, worker_state
from nn_handler.errors import ConfigurationError
from nn_handler.utils._workers.worker import memory_in_use

pytestmark = pytest.mark.timeout(180)


def _init(log):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    worker_state()["calls"] = 0


def _count(_=None):
    worker_state()["calls"] = worker_state().get("calls", 0) + 1
    return os.getpid(), worker_state()["calls"]


def _hold(megabytes):
    import torch

    worker_state().setdefault("held", []).append(torch.ones(megabytes << 18))  # touched: resident
    return os.getpid()


def _memory(_=None):
    import torch

    return memory_in_use(torch.device("cpu"))


def test_max_tasks_per_worker_replaces_the_worker_and_reruns_the_initializer(tmp_path):
    log = tmp_path / "init.log"
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, max_tasks_per_worker=2,
                          initializer=_init, initargs=(str(log),)) as ex:
        results = [ex.submit(_count).result(timeout=60) for _ in range(6)]
        pids = [pid for pid, _ in results]
        assert [calls for _, calls in results] == [1, 2, 1, 2, 1, 2]  # worker_state() fresh in each
        assert len(set(pids)) == 3 and pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        assert log.read_text().split() == [str(p) for p in dict.fromkeys(pids)]  # the initializer ran in each
        assert not pids_alive(pids[:4])  # the retired workers are gone
        assert [calls for _, calls in ex.map(_count, range(4))] == [1, 2, 1, 2]  # map tasks count too


def test_max_tasks_per_worker_counts_run_calls():
    with ParallelExecutor(device_ids=["cpu", "cpu"], pass_device=False, max_tasks_per_worker=1) as ex:
        first, second = ex.run(_count), ex.run(_count)
        assert [c for _, c in first] == [1, 1] == [c for _, c in second]
        assert not {p for p, _ in first} & {p for p, _ in second}


def test_worker_memory_limit_replaces_a_worker_that_grew():
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        baseline = probe.submit(_memory).result(timeout=60)
    limit = baseline + (128 << 20)
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=limit) as ex:
        small = [ex.submit(_hold, 1).result(timeout=60) for _ in range(3)]
        assert len(set(small)) == 1  # under the limit: the same worker
        grown = ex.submit(_hold, 256).result(timeout=60)  # keeps 256 MiB: above the limit after the task
        assert grown == small[0]
        after = ex.submit(_count).result(timeout=60)
        assert after[0] != grown and after[1] == 1 and not pids_alive([grown])


def test_a_worker_above_the_memory_limit_is_retired_once_its_result_is_sent():
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        baseline = probe.submit(_memory).result(timeout=60)
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=baseline + (128 << 20)) as ex:
        grown = ex.submit(_hold, 256).result(timeout=60)
        deadline = time.monotonic() + 30
        while pids_alive([grown]) and time.monotonic() < deadline:  # no next call: it does not wait for one
            time.sleep(0.1)
        assert not pids_alive([grown])
        assert ex.submit(_count).result(timeout=60)[1] == 1  # a fresh worker


def _big_result(megabytes):
    import torch

    return os.getpid(), torch.ones(megabytes << 18)  # touched: resident until it is sent


def test_worker_memory_limit_does_not_count_a_result_already_sent():
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        baseline = probe.submit(_memory).result(timeout=60)
    limit = baseline + (128 << 20)
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=limit) as ex:
        pid, big = ex.submit(_big_result, 256).result(timeout=60)
        assert big.shape == (256 << 18,) and float(big[-1]) == 1.0
        del big
        assert ex.submit(_count).result(timeout=60)[0] == pid  # the worker holds nothing above the limit: kept


def _resident(_=None):
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon:", "RssShmem:")))
    return os.getpid(), sum(int(value.split()[0]) for value in fields.values()) << 10


def test_worker_memory_limit_does_not_count_the_pages_a_worker_shares_with_its_server():
    # Most of an idle worker's resident set is torch's import, shared with the server it was forked from and
    # with the other workers: a limit under it replaced every worker after every task.
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        _, resident = probe.submit(_resident).result(timeout=60)
        private = probe.submit(_memory).result(timeout=60)
    assert private < resident // 2, (private >> 20, resident >> 20)
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=resident // 2) as ex:
        pids = {ex.submit(_resident).result(timeout=60)[0] for _ in range(3)}
    assert len(pids) == 1, "an idle worker was replaced for the pages it shares"


def _results(megabytes, count):
    import torch

    return os.getpid(), [torch.full((megabytes << 18,), float(k)) for k in range(count)]


def test_worker_memory_limit_does_not_count_the_result_files_it_writes_again():
    """A worker writes a result into the file of one the caller dropped, through a mapping it keeps: lent to
    the caller again, the caller's memory, not memory the worker grew by (192 MiB of such files here, against a
    128 MiB margin)."""
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        baseline = probe.submit(_memory).result(timeout=60)
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=baseline + (128 << 20)) as ex:
        pids = []
        for _ in range(4):
            pid, results = ex.submit(_results, 64, 3).result(timeout=60)
            assert [(float(t[0]), float(t[-1])) for t in results] == [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0)]
            pids.append(pid)
            del results
        assert len(set(pids)) == 1, "the worker was replaced for memory it shares with its caller"


def _result_files_held(_=None):
    """This worker's pid, and the result files it holds open (``nnh-*-w0.*``, lent to its caller or given back
    to write again), by the names they had (each side's link reads ``<name> (deleted)``)."""
    return os.getpid(), {link for link in open_files("/nnh-") if "-w0." in link}


def test_worker_memory_limit_counts_the_result_files_a_worker_keeps_for_itself_not_those_it_handed_over():
    # Results the caller holds are the caller's memory: not counted (the worker keeps their files open to write
    # again once they are dropped). Files given back and kept to write again count, and over the limit the
    # worker lets go of them (a cache) before it would be replaced. They were never counted: 192 MiB was kept.
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        baseline = probe.submit(_memory).result(timeout=60)
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=baseline + (128 << 20)) as ex:
        pid, results = ex.submit(_results, 64, 3).result(timeout=60)  # 192 MiB, handed over: kept by the caller
        worker, files = ex.submit(_result_files_held).result(timeout=60)
        assert worker == pid and len(files) == 3
        assert files <= _result_files_held()[1]  # the caller maps them too
        assert ex.submit(_result_files_held).result(timeout=60) == (pid, files), "replaced for the caller's results"
        del results  # given back with the next task: the worker keeps 192 MiB of files to write results into
        assert ex.submit(_result_files_held).result(timeout=60) == (pid, files)
        assert ex.submit(_result_files_held).result(timeout=60) == (pid, set()), "kept its files above the limit"
        # The caller let go of them too: their memory is free. (Only these: a pool an earlier test in this
        # process left to the garbage collector may still hold files of its own worker 0.)
        assert not files & _result_files_held()[1]


def _hold_shared(megabytes, how):
    import mmap

    import torch

    if how == "share_memory_":
        held = torch.ones(megabytes << 18).share_memory_()
    else:  # an anonymous MAP_SHARED mapping, its pages touched
        held = mmap.mmap(-1, megabytes << 20)
        torch.frombuffer(held, dtype=torch.uint8).fill_(1)
    worker_state().setdefault("held", []).append(held)
    return os.getpid()


@pytest.mark.parametrize("how", ["share_memory_", "MAP_SHARED"])
def test_worker_memory_limit_counts_the_shared_memory_a_worker_keeps(how):
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        baseline = probe.submit(_memory).result(timeout=60)
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=baseline + (300 << 20)) as ex:
        first = ex.submit(_hold_shared, 200, how).result(timeout=60)  # 200 MiB: under the limit, kept
        assert ex.submit(_hold_shared, 200, how).result(timeout=60) == first  # 400 MiB after it: replaced
        assert ex.submit(_count).result(timeout=60)[0] != first
        assert not pids_alive([first])


def _keep_a_view(tensor):
    worker_state().setdefault("views", []).append(tensor[:10])  # the whole argument file stays mapped
    return os.getpid()


@pytest.mark.parametrize("how", ["submit", "map"])
def test_worker_memory_limit_counts_the_argument_files_a_worker_keeps_a_view_of(how, caplog):
    # A view keeps its argument's whole file in shared memory, though the worker touched none of its pages.
    import torch

    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as probe:
        baseline = probe.submit(_memory).result(timeout=60)
    argument = torch.ones(64 << 18)  # 64 MiB, a file of its own for each task
    caplog.set_level(logging.INFO, logger="nn_handler.utils._workers.scheduler")
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, worker_memory_limit=baseline + (100 << 20)) as ex:
        if how == "submit":
            pids = [ex.submit(_keep_a_view, argument).result(timeout=60) for _ in range(4)]
        else:
            pids = list(ex.map(_keep_a_view, [argument] * 4))
    # 64 MiB held: kept; 128 MiB: replaced after its second task, and so on.
    assert pids[0] == pids[1] != pids[2] == pids[3], pids
    lines = [r.getMessage() for r in caplog.records if "worker_memory_limit" in r.getMessage()]
    assert len(lines) == 2, lines
    held = re.search(rf"pid {pids[0]}\b.* holds (\d+) MiB", lines[0])  # why, which worker, how much
    assert held and int(held.group(1)) >= ((baseline + (128 << 20)) >> 20) - 8, (baseline >> 20, lines[0])


def test_a_worker_replaced_after_max_tasks_per_worker_leaves_a_line_in_the_log(caplog):
    caplog.set_level(logging.INFO, logger="nn_handler.utils._workers.scheduler")
    with ParallelExecutor(device_ids=["cpu"], pass_device=False, max_tasks_per_worker=2) as ex:
        pids = [ex.submit(_count).result(timeout=60)[0] for _ in range(3)]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "replaced" in r.getMessage()]
    assert len(lines) == 1, lines  # the first worker, after its 2 tasks
    assert f"pid {pids[0]}" in lines[0] and "max_tasks_per_worker=2" in lines[0] and "MiB" in lines[0], lines[0]


@pytest.mark.parametrize("kwargs, text", [
    ({"max_tasks_per_worker": 0}, "max_tasks_per_worker must be an int >= 1 or None, got 0"),
    ({"worker_memory_limit": -5}, "worker_memory_limit must be an int >= 1 or None, got -5"),
    ({"worker_memory_limit": 1.5}, "worker_memory_limit must be an int >= 1 or None, got 1.5"),
])
def test_bad_recycling_settings(kwargs, text):
    with pytest.raises(ConfigurationError, match=text):
        ParallelExecutor(device_ids=["cpu"], **kwargs)


def _filled(value, device=None):
    import torch

    return torch.full((1 << 20,), float(value))  # 4 MiB: through a file in shared memory


@pytest.mark.parametrize("recycling", [{"max_tasks_per_worker": 1}, {"worker_memory_limit": 1}],
                         ids=["max_tasks_per_worker", "worker_memory_limit"])
def test_a_large_result_survives_its_worker_being_replaced_right_after(recycling):
    # The worker is replaced as soon as its reply is read, before the result is
    # loaded: its files must stay until then (they were removed, and the caller
    # read zeros from an empty file of the same name).
    with ParallelExecutor(device_ids=["cpu", "cpu"], **recycling) as ex:
        for call in range(1, 4):
            out = ex.run(_filled, call)
            assert [float(t.min()) for t in out] == [call, call]
            assert [float(t.max()) for t in out] == [call, call]
        assert [float(t[0]) for t in ex.map(_filled, range(10, 16))] == list(range(10, 16))
