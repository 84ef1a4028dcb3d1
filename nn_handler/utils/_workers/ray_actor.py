"""The Ray side of the Ray backend: the session, the device kinds, and the actor that runs on each device.

Ray is imported only inside these functions, and only when an executor asks
for ``backend="ray"``; ``import nn_handler`` never imports it.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import traceback
import warnings

from ..._checks import invalid
from ..._tree import detach_cpu
from ...errors import DeviceError, MissingExtraError, RankFailure
from . import transport as _transport
from . import worker as _worker
from .task_errors import failure_record

__all__ = ["DeviceActor", "import_ray", "place", "ray_devices", "Session", "with_place"]

_INSTALL = "pip install 'nn_handler[ray]'"


def import_ray():
    """The ``ray`` module, or :class:`~nn_handler.MissingExtraError` naming the extra that brings it."""
    try:
        import ray
    except ImportError as exc:
        raise MissingExtraError(f"backend='ray' needs Ray, which is not installed: {_INSTALL}") from exc
    return ray


def ray_devices(num_gpus: int | None, device_ids) -> list[str] | None:
    """One device kind (``"cuda"`` or ``"cpu"``) per actor, or ``None``: every GPU of the cluster.

    Ray decides which GPU of which node an actor gets, so a GPU is named by
    its kind, not its index.
    """
    if device_ids is None:
        return None if num_gpus is None else ["cuda"] * num_gpus
    if isinstance(device_ids, (str, int)) or not hasattr(device_ids, "__len__") or not len(device_ids):
        raise invalid("device_ids", "a non-empty list of 'cpu' or 'cuda' with backend='ray'", device_ids)
    kinds = []
    for d in device_ids:
        kind = str(d)
        if kind not in ("cpu", "cuda"):
            raise invalid("device_ids", "a list of 'cpu' or 'cuda' with backend='ray'", list(device_ids),
                          hint="Ray picks the GPU of each actor: ask for GPUs with num_gpus=N or 'cuda' entries")
        kinds.append(kind)
    if num_gpus is not None and num_gpus != len(kinds):
        raise ValueError(f"num_gpus={num_gpus} disagrees with {len(kinds)} device_ids; give one of them")
    return kinds


# ----------------------------------------------------------------------------- the Ray session
class Session:
    """The Ray this process uses: joined as it is, or started (or connected) here and ended with its last pool."""

    lock = threading.Lock()
    users = 0
    ours = False  # this module called ray.init, so it calls ray.shutdown

    @classmethod
    def enter(cls, address: str | None) -> None:
        ray = import_ray()
        with cls.lock:
            if not ray.is_initialized():
                kwargs = {}
                if address is None and not os.environ.get("RAY_ADDRESS"):
                    # A new local Ray: its workers find the modules this process finds, as the
                    # local pool's do (a function defined in a module next to the script).
                    path = os.pathsep.join(p for p in sys.path if p)
                    kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
                ray.init(address=address, **kwargs)
                cls.ours = True
            cls.users += 1

    @classmethod
    def leave(cls) -> None:
        ray = import_ray()
        with cls.lock:
            cls.users -= 1
            if cls.users == 0 and cls.ours:
                cls.ours = False
                # A local Ray ends; a cluster we connected to is only disconnected from.
                ray.shutdown()


def cluster_gpus() -> int:
    return int(import_ray().cluster_resources().get("GPU", 0))


def place(devices: list[str] | None) -> list[str]:
    """The device kind of each actor, checked against the cluster (``None``: one per GPU, else one CPU actor)."""
    gpus = cluster_gpus()
    if devices is None:
        devices = ["cuda"] * gpus if gpus else None
    wanted = 0 if devices is None else devices.count("cuda")
    if devices is None or (gpus == 0 and wanted):
        n = 1 if devices is None else len(devices)
        warnings.warn(f"the Ray cluster has no GPUs: running {n} worker{'s' if n != 1 else ''} on the CPU "
                      f"instead (pass device_ids=['cpu', ...] to ask for CPU workers without this warning)",
                      RuntimeWarning, stacklevel=5)
        return ["cpu"] * n
    if wanted > gpus:
        raise DeviceError(f"asked for {wanted} GPU workers but the Ray cluster has {gpus} GPU"
                          f"{'s' if gpus != 1 else ''}")
    cpus = int(import_ray().cluster_resources().get("CPU", 0))
    if devices.count("cpu") > cpus:
        raise DeviceError(f"asked for {devices.count('cpu')} CPU workers (one CPU each) but the Ray cluster "
                          f"has {cpus} CPU{'s' if cpus != 1 else ''}")
    return devices


# ----------------------------------------------------------------------------- the actor
class DeviceActor:
    """One worker of a Ray pool, in its own process somewhere in the cluster: one device, its calls."""

    def __init__(self, index: int, kind: str, pass_device: bool, init_blob: bytes | None, seed: int | None = None):
        import ray
        import torch

        _worker._index = index
        if seed is not None and _restarted(ray):
            # An actor that Ray restarted draws anew, from fresh seeds: its first life's numbers are not repeated.
            seed = int.from_bytes(os.urandom(8), "little")
        self.seed = seed  # applied once the initializer's module is imported (see _initialize)
        self.index, self.pass_device = index, pass_device
        if kind == "cuda" and not torch.cuda.is_available():
            # Ray gave this actor a GPU that torch cannot see (a cluster that declares GPUs it lacks).
            warnings.warn(f"actor {index} was given GPU {os.environ.get('CUDA_VISIBLE_DEVICES')!r} by Ray, but "
                          f"CUDA is not available to torch here: running on the CPU", RuntimeWarning)
            kind = "cpu"
        # Ray sets CUDA_VISIBLE_DEVICES per actor: its GPU is the first one it sees.
        self.device = torch.device("cuda:0" if kind == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.where = (os.getpid(), ray.get_runtime_context().get_node_id(), socket.gethostname())
        self.functions = _transport.FunctionCache()
        # The initializer runs in the first task (ready), not here: an actor
        # that dies while it is built is rebuilt by Ray, again and again if
        # the initializer is what kills it, while a task that dies fails.
        self.init_blob, self.init_failure = init_blob, None

    def _initialize(self) -> None:
        """Seed this actor's random streams and run the initializer, once per process."""
        init_blob, self.init_blob = self.init_blob, None
        seed, self.seed = self.seed, None
        try:
            initializer = _transport.loads(init_blob) if init_blob is not None else None
            if seed is not None:
                # As a local worker's (see worker.seed_streams): from the pool's seed and the actor's place, after
                # the initializer's imports (a module that seeds at its top level would seed every actor alike).
                _worker.seed_streams(seed, self.index)
            if initializer is not None:
                self._call(initializer[0], initializer[1], {})
        except BaseException as exc:  # reported by every call, as the local pool's start-up does
            self.init_failure = self._failure(exc)

    def _call(self, fn_and_position, args, kwargs):
        return _worker.call_with_device(fn_and_position, args, kwargs, self.device, self.pass_device)

    def _failure(self, exc: BaseException):
        record, blob = failure_record(self.index, str(self.device), exc, traceback.format_exc())
        return with_place(record, self.where), blob

    def ready(self):
        """``(failure or None, where)`` once the initializer has run (it runs now if it has not)."""
        self._initialize()
        return self.init_failure, self.where

    def call_packed(self, message: bytes):
        """:meth:`call` with its three arguments pickled into one (a small task: cheaper for Ray to send)."""
        return self.call(*pickle.loads(message))

    def call(self, fn_message: tuple, kind: str, payload: bytes):
        """Run one task: ``("ok", result, where)``, ``("err", (record, exception bytes), where)``, or
        ``("miss", None, where)``: the function came by its digest and this process does not hold it.

        ``payload`` is the pickled ``(args, kwargs)`` of a ``run``, or a chunk of items of a ``map``.
        """
        self._initialize()  # a restarted actor that got a task before its ready
        if self.init_failure is not None:
            return "err", self.init_failure, self.where
        if fn_message[1] is None and self.functions.get(fn_message[0]) is None:
            return "miss", None, self.where  # restarted by Ray behind the pool's back: it sends the body
        try:
            fn = _transport.load_function(fn_message, self.functions)
            payload = _transport.loads(payload)
            if kind == "run":
                args, kwargs = payload
                result = self._call(fn, args, kwargs)
            else:
                result = [self._call(fn, (item,), {}) for item in payload]
            return "ok", detach_cpu(result), self.where  # as the local pool: detached, on the CPU
        except BaseException as exc:  # SystemExit too: the actor stays, as a replaced local worker would
            return "err", self._failure(exc), self.where


def _restarted(ray) -> bool:
    """Whether Ray restarted this actor (its constructor runs again)."""
    with warnings.catch_warnings():
        # Ray's own property reads the deprecated `actor_id` (a RayDeprecationWarning at every actor start).
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def with_place(record: RankFailure, where) -> RankFailure:
    pid, node, host = where
    return RankFailure(rank=record.rank, device=record.device, pid=pid, exc_type=record.exc_type,
                       message=record.message, traceback=record.traceback, exitcode=record.exitcode,
                       node=node, host=host)
