"""``on_rank`` and ``main_process_first``: rank-restricted code whose failure reaches every rank.

Protocol of one ``on_rank`` call in a process group (``_collectives.run_on_ranks``)::

    target ranks:  run func ─┐                      ┌─ failed? gather records, raise
                             ├─ exchange(failed, n) ┤
    other ranks:  ───────────┘  (one all_reduce)    └─ ok: [broadcast result] [barrier] return

Every rank takes part in every step, whatever happened on the others, so
none is left waiting in a collective the others will never join.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Callable, Iterator, Literal, ParamSpec, Sequence, TypeVar, Union, overload

import torch.distributed as dist

from . import _collectives as coll
from ._env import detect_launch_env
from ._guard import debug_enabled, no_collectives
from ._stall_report import MAIN_PROCESS_FIRST, note_rank_function
from .ddp import is_distributed

__all__ = ["on_rank", "main_process_first"]

P = ParamSpec("P")
R = TypeVar("R")
Ranks = Union[int, Sequence[int]]


def _describe(value) -> str:
    return f"{type(value).__name__} {value!r}"


def _target_ranks(rank, name: str) -> tuple[int, ...]:
    """Normalise ``rank`` to sorted distinct ints >= 0, or raise ValueError.

    Called at decoration: nothing here depends on the world size, which is
    checked at call time (``_check_range``).
    """
    if isinstance(rank, (list, tuple, set, frozenset, range)):
        items = list(rank)
        if not items:
            raise ValueError(f"on_rank({name}): the list of ranks is empty; give at least one rank, e.g. on_rank(0)")
    else:
        items = [rank]
    ranks = set()
    for item in items:
        # bool is an int to Python, but on_rank(True) is surely a mistake.
        if isinstance(item, bool):
            raise ValueError(f"on_rank({name}): a rank must be an int, got {_describe(item)}")
        try:
            ranks.add(operator.index(item))
        except TypeError:
            raise ValueError(
                f"on_rank({name}): a rank must be an int or a list of ints, got {_describe(item)}"
            ) from None
    negative = sorted(r for r in ranks if r < 0)
    if negative:
        raise ValueError(
            f"on_rank({name}): a rank is never negative (ranks count from 0; the last rank is world_size - 1), "
            f"got {negative[0] if len(negative) == 1 else negative}"
        )
    return tuple(sorted(ranks))


def _check_range(ranks: tuple[int, ...], world_size: int, name: str) -> None:
    if ranks[0] >= 0 and ranks[-1] < world_size:  # sorted: the ends decide
        return
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(
            f"on_rank({name}): rank must be in [0, {world_size}) (the world size is {world_size}), "
            f"got {bad[0] if len(bad) == 1 else bad}"
        )


# Types: the decorated function keeps its parameters; its result is
# ``R | None`` (None on the ranks that skip it) unless every rank gets it.
@overload
def on_rank(rank: Ranks, barrier: bool = False, *, broadcast_result: Literal[True],
            debug: bool | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
@overload
def on_rank(rank: Ranks, barrier: bool = False, *, broadcast_result: bool = False,
            debug: bool | None = None) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


def on_rank(
    rank: Ranks, barrier: bool = False, *, broadcast_result: bool = False, debug: bool | None = None
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the decorated function only on the given rank(s); a failure there raises on every rank.

    Every rank must call the decorated function (it is a collective, like
    ``dist.all_reduce``). On the target ranks it runs; the others skip it.
    Then all ranks exchange one small status message on a side gloo group:
    if the function raised on any target rank, every rank raises within
    moments, instead of the others waiting at the next collective until the
    job's timeout. The rank that failed re-raises its own exception; the
    others raise :class:`~nn_handler.errors.RankFailedError` naming the
    function, the failed ranks, the message and the remote traceback, which
    is also an instance of the original exception type where possible (so
    ``except ValueError`` works on every rank).

    A negative rank, an empty list or a rank that is not an int is an error
    at decoration. Whether the ranks exist is checked when the function is
    called, so it may be defined before the process group exists. Called
    before the group exists in a process that a launcher started as one of
    several ranks (torchrun, srun, mpirun, before ``initialize_ddp``), it
    runs on the target ranks only, by the launcher's rank, and cannot
    ``broadcast_result`` or meet at a ``barrier`` (RuntimeError). Without a
    launcher and without a group it just runs (the single process stands for
    every rank). An ``on_rank`` function called from inside another one (or
    inside a ``main_process_first`` block) runs locally on its target ranks,
    without an exchange, since not every rank is there.

    However long the function runs (a large checkpoint, an evaluation on
    rank 0), the ranks waiting for it are not stalled to the stall watchdog
    (``stall_timeout``); a target rank that itself waits in a collective
    inside the function is, and the watchdog reports it after
    ``stall_timeout``.

    Args:
        rank: A rank or a list of ranks to run on.
        barrier: After the call, and only when no rank failed, meet at a
            ``monitored_barrier`` whose timeout error names the ranks that did
            not arrive. (The status exchange already keeps every rank from
            returning before the function has finished on the target ranks.)
        broadcast_result: Return the result of the lowest target rank on
            every rank (it must be picklable); otherwise the ranks that skip
            the function return ``None``.
        debug: Make a ``torch.distributed`` collective called inside the
            function raise ``RuntimeError`` at once when a rank of its group
            is not a target rank (that rank would never join it: a hang);
            among the target ranks alone it runs. ``None``: on when
            ``NN_HANDLER_DEBUG=1``. Costs a little on every Python call
            inside the function.

    Returns:
        A decorator. The decorated function returns the function's result on
        the target ranks and ``None`` (or the broadcast result) elsewhere.

    Raises:
        ValueError: At decoration: a negative rank, an empty list, or a rank
            that is not an int. At call time on every rank: a rank not below
            the world size.
        RuntimeError: ``broadcast_result`` or ``barrier`` in launched ranks
            before a process group exists.
        RankFailedError: On the ranks where the function did not fail, when
            it failed on a target rank.

    Example:
        >>> from nn_handler.utils.ddp_decorators import on_rank
        >>> @on_rank(0)
        ... def save(path):
        ...     return f"saved {path}"
        >>> save("model.pt")   # no process group here: it just runs
        'saved model.pt'

        In a DDP job, fetch a value on rank 0 and hand it to everyone::

            @on_rank(0, broadcast_result=True)
            def latest_checkpoint():
                return sorted(Path("ckpt").glob("*.pt"))[-1]

            path = latest_checkpoint()   # the same Path on every rank
    """
    if callable(rank) and not isinstance(rank, (int, Sequence)):
        raise ValueError("on_rank needs the rank(s) to run on: write @on_rank(0), not @on_rank")

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        name = getattr(func, "__qualname__", None) or repr(func)
        targets = _target_ranks(rank, name)
        note_rank_function(name)  # a stall in its status exchange can then name the likely cause

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            nested = coll.restricted.get()
            side = coll.side_group(name) if not nested else None
            if side is not None:
                _check_range(targets, side.size, name)
                body = functools.partial(func, *args, **kwargs)
                if len(targets) < side.size and (debug or (debug is None and debug_enabled())):
                    body = functools.partial(_guarded, body, f"the on_rank function {name}",
                                             f"rank{'s' if len(targets) > 1 else ''} {', '.join(map(str, targets))}",
                                             targets)
                return coll.run_on_ranks(side, body, what=name, ranks=targets, broadcast=broadcast_result,
                                         barrier=barrier)
            # No exchange possible: nested in code that only some ranks run,
            # or launched ranks before initialize_ddp. Run on the target ranks.
            if is_distributed():
                me, world = dist.get_rank(), dist.get_world_size()
            else:
                launched = detect_launch_env()
                if not launched.is_distributed:
                    return func(*args, **kwargs)  # a single process stands for every rank
                if not nested and (barrier or broadcast_result):
                    option = "broadcast_result=True" if broadcast_result else "barrier=True"
                    coll.require_group(f"on_rank({name}) with {option}",
                                       "to send the result to the other ranks" if broadcast_result
                                       else "to make the other ranks wait", launched)
                me, world = launched.rank, launched.world_size
            _check_range(targets, world, name)
            return func(*args, **kwargs) if me in targets else None

        return wrapper

    return decorate


