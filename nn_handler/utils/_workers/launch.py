"""The one local launcher: N ranks of one process group on this machine, each in a pool worker.

:meth:`NNHandler.launch` (:func:`launch`: rank 0's result, the first failure
raised at once) and :func:`nn_handler.testing.run_distributed`
(:func:`run_ranks`: every rank's result or exception) both run here, and so
does ``python -m nn_handler check``.

Data flow::

    caller                               thread r (one per rank)            worker r (a one-worker pool)
    ------                               -----------------------            ----------------------------
    pickle (fn, args, kwargs) once
    start pool r (no main script)
    one thread per rank ───────────────> pool_r.run(_rank_body) ──────────> caller's env + RANK..., threads,
                                                                            join the group, fn, leave the group
    outcomes.get(until the deadline) <── put (rank, outcome), then stop
      │                                  worker r: its peers see it leave
      ├─ fail_fast and a failure: kill the other pools (their calls end at once)
      └─ the deadline: kill the pools still running; those ranks are "unfinished"

Why one pool per rank rather than one pool of N workers: a pool call fails as
a whole (a worker's death ends the call on every worker, and a timeout drops
what the finished workers returned), while ``run_distributed`` reports what
every rank did, the ranks that finished before a hang included. With a pool
each, a rank's death, error or deadline is its own, and this module alone
decides when the others stop. The pools still own every process: start, death
seen on the sentinel, the shared-memory transport, the kill.

Under a launch that already started every rank (torchrun, srun, mpirun, or a
process group of several ranks already up), :func:`launch` starts nothing: it
runs ``fn`` once here, on this rank (:func:`_run_in_existing_launch`), so one
script runs unchanged under ``python`` and under each launcher.

Private: NNHandler.launch and nn_handler.testing.run_distributed are the public faces.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import queue
import threading
import time
from typing import Any, Callable

from ..._checks import check_int, check_number
from ...errors import (
    CollectiveStallError,
    ConfigurationError,
    DistributedTimeoutError,
    ExecutorTimeoutError,
    ParallelExecutionError,
    RankFailedError,
    RankFailure,
    RemoteFailure,
    WorkerDiedError,
)
from .._devices import cuda_count
from .._stall import resolve_stall_timeout
from . import pickler
from .executor import ParallelExecutor, _check_picklable, _name, _pickle_call, _threads_per_worker
from .worker import threads_wanted

__all__ = ["launch", "run_ranks"]

log = logging.getLogger(__name__)

# Seconds the launcher still listens after a rank's failure, for a peer's death that caused it.
_DEATH_GRACE = 1.0


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every rank does before and around ``fn`` (travels to the workers)."""

    env: dict  # the rendezvous and the caller's extra variables (the pool gives each worker the caller's environment)
    nprocs: int
    threads: int
    join: bool  # initialize_ddp before fn
    backend: str | None
    pg_timeout: float | None
    stall_timeout: float | None | str  # initialize_ddp's: "env" reads NN_HANDLER_STALL_TIMEOUT in the rank
    pass_rank: bool  # fn(rank, *args) (run_distributed) rather than fn(*args, **kwargs)


def _rank_body(payload: bytes, rank: int, setup: _Setup) -> Any:
    """One rank, in its worker: the launch variables, the group, ``fn``, and leaving the group."""
    import torch

    for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
        # A caller that torchrun started alone (--nproc_per_node=1) passes its
        # agent's variables on. With TORCHELASTIC_USE_AGENT_STORE every rank of
        # this group would join the store as a client, none would host it, and
        # all would wait for it until the group's timeout.
        del os.environ[name]
    os.environ.update(setup.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(setup.nprocs),
                      LOCAL_WORLD_SIZE=str(setup.nprocs))
    torch.set_num_threads(threads_wanted(setup.threads))
    fn, args, kwargs = pickle.loads(payload)
    if setup.join:
        from ..ddp import initialize_ddp

        initialize_ddp(timeout=setup.pg_timeout, backend=setup.backend, stall_timeout=setup.stall_timeout)
    result = fn(rank, *args, **kwargs) if setup.pass_rank else fn(*args, **kwargs)
    # Only on success: after a failure the group is left as it is, so the
    # failed rank's own error reaches the caller first rather than a peer's
    # "connection closed"; its process ends right after (see _call_rank and
    # _stop_bystanders: under fail-fast, once its peers are stopped).
    from ..ddp import cleanup_ddp

    cleanup_ddp()
    return result


