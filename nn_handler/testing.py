"""Run a function on N real processes in one gloo group, with a hard deadline.

For tests of distributed code on a laptop or CI machine: every rank is a
spawned process on 127.0.0.1, every rank's return value or exception comes
back, a hang becomes a clear failure naming the ranks that did not finish,
and no process outlives the call.

Example:
    >>> from nn_handler.testing import run_distributed
    >>> import torch, torch.distributed as dist
    >>> def body(rank):
    ...     t = torch.tensor([rank + 1])
    ...     dist.all_reduce(t)
    ...     return int(t)
    >>> run_distributed(body, nprocs=2)  # doctest: +SKIP
    [3, 3]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping

import cloudpickle

from .errors import DistributedTimeoutError, RemoteFailure  # re-exported: their home was here

__all__ = ["run_distributed", "DistributedTimeoutError", "RemoteFailure"]


def _rank_main(payload: bytes, rank: int, env: dict, writer, init: bool, backend: str, pg_timeout: float) -> None:
    os.environ.update(env)
    try:
        fn, args = cloudpickle.loads(payload)
        if init:
            from nn_handler.utils.ddp import initialize_ddp

            initialize_ddp(timeout=pg_timeout, backend=backend)
        message = ("ok", fn(rank, *args))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        tb = traceback.format_exc()
        try:
            pickle.loads(cloudpickle.dumps(exc))  # can the caller rebuild it?
            message = ("err", exc, tb)
        except Exception:
            message = ("err", RemoteFailure(f"{type(exc).__name__}: {exc}"), tb)
    try:
        data = cloudpickle.dumps(message)
    except Exception as exc:
        data = cloudpickle.dumps(("err", RemoteFailure(f"result could not be pickled: {exc}"), ""))
    writer.send_bytes(data)
    writer.close()
    try:
        from nn_handler.utils.ddp import cleanup_ddp

        cleanup_ddp()
    except Exception:
        pass


def run_distributed(
    fn: Callable[..., Any],
    nprocs: int = 2,
    *,
    args: tuple = (),
    timeout: float = 60.0,
    init: bool = True,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    pg_timeout: float | None = None,
) -> list:
    """Run ``fn(rank, *args)`` on ``nprocs`` spawned processes forming one process group.

    The ranks run ``fn`` only: they do not re-run the calling script's
    top-level code, so a script's prints appear once.

    Args:
        fn: The body; it may be a lambda or closure (it travels with cloudpickle).
        nprocs: Number of ranks.
        args: Extra positional arguments for ``fn``.
        timeout: Seconds until every rank still running is killed and
            :class:`DistributedTimeoutError` is raised.
        init: Call :func:`~nn_handler.utils.ddp.initialize_ddp` before ``fn``
            (the launch variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT`` and ``LOCAL_RANK`` are set either way).
        backend: Backend for ``initialize_ddp``.
        env: Extra environment variables for every rank.
        pg_timeout: Collective timeout of the group, seconds; by default half
            of ``timeout`` so a stuck collective names itself before the
            deadline kills it.

    Returns:
        One entry per rank: what ``fn`` returned, or the exception it raised
        (its remote traceback text in ``.remote_traceback``).

    Raises:
        DistributedTimeoutError: A rank did not finish in time.
    """
    from nn_handler.utils._workers.worker import main_module_hidden
    from nn_handler.utils.ddp import find_free_port

    payload = cloudpickle.dumps((fn, tuple(args)))
    port = find_free_port()
    ctx = mp.get_context("spawn")
    procs, readers = [], []
    try:
        for rank in range(nprocs):
            rank_env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nprocs),
                "LOCAL_WORLD_SIZE": str(nprocs),
                "OMP_NUM_THREADS": "1",
                **(env or {}),
            }
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(payload, rank, rank_env, writer, init, backend, pg_timeout or timeout / 2),
                name=f"nn_handler-test-rank{rank}",
                daemon=True,
            )
            with main_module_hidden():  # fn travels by value: the ranks need not re-run the script
                p.start()
            writer.close()  # the child holds the only writer: EOF when it dies
            procs.append(p)
            readers.append(reader)
        return _collect(procs, readers, time.monotonic() + timeout, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for r in readers:
            r.close()


def _collect(procs, readers, deadline: float, timeout: float) -> list:
    results: list = [None] * len(procs)
    pending = {r: i for i, r in enumerate(readers)}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            unfinished = sorted(pending.values())
            done = {i: results[i] for i in range(len(procs)) if i not in pending}
            raise DistributedTimeoutError(
                f"ranks {unfinished} did not finish within {timeout:.0f}s and were killed "
                f"(finished ranks returned: {done})",
                unfinished,
                results,
            )
        for r in wait(list(pending), timeout=left):
            i = pending.pop(r)
            try:
                message = cloudpickle.loads(r.recv_bytes())
            except (EOFError, OSError):
                procs[i].join(5)
                results[i] = RemoteFailure(f"rank {i} died without a result (exitcode {procs[i].exitcode})")
                continue
            if message[0] == "ok":
                results[i] = message[1]
            else:
                exc = message[1]
                exc.remote_traceback = message[2]
                results[i] = exc
    for p in procs:
        p.join(10)
    return results
