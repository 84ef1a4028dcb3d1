"""How a ``map`` travels: its items cut into chunks and submitted, its results read back in input order.

:meth:`ParallelExecutor.map <nn_handler.utils._workers.executor.ParallelExecutor.map>` validates its
arguments and packs the function; this module does the rest: :class:`_MapChunks` submits the chunks (all at
once, or a few ahead of the reader with ``buffersize``) and keeps the function's large-tensor files until the
last chunk is over; :func:`_results` yields each item's result in order and, with ``return_exceptions``,
each item's exception in its place; :class:`_Progress` counts the items as their chunks finish.

Private: :class:`~nn_handler.utils.ddp_decorators.ParallelExecutor` is the public face.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
from typing import Iterator

import cloudpickle

from ..._checks import invalid
from ..._progress import close as close_bar, progress_bar
from .pool import PayloadPicklingError
from .sweep import Raised, outcomes


def _check_map_timeout(timeout) -> None:
    # Any number, as concurrent.futures takes it: a deadline already past reads what is ready, never waits.
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout != timeout):
        raise invalid("timeout", "None or a number of seconds (0 or less: only the results ready when read)",
                      timeout)


def _length(iterables) -> int | None:
    try:
        return min(len(it) for it in iterables)
    except TypeError:
        return None


class _Progress:
    """A map's progress bar, named after its function, counting each chunk's items as the chunk finishes
    (in any order: a slow first item holds up the results, not the count); with ``return_exceptions``, the
    items that failed too. Its last line says so where the map failed."""

    def __init__(self, total: int | None, label: str, settle: bool):
        self.bar, self.settle = progress_bar(total, label, "item"), settle
        self.failed, self.closed, self.lock = 0, False, threading.Lock()

    def chunk_over(self, future) -> None:
        """A chunk's done-callback (in the thread that settled it)."""
        if future.cancelled():
            return
        failed = 0
        if self.settle:  # (done: these neither wait nor drive)
            if concurrent.futures.Future.exception(future) is not None:
                failed = future.items  # its worker died or timed out: every item of it failed so
            else:
                failed = sum(isinstance(value, Raised) for value in concurrent.futures.Future.result(future))
        with self.lock:  # (a late chunk of an abandoned map draws nothing)
            if self.closed:
                return
            if failed:
                self.failed += failed
                self.bar.set_postfix_str(f"{self.failed} failed", refresh=False)
            self.bar.update(future.items)

    def close(self, failed: str | None = None) -> None:
        with self.lock:
            self.closed = True
            close_bar(self.bar, failed)


def _failure(exc: BaseException, first: int, count: int) -> str:
    """What the last progress line of a map that raised ``exc`` at its items ``first..first+count-1`` says."""
    kind = getattr(exc, "original_type", None) or type(exc)  # the task's own type, not ParallelExecutionError[...]
    message = (str(exc).splitlines() or [""])[0]
    where = f"item {first}" if count == 1 else f"items {first}-{first + count - 1}"
    return f"failed at {where}: {kind.__name__}" + (f": {message[:200]}" if message else "")


