"""The distributed core: process-group setup, device resolution, rank helpers.

Everything here decides at call time, from the launch environment and the
process group as they are when called; importing this module has no effects.

Example:
    >>> from nn_handler.utils.ddp import initialize_ddp, cleanup_ddp
    >>> distributed, rank, local_rank, world_size, device = initialize_ddp()
    >>> (distributed, rank, world_size, device.type)  # a plain `python` run
    (False, 0, 1, 'cpu')
    >>> cleanup_ddp()
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import shlex
import socket
import sys
import warnings
from datetime import timedelta
from typing import Mapping, Union

import torch
import torch.distributed as dist

from .._checks import invalid
from ..errors import DeviceError, LaunchEnvironmentError
from ._devices import cuda_count, parse_device
from . import _stall
from ._stall import watch_collectives
from ._env import (
    LaunchEnv,
    detect_launch_env,
    missing_rendezvous_message,
    slurm_job_without_srun,
    slurm_job_without_srun_message,
)

__all__ = [
    "initialize_ddp",
    "resolve_device",
    "should_use_distributed",
    "get_rank",
    "get_local_rank",
    "get_world_size",
    "is_distributed",
    "is_main_process",
    "barrier",
    "cleanup_ddp",
    "find_free_port",
    "detect_launch_env",
    "LaunchEnv",
    "watch_collectives",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=60)
DeviceLike = Union[torch.device, str, int]


def _check_timeout(timeout) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = timeout
    elif isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}")
    if not seconds > 0:  # NaN too
        raise invalid("timeout", "a timedelta or a number of seconds > 0", timeout)
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def get_rank(environ: Mapping[str, str] | None = None) -> int:
    """Global rank: from the process group if one exists, else from the launcher's environment, else 0."""
    if is_distributed():
        return dist.get_rank()
    return detect_launch_env(environ).rank


def get_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Number of processes: from the process group if one exists, else from the launcher's environment, else 1."""
    if is_distributed():
        return dist.get_world_size()
    return detect_launch_env(environ).world_size


def get_local_rank(environ: Mapping[str, str] | None = None) -> int:
    """Rank within this node (the GPU index to use), from the launcher's environment; 0 when not launched."""
    return detect_launch_env(environ).local_rank


def is_main_process() -> bool:
    """True on global rank 0 (and in a plain single-process run)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank; does nothing without a process group."""
    if is_distributed():
        with _stall.watching("barrier"):
            dist.barrier()


# Callables that drop references to process groups (e.g. the side group of
# on_rank) before the groups are destroyed; see cleanup_ddp.
_release_hooks: list = []
_atexit_registered = False


def on_cleanup(hook) -> None:
    """Register ``hook()`` to run in :func:`cleanup_ddp` before the groups are destroyed (internal)."""
    if hook not in _release_hooks:
        _release_hooks.append(hook)


def cleanup_ddp() -> None:
    """Destroy the process groups. Calling it again, or without a group, is harmless.

    Order matters: a gloo group whose last reference dies during interpreter
    shutdown can abort the process ("terminate called without an active
    exception"). So references the toolkit holds are dropped and garbage
    (say, a DDP model in a reference cycle) is collected first, and the
    groups are then destroyed while Python is still fully alive.
    """
    _stall.stop()
    for hook in _release_hooks:
        hook()
    if is_distributed():
        gc.collect()
        dist.destroy_process_group()


def _cleanup_at_exit() -> None:
    # atexit runs before module teardown: destroy what the script left, in order.
    try:
        cleanup_ddp()
    except Exception as exc:  # never turn a clean exit into a traceback
        log.debug("cleanup at exit failed: %s", exc)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for a local rendezvous).

    Example:
        >>> 0 < find_free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def should_use_distributed(use_distributed_flag: bool | None = None) -> bool:
    """Decide whether to run distributed.

    Args:
        use_distributed_flag: ``True`` to enable DDP when possible (a warning
            says why not otherwise), ``False`` to disable it, ``None`` to
            follow the environment: distributed when a process group exists
            or a launcher started more than one process.

    Example:
        >>> should_use_distributed(False)
        False
    """
    if use_distributed_flag is False:
        return False
    possible = is_distributed() or detect_launch_env().is_distributed
    if use_distributed_flag and not possible:
        warnings.warn(
            "use_distributed=True but this process was not started by a launcher with more than one "
            "process (torchrun, srun, mpirun) and no process group exists; running single-process",
            RuntimeWarning,
            stacklevel=2,
        )
    return possible


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def _fallback_to_cpu(asked: str) -> torch.device:
    warnings.warn(
        f"device {asked!r} was requested but CUDA is not available; falling back to CPU",
        RuntimeWarning,
        stacklevel=3,
    )
    return torch.device("cpu")


