"""Placing the top-level children of one model on several devices (naive model parallelism).

Two halves: :func:`plan_device_map` is pure (child sizes, device labels and
budgets in; a ``{child: device}`` map out), so the placement rules are tested
without GPUs; :func:`dispatch_model` measures a real model, plans, moves each
child and registers a forward pre-hook per child that moves its inputs to its
device. Public names are re-exported by :mod:`nn_handler.utils.parallel`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..._checks import check_choice, invalid
from ..._tree import to_device
from ...errors import ConfigurationError
from .._devices import cuda_count, parse_device

__all__ = ["plan_device_map", "dispatch_model", "parse_memory_size", "DEVICE_MAP_ATTR"]

log = logging.getLogger(__name__)

#: Attribute on a dispatched model holding its ``{child name: device}`` map.
DEVICE_MAP_ATTR = "nn_handler_device_map"
_HOOKS_ATTR = "_nn_handler_dispatch_hooks"
_STRATEGIES = ("balanced", "sequential")
# Of a GPU's free memory, the share a default budget gives to parameters and
# buffers; the rest is left for activations and the CUDA context.
_DEFAULT_GPU_SHARE = 0.9

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"10GiB"``, ``"512MB"``, ``"1.5 GB"``.

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024.

    Raises:
        ConfigurationError: A negative number or a string that is not a size.

    Example:
        >>> parse_memory_size("2GiB"), parse_memory_size("1.5 kb"), parse_memory_size(7)
        (2147483648, 1500, 7)
    """
    if isinstance(size, bool):
        raise invalid("a memory size", "bytes (int) or a string like '10GiB'", size)
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", size)
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ConfigurationError(
                f"cannot read memory size {size!r}; write bytes as an int or a number with one of "
                f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '10GiB')"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise invalid("a memory size", "bytes (int) or a string like '10GiB'", size)
    if value < 0:
        raise invalid("a memory size", ">= 0", size)
    return value


def _fmt(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _plan_sequential(sizes: list[int], caps: list[int | None]) -> list[int]:
    # Fill each device before moving to the next; never go back, so the
    # activations cross each device boundary once.
    placement, device, load = [], 0, 0
    for size in sizes:
        while caps[device] is not None and load + size > caps[device]:
            if device + 1 == len(caps):
                return []
            device, load = device + 1, 0
        placement.append(device)
        load += size
    return placement


def _plan_balanced(sizes: list[int], caps: list[int | None]) -> list[int]:
    # Contiguous groups (one per device, in device order, possibly empty) with
    # the smallest sum of squared group sizes, i.e. as equal as the children
    # allow, and no group over its device's cap. Exact dynamic programme over
    # split points: O(devices * children^2) integer steps.
    n, d = len(sizes), len(caps)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(d + 1)]
    split = [[0] * (n + 1) for _ in range(d + 1)]
    cost[0][0] = 0
    for k in range(1, d + 1):
        cap = caps[k - 1]
        for i in range(n + 1):
            best, best_j = inf, 0
            for j in range(i, -1, -1):  # from the largest j: ties keep earlier devices fuller
                load = prefix[i] - prefix[j]
                if cap is not None and load > cap:
                    break  # loads only grow as j decreases
                if cost[k - 1][j] == inf:
                    continue
                c = cost[k - 1][j] + load * load
                if c < best:
                    best, best_j = c, j
            cost[k][i], split[k][i] = best, best_j
    if cost[d][n] == inf:
        return []
    placement = [0] * n
    i = n
    for k in range(d, 0, -1):
        j = split[k][i]
        placement[j:i] = [k - 1] * (i - j)
        i = j
    return placement


