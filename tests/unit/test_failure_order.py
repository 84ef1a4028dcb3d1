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
