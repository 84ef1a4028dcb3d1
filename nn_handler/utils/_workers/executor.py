"""ParallelExecutor: validation of its arguments over the process engine in :mod:`.pool`."""

from __future__ import annotations

import errno
import inspect
import os
import warnings
import weakref
from typing import Any, Callable, Iterable, ParamSpec, Sequence, TypeVar

import cloudpickle

from ..._checks import check_int, check_number
from ...errors import DeviceError
from .._devices import cuda_count, parse_device_ids
from .pool import ExecutorTimeoutError, PayloadPicklingError, WorkerPool
from .transport import Encoder, PackedFunction
from .worker import worker_state

__all__ = ["ParallelExecutor", "ExecutorTimeoutError", "worker_state"]

P = ParamSpec("P")
R = TypeVar("R")


# ----------------------------------------------------------------------------- validation
def _warn_no_cuda(n: int) -> None:
    warnings.warn(
        f"CUDA is not available: running {n} worker{'s' if n != 1 else ''} on the CPU instead "
        f"(pass device_ids=['cpu', ...] to ask for CPU workers without this warning)",
        RuntimeWarning,
        stacklevel=4,
    )


def _worker_devices(num_gpus: int | None, device_ids: Sequence[int | str] | None) -> list[str]:
    """One device string per worker, validated; raises before anything starts."""
    check_int("num_gpus", num_gpus, minimum=1, allow_none=True)
    count = cuda_count()
    if device_ids is None:
        if count == 0:
            _warn_no_cuda(num_gpus or 1)
            return ["cpu"] * (num_gpus or 1)
        if num_gpus is not None and num_gpus > count:
            raise DeviceError(f"num_gpus={num_gpus} but this machine has {count} CUDA device{'s' if count != 1 else ''}")
        return [f"cuda:{i}" for i in range(num_gpus or count)]

    # CPU workers are allowed; GPUs are checked against this machine unless there are
    # none, in which case the workers fall back to the CPU (below) instead of failing.
    devices = parse_device_ids(device_ids, types=("cpu", "cuda"), exists=count > 0)
    if num_gpus is not None and num_gpus != len(devices):
        raise ValueError(f"num_gpus={num_gpus} disagrees with {len(devices)} device_ids; give one of them")
    if count == 0 and any(d.type == "cuda" for d in devices):
        _warn_no_cuda(len(devices))
        return ["cpu"] * len(devices)
    return [str(d) for d in devices]


def _check_timeout(timeout: float | None) -> float | None:
    return check_number("timeout", timeout, unit="seconds", allow_none=True)


def _device_position(func, pass_device: bool) -> int | None:
    """Where ``device`` goes in a call of ``func``: a positional index, or ``None`` for a keyword.

    The seed's style ``def f(device, data)`` called as ``f(data)`` needs the
    device in the first positional slot; ``def f(data, *, device)`` takes it
    by keyword.
    """
    if not pass_device:
        return None
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None  # builtins without a signature: try the keyword
    for i, p in enumerate(params):
        if p.name == "device":
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return i if positional else None
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        raise TypeError(
            f"{_name(func)} takes no `device` argument but pass_device=True; "
            f"add a `device` parameter or pass pass_device=False"
        )
    return None


def _pickle_call(func, pass_device: bool, encoder: Encoder | None = None) -> PackedFunction:
    """Pickle the function (with where its device argument goes), or say why it cannot be.

    Large tensors it holds (closure, defaults) go to shared-memory files of
    ``encoder`` as arguments do; the caller releases them after the call.
    Without an encoder they stay in the bytes (for checks: nothing to release).
    """
    if not callable(func):
        raise TypeError(f"expected a callable to run, got {type(func).__name__}: {func!r}")
    position = _device_position(func, pass_device)
    try:
        return (encoder or Encoder(None, private=True)).pack_function((func, position))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise  # no room in shared memory nor in the temp dir: not a pickling problem
        raise TypeError(f"function {_name(func)} cannot be pickled to send to the workers: {exc}") from exc
    except Exception as exc:
        raise TypeError(f"function {_name(func)} cannot be pickled to send to the workers: {exc}") from exc