def _guarded(body: Callable[[], R], where: str, ranks: str, inside: Sequence[int]) -> R:
    with no_collectives(where, ranks, inside):
        return body()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run the ``with`` block on rank 0 first, then on the other ranks.

    For work that rank 0 should do once and the others reuse: downloading a
    data set, preprocessing, building a cache. Every rank must enter the
    block. The other ranks wait until rank 0 has left it; if rank 0 raised
    inside, they raise :class:`~nn_handler.errors.RankFailedError` (also an
    instance of the original type where possible) instead of running their
    block. When the others have run their block, rank 0 leaves the ``with``
    statement too, and a failure on any of them raises on every rank. Without
    a process group the block just runs, unless a launcher started several
    ranks (then the others could not wait: call ``initialize_ddp`` first).
    With ``NN_HANDLER_DEBUG=1`` a ``torch.distributed`` collective inside the
    block raises ``RuntimeError`` at once instead of hanging.

    Raises:
        RankFailedError: On the ranks whose block did not fail, when the
            block failed on another rank.
        RuntimeError: In launched ranks before a process group exists.

    Example:
        >>> from nn_handler.utils.ddp_decorators import main_process_first
        >>> with main_process_first():
        ...     ready = True   # rank 0 first (e.g. download), then the others (read the cache)
        >>> ready
        True
    """
    coll.check_collective_allowed("main_process_first")
    side = coll.side_group(MAIN_PROCESS_FIRST)
    if side is None:
        coll.require_group("main_process_first", "to make the other ranks wait for rank 0")
        yield
        return
    name = MAIN_PROCESS_FIRST
    if side.rank != 0:
        coll.agree_on_failure(side, name, None)  # phase 1: wait for rank 0's block
    token = coll.restricted.set(True)
    side_ranks = (0,) if side.rank == 0 else range(1, side.size)  # who runs the block at the same time as this rank
    guard = (no_collectives("a main_process_first block", "one side (rank 0, then the others)", side_ranks)
             if debug_enabled() else contextlib.nullcontext())
    try:
        with guard, coll.working_on(name):
            yield
    except BaseException as exc:
        coll.restricted.reset(token)
        token = None
        if side.rank == 0:
            coll.agree_on_failure(side, name, exc)  # phase 1: tell the others, who have not started
        coll.agree_on_failure(side, name, exc)  # phase 2: raises exc here
        raise  # unreachable: agree_on_failure raised; kept for readers and linters
    finally:
        if token is not None:
            coll.restricted.reset(token)
    if side.rank == 0:
        coll.agree_on_failure(side, name, None)  # phase 1: let the others start
    coll.agree_on_failure(side, name, None)  # phase 2: everyone's block is done
