"""The inference engine: batches out to a :class:`~nn_handler.ParallelExecutor`'s workers, outputs back or to disk.

How a run flows::

    caller                                          worker (one per device, a process or a Ray actor)
    ------                                          -------------------------------------------------
    ParallelExecutor(initializer=start_worker) ---> build (or unpickle) the model once, on its device
    read the input (sources), form batches
    (batching), skip the done items of a
    resumed run (store)
    submit(run_batch, batch): at most           ---> collate, forward under inference_mode; out of
    IN_FLIGHT_PER_DEVICE per device in flight        memory on several items: once more as two halves;
                                                     output_dir: split per item, trim to each item's
                                                     length, write_shard(); return the indices only
    count, record failures, retry a batch       <--- (indices, outputs) without output_dir
    whose worker died; in memory: pad, concat,
    put in input order

The executor is used as any user would use it (``submit``, ``initializer``, ``backend="ray"``); only the batches
travel per task, the model once per worker.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import os
import sys
import traceback
import uuid
from typing import Any, Callable, Iterator, Sequence

import cloudpickle
import torch
from torch import nn

from .. import _progress
from .._padding import pad_cat
from .._tree import apply, combine, detach_cpu, to_device
from ..errors import ConfigurationError, WorkerDiedError
from ..utils._workers.executor import ParallelExecutor
from .batching import Batch, describe, fixed_batches, token_batches
from .layout import shard_name
from .sources import Source, fingerprint
from .store import ShardStore, write_shard

__all__ = ["IN_FLIGHT_PER_DEVICE", "Settings", "predict"]

#: Batches sent to each device before the first of them is back: one running, one ready to start. Bounds what
#: the caller holds (and, without ``output_dir``, what comes back at once) whatever the data set's size.
IN_FLIGHT_PER_DEVICE = 2

#: How often a batch is sent again after its worker died (a lost Ray node, a killed process).
RETRIES_AFTER_DEATH = 2

# Per-worker state, keyed by the run's token: set by start_worker in the worker; empty in the caller.
_WORKERS: dict[str, dict[str, Any]] = {}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every worker needs to run a batch (sent once, with the model)."""

    collate_fn: Callable
    autocast: bool | torch.dtype = False
    output_dir: str | None = None  # absolute: a Ray actor's working directory is not the caller's
    trim: bool = False  # cut each item's output to its own length (output_dir with a length function)


# ----------------------------------------------------------------------------- worker side
def start_worker(token: str, model_or_factory, is_factory: bool, settings: Settings, device: torch.device) -> None:
    """Build (or take) the model once in this worker, on its device, in eval mode."""
    if is_factory:
        wants_device = "device" in inspect.signature(model_or_factory).parameters
        model = model_or_factory(device=device) if wants_device else model_or_factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    else:
        model = model_or_factory
    _WORKERS[token] = {"model": model.to(device).eval(), "settings": settings}


def run_batch(token: str, batch: Batch, device: torch.device) -> list[tuple[list[int], Any, bool]]:
    """Run one batch: ``[(indices, outputs or None once written, whether outputs is a list per item)]``.

    A batch of several items that runs out of device memory is run once more as two halves (two parts back),
    each on its own: when one fails again, the other's outputs are kept (written) before its error is raised.
    """
    state = _WORKERS[token]
    try:
        return [_finish(state["settings"], batch, *_forward(state, batch, device))]
    except torch.OutOfMemoryError:
        if len(batch) < 2:
            raise
    # Out of the except block: the exception's traceback holds the failed forward's activations.
    if device.type == "cuda":
        torch.cuda.empty_cache()
    parts, error = [], None
    for half in batch.halves():  # each half runs, so a half that fails loses the other nothing (it is written)
        try:
            parts.append(_finish(state["settings"], half, *_forward(state, half, device)))
        except Exception as exc:
            traceback.clear_frames(exc.__traceback__)  # its lines stay for the report; its tensors go
            error = error or exc
    if error is not None:
        raise error
    return parts


def _forward(state: dict, batch: Batch, device: torch.device) -> tuple[Any, bool]:
    settings, model = state["settings"], state["model"]
    inputs = batch.samples if isinstance(batch.samples, torch.Tensor) else settings.collate_fn(batch.samples)
    inputs = to_device(inputs, device)
    with torch.inference_mode():
        if settings.autocast is False:
            out = _call(model, inputs)
        else:
            dtype = settings.autocast if isinstance(settings.autocast, torch.dtype) else (
                torch.float16 if device.type == "cuda" else torch.bfloat16)
            with torch.autocast(device_type=device.type, dtype=dtype):
                out = _call(model, inputs)
    return detach_cpu(out), per_item_list(out, len(batch))


