"""Stall diagnosis on 2 real gloo ranks: a rank that does not come to a collective is named, with its line.

Each test starts its own pair (the ranks end with the stall). Limits, smallest
first: stall_timeout (3 s) < the group's collective timeout (30 s) < the
helper's deadline (60 s) < pytest-timeout, so a CollectiveStallError proves the
watchdog ended the wait, not the group's timeout.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nn_handler.errors import CollectiveStallError
from nn_handler.testing import RemoteFailure, run_distributed
from nn_handler.utils.ddp import watch_collectives
from nn_handler.utils.ddp_decorators import on_rank

PG_TIMEOUT = 30
DEADLINE = 60
STALL = {"NN_HANDLER_STALL_TIMEOUT": "3", "NN_HANDLER_STALL_DIR": ""}  # "": the reports go to the cwd
HERE = Path(__file__).resolve()


def _line(marker: str) -> int:
    """The line of this file whose comment is ``# marker`` (once, in a rank body)."""
    [n] = [i for i, text in enumerate(HERE.read_text().splitlines(), 1) if text.endswith(f"# {marker}")]
    return n


def _late_all_reduce(rank, directory, how="sleep"):
    os.chdir(directory)  # the reports go to the cwd
    t = torch.ones(1)
    with watch_collectives():
        if rank == 1 and how == "sleep":
            time.sleep(40)  # rank 1 is late
        elif rank == 1 and how == "loop":
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:  # rank 1 spins
                pass
        elif rank == 1 and how == "lock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire(timeout=40)  # rank 1 waits on a lock
        elif rank == 1 and how == "uninterruptible":
            # Like C code that never returns to Python: the signal that would raise cannot get through.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
            time.sleep(40)  # rank 1 cannot be interrupted
        dist.all_reduce(t)
    return float(t)


def _run(body, *args, env=STALL):
    return run_distributed(body, 2, args=args, timeout=DEADLINE, pg_timeout=PG_TIMEOUT, env=env)


def test_a_rank_late_for_an_all_reduce_is_named_with_its_line_on_every_rank(tmp_path):
    line = f"{HERE}:{_line('rank 1 is late')}"
    results = _run(_late_all_reduce, str(tmp_path))
    for rank, error in enumerate(results):
        assert isinstance(error, CollectiveStallError), (rank, error)
        assert error.missing == (1,) and error.dead == () and error.collective == "all_reduce"
        assert f"rank 1 is at {line}" in str(error)
        report = Path(error.report_path).read_text()
        assert Path(error.report_path).parent == tmp_path
        assert "ranks not in all_reduce: [1]" in report and "<- MISSING" in report
        assert "time.sleep(40)  # rank 1 is late" in report  # from rank 1's own stack
        assert "in all_reduce for" in report


def _late_for_on_rank(rank, directory):
    os.chdir(directory)

    @on_rank(0)
    def save():
        return "saved"

    save()  # together: the side group exists, the next call waits in the status exchange
    if rank == 1:
        time.sleep(40)  # rank 1 never calls save
    return save()


@pytest.mark.parametrize("how, marker", [("loop", "rank 1 spins"), ("lock", "rank 1 waits on a lock")])
def test_a_rank_spinning_or_waiting_on_a_lock_is_interrupted_too(tmp_path, how, marker):
    results = _run(_late_all_reduce, str(tmp_path), how)
    for error in results:
        assert isinstance(error, CollectiveStallError) and error.missing == (1,), results
    assert f"rank 1 is at {HERE}:{_line(marker)}" in str(results[0])


def test_a_rank_that_cannot_be_interrupted_exits_after_writing_its_report(tmp_path):
    error, exited = _run(_late_all_reduce, str(tmp_path), "uninterruptible")
    assert isinstance(error, CollectiveStallError) and error.missing == (1,), (error, exited)
    assert isinstance(exited, RemoteFailure) and "died" in str(exited)  # os._exit(1) after the grace period
    assert f"rank 1 is at {HERE}:{_line('rank 1 cannot be interrupted')}" in str(error)
    assert (tmp_path / "nn_handler-stall-rank1.txt").exists()


