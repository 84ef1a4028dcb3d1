"""The status exchange behind ``on_rank``, ``main_process_first`` and the trainer, and ``any_rank``/``all_ranks``.

"Some ranks do it, every rank agrees on failure" lives here, once:
:func:`run_on_ranks` (run a function on rank 0, or the given ranks, and
optionally hand its result to every rank) and :func:`agree_on_failure` (every
rank did its part; raise on every rank when any failed). ``on_rank``,
``main_process_first`` and NNHandler's checkpoint writes and resume use them.

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

import os
import pickle
import struct
import threading
import traceback
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..errors import RankFailedError, RankFailure, _load_type, _type_refs
from ._env import LaunchEnv, detect_launch_env
from ._stall import watching, working_on
from .ddp import is_distributed, on_cleanup

__all__ = ["any_rank", "all_ranks"]

R = TypeVar("R")

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


def side_group(what: str | None = None) -> SideGroup | None:
    """The side gloo group of the current default group, created on first use; ``None`` without a group.

    Collective on first use: every rank must call it at the same point. ``what``: the rank-restricted work it
    is made for, whose status exchange the creation is then watched as (a stall there names that work).
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
        with watching(f"status exchange of {what}" if what else "new_group (nn_handler's side group)"):
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
    with watching("all_gather"):
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=side.group)
        longest = max(int(n) for n in sizes)  # a pickle is never empty
        buffers = [bytearray(longest) for _ in range(side.size)]
        mine = bytearray(data) + bytearray(longest - len(data))  # gloo gathers equal sizes
        dist.all_gather([torch.frombuffer(b, dtype=torch.uint8) for b in buffers],
                        torch.frombuffer(mine, dtype=torch.uint8), group=side.group)
    return [pickle.loads(b[:int(n)]) for b, n in zip(buffers, sizes)]


def broadcast_bytes(side: SideGroup, data: bytes, size: int, src: int) -> bytes:
    """Send ``data`` (``size`` bytes, known to every rank) from ``src`` to every rank."""
    # The tensor is a view of a bytearray, so the bytes come out through
    # Python itself (Tensor.numpy() would need numpy, not a dependency).
    buffer = bytearray(data) if side.rank == src else bytearray(size)
    if size:  # frombuffer refuses an empty buffer
        with watching("broadcast"):
            dist.broadcast(torch.frombuffer(buffer, dtype=torch.uint8), src=src, group=side.group)
    return data if side.rank == src else bytes(buffer)


# Frames of these files lie between the catch and the user's code (the
# except clause here, on_rank's wrapper, main_process_first's generator): a
# remote traceback starts after them.
_OWN_FILES = frozenset({__file__, os.path.join(os.path.dirname(__file__), "_rank.py")})


def _device_name() -> str:
    # Only ask CUDA when this process already uses it: initializing CUDA in a
    # failure path would be slow and may fail itself.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _failure_record(exc: BaseException, rank: int) -> tuple[RankFailure, tuple[bytes, ...]]:
    """What the other ranks need to raise a faithful RankFailedError: plain, picklable data."""
    try:
        message = str(exc)
    except Exception:
        message = f"<str() of the {type(exc).__name__} failed>"
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next  # start at the user's code, not at the frame that caught the error
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:
        text = ""
    record = RankFailure(rank=rank, device=_device_name(), pid=os.getpid(), exc_type=type(exc).__qualname__,
                         message=message, traceback=text)
    return record, _type_refs(type(exc))


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(note)


def agree_on_failure(side: SideGroup, what: str, failure: BaseException | None = None, payload_size: int = 0, *,
                     peer_error: Callable[[RankFailedError], BaseException] | None = None) -> int:
    """Tell every rank whether this rank failed; raise on every rank when any did.

    Every rank calls it at the same point, with the exception its part raised
    (``None`` when it succeeded). One small all_reduce when none failed; a
    second round then carries the failure records.

    Args:
        side: The side group (:func:`side_group`).
        what: Names the work in messages (``"save failed on rank 0 ..."``).
        failure: This rank's exception, or ``None``.
        payload_size: This rank's share of the total returned (the size of
            a result to broadcast).
        peer_error: Makes what the ranks that did not fail raise from the
            :class:`RankFailedError`, which becomes its ``__cause__``;
            without it they raise the RankFailedError itself.

    Returns:
        The sum of every rank's ``payload_size``, when no rank failed.

    Raises:
        BaseException: ``failure`` itself on the rank that had it.
        RankFailedError: On the others (also an instance of the lowest failed
            rank's exception type where possible), or what ``peer_error`` made.
    """
    try:
        with watching(f"status exchange of {what}"):
            n_failed, size = exchange(side, failure is not None, payload_size)
        if n_failed:
            mine = _failure_record(failure, side.rank) if failure is not None else None
            records = [r for r in gather(side, mine) if r is not None]
    except RuntimeError as exc:
        # Usually a rank died (gloo: "Connection closed by peer") or the
        # group's timeout passed; say which call was waiting.
        note = (f"nn_handler: while the ranks exchanged the status of {what}; another rank probably died "
                f"or did not call {what}")
        if failure is not None:  # this rank's own error explains more than the exchange's
            _add_note(failure, f"{note}: {exc}")
            raise failure
        _add_note(exc, note)
        raise
    if not n_failed:
        return size
    if failure is not None:
        raise failure
    error = RankFailedError.create(what, [r for r, _ in records], _load_type(records[0][1]))
    if peer_error is None:
        raise error
    raise peer_error(error) from error


