"""Loaders, samplers and batch helpers of the training loop; the replay of a half-trained epoch.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, TensorDataset)

from .._checks import check_int
from ..checkpoint import capture_rng_state, restore_rng_state
from ..errors import CheckpointError, ConfigurationError
from ..utils.parallel import MultiGPUConfig, prepare_dataloader

DEFAULT_BATCH_SIZE = 32


def real_sample_count(loader: DataLoader) -> int | None:
    """How many of this rank's samples are real when a ``DistributedSampler`` pads the dataset.

    ``DistributedSampler(drop_last=False)`` repeats samples so every rank gets
    the same count; the repeats occupy the last global positions, so on each
    rank they are the trailing ones. Returns ``None`` when nothing is padded.
    """
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    n = len(sampler.dataset)
    return len(range(sampler.rank, n, sampler.num_replicas))


class IndexedTensors(TensorDataset):
    """A ``TensorDataset`` whose batches are one indexed gather per tensor, not a collate of single rows.

    The ``DataLoader`` hands :meth:`__getitems__` each batch's indices as its
    sampler (``RandomSampler``, ``DistributedSampler``, ...) drew them, so
    the order, the shards, ``drop_last`` and a resume's replay are those of a
    ``TensorDataset``, and so is every batch, value for value; only the
    per-sample ``__getitem__`` and ``default_collate`` are gone (about 7x
    less time per batch of 64 small rows).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> data = IndexedTensors(torch.arange(6.0), torch.arange(6))
        >>> loader = DataLoader(data, batch_size=4, collate_fn=gathered)
        >>> [x.tolist() for x, _ in loader]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    """

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        # index_select: a few times quicker than t[index] (advanced indexing) for the same rows. A list, as
        # default_collate makes of a TensorDataset's tuples.
        return [t.index_select(0, index) for t in self.tensors]


def gathered(batch: Any) -> Any:
    """The ``collate_fn`` of :class:`IndexedTensors`: its batches are gathered already."""
    return batch


def epoch_batches(loader: Any) -> Iterator:
    """An epoch's batches of ``loader``: ``iter(loader)``, or for :class:`IndexedTensors` batched in this process
    the same batches, gathered without the ``DataLoader``'s per-batch machinery.

    There the sampler's order is drawn whole at the first batch (:func:`sampler_order`) and cut into batches of
    the ``BatchSampler``'s size (the last one shorter, or dropped with ``drop_last``), after the global
    generator gave the ``DataLoader`` iterator's one draw: the same batches, value for value, and the same random
    streams after each epoch, so a run, its History and a resume do not tell the two apart.

    Example:
        >>> data = IndexedTensors(torch.arange(5.0))
        >>> loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=gathered)
        >>> _ = torch.manual_seed(0); ours = [b[0].tolist() for b in epoch_batches(loader)]
        >>> _ = torch.manual_seed(0); ours == [b[0].tolist() for b in loader]
        True
    """
    if not gathers(loader):
        return iter(loader)
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)  # iter(loader)'s draw (its base seed)
    return _gather(loader.dataset, loader.batch_sampler)


def gathers(loader: Any) -> bool:
    """True when :func:`epoch_batches` gathers ``loader``'s batches itself (tensors batched in this process)."""
    return (type(loader) is DataLoader and isinstance(loader.dataset, IndexedTensors) and loader.num_workers == 0
            and loader.collate_fn is gathered and type(loader.batch_sampler) is BatchSampler
            and not loader.pin_memory)


def gathered_on(loader: Any, device: torch.device) -> bool:
    """True when :func:`epoch_batches` gathers ``loader``'s batches from tensors on ``device``: they need no move."""
    return gathers(loader) and all(t.device == device for t in loader.dataset.tensors)


