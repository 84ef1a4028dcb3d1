"""Ray is optional: importing nn_handler (and its parallel tools) never imports it."""

from __future__ import annotations

import sys

import pytest

from helpers import needs, run_command

pytestmark = needs("ray")


def test_import_nn_handler_does_not_import_ray():
    code = ("import sys, nn_handler; from nn_handler import ParallelExecutor, parallelize_on_gpus; "
            "from nn_handler.utils import ddp_decorators; "
            "ParallelExecutor(device_ids=['cpu']).shutdown(); "
            "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))[:5]; "
            "print('NO RAY')")
    proc = run_command([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 0 and "NO RAY" in proc.stdout, proc.stdout
