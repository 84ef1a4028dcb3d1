"""The order in which a multi-rank error names its ranks: the likely cause first."""

from nn_handler.errors import ParallelExecutionError, RankFailure, WorkerDiedError

PEER_GONE = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:7556: Connection reset by peer. "
             "This is typically caused by a remote worker hanging")


def test_a_death_comes_before_the_broken_connections_it_caused_in_its_peers():
    error = WorkerDiedError([RankFailure(0, exc_type="RuntimeError", message=PEER_GONE),
                             RankFailure(1, exitcode=3, message="worker died during the call (exit code 3)")])
    assert [f.rank for f in error.failures] == [1, 0]
    assert str(error).startswith("call died on rank 1")


def test_a_user_exception_comes_before_a_death_and_a_broken_connection():
    error = ParallelExecutionError([RankFailure(2, exc_type="RuntimeError", message=PEER_GONE),
                                    RankFailure(1, exitcode=-9, message="killed"),
                                    RankFailure(3, exc_type="ValueError", message="bad shard")])
    assert [f.rank for f in error.failures] == [3, 1, 2]
    assert str(error).startswith("call failed on rank 3")


def test_a_relayed_rank_failed_error_comes_after_the_failure_it_relays():
    error = ParallelExecutionError([RankFailure(0, exc_type="RankFailedError[OSError]",
                                                message="save failed on rank 1 (cpu, pid 7): OSError: disk full"),
                                    RankFailure(1, exc_type="OSError", message="disk full")])
    assert [f.rank for f in error.failures] == [1, 0]
    assert str(error).startswith("call failed on rank 1")


def _printed(error: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(error))


def test_each_ranks_traceback_is_printed_once_root_cause_first():
    from nn_handler.errors import RankFailedError

    tb0 = 'Traceback (most recent call last):\n  File "train.py", line 9, in step\n    raise ValueError("bad")\n'
    tb1 = 'Traceback (most recent call last):\n  File "train.py", line 4, in load\n    raise KeyError("w")\n'
    records = [RankFailure(1, exc_type="RuntimeError", message=PEER_GONE, traceback=tb1 + "RuntimeError\n"),
               RankFailure(0, exc_type="ValueError", message="bad", traceback=tb0 + "ValueError: bad\n")]
    for error in (ParallelExecutionError(records, function="step"),
                  ParallelExecutionError.create(records, {0: ValueError("bad")}, "step"),
                  RankFailedError.create("step", records[1:], ValueError)):
        text = _printed(error)
        assert text.count('raise ValueError("bad")') == 1, text  # the root's: its __cause__, printed first
        assert text.index('raise ValueError("bad")') < text.index("step failed on rank 0"), text
        assert text.count('raise KeyError("w")') == (0 if isinstance(error, RankFailedError) else 1), text
