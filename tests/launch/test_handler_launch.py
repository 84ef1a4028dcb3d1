"""NNHandler.launch: a local DDP group on the ParallelExecutor's workers."""

import sys

import pytest
import torch

from helpers import run_command
from nn_handler import ExecutorTimeoutError, NNHandler, ParallelExecutionError, ParallelExecutor, WorkerDiedError
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


def test_launch_reports_the_rank_that_raised_not_a_peer_relaying_it():
    from nn_handler.utils.ddp_decorators import on_rank

    @on_rank(0)
    def save():
        raise ValueError("bad config on rank 0")

    def body():
        import time

        import torch.distributed as dist

        try:
            save()  # rank 1 raises a RankFailedError relaying rank 0's error, at once
        except ValueError:
            if dist.get_rank() == 0:
                time.sleep(0.3)  # rank 0 cleans up first: the relay reaches the launcher first
            raise

    with pytest.raises(ParallelExecutionError, match="bad config on rank 0") as info:
        NNHandler.launch(body, nprocs=2, timeout=100)
    # The cause alone, as when a rank raises outright: rank 0's ValueError, not rank 1's relay of it.
    assert [(f.rank, f.exc_type) for f in info.value.failures] == [(0, "ValueError")], info.value
    assert ".body failed on rank 0 " in str(info.value)
    assert type(info.value.exceptions[0]) is ValueError


def test_launch_needs_nprocs_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match=r"without GPUs, say how many CPU processes"):
        NNHandler.launch(print)
    with pytest.raises(ValueError, match=r"nprocs must be an int >= 1, got 0"):
        NNHandler.launch(print, nprocs=0)


def test_launch_names_a_rank_that_died():
    def body():
        import os

        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()  # rank 0 waits for the dead one: it is killed, not reported

    # Rank 0's barrier fails at once ("Connection reset by peer"), sometimes before the pool has seen
    # rank 1 die: the death is still the error, and comes first; rank 0's error, if it came, follows.
    with pytest.raises(WorkerDiedError) as info:
        NNHandler.launch(body, nprocs=2, timeout=100)
    first, *rest = info.value.failures
    assert (first.rank, first.exitcode) == (1, 3)
    assert [f.rank for f in rest] in ([], [0])


def test_launch_kills_a_hung_rank_at_the_deadline_and_names_it():
    def body():
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(600)
        return "done"

    # The deadline covers starting the workers too: generous on a loaded 2-core machine.
    with pytest.raises(ExecutorTimeoutError, match=r"rank 1 .*still running after the 20s timeout") as info:
        NNHandler.launch(body, nprocs=2, timeout=20)
    assert isinstance(info.value, TimeoutError) and [f.rank for f in info.value.failures] == [1]


def test_launch_ranks_see_the_callers_environment(monkeypatch):
    # Workers come from a forkserver started earlier, with the environment it had then: a rank gets the
    # caller's present one.
    with ParallelExecutor(device_ids=["cpu"], pass_device=False) as ex:
        ex.run(int)
    monkeypatch.setenv("NNH_TEST_LAUNCH_VAR", "set after the forkserver started")

    def read(name):  # reads the rank's os.environ (a bound os.environ.get would travel with the caller's copy)
        import os

        return os.environ.get(name)

    assert NNHandler.launch(read, "NNH_TEST_LAUNCH_VAR", nprocs=2, timeout=100) == "set after the forkserver started"


_SCRIPT = """
print("top-level code ran", flush=True)
from nn_handler import NNHandler
from nn_handler.testing import run_distributed

def body(*_):
    import torch.distributed as dist
    return dist.get_world_size()

if __name__ == "__main__":
    print("launch", NNHandler.launch(body, nprocs=2, timeout=100))
    print("run_distributed", run_distributed(body, nprocs=2, timeout=100))
"""


def test_ranks_do_not_rerun_the_callers_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    result = run_command([sys.executable, str(script)], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("top-level code ran") == 1, result.stdout[-3000:]
    assert "launch 2" in result.stdout and "run_distributed [2, 2]" in result.stdout, result.stdout[-3000:]


_FAILING_SCRIPT = '''
from nn_handler import NNHandler
from nn_handler.utils.ddp_decorators import on_rank


@on_rank(0)
def save():
    raise ValueError("bad config on rank 0")  # the root cause


def body():
    import torch
    import torch.distributed as dist

    if ON_RANK:
        save()  # rank 1 raises a RankFailedError that relays rank 0's error
    elif dist.get_rank() == 0:
        raise ValueError("bad config on rank 0")  # the root cause
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 waits for a rank that is gone


if __name__ == "__main__":
    NNHandler.launch(body, nprocs=2, timeout=100)
'''


@pytest.mark.parametrize("on_rank", [False, True])
def test_an_uncaught_failure_prints_each_ranks_traceback_once_root_cause_first(tmp_path, on_rank):
    script = tmp_path / "job.py"
    script.write_text(f"ON_RANK = {on_rank}\n" + _FAILING_SCRIPT)
    result = run_command([sys.executable, str(script)], timeout=150, cwd=tmp_path)
    out = result.stdout
    assert result.returncode == 1, out
    assert out.count('raise ValueError("bad config on rank 0")  # the root cause') == 1, out
    # Python prints the cause first: the rank's own frames, then the launch call that raised.
    assert out.index("# the root cause") < out.index("NNHandler.launch(body") < out.index("failed on rank 0"), out
    # With @on_rank too: rank 1's relay of the error gives way to rank 0's own, whichever came first.
    assert out.count("Traceback (most recent call last)") == 2, out  # the worker's, then the caller's
    assert out.count("body failed on rank 0") == 1, out
    assert "failed on rank 1" not in out, out


_FAILING_TRAINING = '''
import torch
from nn_handler import NNHandler


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x):
        import torch.distributed as dist

        self.calls += 1
        if dist.get_rank() == 0 and self.calls == 3:
            raise ValueError("bad batch on rank 0")  # the root cause
        return self.lin(x)


def body():
    handler = NNHandler(Model(), device="cpu")
    handler.set_optimizer(torch.optim.SGD, lr=0.1)
    handler.set_loss_fn(torch.nn.MSELoss())
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    handler.set_train_loader(data, batch_size=4)
    handler.train(2, progress=False)  # rank 1 waits in DDP's all_reduce for rank 0


if __name__ == "__main__":
    NNHandler.launch(body, nprocs=2, timeout=100)
'''


def test_a_rank_failing_in_training_leaves_no_noise_from_the_ranks_it_left_behind(tmp_path):
    # Rank 1 waits in a collective for rank 0, which raised: it is stopped before it can see rank 0 go,
    # so neither a stall report calling rank 0 dead nor the store's C++ "Broken pipe" comes before the cause.
    script = tmp_path / "job.py"
    script.write_text(_FAILING_TRAINING)
    result = run_command([sys.executable, str(script)], timeout=150, cwd=tmp_path)
    out = result.stdout
    assert result.returncode == 1, out
    assert out.count('raise ValueError("bad batch on rank 0")  # the root cause') == 1, out
    assert out.count("Traceback (most recent call last)") == 2, out
    assert "stall report" not in out and "Broken pipe" not in out and "DEAD" not in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py"]  # no stall report file either
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("nn_handler.errors.ParallelExecutionError: body failed on rank 0 "), out