def _call(model: nn.Module, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def per_item_list(out: Any, n: int) -> bool:
    """Whether ``out`` is one output per item: a ``list`` (not a tuple) of ``n`` entries.

    A tuple (or dict) holds several batched outputs; a list as long as the batch holds the items' own outputs
    (per-sample tensors of their own shapes).

    Example:
        >>> import torch
        >>> per_item_list([torch.ones(3), torch.ones(5)], 2), per_item_list((torch.ones(2, 3),), 2)
        (True, False)
    """
    return type(out) is list and len(out) == n


def _finish(settings: Settings, batch: Batch, out: Any, per_item: bool) -> tuple[list[int], Any, bool]:
    if settings.output_dir is None:
        return batch.indices, out, per_item
    items = out if per_item else split_items(out, len(batch))
    if settings.trim and batch.lengths is not None:
        longest = max(batch.lengths)
        items = [trim(item, n, longest) for item, n in zip(items, batch.lengths)]
    write_shard(settings.output_dir, batch.indices, items)
    return batch.indices, None, per_item


def split_items(out: Any, n: int) -> list:
    """A batch's output as one output per item: every tensor cut along dim 0, which must be the batch's.

    Example:
        >>> import torch
        >>> split_items({"emb": torch.arange(6).reshape(3, 2)}, 3)[2]
        {'emb': tensor([4, 5])}
    """
    def check(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(f"output_dir stores one output per item: every output tensor needs the batch's "
                             f"{n} items along dim 0, got a tensor of shape {tuple(t.shape)}; return per-item "
                             f"outputs (or a list of {n} of them)")
        return t

    apply(out, check)
    return [apply(out, lambda t, k=k: t[k]) for k in range(n)]


def trim(item: Any, length: int, longest: int) -> Any:
    """An item's output cut to its own ``length`` along positions: dim 0 of each of its tensors that have positions
    and features (two dims or more) and whose dim 0 is the batch's ``longest`` length.

    Example:
        >>> import torch
        >>> out = trim({"tokens": torch.ones(5, 4), "pooled": torch.ones(4)}, 3, 5)
        >>> out["tokens"].shape, out["pooled"].shape
        (torch.Size([3, 4]), torch.Size([4]))
    """
    # A 1-dim item output (a pooled vector) whose size happens to equal the longest length must not be cut:
    # only (positions, features...) tensors are.
    return apply(item, lambda t: t[:length] if t.dim() >= 2 and t.shape[0] == longest else t)


# ----------------------------------------------------------------------------- caller side
def predict(payload, is_factory: bool, source: Source, *, batch_size: int | None, max_tokens: int | None,
            length: Callable[[Any], int] | None, collate_fn: Callable | None, device_ids: Sequence | None,
            autocast: bool | torch.dtype, num_workers: int, output_dir: str | os.PathLike | None, overwrite: bool,
            on_error: str, padding_value: float, backend: str, progress: bool, name: str = "parallel_predict"):
    """Run the model over ``source`` on every worker; the outputs in input order, in memory or as
    :class:`~nn_handler.Predictions` read from ``output_dir``. Arguments are checked by the public faces."""
    store, done = None, None
    if source.n_items == 0:
        raise ConfigurationError("data is empty: there is nothing to predict")
    if output_dir is not None:
        output_dir = os.path.abspath(os.fspath(output_dir))
        identity = {"n_items": source.n_items, "fingerprint": fingerprint(source.head()),
                    "settings": {"batch_size": batch_size, "max_tokens": max_tokens, "trimmed": length is not None,
                                 "autocast": str(autocast)}}
        store = ShardStore.open(output_dir, identity=identity, overwrite=overwrite)
        store.clear_failures()  # a rerun tries the items that failed before
        done_mask = store.done_mask()
        n_done = int(done_mask.sum())
        if n_done:
            total = "" if source.n_items is None else f" of {source.n_items:,}"
            print(f"{name}: {n_done:,}{total} items done in {output_dir}, resuming", file=sys.stderr, flush=True)
        if n_done == source.n_items:  # nothing left: no worker to start
            return store.finish(n_done)
        limit = len(done_mask)
        done = (lambda i: i < limit and bool(done_mask[i])) if n_done else None
    settings = Settings(source.collate(collate_fn), autocast, output_dir, trim=length is not None)
    batches = _batches(source, done, batch_size, max_tokens, length, num_workers)
    if backend == "ray":
        batches = map(_compact, batches)
    token = uuid.uuid4().hex
    try:
        executor = ParallelExecutor(device_ids=device_ids, backend=backend, initializer=start_worker,
                                    initargs=(token, payload, is_factory, settings))
    except TypeError as exc:
        raise _unpicklable(payload, is_factory, settings, exc) from exc
    run = _Run(store, on_error, name)
    remaining = None if source.n_items is None else source.n_items - (0 if store is None else store.done_count())
    bar = _progress.progress_bar(remaining, name, "item") if progress else _NoBar()
    try:
        with executor:
            run.drive(executor, token, batches, bar)
    except BaseException as exc:
        bar.close() if isinstance(bar, _NoBar) else _progress.close(bar, f"failed: {type(exc).__name__}")
        raise
    failed = None
    if run.failure is not None:
        failed = f"failed at {describe(run.failure[0].indices)}"
    elif run.mixed is not None:
        failed = "failed: list outputs per item for some batches only"
    bar.close() if isinstance(bar, _NoBar) else _progress.close(bar, failed)
    if run.failure is not None:
        raise run.error()
    if run.mixed is not None:
        raise run.mixed
    n_items = source.n_items if source.n_items is not None else source.read
    if n_items == 0:
        raise ConfigurationError("data is empty: the iterable yielded no sample")
    if store is not None:
        return store.finish(n_items)
    if not run.parts:
        raise ConfigurationError("data is empty: there is nothing to predict")
    return assemble(run.parts, padding_value)


def _unpicklable(payload, is_factory: bool, settings: Settings, original: TypeError) -> TypeError:
    """Say whether the model (or factory) or the collate function is what cannot travel to the workers."""
    what = "the model factory" if is_factory else "the model"
    for label, obj, remedy in (
        (what, payload, "define it at module level and keep unpicklable objects out of its closure" if is_factory
         else "pass a factory that builds the model in each worker"),
        ("collate_fn", settings.collate_fn, "define it at module level"),
    ):
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            return TypeError(f"{label} cannot be pickled to send to the workers ({exc}); {remedy}")
    return original


def _batches(source: Source, done, batch_size, max_tokens, length, num_workers) -> Iterator[Batch]:
    if source.is_tensor and max_tokens is None and length is None:
        yield from _tensor_batches(source.data, batch_size, done)
        return
    items = source.items(done or (lambda i: False), num_workers)
    if max_tokens is None:
        yield from fixed_batches(items, batch_size, length)
    else:
        yield from token_batches(items, max_tokens, length, batch_size)


def _tensor_batches(data: torch.Tensor, batch_size: int, done) -> Iterator[Batch]:
    """A tensor's rows as slices (no per-row pickling), the done rows of a resumed run left out."""
    for start in range(0, data.shape[0], batch_size):
        stop = min(start + batch_size, data.shape[0])
        indices = [i for i in range(start, stop) if done is None or not done(i)]
        if len(indices) == stop - start:
            yield Batch(indices, data[start:stop])
        elif indices:
            yield Batch(indices, data[indices])


def _compact(batch: Batch) -> Batch:
    """The batch with every tensor that is a view of a larger one (a row of a ``TensorDataset``, a slice) copied
    alone: Ray pickles a view with its whole storage (the executor's own transport sends only the view's bytes)."""
    batch.samples = apply(batch.samples, lambda t: t.clone() if t.untyped_storage().nbytes() > t.nbytes else t)
    return batch


class _NoBar:
    """Progress shown nowhere."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _Run:
    """The caller's side of one run: what is in flight, what came back, what failed."""

    def __init__(self, store: ShardStore | None, on_error: str, name: str):
        self.store, self.on_error, self.name = store, on_error, name
        self.parts: list[tuple[list[int], Any, bool]] = []
        self.failure: tuple[Batch, BaseException] | None = None
        self.per_item: dict[bool, list[int]] = {}  # per-item list or not -> the indices of the first such batch
        self.mixed: TypeError | None = None  # the model's list outputs are per item for some batches only

    def drive(self, executor: ParallelExecutor, token: str, batches: Iterator[Batch], bar) -> None:
        limit = IN_FLIGHT_PER_DEVICE * executor.num_workers
        pending: dict[concurrent.futures.Future, tuple[Batch, int]] = {}
        try:
            while True:
                while self.failure is None and self.mixed is None and len(pending) < limit:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    pending[executor.submit(run_batch, token, batch)] = (batch, 0)
                if not pending:
                    return
                finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    batch, deaths = pending.pop(future)
                    try:
                        parts = future.result()
                    except WorkerDiedError as exc:
                        if deaths < RETRIES_AFTER_DEATH:  # its worker is replaced: the batch goes again
                            pending[executor.submit(run_batch, token, batch)] = (batch, deaths + 1)
                        else:
                            self._failed(batch, exc)
                        continue
                    except Exception as exc:
                        self._failed(batch, exc)
                        continue
                    for indices, out, per_item in parts:
                        self._check_per_item(indices, per_item)
                        if self.store is None:
                            self.parts.append((indices, out, per_item))
                        bar.update(len(indices))
        finally:
            # Whatever ends the loop (a failure, the input's own error, Ctrl-C), what is in flight finishes (and
            # its shards are written) before the executor shuts down; nothing of theirs is read any more.
            for future in pending:
                future.cancel()

    def _check_per_item(self, indices: list[int], per_item: bool) -> None:
        """Stop the run once a list output was one output per item for one batch and not for another.

        A ``list`` as long as its batch is read as one output per item (:func:`per_item_list`): a model that
        returns a list of several batched outputs is read so only for the batches whose size is the list's
        length, and those items would get another batch's outputs, quietly (on disk) or as an error at the end.
        """
        self.per_item.setdefault(per_item, indices)
        if len(self.per_item) == 2 and self.mixed is None:
            where = "" if self.store is None else (f"; the shards written to {self.store.output_dir} may be nested "
                                                  f"either way: pass overwrite=True when you run it again")
            self.mixed = TypeError(
                f"{self.name}: the model returned a list as long as its batch (read as one output per item) for "
                f"the batch of {describe(self.per_item[True])}, and not for the batch of "
                f"{describe(self.per_item[False])}; return several batched outputs as a tuple or a dict, and a "
                f"list only with one output per item{where}")

    def _failed(self, batch: Batch, exc: BaseException) -> None:
        if self.on_error == "skip":
            text = f"{type(exc).__name__}: {exc}"
            if exc.__cause__ is not None:
                text += f"\n{exc.__cause__}"
            self.store.record_failure(self._not_written(batch), text)
        elif self.failure is None:
            self.failure = (batch, exc)

    def _not_written(self, batch: Batch) -> list[int]:
        """The failed batch's items without an output on disk: after an out-of-memory split, a half that ran is."""
        if len(batch) < 2:
            return batch.indices
        # A half's shard is named by its first item, which no other batch holds: its file is that half's outputs.
        written = {i for half in batch.halves() if (self.store.output_dir / shard_name(half.indices)).exists()
                   for i in half.indices}
        return [i for i in batch.indices if i not in written]

    def error(self) -> BaseException:
        batch, exc = self.failure
        where = f" in {self.store.output_dir}" if self.store is not None else ""
        exc.add_note(f"{self.name}: the batch of {describe(batch.indices)} failed"
                     + (f"; every other finished batch is on disk{where}: the same call again computes only what "
                        f"is missing" if self.store is not None else ""))
        return exc


def assemble(parts: list[tuple[list[int], Any, bool]], padding_value: float) -> Any:
    """The outputs of every batch as one, in input order.

    A list of per-item outputs gives a list with one output per input. Batched tensors are concatenated (padded
    to the longest with ``padding_value`` where batches differ) and put in input order; 0-dim tensors are stacked
    and anything else is a list, one entry per batch (in the order of each batch's first item).
    """
    parts = sorted(parts, key=lambda part: min(part[0]))
    if any(per_item for _, _, per_item in parts):  # then every part is (the run stops otherwise: _check_per_item)
        out: list = [None] * (max(i for indices, _, _ in parts for i in indices) + 1)
        for indices, items, _ in parts:
            for i, item in zip(indices, items):
                out[i] = item
        return out
    indices = [i for idx, _, _ in parts for i in idx]
    order = None if indices == sorted(indices) else torch.argsort(torch.tensor(indices))

    def join(leaves: list):
        if all(leaf is None for leaf in leaves):  # a scalar left out (NNHandler.predict(data_parallel=True))
            return None
        if all(isinstance(t, torch.Tensor) for t in leaves):
            if all(t.dim() == 0 for t in leaves):
                return torch.stack(leaves)
            joined = pad_cat(leaves, padding_value)
            return joined if order is None or joined.shape[0] != len(order) else joined[order]
        return leaves

    return combine([out for _, out, _ in parts], join)
