"""The ranks' buffers (BatchNorm's running statistics and the like) are rank 0's wherever they are read.

Each rank updates its buffers from its own batches, so after a training step
the ranks hold different running statistics. DDP's rule
(``broadcast_buffers=True``) is that rank 0's are the model's: it broadcasts
them from rank 0 before a training forward. Evaluation and prediction run
the unwrapped (or, under FSDP, the sharded) module, which broadcasts nothing,
and FSDP2 never synchronises buffers at all; so before evaluating,
predicting or writing a checkpoint the ranks take rank 0's buffers, and a
result on N ranks equals the exported model's in one process. Rank 0's own
buffers never change by this, so training follows DDP's numbers exactly.
With ``ddp_kwargs={"broadcast_buffers": False}`` each rank keeps its own
buffers, in training and here alike: what is trained does not depend on
whether a validation loader is set.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.utils import _sync_params_and_buffers

from ..utils._collectives import check_collective_allowed
from ..utils._stall import watching
from .parts import Parts

#: Bytes per coalesced broadcast, DDP's default bucket (``broadcast_bucket_size``).
BUCKET_BYTES = 250 * 1024 * 1024


def sync_buffers(parts: Parts, what: str) -> None:
    """Every rank's buffers become rank 0's; call it on every rank (a no-op in one process or without buffers)."""
    if not parts.in_group:
        return
    # broadcast_buffers=False: the user's DDP setting, every rank keeps its own buffers.
    buffers = [b for name, module in parts.modules.items()
               if getattr(parts.models[name], "broadcast_buffers", True) is not False for b in module.buffers()]
    if not buffers:
        return
    check_collective_allowed(what)
    with watching("broadcast (buffers from rank 0)"):
        # torch's own (DDP's) coalescing broadcast over the default group, where the model's device lives.
        _sync_params_and_buffers(dist.group.WORLD, buffers, BUCKET_BYTES, 0)