def _check_picklable(args: tuple, kwargs: dict, func) -> None:
    # Only called after pickling the whole payload failed: find the culprit.
    pieces = [(f"positional argument {i}", a) for i, a in enumerate(args)]
    pieces += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in pieces:
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"{label} of {_name(func)} ({type(value).__name__}) cannot be pickled to send to the workers: {exc}"
            ) from exc


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _threads_per_worker(n: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // n)


# ----------------------------------------------------------------------------- executor
class ParallelExecutor:
    """A warm pool with one spawned worker process per device.

    Workers start on ``__enter__`` (or first use) and serve every call until
    :meth:`shutdown`. Functions and arguments travel with cloudpickle, so
    lambdas, closures and notebook functions work; tensors in results come
    back detached and on the CPU, large ones through shared memory. A failed
    call raises :class:`~nn_handler.ParallelExecutionError` and the pool stays
    usable; a dead worker raises :class:`~nn_handler.WorkerDiedError` at once
    and is restarted on the next call.

    Args:
        num_gpus: Number of GPUs (workers); all GPUs by default. Without CUDA,
            that many CPU workers (1 by default) with a ``RuntimeWarning``.
        pass_device: Call functions with ``device=torch.device(...)``.
        device_ids: Devices to use, e.g. ``[0, 2]`` or ``["cpu", "cpu"]``.
        timeout: Seconds per call; a call past it raises ``TimeoutError`` and
            its stuck workers are replaced.
        initializer: Run once in each worker at start (``initializer(*initargs,
            device=...)`` when ``pass_device``), e.g. to load a model per GPU.
        initargs: Arguments for ``initializer``.

    Example:
        >>> def double(x, device):
        ...     return x.to(device) * 2
        >>> with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:   # doctest: +SKIP
        ...     ex.run(double, torch.tensor([1, 2]))
        [tensor([2, 4]), tensor([2, 4])]
    """

    def __init__(self, num_gpus: int | None = None, pass_device: bool = True, *,
                 device_ids: Sequence[int | str] | None = None, timeout: float | None = None,
                 initializer: Callable[..., Any] | None = None, initargs: tuple = ()):
        self.devices = _worker_devices(num_gpus, device_ids)
        self.timeout = _check_timeout(timeout)
        self.pass_device = bool(pass_device)
        init_blob = None
        if initializer is not None:
            if not callable(initializer):
                raise TypeError(f"initializer must be callable, got {type(initializer).__name__}")
            position = _device_position(initializer, self.pass_device)
            try:
                init_blob = cloudpickle.dumps(((initializer, position), tuple(initargs)))
            except Exception:
                _pickle_call(initializer, self.pass_device)
                _check_picklable(tuple(initargs), {}, initializer)
                raise
        self._pool = WorkerPool(self.devices, pass_device=self.pass_device, init_blob=init_blob,
                                threads=_threads_per_worker(len(self.devices)), start_timeout=self.timeout)
        # Workers end with the executor even if it is dropped without shutdown(),
        # and at interpreter exit without waiting for a daemon thread's call.
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False)

    @property
    def num_workers(self) -> int:
        """How many workers (devices) this executor has."""
        return len(self.devices)

    def __enter__(self) -> "ParallelExecutor":
        self._pool.start()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is KeyboardInterrupt:
            self._pool.terminate()
        self.shutdown()

    def start(self) -> "ParallelExecutor":
        """Start the workers now rather than on first use."""
        self._pool.start()
        return self

    def shutdown(self) -> None:
        """Stop every worker; calling it again is harmless."""
        self._pool.shutdown()

    def run(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]:
        """Call ``func(*args, **kwargs)`` on every worker.

        Returns:
            One result per worker, in device order.

        Raises:
            ParallelExecutionError: ``func`` raised on a worker (every failure
                and remote traceback is in the message and ``.failures``).
            WorkerDiedError: A worker died during the call.
            TimeoutError: The call ran past ``timeout``.
            TypeError: ``func`` or an argument cannot be pickled.
        """
        return self._run(func, args, kwargs)

    def _run(self, func, args: tuple, kwargs: dict, *, fail_fast: bool = False, name: str | None = None) -> list:
        self._pool.check_owner()
        fn_blob = _pickle_call(func, self.pass_device, self._pool.functions)
        try:
            return self._pool.run(fn_blob, args, kwargs, self.timeout, name or _name(func), fail_fast)
        except PayloadPicklingError:
            _check_picklable(args, kwargs, func)
            raise
        finally:
            fn_blob.release()

    def map(self, func: Callable[..., R], iterable: Iterable[Any], *, chunksize: int = 1) -> list[R]:
        """Call ``func(item)`` for every item, spread over the workers as they become free.

        Args:
            func: Called as ``func(item, device=...)`` (``device`` when ``pass_device``).
            iterable: The items.
            chunksize: Items sent to a worker in one message; larger chunks
                cost less per item for small work.

        Returns:
            The results, in input order.
        """
        check_int("chunksize", chunksize, minimum=1)
        self._pool.check_owner()
        items = list(iterable)
        chunks = [items[i:i + chunksize] for i in range(0, len(items), chunksize)]
        fn_blob = _pickle_call(func, self.pass_device, self._pool.functions)
        try:
            return self._pool.map(fn_blob, chunks, self.timeout, _name(func))
        except PayloadPicklingError:
            for i, item in enumerate(items):
                try:
                    cloudpickle.dumps(item)
                except Exception as exc:
                    raise TypeError(
                        f"item {i} ({type(item).__name__}) cannot be pickled to send to the workers: {exc}"
                    ) from exc
            raise
        finally:
            fn_blob.release()
