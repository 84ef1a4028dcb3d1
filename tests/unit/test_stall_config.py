"""The stall watchdog's settings, report and error, without processes."""

from __future__ import annotations

import os
import pickle

import pytest

import nn_handler
from nn_handler.errors import CollectiveStallError, ConfigurationError
from nn_handler.utils import _stall, _stall_report
from nn_handler.utils._guard import debug_enabled
from nn_handler.utils.ddp import initialize_ddp, watch_collectives


@pytest.mark.parametrize("keyword, environ, expected", [
    ("env", {}, _stall.DEFAULT_STALL_TIMEOUT), ("env", {"NN_HANDLER_STALL_TIMEOUT": "3"}, 3.0),
    ("env", {"NN_HANDLER_STALL_TIMEOUT": " 2.5 "}, 2.5), ("env", {"NN_HANDLER_STALL_TIMEOUT": "none"}, None),
    ("env", {"NN_HANDLER_STALL_TIMEOUT": "OFF"}, None), (7, {"NN_HANDLER_STALL_TIMEOUT": "3"}, 7),
    (None, {"NN_HANDLER_STALL_TIMEOUT": "3"}, None)])
def test_keyword_wins_over_the_environment(keyword, environ, expected):
    assert _stall.resolve_stall_timeout(keyword, environ) == expected


@pytest.mark.parametrize("value", ["3s", "0", "-1", "nan"])
def test_a_bad_environment_value_names_the_variable(value):
    with pytest.raises(ConfigurationError, match=r"NN_HANDLER_STALL_TIMEOUT must be a number of seconds > 0 \(or "
                                                 r"inf\), or 'none' to turn the stall watchdog off, got"):
        _stall.resolve_stall_timeout("env", {"NN_HANDLER_STALL_TIMEOUT": value})


@pytest.mark.parametrize("text", ["inf", " Infinity "])
def test_inf_in_the_environment_is_accepted_like_the_keyword(text):
    inf = float("inf")
    assert _stall.resolve_stall_timeout("env", {"NN_HANDLER_STALL_TIMEOUT": text}) == inf
    assert _stall.resolve_stall_timeout(inf, {"NN_HANDLER_STALL_TIMEOUT": "3"}) == inf


@pytest.mark.parametrize("keyword, environ, name", [
    (0.5, {}, "stall_timeout"), (0.2, {"NN_HANDLER_STALL_TIMEOUT": "3"}, "stall_timeout"),
    ("env", {"NN_HANDLER_STALL_TIMEOUT": "0.5"}, "NN_HANDLER_STALL_TIMEOUT")])
def test_less_than_the_watchdogs_sampling_period_is_refused(keyword, environ, name):
    # The watchdog looks once a second: 0.5 s would silently mean "about a second or two".
    with pytest.raises(ConfigurationError, match=rf"{name} must be at least 1 s, the stall watchdog's sampling period"):
        _stall.resolve_stall_timeout(keyword, environ)
    assert _stall.resolve_stall_timeout(_stall.BEAT_S, environ) == _stall.BEAT_S  # the period itself is fine


@pytest.mark.parametrize("value, message", [(0, "> 0 or None"), (0.5, "at least 1 s"), ("3", "> 0 or None")])
def test_run_distributed_and_launch_refuse_a_bad_stall_timeout_before_starting_a_rank(value, message, monkeypatch):
    from nn_handler.testing import run_distributed
    from nn_handler.utils._workers import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "_run_group", no_ranks)
    with pytest.raises(ConfigurationError, match=message):
        run_distributed(abs, 2, stall_timeout=value)
    with pytest.raises(ConfigurationError, match=message):
        nn_handler.NNHandler.launch(abs, nprocs=2, stall_timeout=value)


@pytest.mark.parametrize("value", [0, -2, "3", True])
def test_a_bad_keyword_is_refused_before_anything_starts(value):
    with pytest.raises(ConfigurationError, match="stall_timeout must be a number of seconds > 0 or None"):
        initialize_ddp(stall_timeout=value)


def test_the_error_is_a_runtime_error_that_survives_pickling():
    err = CollectiveStallError("all_reduce stalled", "all_reduce", [1], [2], "/tmp/r.txt")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, RuntimeError) and nn_handler.CollectiveStallError is CollectiveStallError
    assert (back.collective, back.missing, back.dead, back.report_path, str(back)) == \
        ("all_reduce", (1,), (2,), "/tmp/r.txt", "all_reduce stalled")


def test_the_report_names_the_missing_and_the_dead_rank():
    beat = {"host": "h", "pid": 10, "step": 4, "collective": "all_reduce", "where": "train.py:9 (main)",
            "for_s": 5.0, "time": 0.0}
    beats = {0: beat, 1: dict(beat, pid=11, collective=None, where="train.py:7 (main)"), 2: dict(beat, pid=12)}
    text = _stall_report.render_report(0, "all_reduce", beats, {1: "  File train.py, line 7\n"}, [2], [1], 3)
    assert "ranks not in all_reduce: [1]" in text and "dead ranks: [2]" in text
    assert "rank 1 (host h, pid 11, step 4): running its own code for 5.0 s at train.py:7 (main)  <- MISSING" in text
    assert "rank 2 (host h, pid 12, step 4): DEAD" in text and "--- stack of rank 1" in text
    headline = _stall_report.headline(0, "all_reduce", beats, [2], [1], "r.txt")
    assert headline.startswith("all_reduce stalled: ranks [0] waited in it; rank 2 died") and "rank 1 is at" in headline


