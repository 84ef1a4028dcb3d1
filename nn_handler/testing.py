"""Run a function on N real processes in one gloo group, with a hard deadline.

For tests of distributed code on a laptop or CI machine: every rank is a
process on 127.0.0.1 (started by the launcher behind :meth:`NNHandler.launch`),
every rank's return value or exception comes back, a hang becomes a clear failure naming the ranks that did not finish,
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

from typing import Any, Callable, Mapping

from .errors import DistributedTimeoutError, RemoteFailure  # re-exported: their home was here

__all__ = ["run_distributed", "DistributedTimeoutError", "RemoteFailure"]


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
    stall_timeout: float | None | str = "env",
) -> list:
    """Run ``fn(rank, *args)`` on ``nprocs`` processes forming one process group.

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
        env: Extra environment variables for every rank (on top of the
            caller's environment, which every rank sees).
        pg_timeout: Collective timeout of the group, seconds; by default half
            of ``timeout`` so a stuck collective names itself before the
            deadline kills it.
        stall_timeout: The ranks' stall watchdog (``initialize_ddp``'s
            ``stall_timeout``): seconds, ``None`` for none; ``"env"`` reads
            ``NN_HANDLER_STALL_TIMEOUT``, which a number given here wins over.

    Returns:
        One entry per rank: what ``fn`` returned, or the exception it raised
        (its remote traceback text in ``.remote_traceback``).

    Raises:
        DistributedTimeoutError: A rank did not finish in time.
    """
    from .utils._workers.launch import run_ranks  # the one local launcher, NNHandler.launch's too

    return run_ranks(fn, nprocs, args=args, timeout=timeout, init=init, backend=backend, env=env,
                     pg_timeout=pg_timeout, stall_timeout=stall_timeout)
