"""``parallel_on_all_devices``: a plain function as the forward of ``nn.DataParallel``."""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Callable, ParamSpec, Sequence, TypeVar, Union, overload

import torch
from torch import nn
from torch.nn import DataParallel

from ..._tree import tensors
from ...errors import DeviceError
from .._devices import cuda_count, parse_device_ids

__all__ = ["parallel_on_all_devices"]

P = ParamSpec("P")
R = TypeVar("R")
DeviceId = Union[int, str, torch.device]


class _FunctionModule(nn.Module):
    """An ``nn.Module`` without parameters whose forward is ``fn``; DataParallel replicates it per device."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _Runner:
    """Per decorated function: decides once between DataParallel and the plain function, and builds it once."""

    def __init__(self, fn: Callable, device_ids: Sequence[DeviceId] | None) -> None:
        self.fn = fn
        self.name = getattr(fn, "__qualname__", repr(fn))
        # As given (a copy): checked against this machine on the first call.
        self.requested = None if device_ids is None else list(device_ids)
        self.module: nn.Module | None = None
        self.decided = False
        self.lock = threading.Lock()

    def _decide(self) -> None:
        count = cuda_count()
        if self.requested is None:
            ids = list(range(count))
        else:  # without CUDA nothing is checked: the function runs as is (warned below)
            ids = [d.index for d in parse_device_ids(self.requested, exists=count > 0)]
        if count == 0:
            reason = "CUDA is not available"
        elif len(ids) < 2:
            reason = (f"device_ids {self.requested} name a single GPU" if self.requested is not None
                      else "this machine has only 1 CUDA device")
        else:
            reason = None
        if reason:
            warnings.warn(
                f"parallel_on_all_devices({self.name}): {reason}, so it runs as a plain function on its "
                f"inputs' device (DataParallel needs at least 2 GPUs)",
                RuntimeWarning,
                stacklevel=4,
            )
        else:
            self.module = DataParallel(_FunctionModule(self.fn), device_ids=ids, output_device=ids[0])
        self.decided = True

    def __call__(self, args, kwargs):
        if not self.decided:
            # Once per function: the warning is given once, the module built once.
            with self.lock:
                if not self.decided:
                    self._decide()
        if self.module is None:
            return self.fn(*args, **kwargs)
        self._check_inputs(args, kwargs)
        return self.module(*args, **kwargs)

    def _check_inputs(self, args, kwargs) -> None:
        allowed = {torch.device("cuda", i) for i in self.module.device_ids}
        found = [*(tensors(a, f"argument {i}") for i, a in enumerate(args)),
                 *(tensors(v, f"argument {k!r}") for k, v in kwargs.items())]
        for where, tensor in (pair for gen in found for pair in gen):
            if tensor.device.type != "cpu" and tensor.device not in allowed:
                first = f"cuda:{self.module.device_ids[0]}"
                raise DeviceError(
                    f"parallel_on_all_devices({self.name}): {where} is on {tensor.device}, but DataParallel "
                    f"here scatters from the CPU or from its devices "
                    f"{', '.join(f'cuda:{i}' for i in self.module.device_ids)}; move it with .to({first!r})"
                )


@overload
def parallel_on_all_devices(func: Callable[P, R], *, device_ids: None = None) -> Callable[P, R]: ...


@overload
def parallel_on_all_devices(
    func: None = None, *, device_ids: Sequence[DeviceId] | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def parallel_on_all_devices(func=None, *, device_ids=None):
    """Run a function with ``nn.DataParallel``: split the batch over the GPUs, gather on the first.

    The function becomes the ``forward`` of a small parameter-free
    ``nn.Module`` inside ``nn.DataParallel``, built once per decorated
    function (on its first call). Each call scatters the tensor arguments
    along dimension 0 over the devices, runs the function on each chunk in a
    thread per device, and gathers the returned tensors on the first device.
    With fewer than 2 GPUs the function runs as is, after one
    ``RuntimeWarning`` saying why.

    Suitable for single-node inference-style work; DDP is faster for training.

    Args:
        func: The function, when used bare (``@parallel_on_all_devices``).
        device_ids: GPU indices (or ``"cuda:N"``/``torch.device``) to use;
            every visible GPU by default.

    Returns:
        The wrapped function, or a decorator when called with arguments only.

    Raises:
        DeviceError: ``device_ids`` is not a non-empty list of distinct GPU
            indices (when decorating), names a GPU that does not exist, or an
            input tensor is on a device DataParallel cannot scatter from (when
            called). ``DeviceError`` is a ``ValueError``.

    Example:
        >>> import torch, warnings
        >>> from nn_handler.utils.ddp_decorators import parallel_on_all_devices
        >>> @parallel_on_all_devices
        ... def double(batch):
        ...     return batch * 2
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")   # CPU-only here: runs as is, with a warning
        ...     double(torch.ones(4, 2)).shape
        torch.Size([4, 2])

        On a multi-GPU machine::

            @parallel_on_all_devices(device_ids=[0, 1])
            def embed(batch):
                return encoder(batch)

            out = embed(batch.to("cuda:0"))   # halves on cuda:0 and cuda:1, result on cuda:0
    """
    if func is not None and not callable(func):
        raise TypeError(
            f"parallel_on_all_devices takes the function, or only keyword arguments: "
            f"write @parallel_on_all_devices(device_ids=[0, 1]), got {func!r}"
        )
    if device_ids is not None:
        # The form now; whether the GPUs exist on the first call (the decorator may run before CUDA is set up).
        parse_device_ids(device_ids, exists=False)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        runner = _Runner(fn, device_ids)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return runner(args, kwargs)

        return wrapper

    return decorate(func) if func is not None else decorate
