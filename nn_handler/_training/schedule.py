"""The LR scheduler: how one is built and checked, and when the loop steps it.

Private: :class:`~nn_handler.NNHandler` is the public face (``scheduler=``,
``set_scheduler``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigurationError


def build_scheduler(scheduler: Any, kwargs: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> Any:
    """``scheduler`` as an instance over ``optimizer`` (built from a class with ``kwargs``), checked."""
    if isinstance(scheduler, type):
        if optimizer is None:
            raise ConfigurationError("set an optimizer before building a scheduler from a class")
        scheduler = scheduler(optimizer, **kwargs)
    elif kwargs:
        raise ConfigurationError("scheduler_kwargs only apply when the scheduler is given as a class")
    if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")):
        raise TypeError(f"scheduler must be an LR scheduler, got {type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ConfigurationError("the scheduler was built for another optimizer than this handler's")
    return scheduler
