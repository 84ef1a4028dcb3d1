"""NNHandler.launch under a launcher's variables: the checks made before anything runs (no process started)."""

import pytest

from nn_handler import ConfigurationError, NNHandler

TORCHRUN_RANK_1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _never(*_):
    raise AssertionError("fn ran")


@pytest.mark.parametrize("nprocs, bad", [(3, "this process is rank 1 of 2 started by torchrun"),
                                         (0, "nprocs must be an int >= 1, got 0")])
def test_under_torchrun_nprocs_other_than_the_world_size_is_refused_before_fn_runs(monkeypatch, nprocs, bad):
    for name, value in TORCHRUN_RANK_1.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=bad) as info:
        NNHandler.launch(_never, nprocs=nprocs, timeout=5)
    if nprocs == 3:
        assert "pass nprocs=2 or leave it out, or start 3 processes with the launcher" in str(info.value)
