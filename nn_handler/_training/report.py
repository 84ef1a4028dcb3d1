"""What the main process says about training beside the bar: a line per epoch, validation every N steps, resumes.

The epoch line (rank 0) goes to this module's logger at INFO, and, when the
progress bar is on but not on a terminal (``nohup``, SLURM, a pipe: tqdm's
bar then leaves one frozen line per epoch), it is also printed through
``tqdm.write``, so a log file gets the epoch's numbers::

    epoch 2/10: train_loss=0.4117 train_mae=0.5012 val_loss=0.4305 val_mae=0.5155 lr=0.05 time=1.32s

Where a run started with ``resume`` continues is always printed to stderr (:func:`say`), as Lightning's
"Restoring states from the checkpoint path at ..."::

    nn_handler: resuming from ckpt/epoch-0002-batch-000004.ckpt, the newest of the 3 checkpoints in ckpt by
    write order: epoch 2 continues after 4 batches, at global step 14

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from . import metrics as M
from .config import TrainingConfig
from .evaluation import eval_sums
from .parts import Parts
from .schedule import learning_rates
from .state import TrainingState

log = logging.getLogger(__name__)


def epoch_line(row: dict[str, Any], epochs: int | None, stopped_after: int | None = None) -> str:
    """The one-line summary of a History row.

    Example:
        >>> epoch_line({"epoch": 2, "train_loss": 0.41174, "val_loss": 0.5, "lr": 0.05, "epoch_time": 1.3171,
        ...             "samples_per_sec": 900.0}, 10)
        'epoch 2/10: train_loss=0.4117 val_loss=0.5 lr=0.05 time=1.32s'
    """
    where = f"epoch {row['epoch']}" + ("" if epochs is None else f"/{epochs}")
    if stopped_after is not None:
        where += f" (stopped after {stopped_after} batches)"
    values = [f"{k}={v:.4g}" for k, v in row.items() if k.startswith(("train_", "val_")) and v is not None]
    values += [f"{k}={v:.4g}" for k, v in row.items() if (k == "lr" or k.startswith("lr_")) and v is not None]
    if row.get("epoch_time") is not None:
        values.append(f"time={row['epoch_time']:.2f}s")
    return f"{where}: {' '.join(values)}"


def report_epoch(line: str, bar: bool) -> None:
    """Log ``line``; print it too where the bar (``bar``: it is on) is not on a terminal."""
    log.info("%s", line)
    if bar and not _on_terminal(sys.stderr):
        from tqdm.auto import tqdm

        tqdm.write(line, file=sys.stderr)  # between bars, as tqdm keeps them apart


def say(line: str, logger: logging.Logger = log) -> None:
    """Log ``line`` at INFO and print it to stderr, on a terminal or not, between any progress bars (main process).

    For what a user must not miss, such as where a resumed run continues: a logger
    that nobody configured shows no INFO record.
    """
    logger.info("%s", line)
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def resumed_line(path: Any, why: str, epoch: int, global_step: int, batches: int | None, stopped: bool) -> str:
    """What a run resumed from a checkpoint says: which file, which epoch and step it continues at.

    Example:
        >>> resumed_line("ckpt/epoch-0002-batch-000004.ckpt", "", 1, 14, 4, False)[31:]
        'epoch-0002-batch-000004.ckpt: epoch 2 continues after 4 batches, at global step 14'
        >>> resumed_line("ckpt/epoch-0002.ckpt", "", 2, 20, None, False)
        'nn_handler: resuming from ckpt/epoch-0002.ckpt: 2 epochs complete, epoch 3 starts at global step 20'
    """
    if stopped:
        where = f"the run stopped early after epoch {epoch} (global step {global_step}): nothing more to train"
    elif batches:
        where = f"epoch {epoch + 1} continues after {batches} batches, at global step {global_step}"
    else:
        where = f"{epoch} epochs complete, epoch {epoch + 1} starts at global step {global_step}"
    return f"nn_handler: resuming from {path}{why}: {where}"


def _on_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def validate_at_step(parts: Parts, config: TrainingConfig, state: TrainingState, epoch: int) -> dict[str, Any]:
    """Validate now, mid-epoch, on every rank: a History row ``{epoch, step, val_*, lr}`` and ``on_validation_end``.

    One all-reduce of the validation sums (the ranks call this at the same
    global step). A row of a part-way epoch that this run continues is out
    of date once training went on, so it goes first.
    """
    sums, names = eval_sums(parts, config, parts.val_loader, epoch)
    totals, _ = M.reduce_over_ranks(sums, [], parts.device, parts.distributed)
    logs = M.means("val_", totals, names)
    state.drop_partial_row()
    row = {"epoch": epoch, "step": state.global_step, **logs, **learning_rates(parts.optimizers)}
    state.history.append(row)
    if parts.is_main_process:
        log.info("step %d (epoch %d): %s", state.global_step, epoch, " ".join(f"{k}={v:.4g}" for k, v in logs.items()))
    for cb in parts.callbacks:
        cb.on_validation_end(parts.view, epoch, {"step": state.global_step, **logs})
    return row
