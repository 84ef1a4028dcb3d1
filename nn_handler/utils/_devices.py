"""The one device grammar: what a device id is, whether it exists here, and how a bad one is reported.

Every place that takes a device (``ParallelExecutor``, ``prepare_model``,
``MultiGPUConfig``, ``parallel_on_all_devices``, ``parallel_predict``,
``dispatch_model``, ``resolve_device``, the ``validate_*`` helpers) parses it
here, so the same bad id gives the same :class:`~nn_handler.errors.DeviceError`
message everywhere. What differs between them is a parameter: which device
types they accept, whether a CUDA index is checked against this machine now
(a caller that falls back to the CPU without CUDA checks it itself).

A device is an int (a GPU index), a string (``"cpu"``, ``"cuda"``,
``"cuda:N"``, ``"gpu"``, ``"gpu:N"``, any type torch knows: ``"mps"``,
``"meta"``...) or a ``torch.device``. Importing this module costs nothing
beyond torch, so the worker pool can count GPUs without the process-group
module.
"""

from __future__ import annotations

from typing import Collection, Sequence, Union

import torch

from ..errors import DeviceError

__all__ = ["DeviceSpec", "cuda_count", "parse_device", "parse_device_ids", "split_device_ids", "device_problems"]

DeviceSpec = Union[int, str, torch.device]

#: GPU ids only: what ``DataParallel`` takes.
CUDA_ONLY = ("cuda",)


