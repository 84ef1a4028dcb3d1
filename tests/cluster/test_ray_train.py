"""NNHandler inside Ray Train's TorchTrainer (examples/ray_train.py): it uses the group Ray Train made."""

from __future__ import annotations

import re
import sys

import pytest

from helpers import REPO, needs, run_command

pytestmark = needs("ray", "needs Ray Train: pip install 'ray[train]'")


@pytest.mark.timeout(360)
def test_nn_handler_trains_in_ray_train_workers_on_their_process_group(tmp_path):
    proc = run_command([sys.executable, str(REPO / "examples" / "ray_train.py"), "--workers", "2", "--epochs", "3"],
                       timeout=240, cwd=tmp_path, env={"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "DONE ok" in proc.stdout, proc.stdout[-3000:]
    rows = set(re.findall(r"RESULT rank=(\d) world_size=(\d) device=(\S+) same_group=(\w+) loss (\S+) -> (\S+)",
                          proc.stdout))
    assert {r[0] for r in rows} == {"0", "1"}, proc.stdout[-3000:]
    assert all(r[1:4] == ("2", "cpu", "True") for r in rows)
    losses = {r[4:] for r in rows}
    assert len(losses) == 1  # DDP: both ranks see the same averaged losses
    first, last = map(float, losses.pop())
    assert last < first
