"""The status exchange behind ``on_rank`` and ``main_process_first``, and ``any_rank``/``all_ranks``.

Every message travels on a *side* gloo group: CPU tensors, the same under a
gloo or an nccl default group, never queued behind CUDA streams, and kept
apart from the user's own (possibly asynchronous) collectives on the default
group. The side group is made lazily, once per default group, the first time
any of these functions runs; ``dist.new_group`` is itself a collective, and
every rank makes that first call, so every rank creates it at the same point.

One status exchange is one ``all_reduce`` of two int64 values:
``(number of ranks that failed, size of the pickled result to broadcast)``.
Only when a rank failed does a second round (:func:`gather`) carry the
failure records, so the happy path costs about one bare ``all_reduce``.

Objects travel as pickled bytes in tensors that view a ``bytearray``, not
through ``all_gather_object``/``broadcast_object_list``: torch reads their
bytes with ``Tensor.numpy()``, which fails where numpy is not installed (it
is no dependency of torch nor of nn_handler).
"""

from __future__ import annotations

import pickle
import struct
import threading
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ._env import LaunchEnv, detect_launch_env
from .ddp import is_distributed, on_cleanup

__all__ = ["any_rank", "all_ranks"]

# Used when a default group does not say what its timeout is: torch's own
# default for gloo groups.
_FALLBACK_TIMEOUT = timedelta(minutes=30)

# True while this thread runs code that only some ranks run (the body of an
# on_rank function, a main_process_first block). A collective there would
# pair with an unrelated collective of the other ranks, or wait forever.
restricted: ContextVar[bool] = ContextVar("nn_handler_restricted", default=False)


@dataclass(frozen=True, slots=True)
class SideGroup:
    """The side gloo group of one default group, with what every call needs cached."""

    world: weakref.ref  # the default group it belongs to
    group: dist.ProcessGroup
    rank: int
    size: int
    timeout: timedelta
    # The status buffer, reused by every exchange: a tensor over a bytearray,
    # read and written with struct. Making a tensor per call and reading it
    # back with .tolist() cost about a third of a local all_reduce.
    buffer: bytearray
    status: torch.Tensor


_STATUS = struct.Struct("=qq")  # two native int64, the layout of the status tensor

_side: SideGroup | None = None
_side_lock = threading.Lock()


def group_timeout(group) -> timedelta:
    """The collective timeout a process group was created with (``_FALLBACK_TIMEOUT`` if it does not say)."""
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except Exception:  # private API: absent or renamed in some torch version
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    return _FALLBACK_TIMEOUT


def _release_side_group() -> None:
    # Called by cleanup_ddp before it destroys the groups, so the side group's
    # last reference does not outlive them into interpreter shutdown.
    global _side
    _side = None


on_cleanup(_release_side_group)


def side_group() -> SideGroup | None:
    """The side gloo group of the current default group, created on first use; ``None`` without a group.

    Collective on first use: every rank must call it at the same point.
    """
    global _side
    if not is_distributed():
        return None
    world = dist.group.WORLD
    side = _side
    if side is not None and side.world() is world:
        return side
    with _side_lock:
        side = _side
        if side is not None and side.world() is world:
            return side
        if not dist.is_gloo_available():
            raise RuntimeError("nn_handler's rank-restricted calls need torch built with the gloo backend")
        # The side group waits as long as the default group would. A status
        # exchange waits for the rank-restricted function itself to finish on
        # its ranks (saving a large checkpoint takes minutes), so a short
        # timeout here would fail healthy jobs; and a rank that dies is seen
        # at once anyway, as gloo reports the closed connection immediately.
        # The user's timeout for the default group is the bound they chose
        # for "a rank waits on the others".
        timeout = group_timeout(world)
        group = dist.new_group(backend="gloo", timeout=timeout)
        buffer = bytearray(_STATUS.size)
        side = SideGroup(weakref.ref(world), group, dist.get_rank(), dist.get_world_size(), timeout, buffer,
                         torch.frombuffer(buffer, dtype=torch.int64))
        _side = side
        return side


def require_group(what: str, purpose: str, launched: LaunchEnv | None = None) -> None:
    """Raise when a launcher started several ranks but no process group exists yet.

    Called where there is no group: a single process answers for every rank,
    but launched ranks (torchrun, srun, mpirun before ``initialize_ddp``)
    cannot wait for or agree with each other, and answering alone would let
    them part ways silently.
    """
    launched = detect_launch_env() if launched is None else launched
    if launched.is_distributed:
        raise RuntimeError(
            f"{what} needs a process group {purpose}, but this process is rank {launched.rank} of "
            f"{launched.world_size} ({launched.launcher}) and no process group exists yet; call initialize_ddp() "
            f"first (an NNHandler calls it when created)"
        )