def _gather(data: IndexedTensors, batches: BatchSampler) -> Iterator[list[torch.Tensor]]:
    order = sampler_order(batches.sampler)
    if batches.drop_last:
        order = order[:len(order) // batches.batch_size * batches.batch_size]
    if len(order):
        for rows in order.split(batches.batch_size):
            yield [t.index_select(0, rows) for t in data.tensors]


def sampler_order(sampler: Any) -> torch.Tensor:
    """The indices one pass over ``sampler`` yields, as one tensor, with the same random draws.

    A ``RandomSampler`` (without replacement, over its whole dataset) draws one ``randperm`` as its ``__iter__``
    does (from its generator, or from one seeded by the global generator), without a Python int per index; a
    ``SequentialSampler`` is a range; any other sampler is iterated.

    Example:
        >>> _ = torch.manual_seed(0); ours = sampler_order(RandomSampler(range(6)))
        >>> _ = torch.manual_seed(0); ours.tolist() == list(RandomSampler(range(6)))
        True
    """
    if type(sampler) is SequentialSampler:
        return torch.arange(len(sampler))
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        n = len(sampler.data_source)
        if sampler.generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            return torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        order = torch.randperm(n, generator=sampler.generator)
        torch.randperm(n, generator=sampler.generator)  # its last draw, at the end of a pass (its num_samples % n)
        return order
    return torch.tensor(list(sampler), dtype=torch.int64)


def _indexed(data: Any, loader_kwargs: dict) -> Any:
    """``data`` as :class:`IndexedTensors` where it is tensors (a tuple of them, or a plain ``TensorDataset``)
    batched by the default collate; anything else as it is."""
    if "collate_fn" in loader_kwargs or loader_kwargs.get("batch_size", DEFAULT_BATCH_SIZE) is None:
        return data  # the user's own collate, or no batching: per sample, as asked
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return IndexedTensors(*data)
    if type(data) is TensorDataset:  # exactly: a subclass may have its own __getitem__
        return IndexedTensors(*data.tensors)
    return data


def make_loader(data: Any, loader_kwargs: dict, parallel: MultiGPUConfig, *, shuffle: bool,
                seed: int | None) -> DataLoader:
    """A loader over ``data`` (a DataLoader, a Dataset or a tuple of tensors), sharded under DDP.

    Tensors (a tuple of them, a ``TensorDataset``) are batched by index (:class:`IndexedTensors`).
    """
    if isinstance(data, DataLoader):
        if loader_kwargs:
            raise ConfigurationError(
                f"loader settings {sorted(loader_kwargs)} only apply to a Dataset; "
                f"the given DataLoader keeps its own"
            )
        loader = data
    else:
        data = _indexed(data, loader_kwargs)
        if isinstance(data, IndexedTensors):
            loader_kwargs = {**loader_kwargs, "collate_fn": gathered}
        # A list of samples (dicts) or a Hugging Face datasets.Dataset: map-style datasets
        # to a DataLoader, though not Dataset subclasses.
        if not isinstance(data, Dataset) and not (hasattr(data, "__getitem__") and hasattr(data, "__len__")
                                                  and not isinstance(data, (str, bytes, Mapping))):
            raise TypeError(
                f"data must be a DataLoader, a Dataset (or a list of samples) or a tuple of tensors, "
                f"got {type(data).__name__}"
            )
        check_not_empty(data, "given")
        kwargs = {"batch_size": DEFAULT_BATCH_SIZE, **loader_kwargs}
        if not isinstance(data, IterableDataset):
            kwargs.setdefault("shuffle", shuffle)
        loader = DataLoader(data, **kwargs)
    # Evaluation order does not matter, and unshuffled shards keep the
    # padding DistributedSampler adds at the end, where it is cut off.
    return prepare_dataloader(loader, parallel, shuffle=None if shuffle else False,
                              seed=seed if seed is not None else 0)


def predict_loader(data: Any, batch_size: int | None, parallel: MultiGPUConfig, seed: int | None) -> DataLoader:
    """An unshuffled loader over every sample of ``data`` for prediction (a loader's batching is kept)."""
    if batch_size is not None:
        check_int("batch_size", batch_size, minimum=1)
    if isinstance(data, torch.Tensor):
        data = (data,)
    if isinstance(data, DataLoader):
        loader = DataLoader(data.dataset, batch_size=batch_size or data.batch_size or DEFAULT_BATCH_SIZE,
                            shuffle=False, drop_last=False, collate_fn=data.collate_fn,
                            num_workers=data.num_workers, pin_memory=data.pin_memory)
        return prepare_dataloader(loader, parallel, shuffle=False)
    return make_loader(data, {"batch_size": batch_size or DEFAULT_BATCH_SIZE, "drop_last": False}, parallel,
                       shuffle=False, seed=seed)


def check_not_empty(data: DataLoader | Dataset, what: str) -> None:
    dataset = data.dataset if isinstance(data, DataLoader) else data
    try:
        size = len(dataset)
    except TypeError:
        return  # an IterableDataset without a length: found out when it yields nothing
    if size == 0:
        raise ConfigurationError(f"the {what} dataset is empty (0 samples)")


def loader_generators(loader: DataLoader | None) -> dict[str, torch.Generator]:
    """The loader's and its sampler's own generators (what, with the global streams, orders an epoch)."""
    found = {"loader": getattr(loader, "generator", None),
             "sampler": getattr(getattr(loader, "sampler", None), "generator", None)}
    return {name: g for name, g in found.items() if isinstance(g, torch.Generator)}


def sampler_generator(loader: DataLoader | None) -> torch.Generator | None:
    generator = getattr(getattr(loader, "sampler", None), "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def epoch_start_state(loader: DataLoader, learning_rates: dict[str, float] | None = None) -> dict[str, Any]:
    """What decides an epoch's batch order, taken before the loader draws from it; and its learning rates at its
    first step, which the epoch's History row reports also when a per-step scheduler has moved them on before the
    epoch is continued (:func:`~.schedule.epoch_learning_rates`)."""
    return {"rng": capture_rng_state(), "lr": learning_rates,
            "generators": {name: g.get_state() for name, g in loader_generators(loader).items()}}


class RealRows:
    """How many rows of each batch of an epoch are real samples, not ``DistributedSampler`` padding.

    The padding is the last of this rank's samples (:func:`real_sample_count`). Training runs on it, as DDP must
    (every rank takes the same steps on the same batch sizes); the History's sums weigh it 0, so they count every
    sample once, as one process would.

    Example:
        >>> rows = RealRows(None)
        >>> rows.real = 10  # 10 real samples on this rank, 11 with the padding
        >>> [rows.take(4), rows.take(4), rows.take(3)]
        [4, 4, 2]
    """

    def __init__(self, loader: DataLoader | None, seen: int = 0):
        self.real = real_sample_count(loader) if loader is not None else None  # None: nothing padded
        self.seen = seen  # rows already trained (a continued epoch)

    def take(self, n: int) -> int:
        """The real rows among the next ``n``."""
        if self.real is None:
            return n
        keep = max(0, min(n, self.real - self.seen))
        self.seen += n
        return keep


def skip_to(loader: DataLoader, resume: dict[str, Any], epoch: int) -> tuple[Iterator, int]:
    """This epoch's batch iterator, past the ``resume["batches"]`` already trained before the checkpoint."""
    state = resume["epoch_start"]
    restore_rng_state(state["rng"])
    for name, g in loader_generators(loader).items():
        if name in state["generators"]:
            g.set_state(state["generators"][name])
    batches = epoch_batches(loader)
    done = int(resume["batches"])
    # Replaying the loader (rather than skipping sampler indices) also
    # replays whatever randomness the dataset or workers draw per sample.
    for seen in range(done):
        try:
            next(batches)
        except StopIteration:
            raise CheckpointError(
                f"the checkpoint was written after {done} batches of epoch {epoch}, but the training loader "
                f"now yields {seen}; resume with the data and batch size it was written with"
            ) from None
    restore_rng_state(resume["rng"])  # the streams as they were at the checkpoint
    return batches, done