def test_nn_handlers_own_collectives_are_watched_without_asking(tmp_path):
    results = _run(_late_for_on_rank, str(tmp_path))
    error = results[0]
    assert isinstance(error, CollectiveStallError), results
    assert error.collective.startswith("status exchange of") and "save" in error.collective
    assert f"rank 1 is at {HERE}:{_line('rank 1 never calls save')}" in str(error)
    assert isinstance(results[1], CollectiveStallError)


def _on_rank_function_called_on_rank_0_only(rank, directory, first_use):
    os.chdir(directory)

    @on_rank(0)
    def save_checkpoint():
        return "saved"

    if not first_use:
        save_checkpoint()  # together: the side group exists
    if rank == 0:
        save_checkpoint()  # the common mistake: only rank 0 calls it
    with watch_collectives():
        dist.barrier()  # rank 1 goes on to the next collective
    return "done"


@pytest.mark.parametrize("first_use", [False, True])  # True: the call would also make nn_handler's side group
def test_an_on_rank_function_called_on_rank_0_only_is_named_in_the_first_line(tmp_path, first_use):
    results = _run(_on_rank_function_called_on_rank_0_only, str(tmp_path), first_use)
    assert not any(result == "done" for result in results), results  # neither rank went on alone
    for rank in (0, 1):  # both ranks wait in C (the exchange, the barrier): they write their reports and exit
        report = (tmp_path / f"nn_handler-stall-rank{rank}.txt").read_text()
        first = report.splitlines()[0]
        assert first.startswith("the @on_rank function _on_rank_function_called_on_rank_0_only.<locals>."
                                "save_checkpoint was called on rank 0 only: rank 1 never entered it; "
                                "call it on every rank, not under `if rank == 0:`"), report


def _killed_before_all_reduce(rank, directory):
    os.chdir(directory)
    t = torch.ones(1)
    with watch_collectives():
        if rank == 1:
            time.sleep(1.5)  # long enough for a heartbeat
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    return float(t)


def test_a_killed_rank_is_reported_dead_not_slow(tmp_path):
    results = _run(_killed_before_all_reduce, str(tmp_path))
    error, died = results
    assert isinstance(died, RemoteFailure) and "died" in str(died)
    # Gloo fails at once with "Connection closed by peer", which names no rank: the error does.
    assert isinstance(error, CollectiveStallError), error
    assert error.dead == (1,) and error.missing == ()
    assert "rank 1 died" in str(error)
    assert "DEAD" in Path(error.report_path).read_text()
    assert "the collective failed with:" in str(error)  # gloo's own words follow


def _store_host_killed(rank, directory):
    os.chdir(directory)
    t = torch.ones(1)
    with watch_collectives():
        if rank == 0:
            time.sleep(1.5)  # long enough for a heartbeat
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0, the host of the group's store, dies
        dist.all_reduce(t)
    return float(t)


def test_a_killed_rank_0_is_reported_dead_though_the_store_it_hosted_went_with_it(tmp_path):
    died, *survivors = run_distributed(_store_host_killed, 3, args=(str(tmp_path),), timeout=DEADLINE,
                                       pg_timeout=PG_TIMEOUT, env=STALL)
    assert isinstance(died, RemoteFailure) and "died" in str(died)
    for rank, error in enumerate(survivors, start=1):
        # Neither the store's nor gloo's own error: the one that names the dead rank.
        assert isinstance(error, CollectiveStallError), (rank, error)
        assert error.dead == (0,) and error.missing == () and error.collective == "all_reduce"
        assert "rank 0 died" in str(error) and "store" in str(error)
        report = Path(error.report_path).read_text()
        assert Path(error.report_path).name == f"nn_handler-stall-rank{rank}.txt"
        assert "DEAD" in report and f"--- stack of rank {rank} " in report


def _rank_2_late(rank, directory):
    os.chdir(directory)
    t = torch.ones(1)
    with watch_collectives():
        if rank == 2:
            time.sleep(40)  # rank 2 is late
        dist.all_reduce(t)
    return float(t)


