"""``strategy="fsdp"``: FSDP2 (``fully_shard``) applied by a policy, its gradient-sync toggle, full state dicts.

:func:`shard_model` applies :func:`torch.distributed.fsdp.fully_shard` to
the submodules a policy names, then to the root, so that each rank holds
only its shard of the parameters, gradients and optimizer state. The
module is sharded in place: it stays the model (no wrapper around it), its
parameters become ``DTensor`` shards, and its forward all-gathers them.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Mapping

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import check_weights
from ..errors import ConfigurationError
from .precision import Precision

log = logging.getLogger(__name__)


# torch.distributed.fsdp and torch.distributed.checkpoint bring DTensor with them: about half a second at import,
# most of what importing NNHandler would cost. They are imported where a model is sharded or a sharded state is
# read or written; until then no model can be an FSDPModule.
def _fsdp_module_class() -> tuple[type, ...]:
    """``(FSDPModule,)`` once torch's FSDP is loaded (by us or by the user), else ``()``."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    found = getattr(fsdp, "FSDPModule", None)
    return (found,) if found is not None else ()


def wrap_targets(model: nn.Module, classes: tuple) -> list[nn.Module]:
    """The submodules sharded on their own, innermost first; the root is sharded after them.

    ``classes`` empty: every direct child that holds parameters. Otherwise
    every submodule (below the root) that is an instance of one of them.
    A submodule sharing a parameter with a module outside it (tied weights,
    e.g. an embedding and the output layer) is left to the group around it:
    ``fully_shard`` replaces a parameter in the modules it shards alone, so
    sharding one holder by itself would untie the weight.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 1)))
        >>> [type(t).__name__ for t in wrap_targets(m, ())]
        ['Linear', 'Sequential']
        >>> [type(t).__name__ for t in wrap_targets(m, (nn.Linear,))]
        ['Linear', 'Linear']
        >>> m[2][0].weight = nn.Parameter(torch.ones(2, 2))
        >>> m[0].weight = m[2][0].weight  # tied: both stay with the root
        >>> wrap_targets(m, ())
        []
    """
    if not classes:
        targets = [child for child in model.children() if any(True for _ in child.parameters())]
    else:
        below_root = list(model.modules())[1:]
        # Reversed pre-order: every module comes after all of its descendants, as fully_shard needs.
        targets = [m for m in reversed(below_root) if isinstance(m, classes)]
    tied = [t for t in targets if _shares_parameters_outside(model, t)]
    if tied:
        log.info("fsdp: %s share parameters with modules outside them (tied weights); they are sharded with "
                 "the module around them, so the weights stay tied", ", ".join(type(t).__name__ for t in tied))
    return [t for t in targets if t not in tied]


def _shares_parameters_outside(model: nn.Module, target: nn.Module) -> bool:
    inside = {id(m) for m in target.modules()}
    mine = {id(p) for p in target.parameters()}
    return any(id(p) in mine for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False))


def shard_model(model: nn.Module, device: torch.device, precision: Precision, classes: tuple,
                options: Mapping[str, Any], compile_kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """Move ``model`` to ``device`` and apply ``fully_shard`` to the policy's submodules, then to the root.

    With ``compile_kwargs``, each of those submodules is compiled in place
    before it is sharded (the root alone when the policy names none), as
    torchtitan does: the graphs are the blocks' own; FSDP2's hooks are
    marked for Dynamo to skip, so they run eagerly around them.

    Raises:
        ConfigurationError: The model is already sharded or DDP-wrapped.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    if isinstance(model, (FSDPModule, DistributedDataParallel)):
        raise ConfigurationError(f"the model is already wrapped ({type(model).__name__}); with strategy='fsdp' "
                                 f"pass the plain model: NNHandler applies fully_shard itself")
    offload = bool(options.get("cpu_offload", False))  # on a GPU run only: NNHandler checked
    kwargs: dict[str, Any] = {"mp_policy": precision.fsdp_policy(),
                              "reshard_after_forward": options.get("reshard_after_forward", True)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    model = model.to(device)
    targets = wrap_targets(model, classes)
    if classes and not any(isinstance(m, classes) for m in list(model.modules())[1:]):
        log.warning("fsdp_wrap: the model has no submodule of %s; only the whole model is sharded",
                    ", ".join(c.__name__ for c in classes))
    if compile_kwargs is not None:
        for module in targets or [model]:
            module.compile(**compile_kwargs)
    for module in targets:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, _fsdp_module_class())


def can_pause_sync(model: nn.Module) -> bool:
    """True when the model can skip its gradient reduction on non-final micro-steps (DDP or FSDP2)."""
    return isinstance(model, (DistributedDataParallel, *_fsdp_module_class()))


@contextlib.contextmanager
def gradient_sync_paused(model: nn.Module):
    """DDP's ``no_sync()``, or FSDP2's ``set_requires_gradient_sync(False)`` for the block (unsharded grads accumulate)."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated ``state_dict`` on CPU: on rank 0 for a sharded model (empty elsewhere); call it on every rank."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(module: nn.Module, weights: Mapping[str, Any], optimizers: list[torch.optim.Optimizer] = (),
                    optimizer_states: list[Mapping[str, Any]] = (), *, source: str = "checkpoint") -> None:
    """Load a plain (single-file) ``state_dict``, and optionally optimizers', into a sharded model on every rank.

    Each rank keeps its shard of the full tensors. Each optimizer state is the
    ``optimizer.state_dict()`` of the same model unsharded (parameters by
    index, in the order the optimizer was built); it is matched to its
    optimizer's parameters by position.

    Raises:
        CheckpointMismatchError: The keys or shapes do not fit the model (named).
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    check_weights(module, weights, source=source)  # a DTensor's shape is the full one
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, dict(weights), options=options)
    if not optimizers:
        return
    names = {id(p): name for name, p in module.named_parameters()}
    state, groups = {}, []
    for optimizer, optimizer_state in zip(optimizers, optimizer_states):
        by_name = {}
        for saved, group in zip(optimizer_state["param_groups"], optimizer.param_groups):
            fqns = [names[id(p)] for p in group["params"]]
            by_name.update(zip(saved["params"], fqns))
            groups.append({**saved, "params": fqns})
        state.update({by_name[i]: s for i, s in optimizer_state["state"].items()})
    set_optimizer_state_dict(module, list(optimizers), {"state": state, "param_groups": groups}, options=options)
