"""@parallelize_on_gpus: the decorator and its reuse policy (warm pools shared by configuration).

The engine is :class:`~.executor.ParallelExecutor`; this module only decides
when a decorated call gets a warm executor, when a new one starts, and when an
idle one ends (``keep_alive`` seconds after its last call, at interpreter
exit, never in a forked child).
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import warnings
import weakref
from typing import (TYPE_CHECKING, Any, Callable, Concatenate, Iterable, Iterator, Literal, Protocol, Sequence, cast,
                    overload)

from ..._checks import check_choice, check_int, check_number, invalid
from .executor import P, R, ParallelExecutor, _check_timeout, _worker_devices
from .pool import START_TIMEOUT
from .ray_actor import import_ray, ray_devices

if TYPE_CHECKING:
    import torch

__all__ = ["parallelize_on_gpus", "ParallelFunction", "DeviceDecorator"]


class _WarmPools:
    """Warm executors shared by decorated functions, keyed by their configuration.

    Each stays alive while used and shuts down ``keep_alive`` seconds after
    its last call ends, and at interpreter exit. Pools belong to the process
    that started them: a child made with ``os.fork()`` starts its own.
    """

    def __init__(self):
        self._reset()
        self._hooked = False

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[tuple, ParallelExecutor] = {}
        self._timers: dict[tuple, threading.Timer] = {}
        self._users: dict[tuple, int] = {}  # calls in progress per pool: only an idle pool expires

    def get(self, key: tuple, make: Callable[[], ParallelExecutor]) -> ParallelExecutor:
        with self._lock:
            if not self._hooked:
                atexit.register(self.shutdown_all, wait=False)
                # The child inherits the parent's pools but must not use or stop them.
                os.register_at_fork(after_in_child=self._reset)
                self._hooked = True
            timer = self._timers.pop(key, None)
            if timer is not None:
                timer.cancel()
            executor = self._pools.get(key)
            if executor is None or executor._pool.closed:
                executor = self._pools[key] = make()
                self._users[key] = 0
            self._users[key] += 1
            return executor

    def release(self, key: tuple, executor: ParallelExecutor, keep_alive: float) -> None:
        with self._lock:
            if self._pools.get(key) is not executor:
                return
            self._users[key] -= 1
            if self._users[key] > 0:
                return  # another thread is still calling it
            # The timer names the executor by a weak reference: a cancelled timer's thread ends on its own time,
            # and at exit, were it the last to hold the executor, the executor's finalizer would leave the
            # registry that `weakref.finalize`'s exit hook is walking ("dictionary changed size").
            timer = threading.Timer(keep_alive, self._expire, args=(key, weakref.ref(executor)))
            timer.daemon = True  # never keeps the interpreter alive
            self._timers[key] = timer
            timer.start()

    def _expire(self, key: tuple, executor_ref: weakref.ref) -> None:
        with self._lock:
            executor = self._pools.get(key)
            if executor is None or executor is not executor_ref() or key not in self._timers or self._users[key] > 0:
                return
            del self._pools[key], self._timers[key], self._users[key]
        executor.shutdown()

    def close(self, key: tuple) -> None:
        """Shut down the pool of one configuration now (a later call starts a new one)."""
        with self._lock:
            executor = self._pools.pop(key, None)
            self._users.pop(key, None)
            timer = self._timers.pop(key, None)
            if timer is not None:
                timer.cancel()
        if executor is not None:
            executor.shutdown()

    def shutdown_all(self, wait: bool = True) -> None:
        """Shut down every pool; ``wait=False`` (at exit) kills the workers of calls still running."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()
            self._users.clear()
        for executor in pools:
            executor._pool.shutdown(wait=wait)

    def __len__(self) -> int:
        return len(self._pools)


_warm_pools = _WarmPools()


class _Mapping:
    """The results of a decorated function's ``map``; its warm pool counts it as a user until it is read to the
    end, fails, is closed or is dropped (so the pool does not expire under a long sweep)."""

    def __init__(self, results: Iterator, release: Callable[[bool], None]):
        self._results, self._release = results, release
        # Dropped unread: let the pool go without waiting (a finalizer must not block the collector).
        self._finalizer = weakref.finalize(self, release, False)

    def __iter__(self) -> "_Mapping":
        return self

    def __next__(self):
        try:
            return next(self._results)
        except BaseException:  # StopIteration included: the map is over
            self.close()
            raise

    def close(self) -> None:
        """Stop reading: the items not started are cancelled, the pool is let go."""
        if self._finalizer.detach() is not None:
            self._results.close()
            self._release(True)


