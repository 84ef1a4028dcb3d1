"""The per-epoch record of a training run, and its plot.

Example:
    >>> h = History()
    >>> h.append({"epoch": 1, "train_loss": 0.9})
    >>> h.append({"epoch": 2, "train_loss": 0.5, "val_loss": 0.6})
    >>> h["train_loss"]
    [0.9, 0.5]
    >>> h["val_loss"]              # a key that appears later is padded with None
    [None, 0.6]
    >>> h.last()["epoch"], len(h)
    (2, 2)
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator, Mapping

from .errors import MissingExtraError

__all__ = ["History"]


class History:
    """Columns of per-epoch values: one list per key, one entry per epoch.

    Typical keys written by :class:`~nn_handler.NNHandler`: ``epoch`` (from
    1), ``train_loss``, ``val_loss``, ``train_<metric>``, ``val_<metric>``,
    ``lr``, ``epoch_time`` (seconds, slowest rank), ``samples_per_sec``
    (training samples of all ranks per second) and ``peak_mem_mb_rank<r>``
    (peak memory of rank ``r``'s device: CUDA allocations on a GPU, the
    process's peak resident memory on CPU). With ``validate_every_n_steps``,
    rows of validations inside an epoch too, and a ``step`` column (the
    global optimizer step). All values are plain Python numbers (None where
    a row has no value), identical on every rank.

    Example:
        >>> h = History({"epoch": [1], "train_loss": [0.3]})
        >>> h.keys()
        ['epoch', 'train_loss']
    """

    def __init__(self, data: Mapping[str, list] | None = None):
        self._data: dict[str, list] = {k: list(v) for k, v in (data or {}).items()}
        self._n = max((len(v) for v in self._data.values()), default=0)

    def append(self, row: Mapping[str, Any]) -> None:
        """Add one epoch; keys missing from ``row`` get ``None``, new keys are padded back with ``None``."""
        for key, value in row.items():
            if key not in self._data:
                self._data[key] = [None] * self._n
            self._data[key].append(value)
        self._n += 1
        for column in self._data.values():
            if len(column) < self._n:
                column.append(None)

    def __getitem__(self, key: str) -> list:
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(f"no {key!r} in the History; it has {', '.join(self._data) or 'nothing yet'}") from None

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self._n):
            yield {k: v[i] for k, v in self._data.items()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and other._data == self._data

    def __repr__(self) -> str:
        return f"History({self._n} epochs: {', '.join(self._data)})"

    def keys(self) -> list[str]:
        """Column names in the order they first appeared."""
        return list(self._data)

    def last(self) -> dict[str, Any]:
        """The latest epoch's row (empty before the first epoch)."""
        return {k: v[-1] for k, v in self._data.items()} if self._n else {}

    def state_dict(self) -> dict[str, list]:
        """Plain lists, for checkpoints and JSON."""
        return {k: list(v) for k, v in self._data.items()}

    def load_state_dict(self, state: Mapping[str, list]) -> None:
        """Replace the contents with what :meth:`state_dict` returned."""
        self.__init__(state)

    def plot(self, path: str | os.PathLike) -> None:
        """Save a PNG with one panel per quantity: the loss curves, then each metric (train and validation).

        Args:
            path: Where to write the image.

        Raises:
            MissingExtraError: matplotlib is not installed (``pip install 'nn_handler[plot]'``).
            ValueError: The History is empty.
        """
        try:
            # Figure without pyplot: no display needed (servers, CI), and a
            # notebook's chosen backend and open figures are left alone.
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise MissingExtraError(
                "plot_history needs matplotlib, which is not installed; install the plot extra: "
                "pip install 'nn_handler[plot]'"
            ) from exc
        if not self._n:
            raise ValueError("the History is empty: train at least one epoch before plotting")
        panels = self._panels()
        epochs = self._data.get("epoch") or list(range(1, self._n + 1))
        fig = Figure(figsize=(5 * len(panels), 3.5))
        axes = fig.subplots(1, len(panels), squeeze=False)
        for ax, (name, keys) in zip(axes[0], panels.items()):
            for key in keys:
                pairs = [(e, v) for e, v in zip(epochs, self._data[key]) if _is_number(v)]
                if pairs:
                    ax.plot(*zip(*pairs), marker="o", label=key)
            ax.set_title(name)
            ax.set_xlabel("epoch")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=100)

    def _panels(self) -> dict[str, list[str]]:
        panels: dict[str, list[str]] = {}
        for key in self._data:
            for prefix in ("train_", "val_"):
                if key.startswith(prefix):
                    panels.setdefault(key[len(prefix):], []).append(key)
        return panels or {"loss": [k for k in self._data if k != "epoch"]}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
