"""The tqdm bar of a training epoch, showing the recent loss and throughput.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import time

import torch

REFRESH_S = 0.5  # how often the bar reads the loss back from the device (a sync on a GPU)


class EpochBar:
    """One bar per epoch; :meth:`advance` after each batch, :meth:`close` at the end.

    Example:
        >>> bar = EpochBar(1, 2, total=3, done=0, world_size=1, disable=True)
        >>> bar.advance([torch.tensor(0.5)], [4])
        >>> bar.close()
    """

    def __init__(self, epoch: int, epochs: int | None, total: int | None, done: int, world_size: int,
                 disable: bool = False):
        from tqdm.auto import tqdm

        desc = f"epoch {epoch}" if epochs is None else f"epoch {epoch}/{epochs}"
        self._bar = tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, leave=True,
                         disable=disable)
        if done:
            self._bar.update(done)  # a resumed epoch starts where its checkpoint was written
        self._world_size = world_size
        self._mark, self._time = done, time.perf_counter()

    def advance(self, losses: list[torch.Tensor], sizes: list[int]) -> None:
        """One batch more; every :data:`REFRESH_S` seconds, the mean loss and samples/s since the last refresh."""
        self._bar.update(1)
        now = time.perf_counter()
        if now - self._time >= REFRESH_S:
            recent = torch.stack(losses[self._mark:]).float().mean().item()
            rate = sum(sizes[self._mark:]) * self._world_size / (now - self._time)
            self._bar.set_postfix(loss=f"{recent:.4g}", samples_s=f"{rate:.0f}", refresh=False)
            self._mark, self._time = len(losses), now

    def close(self) -> None:
        self._bar.close()