def test_of_three_ranks_only_the_late_one_is_named(tmp_path):
    line = f"{HERE}:{_line('rank 2 is late')}"
    results = run_distributed(_rank_2_late, 3, args=(str(tmp_path),), timeout=DEADLINE, pg_timeout=PG_TIMEOUT,
                              env=STALL)
    for rank, error in enumerate(results):
        assert isinstance(error, CollectiveStallError), (rank, error)
        assert error.missing == (2,) and error.dead == () and error.collective == "all_reduce"
        assert f"rank 2 is at {line}" in str(error) and "waited in it" in str(error)
        assert "rank 0 is at" not in str(error) and "rank 1 is at" not in str(error)
    for rank in (0, 1):
        assert "ranks [0, 1] waited in it" in str(results[rank])
        report = Path(results[rank].report_path).read_text()
        assert "ranks not in all_reduce: [2]" in report and report.count("<- MISSING") == 1
        assert "time.sleep(40)  # rank 2 is late" in report  # from rank 2's own stack


def _slow_rank(rank, directory):
    os.chdir(directory)
    total = 0.0
    for step in range(5):
        with watch_collectives(step=step):
            if rank == 1:
                time.sleep(2)  # slower at each step, but always comes: rank 0 waits 2 s of every step
            t = torch.ones(1)
            dist.all_reduce(t)
            total += float(t)
    return total


def test_a_rank_merely_slower_at_each_step_is_no_stall(tmp_path):
    # 10 s in the same all_reduce line, never 3 s in one call: no stall.
    assert _run(_slow_rank, str(tmp_path), env={**STALL, "NN_HANDLER_STALL_TIMEOUT": "3"}) == [10.0, 10.0]
    assert not list(tmp_path.glob("nn_handler-stall-*"))


def _trainer_with_a_slower_rank(rank, directory):
    os.chdir(directory)  # where a report would go
    from nn_handler import Callback
    from nn_handler.utils import _stall
    from scripts.handler_case import make_data, make_handler, make_model

    class GlobalLoss(Callback):
        """A user's own collective in every step: the loss summed over the ranks, for a log."""

        def __init__(self):
            self.sums = []

        def on_batch_end(self, handler, batch, loss):
            if rank == 1:
                time.sleep(2)  # rank 1 is 2 s slower at each step; rank 0 waits for it below
            total = loss.detach().clone()
            dist.all_reduce(total)
            self.sums.append(float(total))

    callback = GlobalLoss()
    handler = make_handler(make_model(), callbacks=[callback], stall_timeout=3)
    handler.set_train_loader(make_data(96), batch_size=8)  # 6 steps per epoch on each of the 2 ranks
    history = handler.train(3, progress=False)
    dog = _stall.current()
    return handler.global_step, len(callback.sums), len(history), dog is not None and dog.timeout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_no_false_alarm_in_half_a_minute_of_training_with_a_rank_2_s_slower_at_each_step(tmp_path):
    # 18 steps of about 2 s: rank 0 waits 2 s in the same all_reduce line at
    # every step, 36 s in all (12 times the timeout), against a stall_timeout of 3 s.
    results = run_distributed(_trainer_with_a_slower_rank, 2, args=(str(tmp_path),), timeout=130,
                              pg_timeout=60, env=STALL)
    assert results == [(18, 18, 3, 3.0)] * 2, results  # every step ran, on both ranks, with the watchdog on
    assert not list(tmp_path.rglob("*stall*"))


def _stuck_in_backward(rank, directory):
    os.chdir(directory)
    from torch import nn

    from scripts.handler_case import IN, make_data, make_handler

    def stuck(grad):
        time.sleep(40)  # rank 1 is stuck in its backward
        return grad

    class HookOnRank1(nn.Module):
        def forward(self, x):
            if rank == 1 and x.requires_grad:
                x.register_hook(stuck)  # runs inside loss.backward(), before DDP's all_reduce can start
            return x

    torch.manual_seed(0)
    handler = make_handler(nn.Sequential(nn.Linear(IN, 8), HookOnRank1(), nn.Tanh(), nn.Linear(8, 1)))
    handler.set_train_loader(make_data(32), batch_size=8)
    handler.train(1, progress=False)


