"""Progress off a terminal: a line every few seconds with done/total, rate and elapsed time, and one at the end."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import TensorDataset

from nn_handler import _progress
from nn_handler._progress import LogLines, progress_bar
from nn_handler._training.progress import EpochBar
from scripts.handler_case import make_data, make_handler, make_model


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_lines_come_at_most_every_interval_and_once_at_the_end(monkeypatch):
    clock = iter([0.0, 1.0, 6.0, 7.0, 20.0])  # start, then one per update/close
    monkeypatch.setattr(_progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = LogLines(4, "map", "item", out, interval=5.0)
    bar.update()  # 1 s: too soon for a line
    bar.update()  # 6 s: a line
    bar.update()  # 7 s: too soon
    bar.close()  # 20 s: the last line
    bar.close()  # (once)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("map: 2/4 items (50%)") and "elapsed 00:06" in lines[0] and "3.00s/item" in lines[0]  # (2 items in 6 s)
    assert lines[1].startswith("map: 3/4 items (75%)") and "elapsed 00:20" in lines[1]


def test_a_terminal_gets_a_tqdm_bar_and_a_log_file_gets_lines():
    assert not isinstance(progress_bar(3, "map", "item", file=Terminal()), LogLines)
    assert isinstance(progress_bar(3, "map", "item", file=io.StringIO()), LogLines)
    assert not isinstance(progress_bar(3, "map", "item", file=io.StringIO(), disable=True), LogLines)


def test_epoch_bar_off_a_terminal_writes_lines_with_the_loss(monkeypatch, capsys):
    monkeypatch.setattr(_progress, "INTERVAL_S", 0.0)
    monkeypatch.setattr("nn_handler._training.progress.REFRESH_S", 0.0)
    bar = EpochBar(2, 5, total=3, done=0, world_size=1)
    for i in range(3):
        bar.advance([torch.tensor(0.5)] * (i + 1), [4] * (i + 1))
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("epoch 2/5: 3/3 batches (100%)") and "loss=0.5" in lines[-1], lines
    assert len(lines) == 4  # one per batch (interval 0), and the last


def test_training_off_a_terminal_reports_each_epoch_in_plain_lines(capsys):
    X, y = make_data(32)
    handler = make_handler(make_model())
    handler.set_train_loader(TensorDataset(X, y), batch_size=8)
    handler.train(2, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if "batches" in line]  # (more than one an epoch on a slow machine)
    assert [line.split(":")[0] for line in lines][-1] == "epoch 2/2" and lines[0].startswith("epoch 1/2: ")
    ends = [line for line in lines if "4/4 batches (100%)" in line]  # the last line of each epoch
    assert list(dict.fromkeys(line.split(":")[0] for line in ends)) == ["epoch 1/2", "epoch 2/2"], err


@pytest.mark.parametrize("stream", [Terminal, io.StringIO], ids=["drawn bar", "lines"])
def test_a_bar_closed_on_a_failure_says_so_on_its_last_line(stream):
    out = stream()
    bar = progress_bar(5, "train_one", "item", file=out)
    bar.update(2)
    bar.set_postfix_str("1 failed")
    _progress.close(bar, "failed at item 2: ValueError: lr=5.0 diverges")
    last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("train_one: ") and "2/5" in last, last
    assert "1 failed, failed at item 2: ValueError: lr=5.0 diverges" in last, last
    bar.update(1)  # a late step (a chunk of an abandoned map) draws nothing
    assert out.getvalue().replace("\r", "\n").strip().splitlines()[-1] == last
