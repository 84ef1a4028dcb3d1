"""The tracker's own process (``nn_handler._tracking.child``): what it leaves behind and what its bounds count."""

from __future__ import annotations

import gc
import json
import logging
import warnings

import pytest

from helpers import REPO
from nn_handler._tracking.child import ChildSender
from scripts.tracker_clients import FileClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # each test starts a tracker process


@pytest.fixture(autouse=True)
def _clients_importable_in_the_tracker_process(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests"))


def sent(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_closed_sender_leaves_no_pipe_open(tmp_path):
    sender = ChildSender(FileClient(str(tmp_path / "sent.jsonl")), "test", every_s=0.0, end_timeout_s=30.0,
                         fallback=None)
    sender.put({"kind": "metrics", "step": 1})
    assert sender.close(30.0) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del sender
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    assert sent(tmp_path / "sent.jsonl") == [{"kind": "metrics", "step": 1}]


def test_the_end_bound_counts_sending_not_the_client_s_import(tmp_path):
    # A 1 s bound on the end, a client whose import takes 4 s: every record still goes, as the import is done
    # before the tracker process reads the first record (and before the bound starts).
    path = tmp_path / "sent.jsonl"
    sender = ChildSender(FileClient(str(path), import_s=4.0), "test", every_s=0.0, end_timeout_s=1.0,
                         fallback=tmp_path / "unsent-{run_id}.jsonl")
    for step in range(1, 6):
        sender.put({"kind": "metrics", "step": step})
    assert sender.close(1.0) == 0
    assert [r["step"] for r in sent(path)] == [1, 2, 3, 4, 5]
    assert not list(tmp_path.glob("unsent-*"))


def test_a_client_whose_prepare_fails_is_a_warning_and_its_records_are_still_sent(tmp_path, caplog):
    path = tmp_path / "sent.jsonl"
    with caplog.at_level(logging.WARNING, logger="nn_handler.loggers"):
        sender = ChildSender(FileClient(str(path), prepare_fails=True), "stand-in tracker", every_s=0.0,
                             end_timeout_s=30.0, fallback=None)
        sender.put({"kind": "metrics", "step": 1})
        assert sender.close(30.0) == 0
    assert sent(path) == [{"kind": "metrics", "step": 1}]
    assert [r.getMessage() for r in caplog.records] == [
        "stand-in tracker: ImportError: no module named 'tracker' (a stand-in)"]
