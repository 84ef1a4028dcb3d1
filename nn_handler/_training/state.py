"""Where a training run stands: epoch, global step, stop flag, History, run identity, resume marker.

Private: :class:`~nn_handler.NNHandler` shows ``epoch``, ``global_step``,
``stop_training`` and ``history`` as its own attributes; they live here.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from ..history import History


@dataclass(eq=False)
class TrainingState:
    """The mutable state of one run, handed to the loop and to checkpoint/resume.

    Example:
        >>> restored = TrainingState()
        >>> restored.load_state_dict(TrainingState(epoch=3, global_step=120).state_dict())
        >>> restored.epoch, restored.global_step
        (3, 120)
    """

    epoch: int = 0  # completed epochs
    global_step: int = 0  # optimizer steps taken
    stop_training: bool = False  # set (by a callback) to stop after the current epoch
    history: History = field(default_factory=History)
    # Written into every checkpoint: the files of checkpoint_dir that carry
    # this id are this run's (to prune, to resume). A resumed checkpoint's id
    # replaces it, so a rerun continues the same run.
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    run_seq: int = 0  # checkpoint_dir's last write number (rank 0 numbers the files it writes)
    start_pending: bool = False  # the first train() still has to load `resume` and claim checkpoint_dir
    resume_partial: dict[str, Any] | None = None  # a mid-epoch checkpoint's state, until train uses it
    finished_early: bool = False  # the loaded checkpoint was written after an early stop
    # The last History row is of an epoch that max_steps or max_time stopped
    # part-way; the run that completes the epoch replaces it.
    partial_row: bool = False

    def drop_partial_row(self) -> None:
        """Remove the History row of a part-way epoch (and the columns only it had), if the last row is one."""
        if self.partial_row:
            data = {key: column[:-1] for key, column in self.history.state_dict().items()}
            self.history.load_state_dict({k: c for k, c in data.items() if any(v is not None for v in c)})
            self.partial_row = False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run's position (plain values)."""
        return {"epoch": self.epoch, "global_step": self.global_step, "history": self.history.state_dict(),
                "partial_row": self.partial_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.history.load_state_dict(state["history"])
        self.partial_row = bool(state.get("partial_row", False))  # absent from checkpoints of nn_handler <= 0.1


def state_property(name: str, doc: str) -> property:
    """An attribute of the trainer kept in its :class:`TrainingState` (the loop and resume update it there)."""
    return property(lambda self: getattr(self._state, name), lambda self, value: setattr(self._state, name, value),
                    doc=doc)
