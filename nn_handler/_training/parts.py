"""The objects one train / evaluate / save call works on, handed over explicitly by the public face.

Private: :class:`~nn_handler.NNHandler` builds its model with
:func:`wrap_model` and a :class:`Parts` at the start of each call from its
current model, optimizer, loaders and callbacks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..callbacks import TrainerView
from ..utils.ddp import is_distributed
from ..utils.parallel import MultiGPUConfig, prepare_model, unwrap_parallel_model
from .config import TrainingConfig
from .precision import Precision
from .sharding import shard_model

log = logging.getLogger(__name__)


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
    training_step: Callable | None = None  # fn(ctx, batch); None: the built-in step (loss_fn, metrics)
    validation_step: Callable | None = None

    @property
    def models(self) -> dict[str, nn.Module]:
        """The models as trained, by name."""
        return {"model": self.model}

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The models themselves (unwrapped), by name."""
        return {"model": self.module}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {} if self.optimizer is None else {"optimizer": self.optimizer}

    @property
    def schedulers(self) -> dict[str, Any]:
        """The schedulers by the name of their optimizer."""
        return {} if self.scheduler is None else {"optimizer": self.scheduler}

    @property
    def in_group(self) -> bool:
        """Distributed, and the process group still exists (a handler told ``use_distributed=False`` decides alone)."""
        return self.distributed and is_distributed()

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


def wrap_model(model: nn.Module, config: TrainingConfig, device: torch.device, precision: Precision,
               parallel: MultiGPUConfig, distributed: bool) -> nn.Module:
    """``model`` (unwrapped first) as trained: compiled when asked, then DDP-wrapped or sharded, or only moved.

    ``torch.compile`` is applied in place (``nn.Module.compile``), so the
    model keeps its class and its ``state_dict`` keys (no ``_orig_mod.``),
    and in the order torch recommends: the inner module before DDP wraps
    it; under FSDP2 each block before ``fully_shard`` shards it.
    """
    if isinstance(getattr(model, "_orig_mod", None), nn.Module) and not config.compile:
        log.warning("the model came compiled (torch.compile); NNHandler trains the module inside it: pass "
                    "compile=True (and compile_kwargs) to compile it in the order DDP and FSDP need")
    model = unwrap_parallel_model(model)
    compile_kwargs = dict(config.compile_kwargs) if config.compile else None
    if config.strategy == "fsdp" and distributed:
        return shard_model(model, device, precision, config.fsdp_wrap, config.fsdp_kwargs, compile_kwargs)
    if compile_kwargs is not None:
        model.compile(**compile_kwargs)
    return prepare_model(model, parallel, device=device)
