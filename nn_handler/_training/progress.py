"""The progress of a training epoch (a tqdm bar, or lines off a terminal), showing the recent loss and throughput.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import time

import torch

from .._progress import progress_bar
from .readout import PendingValue

REFRESH_S = 0.5  # how often the bar refreshes its loss and rate


class EpochBar:
    """One bar per epoch; :meth:`advance` after each batch, :meth:`close` at the end.

    Off a terminal (a log file, SLURM) it writes a line every few seconds instead (see
    :func:`nn_handler._progress.progress_bar`).

    The loss is read without waiting for the GPU: each refresh starts a
    non-blocking copy of the recent mean loss and shows the newest copy that
    has landed (on the CPU, at once).

    Example:
        >>> bar = EpochBar(1, 2, total=3, done=0, world_size=1, disable=True)
        >>> bar.advance([torch.tensor(0.5)], [4])
        >>> bar.close()
    """

    def __init__(self, epoch: int, epochs: int | None, total: int | None, done: int, world_size: int,
                 disable: bool = False):
        desc = f"epoch {epoch}" if epochs is None else f"epoch {epoch}/{epochs}"
        self._bar = progress_bar(total, desc, "batch", disable=disable, dynamic_ncols=True, leave=True)
        if done:
            self._bar.update(done)  # a resumed epoch starts where its checkpoint was written
        self._world_size = world_size
        self._mark, self._time = done, time.perf_counter()
        self._pending: PendingValue | None = None

    def advance(self, losses: list[torch.Tensor], sizes: list[int]) -> None:
        """One batch more; every :data:`REFRESH_S` seconds, the mean loss and samples/s since the last refresh."""
        self._bar.update(1)
        now = time.perf_counter()
        if now - self._time >= REFRESH_S:
            loss = self._landed()  # the previous window's, on a GPU
            if self._pending is None:  # else that copy is still on its way: no second one
                self._pending = PendingValue(torch.stack(losses[self._mark:]).float().mean())
                loss = self._landed() if self._pending.ready() else loss  # on the CPU: this window's
            rate = sum(sizes[self._mark:]) * self._world_size / (now - self._time)
            postfix = {"samples_s": f"{rate:.0f}"}
            if loss is not None:
                postfix = {"loss": f"{loss:.4g}", **postfix}
            self._bar.set_postfix(postfix, refresh=False)
            self._mark, self._time = len(losses), now

    def _landed(self) -> float | None:
        if self._pending is None or not self._pending.ready():
            return None
        value, self._pending = self._pending.get(), None
        return value

    def close(self) -> None:
        self._bar.close()