def test_a_rank_stuck_in_its_own_backward_is_named_with_its_line_while_the_others_wait_in_theirs(tmp_path):
    # Both ranks are inside backward; only rank 0 waits in DDP's all_reduce there: rank 1 runs its hook.
    results = _run(_stuck_in_backward, str(tmp_path))
    for rank, error in enumerate(results):
        assert isinstance(error, CollectiveStallError), (rank, error)
        assert error.missing == (1,) and error.collective == "backward (DDP's gradient all_reduce)"
        assert f"rank 1 is at {HERE}:{_line('rank 1 is stuck in its backward')} (stuck)" in str(error)
        assert "running its own code inside backward" in str(error)
    report = Path(results[0].report_path).read_text()
    assert "time.sleep(40)  # rank 1 is stuck in its backward" in report and "<- MISSING" in report


def test_no_watchdog_with_stall_timeout_none(tmp_path):
    def body(rank, directory):
        from nn_handler.utils import _stall

        return _stall.current() is None

    assert _run(body, str(tmp_path), env={**STALL, "NN_HANDLER_STALL_TIMEOUT": "none"}) == [True, True]


def _collective_inside_on_rank(rank, use_env):
    @on_rank(0, debug=None if use_env else True)
    def save():
        dist.barrier()  # only rank 0 gets here: a hang without the guard
        return "saved"

    try:
        return save()
    except Exception as exc:  # noqa: BLE001 - what each rank raised, as plain data
        return type(exc).__name__, str(exc)


def test_debug_guard_a_collective_inside_on_rank_raises_at_once_instead_of_hanging():
    name, text = _run(_collective_inside_on_rank, False, env={})[0]
    assert name == "RuntimeError" and "torch.distributed.barrier was called inside the on_rank function" in text
    assert "only rank 0 runs" in text and "hang" in text
    peer = _run(_collective_inside_on_rank, True, env={"NN_HANDLER_DEBUG": "1"})[1]
    assert peer[0].startswith("RankFailedError") and "torch.distributed.barrier" in peer[1]


def _collective_inside_main_process_first(rank):
    from nn_handler.utils.ddp_decorators import main_process_first

    try:
        with main_process_first():
            dist.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


def test_debug_guard_covers_main_process_first():
    results = _run(_collective_inside_main_process_first, env={"NN_HANDLER_DEBUG": "1"})
    assert results[0][0] == "RuntimeError" and "all_reduce was called inside a main_process_first block" in results[0][1]


def _long_save_on_rank_0(rank, directory):
    os.chdir(directory)

    @on_rank(0, broadcast_result=True)
    def save():
        time.sleep(5)  # longer than stall_timeout: rank 1 waits for it by design
        return "saved"

    return save()


def test_a_long_on_rank_function_is_no_stall_for_the_ranks_waiting_for_it(tmp_path):
    assert _run(_long_save_on_rank_0, str(tmp_path)) == ["saved", "saved"]
    assert not list(tmp_path.glob("nn_handler-stall-*"))


def _collective_inside_rank_0_work(rank, directory, where):
    os.chdir(directory)
    from nn_handler.utils.ddp_decorators import main_process_first

    @on_rank(0)
    def save():
        dist.barrier()  # rank 0 waits in a barrier the others never join
        return "saved"

    if where == "on_rank":
        return save()
    with main_process_first():
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 0 waits in an all_reduce the others never join
    return "done"


@pytest.mark.parametrize("where, collective, task, marker", [
    ("on_rank", "barrier", "_collective_inside_rank_0_work.<locals>.save",
     "rank 0 waits in a barrier the others never join"),
    ("main_process_first", "all_reduce", "main_process_first block",
     "rank 0 waits in an all_reduce the others never join")])
