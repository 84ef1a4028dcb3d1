"""How a ``map`` travels: its items cut into chunks and submitted, its results read back in input order.

:meth:`ParallelExecutor.map <nn_handler.utils._workers.executor.ParallelExecutor.map>` validates its
arguments and packs the function; this module does the rest: :class:`_MapChunks` submits the chunks (all at
once, or a few ahead of the reader with ``buffersize``) and keeps the function's large-tensor files until the
last chunk is over; :func:`_results` yields each item's result in order, with a progress bar and, with
``return_exceptions``, each item's exception in its place.

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
from ..._progress import progress_bar
from .pool import PayloadPicklingError
from .sweep import outcomes


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


def _progress_bar(progress: bool, total: int | None):
    return progress_bar(total, "map", "item") if progress else None


class _MapChunks:
    """A map's input cut into chunks and submitted; the function's large-tensor files live until every chunk
    submitted is over and no more will be."""

    def __init__(self, pool, fn_blob, name, task_timeout, items, chunksize):
        self.pool, self.fn_blob, self.name, self.task_timeout = pool, fn_blob, name, task_timeout
        self.fn_id = pool.new_fn_id()
        self.items, self.chunksize = items, chunksize
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
        for future in futures:
            concurrent.futures.Future.add_done_callback(future, self._chunk_over)  # (no one looking: see CallFuture)
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


def _results(executor, futures: collections.deque, chunks: _MapChunks, end: float | None, bar,
             settle: bool = False) -> Iterator:
    """The items of each chunk's result in order, one more chunk submitted per chunk read while ``chunks`` is
    open (``buffersize``). Nothing is held once yielded: a result the caller dropped is freed at once. Closed
    early, the chunks not started are cancelled. ``executor``: kept alive until the end (a lazy map's), or
    ``None``."""
    try:
        while futures:
            future = futures.popleft()
            if not chunks.closed:
                futures.extend(chunks.submit(1) or chunks.close() or ())
            try:
                chunk = future.result(None if end is None else end - time.monotonic())
            except (TimeoutError, concurrent.futures.TimeoutError) as exc:
                if not future.done():
                    raise TimeoutError(f"map of {chunks.name}: results not in within its timeout") from None
                if not settle:
                    raise  # the task's own timeout (ExecutorTimeoutError), with its worker's story
                chunk = [exc] * future.items
            except Exception as exc:
                if not settle:
                    raise
                chunk = [exc] * future.items  # its worker died: every item of it failed so
            finally:
                future.cancel()  # (past the map's timeout: it will not be read)
                del future
            if bar is not None:
                bar.update(len(chunk))
            if settle:
                chunk = outcomes(chunk, chunks.name)
            chunk.reverse()
            while chunk:
                yield chunk.pop()
            del chunk
    finally:  # done, failed or abandoned: the chunks not started yet are dropped
        for future in futures:
            future.cancel()
        chunks.close(release=True)  # read to the end (every chunk is over), failed or abandoned
        if bar is not None:
            bar.close()
        del executor  # (a lazy map's, held while it may submit more)