def cuda_count() -> int:
    """How many CUDA devices this process can use; 0 where CUDA is not available.

    ``torch.cuda.device_count()`` alone can be positive where torch cannot use
    the GPUs (a driver without a CUDA build), hence the ``is_available`` check.

    Example:
        >>> cuda_count() >= 0
        True
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _shown(spec) -> str:
    # A torch.device shows as the string the user would type: 'cuda:5'.
    return repr(str(spec)) if isinstance(spec, torch.device) else repr(spec)


def _use(types: Collection[str]) -> str:
    # ("cpu", "cuda") -> "a GPU index, 'cpu' or 'cuda:N'"
    words = ["a GPU index"] + [f"'{t}'" for t in types if t != "cuda"] + (["'cuda:N'"] if "cuda" in types else [])
    return ", ".join(words[:-1]) + " or " + words[-1]


def _missing(what: str, spec, count: int) -> str:
    if count == 0:
        return f"{what} {_shown(spec)} does not exist: CUDA is not available on this machine"
    return (f"{what} {_shown(spec)} does not exist: this machine has {count} CUDA device"
            f"{'s' if count != 1 else ''} (valid ids 0..{count - 1})")


def parse_device(
    spec: DeviceSpec,
    *,
    types: Collection[str] | None = None,
    exists: bool = True,
    cuda_index: int | None = 0,
    what: str = "device",
) -> torch.device:
    """One device as a ``torch.device``, checked; raises :class:`DeviceError` saying what is wrong.

    Args:
        spec: An int GPU index, a string (``"cpu"``, ``"cuda"``, ``"cuda:N"``,
            ``"gpu"``, ``"gpu:N"``, ``"mps"``, ...; case and spaces ignored) or
            a ``torch.device``.
        types: The device types accepted here (``("cuda",)`` for GPUs only);
            ``None`` accepts any type torch knows.
        exists: Check a CUDA index against the GPUs of this machine. Pass
            ``False`` where the caller falls back to the CPU without CUDA.
        cuda_index: The index that ``"cuda"`` without one means (0, or the
            local rank's GPU for :func:`~nn_handler.resolve_device`); ``None``
            leaves it without one (and unchecked).
        what: How the message names the value (an argument name such as
            ``"output_device"``).

    Returns:
        The device; CUDA devices carry an index unless ``cuda_index`` is ``None``.

    Raises:
        DeviceError: A value that is not a device, an unknown string, a
            negative GPU index, a type not accepted here, or (``exists``) a GPU
            that this machine does not have.

    Example:
        >>> parse_device(1, exists=False)
        device(type='cuda', index=1)
        >>> parse_device(" GPU:1 ", exists=False)
        device(type='cuda', index=1)
        >>> parse_device("tpu")
        Traceback (most recent call last):
        ...
        nn_handler.errors.DeviceError: unknown device 'tpu'; use a GPU index, 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device
    """
    if isinstance(spec, bool) or not isinstance(spec, (int, str, torch.device)):
        raise DeviceError(
            f"{what} must be a GPU index, a string such as 'cuda:0' or a torch.device, "
            f"got {type(spec).__name__} {spec!r}"
        )
    if isinstance(spec, int):
        if spec < 0:
            raise DeviceError(f"{what} must be a GPU index >= 0, got {spec}")
        device = torch.device("cuda", spec)
    elif isinstance(spec, torch.device):
        device = spec
    else:
        word = spec.strip().lower()
        if word == "gpu" or word.startswith("gpu:"):
            word = "cuda" + word[3:]
        try:
            device = torch.device(word)
        except RuntimeError:  # torch's own message lists 20 backends; ours says what we take
            raise DeviceError(
                f"unknown {what} {spec!r}; use a GPU index, 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"
            ) from None
    if types is not None and device.type not in types:
        verdict = "is not a CUDA device" if tuple(types) == CUDA_ONLY else "is not supported here"
        raise DeviceError(f"{what} {_shown(spec)} {verdict}; use {_use(types)}")
    if device.type == "cuda":
        if device.index is None and cuda_index is not None:
            device = torch.device("cuda", cuda_index)
        if exists and device.index is not None:
            count = cuda_count()
            if device.index >= count:
                raise DeviceError(_missing(what, spec, count))
    return device


def split_device_ids(
    ids: Sequence[DeviceSpec],
    *,
    types: Collection[str] | None = CUDA_ONLY,
    exists: bool = True,
    what: str = "device_ids",
) -> tuple[list[torch.device] | None, list[str]]:
    """The usable devices among ``ids`` and one sentence per problem; never raises.

    Each id is parsed as :func:`parse_device` does (same arguments, same
    messages); an id that repeats a device other than the CPU is a problem
    too. Where ``ids`` is not a non-empty list, the devices are ``None`` and
    the one problem says so.

    Example:
        >>> split_device_ids(["cpu", 0, 0], types=("cpu", "cuda"), exists=False)[1]
        ["device_ids lists cuda:0 twice: ['cpu', 0, 0]; give each GPU once"]
    """
    if isinstance(ids, (str, int, torch.device)) or not isinstance(ids, Sequence) or len(ids) == 0:
        return None, [f"{what} must be a non-empty list such as [0, 1], or None for every GPU; got {ids!r}"]
    devices: list[torch.device] = []
    problems: list[str] = []
    for spec in ids:
        try:
            device = parse_device(spec, types=types, exists=exists)
        except DeviceError as exc:
            problems.append(str(exc))
            continue
        if device.type != "cpu" and device in devices:  # CPU workers may repeat; a GPU serves one
            problems.append(f"{what} lists {device} twice: {list(ids)!r}; give each GPU once")
            continue
        devices.append(device)
    return devices, problems


def parse_device_ids(
    ids: Sequence[DeviceSpec],
    *,
    types: Collection[str] | None = CUDA_ONLY,
    exists: bool = True,
    what: str = "device_ids",
) -> list[torch.device]:
    """A list of device ids, parsed and checked; raises on the first problem.

    Lightning Fabric's ``_parse_gpu_ids`` is the model: normalise, type-check,
    check against what exists, check uniqueness, one exception type.

    Args:
        ids: A non-empty list of ids (see :func:`parse_device`).
        types: Device types accepted; GPUs only by default.
        exists: Check each CUDA index against this machine.
        what: The argument's name, for the messages about the list itself.

    Returns:
        One ``torch.device`` per id, in order.

    Raises:
        DeviceError: ``ids`` is not a non-empty list, an id is not a device
            accepted here or does not exist, or a GPU is listed twice.

    Example:
        >>> parse_device_ids(["cpu", "cpu"], types=("cpu", "cuda"))
        [device(type='cpu'), device(type='cpu')]
        >>> parse_device_ids([0, "cuda:0"], exists=False)
        Traceback (most recent call last):
        ...
        nn_handler.errors.DeviceError: device_ids lists cuda:0 twice: [0, 'cuda:0']; give each GPU once
    """
    devices, problems = split_device_ids(ids, types=types, exists=exists, what=what)
    if problems:
        raise DeviceError(problems[0])
    return devices


def device_problems(
    ids: Sequence[DeviceSpec],
    *,
    types: Collection[str] | None = CUDA_ONLY,
    exists: bool = True,
    what: str = "device_ids",
) -> list[str]:
    """One sentence per problem with ``ids`` (the messages :func:`parse_device_ids` raises); ``[]`` if none.

    For the ``validate_*`` helpers, which report instead of raising.

    Example:
        >>> device_problems(["cuda:0", "tpu"], exists=False)
        ["unknown device 'tpu'; use a GPU index, 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"]
    """
    return split_device_ids(ids, types=types, exists=exists, what=what)[1]
