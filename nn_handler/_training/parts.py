"""The objects one train / evaluate / save call works on, handed over explicitly by the public face.

Private: :class:`~nn_handler.NNHandler` builds a :class:`Parts` at the
start of each call from its current model, optimizer, loaders and callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..callbacks import TrainerView
from ..utils.ddp import is_distributed
from .precision import Precision


@dataclass(eq=False)
class Parts:
    """Model, optimizer, loaders, callbacks and placement of one call."""

    view: TrainerView  # what callbacks receive as ``handler``
    model: nn.Module  # as trained: DDP-wrapped when distributed
    module: nn.Module  # the model itself
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scaler: Any  # a GradScaler (fp16) or None
    loss_fn: Callable | None
    train_loader: DataLoader | None
    val_loader: DataLoader | None
    callbacks: list
    device: torch.device
    distributed: bool
    rank: int
    world_size: int
    precision: Precision  # the autocast dtype, asked by the step, evaluation and sharding
    strategy: str = "ddp"  # "fsdp": sharded model (in a group) and sharded checkpoint directories

    @property
    def in_group(self) -> bool:
        """Distributed, and the process group still exists (a handler told ``use_distributed=False`` decides alone)."""
        return self.distributed and is_distributed()

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0