@dataclasses.dataclass
class _Outcome:
    value: Any = None
    failure: RankFailure | None = None  # None: fn returned ``value``
    exception: BaseException | None = None  # the rank's own exception, where it could be rebuilt here


def _call_rank(executor: ParallelExecutor, rank: int, payload: bytes, setup: _Setup, name: str,
               outcomes: queue.Queue, fail_fast: bool) -> None:
    outcome: _Outcome | None = None
    try:
        [value] = executor._run(_rank_body, (payload, rank, setup), {}, name=name)
        outcome = _Outcome(value=value)
    except ExecutorTimeoutError:
        pass  # past the launcher's own deadline: the rank counts as unfinished
    except ParallelExecutionError as exc:  # WorkerDiedError too
        # A one-worker pool calls its worker 0: the record gets the rank back.
        # (_failures, _exceptions: the records even where the task's exception has attributes of the public names)
        outcome = _Outcome(failure=dataclasses.replace(exc._failures[0], rank=rank), exception=exc._exceptions.get(0))
    except BaseException as exc:  # noqa: BLE001 - the caller's thread decides what to raise
        outcome = _Outcome(failure=RankFailure(rank, executor.devices[0], message=f"{type(exc).__name__}: {exc}"),
                           exception=exc)
    finally:
        # Reported before the worker stops: a peer that then sees it leave
        # and fails cannot overtake the root cause in the queue.
        outcomes.put((rank, outcome))
        # The process ends with its call, so its peers see it leave at once
        # instead of waiting in a collective until the group's timeout. Under
        # fail-fast a failed rank is left to the launcher, which stops its
        # peers first (see _stop_bystanders).
        if not (fail_fast and outcome is not None and outcome.failure is not None):
            executor.shutdown()


def _kill(executor: ParallelExecutor) -> None:
    # From this thread, while the rank's thread holds the pool in its call:
    # wait=False kills the worker; that thread then sees it die and returns.
    executor._pool.shutdown(wait=False)


def _run_group(fn: Callable[..., Any], args: tuple, kwargs: dict, *, devices: list[str], timeout: float | None,
               fail_fast: bool, join: bool, backend: str | None = None, pg_timeout: float | None = None,
               env: dict | None = None, pass_rank: bool = False, stall_timeout: float | None | str = "env"
               ) -> list[_Outcome | None]:
    """Run ``fn`` on one rank per device; one outcome per rank, ``None`` for a rank that did not finish.

    ``fail_fast``: at the first failure, the other ranks are killed (and left ``None``).
    """
    from ..ddp import find_free_port

    try:
        payload = pickler.dumps((fn, tuple(args), dict(kwargs)))  # tracebacks name the user's file
    except Exception:
        _pickle_call(fn, False)  # names the function or the argument that cannot travel
        _check_picklable(tuple(args), dict(kwargs), fn)
        raise
    nprocs = len(devices)
    deadline = None if timeout is None else time.monotonic() + timeout
    setup = _Setup(env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()),
                        **(env or {})},
                   nprocs=nprocs, threads=_threads_per_worker(nprocs), join=join, backend=backend,
                   pg_timeout=pg_timeout, stall_timeout=stall_timeout, pass_rank=pass_rank)
    name = _name(fn)
    executors = [ParallelExecutor(device_ids=[d], pass_device=False, timeout=timeout) for d in devices]
    outcomes: list[_Outcome | None] = [None] * nprocs
    threads: list[threading.Thread] = []
    try:
        for executor in executors:
            executor._pool.import_main = False  # fn travels by value: the ranks need not re-run the caller's script
            executor._pool.start_timeout = timeout  # the call's deadline counts the ranks' start too
            executor.start()
        replies: queue.Queue = queue.Queue()
        for rank, executor in enumerate(executors):
            thread = threading.Thread(target=_call_rank,
                                      args=(executor, rank, payload, setup, name, replies, fail_fast),
                                      name=f"nn_handler-rank{rank}", daemon=True)
            thread.start()
            threads.append(thread)
        for _ in range(nprocs):
            left = None if deadline is None else deadline - time.monotonic()
            try:
                rank, outcome = replies.get(timeout=None if left is None else max(0.0, left))
            except queue.Empty:
                break  # the deadline: the ranks still running are killed below
            outcomes[rank] = outcome
            if fail_fast and outcome is not None and outcome.failure is not None:
                stopped = _stop_bystanders(executors, outcomes, rank)
                _collect_causes(replies, outcomes, rank, deadline, stopped)
                break
    finally:
        # Whatever ended the wait (done, a failure, the deadline, Ctrl-C): no rank outlives the call.
        for executor in executors:
            _kill(executor)
        for thread in threads:
            thread.join(30)
    return outcomes


