"""A training step that returns several values, and the runs the logger tests compare (tests/unit/test_logger*.py,
test_trackers.py)."""

from __future__ import annotations

import torch
from torch import nn

from nn_handler import NNHandler
from nn_handler.callbacks import Callback
from scripts.handler_case import make_data, make_model

EVERY = 3  # log every 3rd step; 96 samples in batches of 8, 2 micro-batches a step: 6 steps an epoch


class TwoLosses:
    """A step that returns the loss and two more values, and records them per micro-batch (on the host)."""

    def __init__(self):
        self.seen: list[dict[str, float]] = []

    def __call__(self, ctx, batch):
        x, y = batch
        out = ctx.model(x)
        loss = nn.functional.mse_loss(out, y)
        ctx.backward(loss)
        ctx.step()
        d, g = loss.detach() * 2, (out - y).abs().mean().detach()
        self.seen.append({"train_loss": loss.item(), "train_d": d.item(), "train_g": g.item()})
        return {"loss": loss, "d": d, "g": g}

    def step_means(self, every):
        """``{step: {name: mean over the step's micro-batches}}`` of every ``every``-th step."""
        pairs = [self.seen[i:i + 2] for i in range(0, len(self.seen), 2)]
        return {s: {k: (a[k] + b[k]) / 2 for k in a} for s, (a, b) in enumerate(pairs, start=1) if s % every == 0}


def train_two_losses(callbacks, step, epochs=2, **kwargs):
    X, y = make_data(96)
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05}, device="cpu",
                        grad_accum_steps=2, training_step=step, callbacks=callbacks, **kwargs)
    handler.set_train_loader((X, y), batch_size=8)
    handler.train(epochs, progress=False)
    return handler


# ----------------------------------------------------------------------------- W&B's offline run files
def wandb_records(run_dir):
    """The records of an offline W&B run directory's ``.wandb`` file, parsed with wandb's own protobuf ``Record``.

    The file is a LevelDB-style log (wandb 0.31 ships no Python reader of it): a 7-byte header (``:W&B``,
    magic, version), then 32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: full, first,
    middle, last) and its bytes; a block's last < 7 bytes are padding.
    """
    import struct
    from pathlib import Path

    from wandb.proto import wandb_internal_pb2

    [path] = Path(run_dir).glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _item_value(item):
    import json

    which = item.WhichOneof("value") if any(o.name == "value" for o in item.DESCRIPTOR.oneofs) else None
    return json.loads(item.value_json) if which in (None, "value_json") else getattr(item, which)


def wandb_history(run_dirs) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value), ...]}`` of the history rows of one or more offline run directories, in order."""
    series: dict[str, list] = {}
    for run_dir in run_dirs:
        for record in wandb_records(run_dir):
            if record.WhichOneof("record_type") == "history":
                step = record.history.step.num
                for item in record.history.item:
                    if not _item_key(item).startswith("_"):
                        series.setdefault(_item_key(item), []).append((step, _item_value(item)))
    return series


def wandb_updates(run_dir, kind: str) -> dict:
    """The last value of each key of the ``config`` or ``summary`` records of an offline run directory."""
    values = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == kind:
            for item in record.__getattribute__(kind).update:
                values[_item_key(item)] = _item_value(item)
    return values


# ----------------------------------------------------------------------------- runs the tracker tests compare
TIMINGS = ("epoch_time", "samples_per_sec", "peak_mem_mb")  # columns that differ from run to run


def learning_series(series: dict[str, list]) -> dict[str, list]:
    """The series that a resumed run must reproduce exactly: all but the timings."""
    return {key: points for key, points in series.items() if not any(t in key for t in TIMINGS)}


def make_run(callbacks, **kwargs):
    """The handler of the tracker tests: 96 samples in batches of 8 (12 steps an epoch), a metric, validation."""
    from torch.utils.data import TensorDataset

    from scripts.handler_case import make_handler

    X, y = make_data(96)
    Xv, yv = make_data(37, seed=1)
    handler = make_handler(make_model(dropout=0.2), seed=5, callbacks=callbacks, **kwargs)
    handler.set_train_loader(TensorDataset(X, y), batch_size=8, shuffle=True)
    handler.set_val_loader(TensorDataset(Xv, yv), batch_size=8)
    return handler


class Outputs(Callback):
    """Records, per optimizer step, what the step returned (through the 4-parameter ``on_batch_end``)."""

    def __init__(self):
        self.steps: dict[int, dict[str, float]] = {}

    def on_batch_end(self, handler, step, loss, outputs):
        values = {"train_loss": float(loss)}
        if isinstance(outputs, dict):
            values.update({f"train_{k}": float(v) for k, v in outputs.items() if k != "loss"})
        self.steps[handler.global_step] = values
