"""NNHandler.launch: a local DDP group on the ParallelExecutor's workers."""

import pytest
import torch

from nn_handler import NNHandler, ParallelExecutionError
from scripts.handler_case import make_data, reference_train, weights


def _train_in_group(epochs):
    import torch.distributed as dist

    from scripts.handler_case import make_data, make_handler, make_model, weights

    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    handler = make_handler(make_model())
    handler.set_train_loader((X, y), batch_size=8)
    handler.set_val_loader((Xv, yv), batch_size=8)
    history = handler.train(epochs, progress=False)
    return {"world_size": dist.get_world_size(), "rank": dist.get_rank(), "weights": weights(handler.module),
            "val_loss": history["val_loss"]}


def test_launch_trains_on_two_ranks_and_returns_rank_zero_result():
    result = NNHandler.launch(_train_in_group, 2, nprocs=2, timeout=150)
    assert result["world_size"] == 2 and result["rank"] == 0
    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    ref_model, ref_history = reference_train(X, y, Xv, yv, epochs=2, batch_size=8, world_size=2)
    assert result["val_loss"] == pytest.approx(ref_history["val_loss"], rel=1e-5)
    assert result["weights"] == pytest.approx(weights(ref_model), abs=1e-5)


def test_launch_raises_when_a_rank_fails_without_hanging():
    def body():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("bad shard on rank 1")
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
        return t

    # A hang would end in the executor's TimeoutError after 100 s, not in this error.
    with pytest.raises(ParallelExecutionError, match="bad shard on rank 1") as info:
        NNHandler.launch(body, nprocs=2, timeout=100)
    assert "body failed on rank 1" in str(info.value)  # the user's function, not the launcher's wrapper
    assert not isinstance(info.value, TimeoutError)
    # fail-fast: the root cause alone, not a peer's "connection closed" first
    assert [(f.rank, f.exc_type) for f in info.value.failures] == [(1, "ValueError")]
    assert isinstance(info.value.exceptions[1], ValueError)


def test_launch_needs_nprocs_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match=r"without GPUs, say how many CPU processes"):
        NNHandler.launch(print)
    with pytest.raises(ValueError, match=r"nprocs must be an int >= 1, got 0"):
        NNHandler.launch(print, nprocs=0)
