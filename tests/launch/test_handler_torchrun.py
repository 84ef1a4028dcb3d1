"""NNHandler under a real torchrun launch (2 CPU processes, gloo) equals the hand-written loop."""

import sys

import pytest

from helpers import parse_results, run_command
from nn_handler.utils.ddp import find_free_port
from scripts.handler_case import make_data, reference_train, weights

pytestmark = pytest.mark.slow


def test_torchrun_two_processes_match_a_hand_written_loop():
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={find_free_port()}", "tests/scripts/train_compare.py", "2"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    rows = parse_results(result.stdout)
    assert [r["rank"] for r in rows] == [0, 1] and rows[0]["world_size"] == 2, result.stdout[-3000:]
    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    ref_model, ref_history = reference_train(X, y, Xv, yv, epochs=3, batch_size=8, world_size=2, grad_accum=2)
    for row in rows:
        for key, values in ref_history.items():
            assert row[key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
        assert row["weights"] == pytest.approx(weights(ref_model), abs=1e-5)
    assert rows[0]["train_loss"] == rows[1]["train_loss"] and rows[0]["lr"] == [0.05, 0.05, 0.025]
    assert result.stdout.count("epoch 3/3") >= 1  # rank 0's progress bar