def test_a_collective_inside_rank_0_work_is_reported_without_the_debug_guard(tmp_path, where, collective, task,
                                                                              marker):
    # The others wait for the work to end and are no stall; rank 0, waiting inside it, is.
    results = _run(_collective_inside_rank_0_work, str(tmp_path), where, env={**STALL, "NN_HANDLER_DEBUG": "0"})
    error = results[1]
    assert isinstance(error, CollectiveStallError), results
    assert error.collective == f"status exchange of {task}" and error.missing == (0,), str(error)
    assert f"rank 0 is at {HERE}:{_line(marker)}" in str(error)
    assert f"rank 0 waits in {collective} inside {task}, which not every rank runs" in str(error)
    # Rank 0 is blocked in C: it exits after writing its report, which wakes rank 1.
    assert isinstance(results[0], (CollectiveStallError, RemoteFailure)), results[0]
    report = (tmp_path / "nn_handler-stall-rank0.txt").read_text()
    assert f"# {marker}" in report and "<- MISSING" in report


def _watchdog_timeout(rank):
    from nn_handler.utils import _stall

    dog = _stall.current()
    return None if dog is None else dog.timeout


@pytest.mark.parametrize("keyword, variable, expected", [(2, "none", 2), (None, "7", None), ("env", "inf", float("inf"))])
def test_run_distributed_stall_timeout_wins_over_the_variable(keyword, variable, expected):
    env = {"NN_HANDLER_STALL_TIMEOUT": variable}
    assert run_distributed(_watchdog_timeout, 2, timeout=DEADLINE, env=env, stall_timeout=keyword) == [expected] * 2


def _slow_deletions_on_rank_0(rank, directory, which):
    os.chdir(directory)  # where a report would go
    from pathlib import Path

    from scripts.handler_case import make_data, make_handler, make_model

    ckpt = Path(directory) / "ckpt"
    if which == "overwrite":  # another run's checkpoint, which overwrite=True deletes
        other = make_handler(make_model(), checkpoint_dir=ckpt)
        other.set_train_loader(make_data(32), batch_size=8)
        other.train(1, progress=False)
    slow = []
    if rank == 0:  # a slow filesystem (an rmtree on NFS): each deletion takes longer than stall_timeout
        unlink = Path.unlink

        def slow_unlink(path, *args, **kwargs):
            if path.suffix == ".ckpt":
                slow.append(path.name)
                time.sleep(4)  # longer than stall_timeout=2
            unlink(path, *args, **kwargs)

        Path.unlink = slow_unlink
    handler = make_handler(make_model(), checkpoint_dir=ckpt, overwrite=which == "overwrite", keep_last=1,
                           stall_timeout=2)
    handler.set_train_loader(make_data(32), batch_size=8)
    handler.train(1 if which == "overwrite" else 3, progress=False)
    from nn_handler.utils import _stall

    watched = _stall.current() is not None and _stall.current().timeout  # the watchdog was on all along
    return handler.global_step, sorted(p.name for p in ckpt.iterdir()), len(slow), watched


@pytest.mark.parametrize("which, epochs, deleted", [("overwrite", 1, 1), ("prune", 3, 2)])
def test_rank_0_deleting_checkpoints_on_a_slow_filesystem_is_no_stall(tmp_path, which, epochs, deleted):
    # Rank 0 alone deletes old checkpoints (overwrite=True, keep_last); the others wait for it, for 4 s
    # each time, twice stall_timeout: a healthy job, not a stall.
    zero, one = _run(_slow_deletions_on_rank_0, str(tmp_path), which)
    assert not isinstance(zero, BaseException) and not isinstance(one, BaseException), (zero, one)
    assert zero[0] == one[0] == 2 * epochs  # 2 steps an epoch on each rank
    assert zero[1] == one[1] and len(zero[1]) == 1  # keep_last=1; the other run's file is gone
    assert (zero[2], one[2]) == (deleted, 0) and zero[3] == one[3] == 2
    assert not list(tmp_path.glob("*stall*"))