def test_watch_collectives_without_a_group_does_nothing():
    with watch_collectives(step=3):
        pass
    assert _stall.current() is None and nn_handler.watch_collectives is watch_collectives


@pytest.mark.parametrize("value, on", [("", False), ("0", False), ("false", False), ("1", True), ("yes", True)])
def test_debug_switch(value, on):
    assert debug_enabled({"NN_HANDLER_DEBUG": value}) is on


def test_reports_go_beside_the_checkpoint_dir_not_into_it(tmp_path, monkeypatch):
    monkeypatch.delenv("NN_HANDLER_STALL_DIR", raising=False)
    dog = _stall.Watchdog(store=None, rank=1, world_size=2, timeout=3)
    dog.report_next_to(tmp_path / "run-a")
    assert dog._write("report\n") == str(tmp_path / "run-a-stall-rank1.txt")
    assert (tmp_path / "run-a-stall-rank1.txt").read_text() == "report\n"


def test_nn_handler_stall_dir_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("NN_HANDLER_STALL_DIR", str(tmp_path / "reports"))
    dog = _stall.Watchdog(store=None, rank=0, world_size=2, timeout=3)
    dog.report_next_to(tmp_path / "run-a")
    assert dog._write("report\n") == str(tmp_path / "reports" / "nn_handler-stall-rank0.txt")


@pytest.mark.parametrize("value", [0, -2, "3", True])
def test_nnhandler_refuses_a_bad_stall_timeout_before_it_starts_anything(value):
    from torch import nn

    with pytest.raises(ConfigurationError, match="stall_timeout must be a number of seconds > 0 or None"):
        nn_handler.NNHandler(nn.Linear(2, 1), stall_timeout=value)


def _lost_store_watchdog(tmp_path, host_pid):
    """Rank 1's watchdog, its watched thread's all_reduce failed with a lost peer, and rank 0's store gone."""
    dog = _stall.Watchdog(store=None, rank=1, world_size=2, timeout=3, report_dir=str(tmp_path), store_host=0)
    dog._host_beat = {"host": dog.host, "pid": host_pid, "step": None, "collective": None,
                      "where": "train.py:9 (main)", "for_s": 0.0, "time": 0.0}
    dog.now.collective, dog._peer_lost, dog._store_gone = "all_reduce", "all_reduce", True
    dog._stop = True  # no signal and no exit: there is no watched thread to reach here
    dog._without_store()
    assert dog.reported.is_set()
    return dog


def test_a_gone_store_whose_host_process_is_gone_names_the_host_rank_dead(tmp_path):
    dog = _lost_store_watchdog(tmp_path, host_pid=2**22 + 1)  # above Linux's largest pid: no such process
    assert dog.error.dead == (0,) and dog.error.missing == () and dog.error.collective == "all_reduce"
    assert "rank 0 died (pid 4194305" in str(dog.error) and "hosted the group's store" in str(dog.error)
    assert "DEAD" in (tmp_path / "nn_handler-stall-rank1.txt").read_text()


def test_a_gone_store_whose_host_process_lives_is_not_called_a_death(tmp_path):
    dog = _lost_store_watchdog(tmp_path, host_pid=os.getpid())
    assert dog.error is None and dog._peer_lost is None  # the collective's own error stands
    assert not list(tmp_path.iterdir())


def _exchange_beats(name):
    waiting = {"host": "h", "pid": 10, "step": None, "collective": f"status exchange of {name}",
               "where": "train.py:20 (main)", "for_s": 5.0, "time": 0.0}
    return {0: waiting, 1: dict(waiting, pid=11, collective="barrier", where="train.py:22 (main)")}


@pytest.mark.parametrize("name, what", [
    ("save_weights", "the @on_rank function save_weights"),
    ("main_process_first block", "the main_process_first block"),
])
def test_a_rank_restricted_call_some_ranks_skipped_is_the_first_line_of_report_and_error(name, what):
    _stall_report.note_rank_function("save_weights")  # as @on_rank does when it decorates
    beats, collective = _exchange_beats(name), f"status exchange of {name}"
    cause = (f"{what} was called on rank 0 only: rank 1 never entered it; call it on every rank, "
             f"not under `if rank == 0:`")
    text = _stall_report.render_report(0, collective, beats, {}, [], [1], 3)
    assert text.splitlines()[0].startswith(cause), text
    headline = _stall_report.headline(0, collective, beats, [], [1], "r.txt")
    assert headline.startswith(cause) and "rank 1 is at train.py:22 (main) in barrier" in headline


def test_a_skipped_call_is_not_claimed_for_other_exchanges_or_a_rank_inside_the_function():
    beats = _exchange_beats("loading ckpt.pt")  # the trainer's own exchange: not an @on_rank function
    assert _stall_report.skipped_call("status exchange of loading ckpt.pt", beats, [1]) == ""
    _stall_report.note_rank_function("save_weights")
    beats = _exchange_beats("save_weights")
    beats[1] = dict(beats[1], collective=None, task="save_weights")  # rank 1 is in it (and stuck there)
    assert _stall_report.skipped_call("status exchange of save_weights", beats, [1]) == ""