class ParallelFunction(Protocol[P, R]):
    """What :func:`parallelize_on_gpus` returns: the function, giving one result per device, ``map`` and
    ``shutdown``."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> list[R]: ...

    def map(self, *iterables: Iterable[Any], chunksize: int = 1, progress: bool = False,
            return_exceptions: bool = False) -> Iterator[R]:
        """One call per item (not per device), spread over the warm workers: see :meth:`ParallelExecutor.map`."""

    def shutdown(self) -> None:
        """End the warm pool now instead of after ``keep_alive`` idle seconds."""


class DeviceDecorator(Protocol):
    """What ``parallelize_on_gpus(...)`` returns with ``pass_device=True``: a decorator that hides the device.

    A function that takes the device first (``def f(device, x: int) -> float``)
    is called without it (``f(3) -> list[float]``). One that takes it elsewhere
    (by keyword, or after its data) cannot be written as a ``ParamSpec``: its
    arguments are not checked, its result type still is.
    """

    @overload
    def __call__(self, func: Callable[Concatenate[torch.device, P], R]) -> ParallelFunction[P, R]: ...
    @overload
    def __call__(self, func: Callable[..., R]) -> ParallelFunction[..., R]: ...


# Used bare (@parallelize_on_gpus): pass_device is True.
@overload
def parallelize_on_gpus(num_gpus: Callable[Concatenate[torch.device, P], R]) -> ParallelFunction[P, R]: ...
@overload
def parallelize_on_gpus(num_gpus: Callable[..., R]) -> ParallelFunction[..., R]: ...
@overload
def parallelize_on_gpus(num_gpus: int | None = None, pass_device: Literal[True] = True, *,
                        device_ids: Sequence[int | str] | None = None, timeout: float | None = None,
                        start_timeout: float | None = START_TIMEOUT, keep_alive: float = 60, backend: str = "local",
                        address: str | None = None) -> DeviceDecorator: ...
@overload
def parallelize_on_gpus(num_gpus: int | None, pass_device: Literal[False], *,
                        device_ids: Sequence[int | str] | None = None, timeout: float | None = None,
                        start_timeout: float | None = START_TIMEOUT, keep_alive: float = 60, backend: str = "local",
                        address: str | None = None) -> Callable[[Callable[P, R]], ParallelFunction[P, R]]: ...
@overload
def parallelize_on_gpus(num_gpus: int | None = None, *, pass_device: Literal[False],
                        device_ids: Sequence[int | str] | None = None, timeout: float | None = None,
                        start_timeout: float | None = START_TIMEOUT, keep_alive: float = 60, backend: str = "local",
                        address: str | None = None) -> Callable[[Callable[P, R]], ParallelFunction[P, R]]: ...
@overload
def parallelize_on_gpus(num_gpus: int | None = None, pass_device: bool = True, *,
                        device_ids: Sequence[int | str] | None = None, timeout: float | None = None,
                        start_timeout: float | None = START_TIMEOUT, keep_alive: float = 60, backend: str = "local",
                        address: str | None = None) -> Callable[[Callable[..., R]], ParallelFunction[..., R]]: ...


def parallelize_on_gpus(num_gpus: Any = None, pass_device: bool = True, *,
                        device_ids: Sequence[int | str] | None = None, timeout: float | None = None,
                        start_timeout: float | None = START_TIMEOUT, keep_alive: float = 60, backend: str = "local",
                        address: str | None = None) -> Any:
    """Run the decorated function on every GPU at once; the call returns one result per GPU.

    Repeated calls reuse one warm pool, shut down after ``keep_alive`` idle
    seconds and at interpreter exit (``keep_alive=0``: a fresh pool per call).
    Without CUDA it runs on CPU workers with a ``RuntimeWarning``.

    Args:
        num_gpus: How many GPUs; all by default.
        pass_device: Pass ``device=torch.device(...)`` to the function.
        device_ids: Which devices, e.g. ``[0, 2]`` or ``["cpu", "cpu"]``.
        timeout: Seconds per call.
        start_timeout: Seconds a worker may take to start (see :class:`~nn_handler.ParallelExecutor`).
        keep_alive: Idle seconds before the warm pool shuts down.
        backend: ``"local"`` (worker processes here) or ``"ray"`` (one Ray
            actor per device; see :class:`~nn_handler.ParallelExecutor`).
        address: The Ray cluster with ``backend="ray"`` (as ``ray.init`` takes it).

    Returns:
        The decorator (used bare: the decorated function). The decorated
        function takes ``func``'s arguments but the device (typed with its
        ``ParamSpec``: see :class:`DeviceDecorator`) and returns a list of its
        results, one per device; its ``map(items, chunksize=, progress=,
        return_exceptions=)`` calls it once per item instead, spread over the
        same warm workers, each with its own device, results in input order
        (as :meth:`ParallelExecutor.map`: a sweep); its ``shutdown()`` ends the
        warm pool now.

    Example:
        >>> @parallelize_on_gpus(device_ids=["cpu", "cpu"])
        ... def process_on_gpu(device, data):
        ...     return data.to(device) * 2
        >>> process_on_gpu(torch.tensor([1, 2, 3]))   # doctest: +SKIP
        [tensor([2, 4, 6]), tensor([2, 4, 6])]
        >>> list(process_on_gpu.map([torch.tensor([1]), torch.tensor([2])]))   # doctest: +SKIP
        [tensor([2]), tensor([4])]
    """
    if callable(num_gpus) and not isinstance(num_gpus, int):
        # Used bare: @parallelize_on_gpus
        return parallelize_on_gpus()(num_gpus)
    check_number("keep_alive", keep_alive, strict=False, unit="seconds")
    check_choice("backend", backend, ("local", "ray"))
    # Validate now so a bad configuration fails at decoration, not at first call.
    if backend == "ray":
        # The cluster is not asked yet (it may not be up at import): its GPUs are counted at first call.
        check_int("num_gpus", num_gpus, minimum=1, allow_none=True)
        kinds = ray_devices(num_gpus, device_ids)
        devices = None if kinds is None else tuple(kinds)
        import_ray()
    else:
        if address is not None:
            raise invalid("address", "None with backend='local'", address,
                          hint="pass backend='ray' to run on a Ray cluster")
        devices = tuple(_worker_devices(num_gpus, device_ids))
    _check_timeout(timeout)
    _check_timeout(start_timeout, "start_timeout")

    def decorate(func: Callable[P, R]) -> ParallelFunction[P, R]:
        if not callable(func):
            raise TypeError(f"parallelize_on_gpus decorates a callable, got {type(func).__name__}")

        def make() -> ParallelExecutor:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # already warned at decoration
                if backend == "ray":
                    return ParallelExecutor(num_gpus, pass_device, device_ids=None if devices is None else
                                            list(devices), timeout=timeout, start_timeout=start_timeout,
                                            backend="ray", address=address)
                return ParallelExecutor(len(devices), pass_device, device_ids=list(devices), timeout=timeout,
                                        start_timeout=start_timeout)

        key = (devices, pass_device, timeout, start_timeout, backend, address)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> list[R]:
            if keep_alive == 0:
                with make() as executor:
                    return executor.run(func, *args, **kwargs)
            executor = _warm_pools.get(key, make)
            try:
                return executor.run(func, *args, **kwargs)
            finally:
                _warm_pools.release(key, executor, keep_alive)

        def map_(*iterables: Iterable[Any], chunksize: int = 1, progress: bool = False,
                 return_exceptions: bool = False) -> Iterator[R]:
            options = dict(chunksize=chunksize, progress=progress, return_exceptions=return_exceptions)
            if keep_alive == 0:
                executor = make().start()
                release = lambda wait: executor.shutdown(wait=wait)  # noqa: E731
            else:
                executor = _warm_pools.get(key, make)
                release = lambda wait: _warm_pools.release(key, executor, keep_alive)  # noqa: E731
            try:
                return _Mapping(executor.map(func, *iterables, **options), release)
            except BaseException:  # a bad option or an item that cannot be pickled: nothing runs
                release(True)
                raise

        wrapper.map = map_  # type: ignore[attr-defined]
        # Ends the warm pool now instead of after keep_alive idle seconds (it is
        # shared with other functions decorated with the same devices).
        wrapper.shutdown = lambda: _warm_pools.close(key)  # type: ignore[attr-defined]
        return cast("ParallelFunction[P, R]", wrapper)

    return decorate