def check_collective_allowed(what: str) -> None:
    """Raise when called where not every rank runs (see ``restricted``) instead of hanging."""
    if restricted.get():
        raise RuntimeError(
            f"{what} was called inside an on_rank function or a main_process_first block, which not every "
            f"rank runs at the same time, so it would wait forever; call it outside, on every rank"
        )


def exchange(side: SideGroup, failed: bool, payload_size: int = 0) -> tuple[int, int]:
    """Agree on ``(number of failed ranks, total payload size)``; one small all_reduce.

    Not for concurrent use from several threads (no collective on one group is).
    """
    _STATUS.pack_into(side.buffer, 0, 1 if failed else 0, payload_size)
    dist.all_reduce(side.status, group=side.group)  # synchronous: the buffer is ours again on return
    return _STATUS.unpack_from(side.buffer)


def gather(side: SideGroup, obj) -> list:
    """Every rank's ``obj`` (picklable), by rank; ``dist.all_gather_object`` without numpy."""
    data = pickle.dumps(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(side.size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=side.group)
    longest = max(int(n) for n in sizes)  # a pickle is never empty
    buffers = [bytearray(longest) for _ in range(side.size)]
    mine = bytearray(data) + bytearray(longest - len(data))  # gloo gathers equal sizes
    dist.all_gather([torch.frombuffer(b, dtype=torch.uint8) for b in buffers],
                    torch.frombuffer(mine, dtype=torch.uint8), group=side.group)
    return [pickle.loads(b[:int(n)]) for b, n in zip(buffers, sizes)]


def broadcast_object(side: SideGroup, obj, src: int = 0):
    """``src``'s ``obj`` (picklable) on every rank; ``dist.broadcast_object_list`` without numpy."""
    data = pickle.dumps(obj) if side.rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=side.group)
    data = broadcast_bytes(side, data, int(size), src)
    return obj if side.rank == src else pickle.loads(data)


def broadcast_bytes(side: SideGroup, data: bytes, size: int, src: int) -> bytes:
    """Send ``data`` (``size`` bytes, known to every rank) from ``src`` to every rank."""
    # The tensor is a view of a bytearray, so the bytes come out through
    # Python itself (Tensor.numpy() would need numpy, not a dependency).
    buffer = bytearray(data) if side.rank == src else bytearray(size)
    if size:  # frombuffer refuses an empty buffer
        dist.broadcast(torch.frombuffer(buffer, dtype=torch.uint8), src=src, group=side.group)
    return data if side.rank == src else bytes(buffer)


def monitored_barrier(side: SideGroup, timeout: timedelta | None = None) -> None:
    """A barrier whose timeout error names the ranks that did not arrive.

    ``wait_all_ranks=True``: rank 0 lists every missing rank, not only the first.
    """
    dist.monitored_barrier(group=side.group, timeout=timeout or side.timeout, wait_all_ranks=True)


def _agree(flag, op, what: str) -> bool:
    side = side_group()
    if side is None:
        require_group(what, "to agree with the other ranks")
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=op, group=side.group)
    return bool(value.item())


def any_rank(flag) -> bool:
    """True on every rank when ``flag`` is true on at least one rank.

    Every rank must call it (it is a collective on nn_handler's side gloo
    group); without a process group it returns ``bool(flag)``, unless a
    launcher started several ranks (before ``initialize_ddp``), which could
    not agree: then it raises ``RuntimeError``.

    Args:
        flag: Anything with a truth value: a bool, or a one-element tensor
            such as ``torch.isnan(loss).any()``.

    Returns:
        The same bool on every rank.

    Raises:
        RuntimeError: Called inside an ``on_rank`` function or a
            ``main_process_first`` block, where not every rank would join;
            or in launched ranks before a process group exists.

    Example:
        >>> from nn_handler.utils.ddp_decorators import any_rank
        >>> any_rank(False)   # no process group: the flag itself
        False

        In a training loop, skip a bad batch on every rank together::

            if any_rank(not torch.isfinite(loss)):
                continue
    """
    check_collective_allowed("any_rank")
    return _agree(flag, dist.ReduceOp.MAX, "any_rank")


def all_ranks(flag) -> bool:
    """True on every rank when ``flag`` is true on every rank.

    Every rank must call it; without a process group it returns ``bool(flag)``
    (launched ranks before ``initialize_ddp``: ``RuntimeError``, as ``any_rank``).

    Args:
        flag: Anything with a truth value.

    Returns:
        The same bool on every rank.

    Raises:
        RuntimeError: Called inside an ``on_rank`` function or a
            ``main_process_first`` block.

    Example:
        >>> from nn_handler.utils.ddp_decorators import all_ranks
        >>> all_ranks(True)
        True

        Stop early only when every rank has converged::

            if all_ranks(patience_left == 0):
                break
    """
    check_collective_allowed("all_ranks")
    return _agree(flag, dist.ReduceOp.MIN, "all_ranks")
