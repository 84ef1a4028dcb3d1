"""backend="ray" without Ray installed: a clear error naming the extra, before anything starts."""

from __future__ import annotations

import sys

import pytest

from nn_handler import MissingExtraError, ParallelExecutor, parallelize_on_gpus


@pytest.fixture
def no_ray(monkeypatch):
    # None in sys.modules: `import ray` raises ImportError, as when it is not installed.
    monkeypatch.setitem(sys.modules, "ray", None)


def test_executor_names_the_extra(no_ray):
    with pytest.raises(MissingExtraError, match=r"pip install 'nn_handler\[ray\]'"):
        ParallelExecutor(device_ids=["cpu"], backend="ray")


def test_decorator_names_the_extra_at_decoration(no_ray):
    with pytest.raises(MissingExtraError, match=r"nn_handler\[ray\]"):
        parallelize_on_gpus(device_ids=["cpu"], backend="ray")


def test_missing_extra_is_an_import_error(no_ray):
    with pytest.raises(ImportError):
        ParallelExecutor(num_gpus=1, backend="ray")


def test_local_backend_needs_no_ray(no_ray):
    ex = ParallelExecutor(device_ids=["cpu"])  # nothing starts until first use
    assert ex.backend == "local"
    ex.shutdown()
