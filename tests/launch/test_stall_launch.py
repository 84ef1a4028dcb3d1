"""Stall diagnosis under the real launchers: NNHandler.launch (the caller gets CollectiveStallError) and torchrun.

Limits, smallest first: stall_timeout (3 s) < the group's timeout (60 s) <
the call's deadline < pytest-timeout, so the stall error proves the watchdog
ended the wait.
"""

import sys
from pathlib import Path

import pytest

from helpers import REPO, run_command
from nn_handler import CollectiveStallError, NNHandler
from nn_handler.utils.ddp import find_free_port

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "scripts" / "stall.py"


def _late_rank_in_training():
    import time

    import torch.distributed as dist

    from nn_handler import Callback
    from scripts.handler_case import make_data, make_handler, make_model

    class LateOnRank1(Callback):
        def on_batch_end(self, handler, batch, loss):
            if dist.get_rank() == 1 and batch == 2:
                time.sleep(60)  # rank 1 is stuck in a callback

    handler = make_handler(make_model(), callbacks=[LateOnRank1()])
    handler.set_train_loader(make_data(96), batch_size=8)
    handler.train(2, progress=False)


def test_launch_raises_collective_stall_error_naming_the_rank_stuck_in_a_training_callback(tmp_path, monkeypatch):
    monkeypatch.setenv("NN_HANDLER_STALL_TIMEOUT", "3")
    monkeypatch.setenv("NN_HANDLER_STALL_DIR", str(tmp_path))
    with pytest.raises(CollectiveStallError) as info:
        NNHandler.launch(_late_rank_in_training, nprocs=2, timeout=100)
    error = info.value
    assert error.missing == (1,) and "backward" in error.collective
    assert "test_stall_launch.py" in str(error) and "on_batch_end" in str(error)
    assert Path(error.report_path).parent == tmp_path  # NN_HANDLER_STALL_DIR
    report = Path(error.report_path).read_text()
    assert "time.sleep(60)  # rank 1 is stuck in a callback" in report


def test_launch_names_the_line_of_a_function_sent_by_value(tmp_path, monkeypatch):
    # A local function travels by value (cloudpickle >= 3.1 renames its file "<dynamic-code>").
    def body():
        import time

        import torch
        import torch.distributed as dist

        from nn_handler import watch_collectives

        with watch_collectives():
            if dist.get_rank() == 1:
                time.sleep(60)  # rank 1 is late, by value
            dist.all_reduce(torch.ones(1))

    monkeypatch.setenv("NN_HANDLER_STALL_TIMEOUT", "3")
    monkeypatch.setenv("NN_HANDLER_STALL_DIR", str(tmp_path))
    with pytest.raises(CollectiveStallError) as info:
        NNHandler.launch(body, nprocs=2, timeout=100)
    line = body.__code__.co_firstlineno + 10
    assert f"rank 1 is at {__file__}:{line} (body)" in str(info.value)
    assert "time.sleep(60)  # rank 1 is late, by value" in Path(info.value.report_path).read_text()


def test_torchrun_exits_non_zero_with_the_report_in_the_error_file(tmp_path):
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={find_free_port()}", str(SCRIPT)], timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(REPO), "NN_HANDLER_STALL_DIR": ""})  # reports in the cwd
    out = result.stdout
    assert result.returncode != 0, out[-3000:]
    assert "finished" not in out
    # torchrun prints each rank's error file: the report, with rank 1's line from rank 1's own stack.
    assert "error_file" in out and "CollectiveStallError: all_reduce stalled" in out, out[-3000:]
    assert f"rank 1 is at {SCRIPT}:13 (<module>)" in out
    assert "time.sleep(60)  # rank 1 is late" in out
    assert sorted(p.name for p in tmp_path.glob("nn_handler-stall-rank*.txt")) == \
        ["nn_handler-stall-rank0.txt", "nn_handler-stall-rank1.txt"]


def _watchdog_timeout():
    from nn_handler.utils import _stall

    dog = _stall.current()
    return None if dog is None else dog.timeout


@pytest.mark.parametrize("keyword, variable, expected", [(2, "none", 2), (None, "7", None), ("env", "7", 7)])
def test_launch_stall_timeout_wins_over_the_variable(keyword, variable, expected, monkeypatch):
    monkeypatch.setenv("NN_HANDLER_STALL_TIMEOUT", variable)
    assert NNHandler.launch(_watchdog_timeout, nprocs=2, timeout=100, stall_timeout=keyword) == expected