class _MapChunks:
    """A map's input cut into chunks and submitted; the function's large-tensor files live until every chunk
    submitted is over and no more will be. ``progress``: counts each chunk as it finishes, or ``None``."""

    def __init__(self, pool, fn_blob, name, task_timeout, items, chunksize, progress: _Progress | None = None):
        self.pool, self.fn_blob, self.name, self.task_timeout = pool, fn_blob, name, task_timeout
        self.fn_id = pool.new_fn_id()
        self.items, self.chunksize, self.progress = items, chunksize, progress
        self.first = 0  # index of the first item of the next chunk to send
        self.pending, self.closed, self.released, self.lock = 0, False, False, threading.Lock()

    def submit(self, count: int | None) -> list:
        """Submit the next ``count`` chunks (all that are left: ``None``); their futures."""
        chunks = []
        while count is None or len(chunks) < count:
            chunk = list(itertools.islice(self.items, self.chunksize))
            if not chunk:
                break
            chunks.append(chunk)
        if not chunks:
            return []
        try:
            futures = self.pool.submit(self.fn_id, self.fn_blob, "map", chunks, self.task_timeout, self.name)
        except PayloadPicklingError:
            for i, item in enumerate(item for chunk in chunks for item in chunk):
                try:
                    cloudpickle.dumps(item)
                except Exception as exc:
                    raise TypeError(f"item {self.first + i} ({type(item).__name__}) cannot be pickled to send "
                                    f"to the workers: {exc}") from exc
            raise
        self.first += sum(len(chunk) for chunk in chunks)
        for future, chunk in zip(futures, chunks):
            future.items = len(chunk)  # (return_exceptions: one error for each)
        with self.lock:
            self.pending += len(futures)
        for future in futures:  # (the base class's method: no one looking, see CallFuture)
            concurrent.futures.Future.add_done_callback(future, self._chunk_over)
            if self.progress is not None:
                concurrent.futures.Future.add_done_callback(future, self.progress.chunk_over)
        return futures

    def _chunk_over(self, _future) -> None:
        with self.lock:
            self.pending -= 1
            self._release_if(self.closed and self.pending == 0)

    def close(self, release: bool = False) -> None:
        """No more chunks will be submitted; ``release``: their results will not be read either, so the
        function's files go now (a chunk a worker is loading may fail unseen), not with the last chunk."""
        with self.lock:
            self.closed = True
            self._release_if(release or self.pending == 0)

    def _release_if(self, due: bool) -> None:
        # Under the lock: whoever sees `released` set knows the files are gone.
        if due and not self.released:
            self.released = True
            self.fn_blob.release()


def _results(executor, futures: collections.deque, chunks: _MapChunks, end: float | None,
             settle: bool = False) -> Iterator:
    """The items of each chunk's result in order, one more chunk submitted per chunk read while ``chunks`` is
    open (``buffersize``). Nothing is held once yielded: a result the caller dropped is freed at once. Closed
    early, the chunks not started are cancelled. ``executor``: kept alive until the end (a lazy map's), or
    ``None``."""
    failed, read = None, 0  # read: items yielded (the index of the next one)
    try:
        while futures:
            future = futures.popleft()
            if not chunks.closed:
                futures.extend(chunks.submit(1) or chunks.close() or ())
            try:
                chunk = future.result(None if end is None else end - time.monotonic())
            except (TimeoutError, concurrent.futures.TimeoutError) as exc:
                if not future.done():
                    failed = _failure(TimeoutError("results not in within the map's timeout"), read, future.items)
                    raise TimeoutError(f"map of {chunks.name}: results not in within its timeout") from None
                if not settle:
                    failed = _failure(exc, read, future.items)
                    raise  # the task's own timeout (ExecutorTimeoutError), with its worker's story
                chunk = [exc] * future.items
            except Exception as exc:
                if not settle:
                    failed = _failure(exc, read, future.items)
                    raise
                chunk = [exc] * future.items  # its worker died: every item of it failed so
            finally:
                future.cancel()  # (past the map's timeout: it will not be read)
                del future
            if settle:
                chunk = outcomes(chunk, chunks.name)
            read += len(chunk)
            chunk.reverse()
            while chunk:
                yield chunk.pop()
            del chunk
    except (Exception, KeyboardInterrupt) as exc:  # (not GeneratorExit: the reader stopped, nothing failed)
        failed = failed or _failure(exc, read, 1)
        raise
    finally:  # done, failed or abandoned: the chunks not started yet are dropped
        for future in futures:
            future.cancel()
        chunks.close(release=True)  # read to the end (every chunk is over), failed or abandoned
        if chunks.progress is not None:
            chunks.progress.close(failed)
        del executor  # (a lazy map's, held while it may submit more)