def _stop_bystanders(executors: list, outcomes: list, first: int) -> set[int]:
    """Kill at once the ranks that rank ``first``'s own error leaves behind; the ranks killed.

    Once a rank has raised an error of its own (not its death, not a
    collective that failed because a peer went away, not a stall), what its
    peers do next is a consequence. Left running through the grace, they see
    it go and print what that does to them before its error is raised: the
    store's "Broken pipe" from C++, a stall report calling it dead. A rank
    whose error ``first`` only relays is spared: its own error is the cause.
    """
    outcome = outcomes[first]
    if outcome.failure.died or not _is_own_error(outcome.exception):
        return set()
    spared = _relayed_ranks(first, outcome) | {first}
    stopped = {r for r, o in enumerate(outcomes) if o is None and r not in spared}
    for r in stopped:
        _kill(executors[r])
    return stopped


def _is_own_error(exc: BaseException | None) -> bool:
    """Whether a rank raised ``exc`` itself, rather than because a peer failed, died or stalled."""
    import torch.distributed as dist

    from .._stall import _is_peer_failure

    consequences = (CollectiveStallError, DistributedTimeoutError, dist.DistError)
    return exc is not None and not isinstance(exc, consequences) and not _is_peer_failure(exc)


def _collect_causes(replies: queue.Queue, outcomes: list, first: int, deadline: float | None,
                    stopped: set[int]) -> None:
    """After rank ``first``'s failure, take within a short grace the failures that caused it.

    Two races can put a peer's error ahead of its cause. A rank that dies
    makes its peers' collectives fail at once ("Connection reset by peer"),
    and that error can reach us before the pool has seen the death. And when
    an ``@on_rank`` function fails, every other rank raises a
    ``RankFailedError`` relaying it at the moment the failing rank raises its
    own error, which may still be on its way (a ``finally`` that cleans up).
    The dead rank, or the rank that raised, is the cause and must not be lost:
    a death is added, and a relay gives way to the error it relays.
    """
    relayed = _relayed_ranks(first, outcomes[first])
    end = time.monotonic() + _DEATH_GRACE
    if deadline is not None:
        end = min(end, deadline)
    waiting = outcomes.count(None)
    while waiting and (left := end - time.monotonic()) > 0:
        try:
            rank, outcome = replies.get(timeout=left)
        except queue.Empty:
            return
        waiting -= 1
        if rank in stopped or outcome is None or outcome.failure is None:
            continue  # a peer's own error is left out: fail-fast reports the cause alone
        if outcome.failure.died:
            outcomes[rank] = outcome
        elif rank in relayed and outcomes[first] is not None:
            outcomes[rank] = outcome
            outcomes[first] = None  # the relay only repeats that rank's error


