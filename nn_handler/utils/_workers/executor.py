"""ParallelExecutor: validation of its arguments over the process engine in :mod:`.pool`."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import inspect
import os
import threading
import time
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Concatenate, Iterable, Iterator, ParamSpec, Sequence, TypeVar, overload

import cloudpickle

from ..._checks import check_bool, check_choice, check_int, check_number, invalid
from ...errors import ConfigurationError, DeviceError
from .._devices import cuda_count, parse_device_ids
from . import pickler
from .function_memo import FunctionMemo
from .pool import START_TIMEOUT, ExecutorTimeoutError, PayloadPicklingError, WorkerPool
from .map_chunks import _MapChunks, _Progress, _check_map_timeout, _length, _results
from .sweep import Settled, check_device_given, cpu_pool, function_name, required_device
from .transport import Encoder, PackedFunction
from .worker import worker_state

if TYPE_CHECKING:
    import torch

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


def _check_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    return check_number(name, timeout, unit="seconds", allow_none=True)


_positions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # code object -> device position
_UNSEEN = object()  # a code object not yet in _positions (None is a position: by keyword)
_packed = FunctionMemo()  # functions whose pickle cannot have changed since they were last sent


def _device_position(func, pass_device: bool) -> int | None:
    """Where ``device`` goes in a call of ``func`` (see :func:`_find_device_position`), cached per code object:
    inspecting a signature costs more than the rest of a warm call."""
    if not pass_device:
        return None
    code = getattr(func, "__code__", None)
    plain = isinstance(func, types.FunctionType) and not hasattr(func, "__signature__") \
        and not hasattr(func, "__wrapped__")
    if not plain or code is None:
        return _find_device_position(func, pass_device)
    position = _positions.get(code, _UNSEEN)
    if position is _UNSEEN:  # (not in an ``except KeyError``: a TypeError for a bad signature would chain to it)
        position = _positions[code] = _find_device_position(func, pass_device)
    return position


def _find_device_position(func, pass_device: bool) -> int | None:
    """Where ``device`` goes in a call of ``func``: a positional index, or ``None`` for a keyword.

    The seed's style ``def f(device, data)`` called as ``f(data)`` needs the
    device in the first positional slot; ``def f(data, *, device)`` takes it
    by keyword.
    """
    if not pass_device:
        return None
    try:
        # What the callable itself takes: a wrapper (functools.wraps) may supply or consume `device` itself.
        params = list(inspect.signature(func, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return None  # builtins without a signature: try the keyword
    for i, p in enumerate(params):
        if p.name == "device":
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return i if positional else None
    if any(p.kind == p.VAR_POSITIONAL for p in params) and hasattr(func, "__wrapped__"):
        # A wrapper taking (*args, **kwargs) passes them on: the device goes where the wrapped function takes it
        # positionally (def f(device, data) called as f(data): first), else by keyword.
        position = _wrapped_device_position(func)
        if position is not None:
            return position
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        raise TypeError(
            f"{_name(func)} takes no `device` argument but pass_device=True; "
            f"add a `device` parameter or pass pass_device=False"
        )
    return None


def _wrapped_device_position(func) -> int | None:
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "device" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return i
    return None


def _pickle_call(func, pass_device: bool, encoder: Encoder | None = None, positional: int = 0,
                 keywords=()) -> PackedFunction:
    """Pickle the function (with where its device argument goes), or say why it cannot be.

    Large tensors it holds (closure, defaults) go to shared-memory files of
    ``encoder`` as arguments do; the caller releases them after the call.
    Without an encoder they stay in the bytes (for checks: nothing to release).
    ``positional``, ``keywords``: how it will be called, to tell a function that needs a ``device`` it will
    not get (``pass_device=False``) so at once (see :func:`.sweep.check_device_given`).
    """
    if not callable(func):
        raise TypeError(f"expected a callable to run, got {type(func).__name__}: {func!r}")
    if encoder is None:
        return _pack(func, _device_position(func, pass_device), _name(func), None)
    # Kept per pass_device: the position follows from the function's code and
    # attributes, which the memo checks are the same objects as when it was packed.
    packed = _packed.get(func, pass_device)
    if packed is None:
        needs = None if pass_device else required_device(func, every_callable=False)
        if needs is not None:
            check_device_given(func, needs, positional, keywords)
        packed = _pack(func, _device_position(func, pass_device), _name(func), encoder)
        # (Not kept: one holding a large tensor, and one that needs its device given, checked at each call.)
        if not packed.files and needs is None and _packed.unchanging(func):
            packed = dataclasses.replace(packed, unchanging=True)  # workers may copy the one they loaded before
            _packed.put(func, pass_device, packed)
    return packed


def _pack(func, position: int | None, name: str, encoder: Encoder | None) -> PackedFunction:
    try:
        return (encoder or Encoder(None, private=True)).pack_function((func, position))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise  # no room in shared memory nor in the temp dir: not a pickling problem
        raise TypeError(f"function {name} cannot be pickled to send to the workers: {exc}") from exc
    except Exception as exc:
        raise TypeError(f"function {name} cannot be pickled to send to the workers: {exc}") from exc


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


class _Star:
    """``map`` over several iterables: the worker calls it with one tuple of items and the device."""

    def __init__(self, func, position: int | None, pass_device: bool):
        self.func, self.position, self.pass_device = func, position, pass_device
        self.__name__ = function_name(func)  # what the worker's messages call it

    def __call__(self, items, device=None):
        if not self.pass_device:
            return self.func(*items)
        if self.position is not None:
            return self.func(*items[:self.position], device, *items[self.position:])
        return self.func(*items, device=device)


def _pickle_star(func, pass_device: bool, encoder: Encoder | None = None) -> PackedFunction:
    """As :func:`_pickle_call`, for ``map`` over several iterables: the worker calls ``func(*items)``."""
    if not callable(func):
        raise TypeError(f"expected a callable to run, got {type(func).__name__}: {func!r}")
    star = _Star(func, _device_position(func, pass_device), pass_device)
    return _pack(star, None, _name(func), encoder)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _threads_per_worker(n: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // n)


# ----------------------------------------------------------------------------- executor
class ParallelExecutor(concurrent.futures.Executor):
    """A warm pool with one worker process per device, and a :class:`concurrent.futures.Executor`.

    Workers start on ``__enter__`` (or first use) and serve every call until
    :meth:`shutdown`. :meth:`submit` and :meth:`map` give tasks to whichever
    worker is free, so ``concurrent.futures.wait``, ``as_completed`` and
    ``asyncio`` (``loop.run_in_executor``) work as with any executor;
    :meth:`run` runs a function once on every worker. Calls from several
    threads share the workers. Functions and arguments travel with
    cloudpickle, so lambdas, closures and notebook functions work; tensors in
    results come back detached and on the CPU, large ones through shared
    memory. A task's exception comes back as an instance of its own type and
    of :class:`~nn_handler.ParallelExecutionError`, with the worker's
    traceback as its ``__cause__``; the pool stays usable. A dead worker fails
    its task with :class:`~nn_handler.WorkerDiedError` and is replaced.

    Args:
        num_gpus: Number of GPUs (workers); all GPUs by default. Without CUDA,
            that many CPU workers (1 by default) with a ``RuntimeWarning``.
        pass_device: Call functions with ``device=torch.device(...)``; by
            default yes, but not with ``max_workers`` alone.
        max_workers: That many CPU workers, functions called without a
            device: ``ProcessPoolExecutor(max_workers=N)``'s pool. With
            ``num_gpus``, or ``device_ids`` of another length: a
            :class:`~nn_handler.ConfigurationError`.
        device_ids: Devices to use, e.g. ``[0, 2]`` or ``["cpu", "cpu"]``.
        timeout: Seconds per task from when its function starts (loading it,
            e.g. its module's first import, gets as long again); a task past
            it raises ``TimeoutError`` and its stuck worker is replaced. A
            worker's start-up (initializer included) has a bound of its own:
            ``start_timeout``.
        start_timeout: Seconds a worker (a Ray actor) may take to start: its
            process, the import of your main script, the initializer (loading
            a large model); past it the start raises
            :class:`~nn_handler.ExecutorTimeoutError`. 300 by default; ``None``:
            no bound.
        initializer: Run once in each worker at start (``initializer(*initargs,
            device=...)`` when ``pass_device``), e.g. to load a model per GPU.
        initargs: Arguments for ``initializer``.
        max_tasks_per_worker: Replace a worker after this many tasks (its
            initializer runs again in the new one); ``None``: never.
        worker_memory_limit: Replace a worker whose memory after a task is
            above this many bytes (on the CPU its private pages, not those it shares with its server, and
            the argument files it still maps, whole, less its result files; ``torch.cuda.memory_reserved`` on a
            GPU); ``None``: never.
            Each replacement is logged (INFO).
        backend: ``"local"``: worker processes on this machine. ``"ray"``:
            one Ray actor per device anywhere in a Ray cluster (``num_gpus=1``
            each for GPUs, ``num_cpus=1`` for ``"cpu"`` workers; Ray picks the
            GPU, so ``device_ids`` lists ``"cuda"`` or ``"cpu"``, and all the
            cluster's GPUs by default). Needs ``pip install 'nn_handler[ray]'``.
        address: With ``backend="ray"``, the cluster as ``ray.init`` takes
            it (``"auto"``, ``"ray://host:10001"``); ``None``: the Ray this
            process already uses, else a new local one. A Ray the executor
            started or connected to ends (or is let go) with it; a cluster is
            left running, only its actors end.

    Example:
        >>> def double(x, device):
        ...     return x.to(device) * 2
        >>> with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:   # doctest: +SKIP
        ...     ex.run(double, torch.tensor([1, 2]))
        ...     ex.submit(double, torch.tensor([3])).result()
        ...     list(ex.map(double, [torch.tensor([4]), torch.tensor([5])]))
        [tensor([2, 4]), tensor([2, 4])]
        tensor([6])
        [tensor([8]), tensor([10])]
    """

    def __init__(self, num_gpus: int | None = None, pass_device: bool | None = None, *,
                 max_workers: int | None = None, device_ids: Sequence[int | str] | None = None,
                 timeout: float | None = None, start_timeout: float | None = START_TIMEOUT,
                 initializer: Callable[..., Any] | None = None, initargs: tuple = (),
                 max_tasks_per_worker: int | None = None, worker_memory_limit: int | None = None,
                 backend: str = "local", address: str | None = None):
        check_choice("backend", backend, ("local", "ray"))
        device_ids, pass_device = cpu_pool(max_workers, num_gpus, device_ids, pass_device)
        if backend == "local":
            if address is not None:
                raise invalid("address", "None with backend='local'", address,
                              hint="pass backend='ray' to run on a Ray cluster")
            self.devices = _worker_devices(num_gpus, device_ids)
        else:
            from .ray_actor import import_ray, ray_devices

            check_int("num_gpus", num_gpus, minimum=1, allow_none=True)
            if max_tasks_per_worker is not None or worker_memory_limit is not None:
                raise ConfigurationError("max_tasks_per_worker and worker_memory_limit work with backend='local' "
                                         "only; with backend='ray' leave them None")
            if address is not None and not isinstance(address, str):
                raise invalid("address", "None or a Ray address such as 'auto' or 'ray://host:10001'", address)
            ray_kinds = ray_devices(num_gpus, device_ids)
            import_ray()  # before anything else: without Ray, say which extra brings it
        self.backend = backend
        self.timeout = _check_timeout(timeout)
        start_timeout = _check_timeout(start_timeout, "start_timeout")
        self.pass_device = bool(pass_device)
        check_int("max_tasks_per_worker", max_tasks_per_worker, minimum=1, allow_none=True)
        check_int("worker_memory_limit", worker_memory_limit, minimum=1, allow_none=True)
        init_blob = None
        if initializer is not None:
            if not callable(initializer):
                raise TypeError(f"initializer must be callable, got {type(initializer).__name__}")
            position = _device_position(initializer, self.pass_device)
            if not self.pass_device:
                check_device_given(initializer, required_device(initializer), len(initargs))
            try:
                init_blob = pickler.dumps(((initializer, position), tuple(initargs)))
            except Exception:
                _pickle_call(initializer, self.pass_device)
                _check_picklable(tuple(initargs), {}, initializer)
                raise
        if backend == "ray":
            from .ray_pool import RayPool

            self._pool = RayPool(ray_kinds, pass_device=self.pass_device, init_blob=init_blob, address=address,
                                 start_timeout=start_timeout)
            self.devices = self._pool.devices
        else:
            self._pool = WorkerPool(self.devices, pass_device=self.pass_device, init_blob=init_blob,
                                    threads=_threads_per_worker(len(self.devices)), start_limit=start_timeout,
                                    max_tasks=max_tasks_per_worker, memory_limit=worker_memory_limit)
        # Workers end with the executor even if it is dropped without shutdown() (once the tasks submitted
        # are done), and at interpreter exit without waiting for a daemon thread's call. Nothing of ours
        # holds the executor: not its futures, not a map's iterator (but a lazy one's, which submits more).
        self._finalizer = weakref.finalize(self, _executor_dropped, self._pool)

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

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop every worker once the tasks already submitted are done; calling it again is harmless.

        Args:
            wait: Return only once the workers are gone. ``False`` returns at
                once; the tasks already submitted still run (the program does
                not exit before they are done), then the workers end.
            cancel_futures: Cancel the tasks that no worker has started yet.
        """
        if wait:
            self._pool.shutdown(cancel=cancel_futures)
        else:
            self._pool.shutdown_later(cancel=cancel_futures)

    # Types: a function that takes the device first is shown without it (the
    # executor passes it); one that takes it elsewhere (by keyword, or after
    # its data) cannot be written as a ParamSpec, and keeps its result type only.
    @overload
    def run(self, func: Callable[Concatenate[torch.device, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]: ...
    @overload
    def run(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]: ...

    def run(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]:
        """Call ``func(*args, **kwargs)`` once on every worker (after the tasks they are running).

        Returns:
            One result per worker, in device order.

        Raises:
            ParallelExecutionError: ``func`` raised on a worker: the root
                failure's own exception (type, args, attributes), also a
                ``ParallelExecutionError``; every failure is in its last note
                and ``.failures``, the remote traceback its ``__cause__``.
            WorkerDiedError: A worker died during the call.
            TimeoutError: The call ran past ``timeout``.
            TypeError: ``func`` or an argument cannot be pickled.
        """
        return self._run(func, args, kwargs)

    def _run(self, func, args: tuple, kwargs: dict, *, fail_fast: bool = False, name: str | None = None) -> list:
        self._pool.check_owner()
        fn_blob = _pickle_call(func, self.pass_device, self._pool.functions, len(args), kwargs)
        try:
            return self._pool.run(fn_blob, args, kwargs, self.timeout, name or _name(func), fail_fast)
        except PayloadPicklingError:
            _check_picklable(args, kwargs, func)
            raise
        finally:
            fn_blob.release()

    @overload
    def submit(self, fn: Callable[Concatenate[torch.device, P], R], /, *args: P.args,
               **kwargs: P.kwargs) -> concurrent.futures.Future[R]: ...
    @overload
    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[R]: ...

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> "concurrent.futures.Future[R]":
        """Run ``fn(*args, **kwargs)`` once, on whichever worker is free; its future holds the result.

        Example:
            >>> with ParallelExecutor(device_ids=["cpu"], pass_device=False) as ex:   # doctest: +SKIP
            ...     ex.submit(pow, 2, 10).result()
            1024
        """
        self._pool.check_owner()
        fn_blob = _pickle_call(fn, self.pass_device, self._pool.functions, len(args), kwargs)
        try:
            future = self._pool.submit(self._pool.new_fn_id(), fn_blob, "run", [(args, kwargs)], self.timeout,
                                       _name(fn))[0]
        except PayloadPicklingError:
            fn_blob.release()
            _check_picklable(args, kwargs, fn)
            raise
        except BaseException:
            fn_blob.release()
            raise
        # Its large-tensor files, once it is over (the base class's method: this is no one looking at the outcome).
        concurrent.futures.Future.add_done_callback(future, lambda _: fn_blob.release())
        return future

    def map(self, fn: Callable[..., R], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1, buffersize: int | None = None, progress: bool = False,
            return_exceptions: bool = False) -> Iterator[R]:
        """``fn(item)`` for every item (``fn(a, b)`` over several iterables), spread over the free workers.

        As :meth:`concurrent.futures.Executor.map`: every item is submitted
        when ``map`` is called (so a map never iterated, or read after
        ``shutdown``, still runs all of them); the results come in input
        order as they arrive, the first before the last item is done. With
        ``buffersize``, as in Python 3.14, the input is read lazily instead,
        at most that many chunks ahead of the results: a generator of a
        million items is never held at once.

        Args:
            fn: Called as ``fn(item, device=...)`` (``device`` when ``pass_device``).
            iterables: The items.
            timeout: Seconds from this call until every result must be in;
                past it the iterator raises ``TimeoutError``. As in the
                standard: ``0`` (or less) gives the results ready when read.
            chunksize: Items sent to a worker in one message; larger chunks
                cost less per item for small work.
            buffersize: Chunks (items, with ``chunksize=1``) submitted ahead
                of the result being read; ``None``: all of them at once.
            progress: Draw a tqdm bar (items/s, ETA) named after ``fn``, counting
                items as they finish, on a terminal; elsewhere (a log file, a
                pipe) write a line every few seconds. A failed map's last line
                says where and why.
            return_exceptions: Yield an item's exception in its place instead
                of raising it (as ``asyncio.gather``), so a failed item loses
                nothing else, whatever the chunksize (a result that cannot be
                pickled, an item's ``SystemExit``: that item's error); a chunk
                whose worker died or timed out yields that error for each of
                its items.

        Returns:
            An iterator over the results, in input order (``list(...)`` for a list).
        """
        check_int("chunksize", chunksize, minimum=1)
        check_int("buffersize", buffersize, minimum=1, allow_none=True)
        _check_map_timeout(timeout)
        check_bool("progress", progress)
        check_bool("return_exceptions", return_exceptions)
        self._pool.check_owner()
        if not iterables:
            return iter(())  # as zip() of nothing: no item, no call
        if not self.pass_device:  # (once per map: any callable's signature)
            check_device_given(fn, required_device(fn), len(iterables))
        if return_exceptions:  # each item's exception is caught in the worker (see .sweep)
            star = len(iterables) > 1
            settled = Settled(fn, _device_position(fn, self.pass_device), self.pass_device, star)
            fn_blob = _pack(settled, None, _name(fn), self._pool.functions)
            items = zip(*iterables) if star else iter(iterables[0])
        elif len(iterables) == 1:
            fn_blob, items = _pickle_call(fn, self.pass_device, self._pool.functions, 1), iter(iterables[0])
        else:
            fn_blob, items = _pickle_star(fn, self.pass_device, self._pool.functions), zip(*iterables)
        end = None if timeout is None else time.monotonic() + timeout
        total = _length(iterables)
        bar = _Progress(total, function_name(fn), return_exceptions) if progress else None
        chunks = _MapChunks(self._pool, fn_blob, _name(fn), self.timeout, items, chunksize, bar)
        try:
            futures = collections.deque(chunks.submit(buffersize))  # all of them, unless buffered
        except BaseException as exc:
            chunks.close()
            if bar is not None:
                bar.close(f"failed before any item was sent: {type(exc).__name__}")
            raise
        if buffersize is None:
            chunks.close()  # nothing more to send: the function's files go with its last chunk
        # A lazy map submits as it is read, so its iterator keeps the executor; any other holds only its
        # futures: dropped with the executor, it leaves the workers free to end once its tasks are done.
        keep = self if buffersize is not None else None
        return _results(keep, futures, chunks, end, return_exceptions)


def _executor_dropped(pool) -> None:
    """The executor was dropped without ``shutdown()``, or the interpreter exits.

    As ``ProcessPoolExecutor``: no new task, and the workers end once the
    tasks already submitted are done (an unread ``map``'s too: its results
    stay readable). At exit the pool's exit hook has let them finish already
    (but a daemon thread's ``run()``), and what is left is killed.
    """
    if pool.closed:
        return
    if pool._busy() and threading.main_thread().is_alive():  # (the main thread ends before atexit runs us)
        # Garbage collection may run this in any thread: the waiting is done by one of its own.
        threading.Thread(target=pool.shutdown, name="nn_handler-dropped", daemon=True).start()
    else:
        pool.shutdown(wait=False)  # idle: nothing is lost
