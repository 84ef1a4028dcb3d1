"""When the training loop reads device values on the host: at each step where that is free, else without waiting.

On a GPU, every ``loss.item()``, ``bool(tensor)`` or blocking copy makes the
CPU wait until the GPU has caught up, and the GPU then idles while the CPU
prepares the next step. So on a device the loop reads nothing per step: it
moves batches without blocking, keeps losses and metric values on the device
until the epoch's sums, and the progress bar shows a loss copied into
page-locked memory without blocking (shown once the copy has landed). In a
single CPU process a read costs nothing, and each loss is checked before its
backward pass.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostReads:
    """How the loop reads device values: ``free`` (a CPU process) or without blocking (a device).

    Example:
        >>> HostReads.for_device(torch.device("cpu")).free
        True
        >>> HostReads.for_device(torch.device("cuda", 0)).non_blocking
        True
    """

    free: bool

    @classmethod
    def for_device(cls, device: torch.device) -> "HostReads":
        return cls(free=device.type == "cpu")

    @property
    def non_blocking(self) -> bool:
        """Copy batches to the device without waiting (host-to-device copies are safe so)."""
        return not self.free


class PendingValue:
    """A scalar of the device, copied to the host without blocking; :meth:`ready` once it has landed.

    Example:
        >>> v = PendingValue(torch.tensor(0.25))
        >>> v.ready(), v.get()
        (True, 0.25)
    """

    def __init__(self, value: torch.Tensor):
        value = value.detach()
        self._done = None
        if value.device.type == "cuda":
            # A non-blocking copy into pageable memory may be read before it
            # lands; into page-locked memory, with an event, it is safe.
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = value

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def get(self) -> float:
        """The value; call it once :meth:`ready` (before, it would wait for the copy)."""
        return self._host.item()