def resolve_device(device: DeviceLike = "auto") -> torch.device:
    """Turn a device specification into a ``torch.device`` that exists here.

    Args:
        device: A ``torch.device``, an int (GPU index) or a string: ``"cpu"``,
            ``"cuda"``/``"gpu"`` (this rank's GPU, from the local rank),
            ``"cuda:N"``, ``"mps"`` or ``"auto"`` (this rank's GPU, else MPS,
            else CPU). Asking for CUDA or MPS where there is none falls back to
            CPU with a ``RuntimeWarning``.

    Raises:
        DeviceError: An unknown string, or a GPU index that does not exist
            (the messages of every other device argument, from :mod:`._devices`).

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if isinstance(device, str) and device.strip().lower() == "auto":
        count = cuda_count()
        if count:
            return torch.device("cuda", get_local_rank() % count)
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    # The local rank is read only for a bare "cuda": a CPU run never looks at launch variables.
    spec = parse_device(device, exists=False, cuda_index=None)
    if spec.type == "cuda":
        if cuda_count() == 0:
            return _fallback_to_cpu(str(device))
        return parse_device(device, cuda_index=get_local_rank())
    if spec.type == "mps":
        return spec if _mps_available() else _fallback_to_cpu(str(device))
    # Other backends (xpu, meta, ...) are passed through as torch understands them.
    return spec


def _rendezvous_store(env: LaunchEnv, timeout: timedelta) -> dist.Store:
    # Under torchrun the agent already hosts a TCPStore at MASTER_ADDR:PORT and
    # keeps it across restarts; a restarted attempt would read the dead
    # attempt's keys. A prefix per restart attempt keeps attempts apart.
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        world_size=None if env.uses_agent_store else env.world_size,
        is_master=env.rank == 0 and not env.uses_agent_store,
        timeout=timeout,
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"nn_handler/attempt{env.restart_count}", store)


def _wait_for_every_rank(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Return once every rank's process group is up.

    gloo's set-up can return on one rank while a peer is still finishing its
    handshake: a rank that then ran a short function and tore its group down
    cut that peer off ("Connection closed by peer"). Done on the store, not
    with a collective, so that an NCCL group creates no communicator here.
    """
    store.set(f"group_up/{rank}", "1")
    store.wait([f"group_up/{other}" for other in range(world_size)], timeout)


def initialize_ddp(timeout: timedelta | float | None = None, backend: str | None = None, *,
                   stall_timeout: float | None | str = "env"):
    """Set up the default process group from the launch environment, if there is one.

    Reads torchrun, SLURM (``srun``), Open MPI (``mpirun``) and PMI/MPICH
    variables. Picks ``nccl`` for CUDA devices and ``gloo`` otherwise, and
    pins this process to the GPU of its local rank. No rank returns before
    every rank's group is up.

    Args:
        timeout: Collective timeout (``timedelta`` or seconds); 60 minutes by default.
        backend: Force a backend (``"gloo"``, ``"nccl"``, ``"mpi"``).
        stall_timeout: Seconds a rank may wait in a watched collective (see
            :func:`watch_collectives`) while another rank is elsewhere; then
            every rank writes a report naming the missing ranks and where they
            are, and raises :class:`~nn_handler.errors.CollectiveStallError`.
            ``"env"`` (default) reads ``NN_HANDLER_STALL_TIMEOUT`` (seconds or
            ``none``; 300 s when unset); ``None`` turns the watchdog off.

    Returns:
        ``(distributed, rank, local_rank, world_size, device)`` on the first
        call, or ``None`` when a process group already exists. A plain
        ``python`` run gives ``(False, 0, 0, 1, device)``.

    A plain process inside a SLURM allocation of several tasks (``python
    train.py`` in an sbatch script, without ``srun``) runs alone, as before,
    and logs a warning saying so, once per process.

    Raises:
        LaunchEnvironmentError: Launch variables that are set but wrong
            (``RANK=""``, ``MASTER_PORT=70000``, ``WORLD_SIZE`` without
            ``RANK``, a rank not below the world size), before torch sees them.
        ValueError: A non-positive timeout or stall_timeout (a ConfigurationError).

    Example:
        >>> initialize_ddp()[0]  # not launched by torchrun/srun/mpirun
        False
    """
    timeout = _check_timeout(timeout)
    stall_timeout = _stall.resolve_stall_timeout(stall_timeout)
    if is_distributed():
        return None
    env = detect_launch_env()
    device = _device_for_local_rank(env.local_rank)
    if not env.is_distributed:
        _warn_if_alone_in_slurm_job()
        return False, 0, 0, 1, device
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "mpi":
        dist.init_process_group("mpi", timeout=timeout)
    else:
        if env.master_addr is None or env.master_port is None:
            raise LaunchEnvironmentError(missing_rendezvous_message(env))
        store = _rendezvous_store(env, timeout)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        _wait_for_every_rank(store, env.rank, env.world_size, timeout)
        if stall_timeout is not None:
            _stall.start(_stall.client_store(env.master_addr, env.master_port,
                                             f"nn_handler/attempt{env.restart_count}/stall", timeout),
                         env.rank, env.world_size, stall_timeout,
                         store_host=None if env.uses_agent_store else 0)
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_cleanup_at_exit)
        _atexit_registered = True
    log.info("rank %d/%d joined a %s group on %s (%s)", env.rank, env.world_size, backend, device, env.launcher)
    return True, env.rank, env.local_rank, env.world_size, device


_warned_alone_in_slurm_job = False


def _warn_if_alone_in_slurm_job() -> None:
    # `python train.py` in an sbatch script runs one process where the job
    # asked for several: legal (a preprocessing step, say), so a warning, once.
    global _warned_alone_in_slurm_job
    found = slurm_job_without_srun()
    if found is None or _warned_alone_in_slurm_job:
        return
    _warned_alone_in_slurm_job = True
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else ""
    command = shlex.join(["python", *sys.argv]) if script and os.path.basename(script) != "__main__.py" \
        else "python train.py"
    log.warning("%s", slurm_job_without_srun_message(*found, command=command))


def _device_for_local_rank(local_rank: int) -> torch.device:
    count = cuda_count()
    if count == 0:
        return torch.device("cpu")
    if local_rank >= count:
        raise DeviceError(
            f"local rank {local_rank} has no GPU: this node has {count} CUDA device"
            f"{'s' if count != 1 else ''}; start at most {count} processes per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# The seed's names: aliases of the public functions.
_should_use_distributed = should_use_distributed
_resolve_device = resolve_device
# Moved to ._devices; kept so that code outside the package importing it still works.
_cuda_count = cuda_count
