"""One walk over the tensors inside tuples, lists, dicts, namedtuples and dataclasses.

Batches and model outputs arrive as nested containers; moving them to a
device, bringing them back to the CPU, cutting them to the first samples and
finding their tensors are all the same walk. Containers are rebuilt with their
own type (a namedtuple stays that namedtuple, an ``OrderedDict`` or
``defaultdict`` stays one, a dataclass is copied with its fields replaced);
anything that is neither a tensor nor a container is passed through as is.

Example:
    >>> import torch
    >>> batch = {"x": torch.ones(2, 3), "ids": [torch.arange(2), "label"]}
    >>> moved = to_device(batch, torch.device("cpu"))
    >>> moved["ids"][1], moved["x"].shape
    ('label', torch.Size([2, 3]))
    >>> [path for path, _ in tensors(batch, "batch")]
    ["batch['x']", "batch['ids'][0]"]
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["apply", "combine", "to_device", "detach_cpu", "tensors"]


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


# Containers are what DataParallel's scatter and default_collate walk too:
# lists, tuples (namedtuples), dicts (and subclasses); plus dataclasses. Other
# Mappings stay leaves: their constructors take no (key, value) pairs in general.
def _items(obj: Any) -> list[tuple[Any, Any]] | None:
    """``(key, child)`` pairs of a container, ``None`` for a leaf."""
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    if isinstance(obj, dict):
        return list(obj.items())
    if _is_dataclass_instance(obj):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def _rebuild(like: Any, keys: Sequence[Any], values: Sequence[Any]) -> Any:
    """A container of ``like``'s type holding ``values`` under ``keys``."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple: fields are positional arguments
        return type(like)(*values)
    if isinstance(like, (list, tuple)):
        return type(like)(values)
    if isinstance(like, dict):
        if isinstance(like, defaultdict):  # its first argument is the factory
            return type(like)(like.default_factory, zip(keys, values))
        return type(like)(zip(keys, values))
    # A dataclass: a shallow copy with the fields set past __init__, which may
    # validate or derive (frozen ones too), and which we must not rerun.
    new = copy.copy(like)
    for name, value in zip(keys, values):
        object.__setattr__(new, name, value)
    return new


def apply(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn(tensor)`` in place of every tensor inside it.

    Example:
        >>> import torch
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "a b")
        >>> apply(Pair(torch.tensor(1), None), lambda t: t + 1)
        Pair(a=tensor(2), b=None)
    """
    # Runs on every batch of the training loop: the common containers are
    # rebuilt inline, without the (key, value) lists of _items.
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        values = [apply(o, fn) for o in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if type(obj) is dict:
        return {k: apply(v, fn) for k, v in obj.items()}
    items = _items(obj)
    if items is None:
        return obj
    return _rebuild(obj, [k for k, _ in items], [apply(v, fn) for _, v in items])


def combine(objs: Sequence[Any], fn: Callable[[list], Any]) -> Any:
    """Merge trees of the same shape: ``fn(leaves)`` at each position, ``leaves`` taken from every tree in order.

    The structure comes from ``objs[0]``; a leaf is anything that is not a
    container (tensors included).

    Example:
        >>> import torch
        >>> outs = [{"y": torch.tensor([1, 2]), "n": 2}, {"y": torch.tensor([3]), "n": 1}]
        >>> combine(outs, lambda leaves: torch.cat(leaves) if isinstance(leaves[0], torch.Tensor) else leaves)
        {'y': tensor([1, 2, 3]), 'n': [2, 1]}
    """
    first = objs[0]
    items = None if isinstance(first, torch.Tensor) else _items(first)
    if items is None:
        return fn(list(objs))
    keys = [k for k, _ in items]
    if isinstance(first, (list, tuple, dict)):
        values = [combine([o[k] for o in objs], fn) for k in keys]
    else:  # a dataclass
        values = [combine([getattr(o, k) for o in objs], fn) for k in keys]
    return _rebuild(first, keys, values)


def to_device(obj: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor inside moved to ``device`` (tensors already there are kept, not copied).

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> to_device((t, 3), "cpu")[0] is t
        True
    """
    # Every training batch comes through here, most often as an (inputs,
    # targets) pair of tensors: moved without the walk (a fifth of the cost).
    if type(obj) in (tuple, list) and len(obj) == 2:
        a, b = obj
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.device == device and b.device == device:  # what .to() would return, for a tenth of its cost
                return obj
            return type(obj)((a.to(device, non_blocking=non_blocking), b.to(device, non_blocking=non_blocking)))
    return apply(obj, lambda t: t.to(device, non_blocking=non_blocking))


def detach_cpu(obj: Any) -> Any:
    """``obj`` with every tensor inside detached from autograd and on the CPU.

    Example:
        >>> import torch
        >>> out = detach_cpu([torch.ones(1, requires_grad=True) * 2])
        >>> out[0].requires_grad, out[0].device.type
        (False, 'cpu')
    """
    return apply(obj, lambda t: t.detach().cpu())


def tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj``, depth first, with where it sits (``"[0]"``, ``"['x']"``, ``".field"``).

    Example:
        >>> import torch
        >>> [(p, t.tolist()) for p, t in tensors(([torch.tensor(1)], {"k": torch.tensor(2)}), "args")]
        [('args[0][0]', 1), ("args[1]['k']", 2)]
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    items = _items(obj)
    if items is None:
        return
    by_attribute = not isinstance(obj, (list, tuple, dict))  # a dataclass
    for key, value in items:
        yield from tensors(value, f"{path}.{key}" if by_attribute else f"{path}[{key!r}]")