def _relayed_ranks(rank: int, outcome: _Outcome) -> set[int]:
    """The ranks whose error this failure only relays (a RankFailedError raised for another rank's failure)."""
    exc = outcome.exception
    if isinstance(exc, RankFailedError) and rank not in exc.ranks:
        return set(exc.ranks)
    return set()


def launch(fn: Callable[..., Any], args: tuple, kwargs: dict, nprocs: int | None, timeout: float | None,
           stall_timeout: float | None | str = "env") -> Any:
    """Run ``fn(*args, **kwargs)`` on a fresh local process group of ``nprocs`` ranks; rank 0's result.

    What :meth:`NNHandler.launch` runs: one rank per GPU (NCCL) by default,
    ``nprocs`` CPU ranks (gloo) without GPUs. The first rank to fail ends the
    call: its error is raised and the other ranks are killed. An ``@on_rank``
    function's failure is reported from the rank that raised it, not from a
    peer's ``RankFailedError`` relaying it.

    Under a launch that already started several ranks, ``fn`` runs here
    instead, once, and this rank's result is returned
    (:func:`_run_in_existing_launch`).

    Raises:
        ParallelExecutionError: ``fn`` raised on a rank (the first one, named).
        CollectiveStallError: A rank waited in a collective for a rank that did not come (see
            ``initialize_ddp``'s ``stall_timeout``).
        WorkerDiedError: A rank's process died (the errors its death caused in its peers, if they
            came within a second, are in ``failures`` too).
        ExecutorTimeoutError: The call ran past ``timeout`` (a ``TimeoutError``).
        ValueError: ``nprocs`` missing without GPUs, or more than the GPUs; under an existing launch,
            ``nprocs`` other than its world size (a ``ConfigurationError``).
    """
    existing = _existing_launch()
    if existing is not None:
        return _run_in_existing_launch(fn, args, kwargs, nprocs, timeout, stall_timeout, *existing)
    gpus = cuda_count()
    if nprocs is None:
        if gpus == 0:
            raise ValueError("NNHandler.launch(fn, nprocs=N): without GPUs, say how many CPU processes to start")
        nprocs = gpus
    check_int("nprocs", nprocs, minimum=1)
    timeout = check_number("timeout", timeout, unit="seconds", allow_none=True)
    resolve_stall_timeout(stall_timeout, {})  # a bad value fails here, before any process starts
    if gpus and nprocs > gpus:
        raise ValueError(f"nprocs={nprocs} but this machine has {gpus} GPUs; one process per GPU")
    devices = [f"cuda:{i}" for i in range(nprocs)] if gpus else ["cpu"] * nprocs
    outcomes = _run_group(fn, args, kwargs, devices=devices, timeout=timeout, fail_fast=True, join=True,
                          stall_timeout=stall_timeout)
    name = _name(fn)  # errors name the user's function, not the wrapper that runs it
    failed = {rank: o for rank, o in enumerate(outcomes) if o is not None and o.failure is not None}
    if failed:
        failures = [o.failure for o in failed.values()]
        exceptions = {rank: o.exception for rank, o in failed.items() if o.exception is not None}
        cls = WorkerDiedError if any(f.died for f in failures) else ParallelExecutionError
        error = cls(failures, exceptions, function=name)
        # A stall is the caller's to handle by type: raise it, with the ranks' records as its cause.
        stalls = [exc for exc in exceptions.values() if isinstance(exc, CollectiveStallError)]
        if stalls:
            raise stalls[0] from error
        raise error
    unfinished = [rank for rank, o in enumerate(outcomes) if o is None]
    if unfinished:
        raise ExecutorTimeoutError([RankFailure(rank, devices[rank], message=f"still running after the {timeout:g}s "
                                                                             f"timeout; killed")
                                    for rank in unfinished], function=name)
    return outcomes[0].value