def plan_device_map(
    sizes: Mapping[str, int],
    devices: Sequence[str],
    strategy: str = "balanced",
    max_memory: Mapping[str, int | None] | None = None,
) -> dict[str, str]:
    """Assign ordered children to devices; pure, touches no device.

    Children stay in order and each device gets one contiguous run of them
    (possibly none), so activations cross from device to device in one
    direction only.

    Args:
        sizes: ``{child name: bytes}`` in the order the children run.
        devices: Device labels in the order to use them; no repeats.
        strategy: ``"balanced"``: runs of as equal total size as possible;
            ``"sequential"``: fill each device up to its budget before the next.
        max_memory: ``{device label: bytes}`` budgets; a missing label or
            ``None`` means no limit.

    Returns:
        ``{child name: device label}``, in the order of ``sizes``.

    Raises:
        ConfigurationError: An unknown strategy, no devices, a repeated device,
            a negative size, a budget for an unknown device, or children that
            do not fit in the budgets.

    Example:
        >>> sizes = {"embed": 400, "block1": 300, "block2": 300, "head": 400}
        >>> plan_device_map(sizes, ["cuda:0", "cuda:1"])
        {'embed': 'cuda:0', 'block1': 'cuda:0', 'block2': 'cuda:1', 'head': 'cuda:1'}
        >>> plan_device_map(sizes, ["cuda:0", "cuda:1"], "sequential", {"cuda:0": 1000})
        {'embed': 'cuda:0', 'block1': 'cuda:0', 'block2': 'cuda:0', 'head': 'cuda:1'}
    """
    check_choice("strategy", strategy, _STRATEGIES)
    devices = list(devices)
    if not devices:
        raise ConfigurationError("no devices to place the model on")
    if len(set(devices)) != len(devices):
        raise ConfigurationError(f"devices must not repeat, got {devices}")
    budgets = dict(max_memory or {})
    unknown = [k for k in budgets if k not in devices]
    if unknown:
        raise ConfigurationError(f"max_memory names devices {unknown} that are not among {devices}")
    caps = [budgets.get(dev) for dev in devices]
    names, values = list(sizes), [sizes[n] for n in sizes]
    bad = [(n, v) for n, v in zip(names, values) if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise invalid("sizes", "byte counts >= 0", dict(bad))
    plan = (_plan_balanced if strategy == "balanced" else _plan_sequential)(values, caps)
    if values and not plan:
        largest = max(zip(values, names))
        budget_text = ", ".join(f"{dev} {'unlimited' if cap is None else _fmt(cap)}" for dev, cap in zip(devices, caps))
        raise ConfigurationError(
            f"the model does not fit in max_memory ({strategy}): its children need {_fmt(sum(values))} in all, "
            f"the largest ({largest[1]!r}) {_fmt(largest[0])}; budgets: {budget_text}. Raise max_memory, add "
            f"devices, or split the largest child into smaller top-level children"
        )
    return {name: devices[i] for name, i in zip(names, plan)}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _child_sizes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters and buffers per top-level child; a tensor shared by children counts once."""
    seen: set[int] = set()
    sizes = {}
    for name, child in model.named_children():
        total = 0
        for t in list(child.parameters()) + list(child.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += _tensor_bytes(t)
        sizes[name] = total
    return sizes


def _tensor_sites(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """Every place each parameter or buffer is held: ``(module, "_parameters" or "_buffers", name)``."""
    sites: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    sites.setdefault(id(t), []).append((module, kind, name))
    return sites


def _check_ties(model: nn.Module, plan: dict[str, str], first: str) -> None:
    """Refuse a plan that puts a tensor held by several children (tied weights) on several devices."""
    owners: dict[int, set[str]] = {}
    for name, t in list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False)):
        owners.setdefault(id(t), set()).add("")  # the model itself: goes with the first child
    for child_name, child in model.named_children():
        for t in list(child.parameters()) + list(child.buffers()):
            owners.setdefault(id(t), set()).add(child_name)
    for names in owners.values():
        places = {plan.get(n, first) for n in names}
        if len(places) > 1:
            shown = sorted(n if n else "(the model itself)" for n in names)
            raise ConfigurationError(
                f"children {shown} share a parameter or buffer (tied weights) but were placed on "
                f"{sorted(places)}; pass a dict device_map that puts them on one device"
            )


def _retie(sites: dict[int, list[tuple[nn.Module, str, str]]]) -> None:
    # Moving to a device whose tensor type differs (meta, sometimes across
    # backends) gives every holder of a shared parameter its own copy; point
    # them all back at one, as they were before the move.
    for places in sites.values():
        if len(places) > 1:
            module, kind, name = places[0]
            kept = getattr(module, kind)[name]
            for module, kind, name in places[1:]:
                getattr(module, kind)[name] = kept


def _label(spec: Any) -> str:
    """A canonical device label ('cpu', 'cuda:1', ...) for a device that exists here."""
    return str(parse_device(spec))


def _default_budget(label: str) -> int | None:
    if label.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(label))
        return int(free * _DEFAULT_GPU_SHARE)
    return None  # host memory: no budget unless the caller gives one


def _input_mover(device: torch.device):
    def hook(module, args, kwargs):
        return to_device(args, device), to_device(kwargs, device)
    return hook


def _move_own_tensors(model: nn.Module, device: torch.device) -> None:
    # Parameters and buffers of the top module itself (not of a child), moved
    # the way Module.to moves them but without recursing: model.to() would
    # first pull every child onto `device`.
    model._apply(lambda t: t.to(device), recurse=False)


def _remove_dispatch(model: nn.Module) -> None:
    for handle in getattr(model, _HOOKS_ATTR, ()):
        handle.remove()
    for attr in (_HOOKS_ATTR, DEVICE_MAP_ATTR):
        if attr in model.__dict__:
            delattr(model, attr)


def dispatch_model(
    model: nn.Module,
    device_map: str | Mapping[str, Any] = "balanced",
    max_memory: Mapping[Any, int | str | None] | None = None,
) -> nn.Module:
    """Spread the top-level children of ``model`` over several devices, in place.

    For ``nn.Sequential`` and any module whose top-level children run one
    after another. Each child moves to its device and gets a forward
    pre-hook that moves its inputs there, so a forward pass hops from device
    to device; the output is on the last child's device. The map is recorded
    as ``model.nn_handler_device_map`` (``{child name: "cuda:1"}``). Calling
    it again re-plans and replaces the hooks.

    Args:
        model: The model; not wrapped in ``DataParallel``/DDP.
        device_map: ``"balanced"`` (``"auto"`` is the same): contiguous runs
            of children of as equal parameter size as possible, one run per
            device; ``"sequential"``: fill the first device up to its budget,
            then the next; or a dict ``{child name: device}`` naming every child.
        max_memory: ``{device: budget}``, the devices to use in order and the
            bytes (int or ``"10GiB"``) each may hold in parameters and buffers;
            ``None`` as a budget means the default. Without it: every GPU, each
            with 90% of its free memory (or ``"cpu"`` alone, unlimited, where
            there is no GPU).

    Returns:
        ``model`` itself, dispatched.

    Raises:
        ConfigurationError: An unknown strategy, a dict that misses or invents
            children, a wrapped or childless model, tied weights split over
            devices, or children that do not fit in the budgets.
        DeviceError: A device that does not exist.

    Example:
        >>> import torch, torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> dispatch_model(model, {"0": "cpu", "1": "cpu", "2": "cpu"}).nn_handler_device_map
        {'0': 'cpu', '1': 'cpu', '2': 'cpu'}
        >>> model(torch.ones(3, 4)).shape
        torch.Size([3, 2])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ConfigurationError(
            f"dispatch_model places one copy of a model over several devices; it cannot split a "
            f"{type(model).__name__}. Dispatch the plain model (unwrap_parallel_model(model)) instead"
        )
    sizes = _child_sizes(model)
    if not sizes:
        raise ConfigurationError(f"{type(model).__name__} has no child modules to place on devices")

    if isinstance(device_map, Mapping):
        mapping = {str(k): v for k, v in device_map.items()}
        missing = [n for n in sizes if n not in mapping]
        unknown = [n for n in mapping if n not in sizes]
        if missing or unknown:
            raise ConfigurationError(
                "device_map must name every top-level child of the model exactly: "
                + (f"missing {missing}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"not children {unknown}" if unknown else "")
                + f" (children: {list(sizes)})"
            )
        plan = {n: _label(mapping[n]) for n in sizes}
        if max_memory is not None:
            log.warning("dispatch_model: max_memory is ignored when device_map is a dict")
    else:
        strategy = "balanced" if device_map == "auto" else device_map
        if strategy not in _STRATEGIES:
            raise ConfigurationError(
                f"device_map must be 'balanced', 'sequential', 'auto' or a dict {{child name: device}}, "
                f"got {device_map!r}"
            )
        if max_memory is not None:
            if not isinstance(max_memory, Mapping) or not max_memory:
                raise ConfigurationError(f"max_memory must be a non-empty dict {{device: bytes}}, got {max_memory!r}")
            budgets = {}
            for key, value in max_memory.items():
                label = _label(key)
                if label in budgets:
                    raise ConfigurationError(f"max_memory names device {label} twice")
                budgets[label] = _default_budget(label) if value is None else parse_memory_size(value)
        else:
            count = cuda_count()
            labels = [f"cuda:{i}" for i in range(count)] or ["cpu"]
            budgets = {label: _default_budget(label) for label in labels}
        plan = plan_device_map(sizes, list(budgets), strategy, budgets)

    first = next(iter(plan.values()))
    _check_ties(model, plan, first)

    _remove_dispatch(model)
    handles = []
    sites = _tensor_sites(model)
    _move_own_tensors(model, torch.device(first))
    for name, child in model.named_children():
        device = torch.device(plan[name])
        child.to(device)
        handles.append(child.register_forward_pre_hook(_input_mover(device), with_kwargs=True))
    _retie(sites)
    setattr(model, _HOOKS_ATTR, handles)
    setattr(model, DEVICE_MAP_ATTR, dict(plan))
    log.info("dispatched %s over %s", type(model).__name__, sorted(set(plan.values())))
    return model