def _pickled_result(result, what: str) -> bytes:
    try:
        return pickle.dumps(result)
    except Exception as exc:
        raise TypeError(
            f"{what} returned a {type(result).__name__} that cannot be pickled, but broadcast_result=True "
            f"sends it to every rank: {exc}; return plain data (tensors, numbers, dicts) instead"
        ) from exc


def run_on_ranks(side: SideGroup, fn: Callable[[], R], *, what: str, ranks: Sequence[int] = (0,),
                 broadcast: bool = False, barrier: bool = False,
                 peer_error: Callable[[RankFailedError], BaseException] | None = None) -> R | None:
    """Run ``fn()`` on ``ranks`` only (rank 0 by default); a failure there raises on every rank.

    Every rank must call it at the same point (it is a collective). While
    ``fn`` runs, collectives of nn_handler refuse (see ``restricted``), since
    the other ranks do not run it (unless ``ranks`` is every rank). Then the ranks agree as
    :func:`agree_on_failure` does: the rank that failed re-raises its own
    exception, the others raise :class:`RankFailedError` (also an instance
    of the original type where possible), or what ``peer_error`` makes of it.

    Args:
        side: The side group (:func:`side_group`); the caller handles "no group".
        fn: Takes no arguments (bind them with ``functools.partial``).
        what: Names the work in messages.
        ranks: Sorted distinct ranks to run on, each below the world size.
        broadcast: Return the result of ``ranks[0]`` on every rank (pickled:
            an unpicklable result fails there, like ``fn`` raising).
        barrier: After success, meet at a :func:`monitored_barrier`.
        peer_error: See :func:`agree_on_failure`.

    Returns:
        ``fn``'s result on ``ranks`` (on every rank with ``broadcast``), else ``None``.
    """
    check_collective_allowed(what)
    source = ranks[0]  # whose result broadcast sends
    result, failure, payload = None, None, b""
    if side.rank in ranks:
        token = restricted.set(len(ranks) < side.size)  # on every rank, fn may use collectives like any code
        try:
            with working_on(what):  # the others wait for it in the status exchange: no stall
                result = fn()
            if broadcast and side.rank == source:
                payload = _pickled_result(result, what)
        except BaseException as exc:  # KeyboardInterrupt too: the others must not wait for it
            failure = exc
        finally:
            restricted.reset(token)
    try:
        size = agree_on_failure(side, what, failure, len(payload), peer_error=peer_error)
    finally:
        failure = None  # no frame <-> traceback cycle kept alive by this frame
    if broadcast:
        data = broadcast_bytes(side, payload, size, source)
        if side.rank != source:
            result = pickle.loads(data)
    if barrier:
        monitored_barrier(side)
    return result


def monitored_barrier(side: SideGroup, timeout: timedelta | None = None) -> None:
    """A barrier whose timeout error names the ranks that did not arrive.

    ``wait_all_ranks=True``: rank 0 lists every missing rank, not only the first.
    """
    with watching("monitored_barrier"):
        dist.monitored_barrier(group=side.group, timeout=timeout or side.timeout, wait_all_ranks=True)


def reduce_ints(side: SideGroup, values, op) -> list[int]:
    """Element-wise ``op`` (a ``dist.ReduceOp``) of every rank's ints ``values``: one all_reduce on the side group."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    with watching("all_reduce"):
        dist.all_reduce(t, op=op, group=side.group)
    return t.tolist()


def _agree(flag, op, what: str) -> bool:
    side = side_group()
    if side is None:
        require_group(what, "to agree with the other ranks")
        return bool(flag)
    return bool(reduce_ints(side, [1 if flag else 0], op)[0])


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