def _existing_launch() -> tuple[str, int, int, bool] | None:
    """``(where the ranks come from, rank, world size, whether the group is up)`` when several ranks already run.

    A process group of several ranks already up, or a launcher's variables
    for several processes (torchrun, srun, mpirun). A launcher's single process
    (``srun -n1`` in a job of four GPUs) is not one: ``launch`` starts its ranks.
    """
    import torch.distributed as dist

    from ..ddp import detect_launch_env

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "in a process group already up", dist.get_rank(), dist.get_world_size(), True
    env = detect_launch_env()  # wrong launch variables raise here, naming the variable
    if env.is_distributed:
        return f"started by {env.launcher}", env.rank, env.world_size, False
    return None


def _run_in_existing_launch(fn: Callable[..., Any], args: tuple, kwargs: dict, nprocs: int | None,
                            timeout: float | None, stall_timeout: float | None | str, launcher: str, rank: int,
                            world_size: int, group_up: bool) -> Any:
    """``fn(*args, **kwargs)`` once, here, as this rank of the launch that started it; its own result.

    The launcher started every rank and each runs the script: starting
    ``nprocs`` more from each would make a group per rank, and under torchrun
    those ranks hang (they inherit ``TORCHELASTIC_USE_AGENT_STORE`` and wait,
    all as clients, for a store nobody hosts). The launcher owns the processes:
    ``timeout`` is not applied here, and ``fn``'s exception propagates as it is.
    """
    check_number("timeout", timeout, unit="seconds", allow_none=True)
    if nprocs is not None and check_int("nprocs", nprocs, minimum=1) != world_size:
        raise ConfigurationError(
            f"NNHandler.launch(fn, nprocs={nprocs}): this process is rank {rank} of {world_size} {launcher}, "
            f"and every rank runs fn in its own process; pass nprocs={world_size} or leave it out, "
            f"or start {nprocs} processes with the launcher")
    log.info("NNHandler.launch: running %s here, as rank %d of %d %s%s", _name(fn), rank, world_size, launcher,
             "" if timeout is None else f" (timeout={timeout:g}s is the launcher's to enforce)")
    if group_up:
        return fn(*args, **kwargs)  # the group is the caller's: it stays up
    from ..ddp import cleanup_ddp, initialize_ddp

    initialize_ddp(stall_timeout=stall_timeout)
    result = fn(*args, **kwargs)
    cleanup_ddp()  # leave the group, as the ranks launch starts do (only on success: see _rank_body)
    return result


def _as_result(rank: int, outcome: _Outcome) -> Any:
    """What ``run_distributed`` returns for a rank: the value, or the exception with its remote traceback."""
    failure = outcome.failure
    if failure is None:
        return outcome.value
    if failure.died:
        return RemoteFailure(f"rank {rank} died without a result (exitcode {failure.exitcode})")
    exc = outcome.exception or RemoteFailure(f"{failure.exc_type}: {failure.message}")
    exc.remote_traceback = failure.traceback
    return exc


def run_ranks(fn: Callable[..., Any], nprocs: int = 2, *, args: tuple = (), timeout: float = 60.0, init: bool = True,
              backend: str = "gloo", env: dict | None = None, pg_timeout: float | None = None,
              stall_timeout: float | None | str = "env") -> list:
    """:func:`nn_handler.testing.run_distributed` (its docstring is the documentation): every rank's result."""
    check_int("nprocs", nprocs, minimum=1)
    check_number("timeout", timeout, unit="seconds")
    resolve_stall_timeout(stall_timeout, {})  # a bad value fails here, before any process starts
    outcomes = _run_group(fn, args, {}, devices=["cpu"] * nprocs, timeout=timeout, fail_fast=False, join=init,
                          backend=backend, pg_timeout=pg_timeout or timeout / 2, env=dict(env or {}),
                          pass_rank=True, stall_timeout=stall_timeout)
    results = [None if o is None else _as_result(rank, o) for rank, o in enumerate(outcomes)]
    unfinished = [rank for rank, o in enumerate(outcomes) if o is None]
    if unfinished:
        done = {rank: results[rank] for rank in range(nprocs) if rank not in unfinished}
        raise DistributedTimeoutError(
            f"ranks {unfinished} did not finish within {timeout:.0f}s and were killed "
            f"(finished ranks returned: {done})",
            unfinished,
            results,
        )
    return results
