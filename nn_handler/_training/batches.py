"""What a batch is, how the model is called with it, and where its targets and its loss come from.

Three shapes of batch, asked about here by the loop, evaluation and prediction alike:

- a pair ``(inputs, targets)``: ``model(inputs)``, ``loss_fn(outputs, targets)``;
- inputs alone (a tensor, a 1-tuple): ``model(inputs)``, no targets (prediction);
- a ``Mapping`` (``{"input_ids": ..., "labels": ...}``, a Hugging Face ``BatchEncoding``):
  ``model(**batch)``; its targets are its ``"labels"`` entry when there is one (the
  Hugging Face convention), else None. A model whose ``forward`` takes no ``labels``
  (and no ``**kwargs``) is called without them.

The loss is ``loss_fn(outputs, targets)``, or with no ``loss_fn`` the output's own
``loss`` (an attribute, as Hugging Face's ``ModelOutput`` has, or a ``"loss"`` key), as
the Hugging Face ``Trainer.compute_loss`` reads it. The batch size (what a loss is
weighted by over ranks) is the first dimension of the targets, else of the first tensor
of the inputs.

Private: :class:`~nn_handler.NNHandler` is the public face.

Example:
    >>> import torch
    >>> batch = {"x": torch.ones(3, 2), "labels": torch.zeros(3)}
    >>> inputs, targets = split(batch)
    >>> inputs is batch, targets.shape, size_of(inputs, targets)
    (True, torch.Size([3]), 3)
    >>> call(lambda x, labels: {"loss": (x.sum(1) - labels).pow(2).mean()}, inputs)["loss"]
    tensor(4.)
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping  # not typing's: isinstance with it runs through Python at every batch
from typing import Any, Callable

import torch

from .._tree import apply, tensors, to_device
from ..errors import ConfigurationError
from ..utils._models.wrap import unwrap_parallel_model

__all__ = ["split", "call", "takes_labels", "loss_of", "own_loss", "size_of", "sample_count", "head", "cut", "move",
           "check_targets", "outputs_of"]

NO_LOSS = ("no loss function: pass loss_fn= to NNHandler or call set_loss_fn(), or give a model that returns its "
           "own loss (an output with a `loss` attribute or key, as Hugging Face models do when the batch holds "
           "\"labels\")")


def split(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch: a pair gives both, a lone tensor or 1-tuple only inputs.

    A mapping is its own inputs (``model(**batch)`` gets ``"labels"`` too, to compute its loss)
    and its ``"labels"`` are the targets.

    Example:
        >>> split((1, 2)), split([3]), split({"a": 1})
        ((1, 2), (3, None), ({'a': 1}, None))
    """
    if isinstance(batch, Mapping):
        return batch, batch.get("labels")
    if isinstance(batch, (list, tuple)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
        raise ValueError(
            f"a batch must be (inputs, targets), inputs alone or a mapping of keyword arguments, got a "
            f"{type(batch).__name__} of {len(batch)} items; give the loader a collate_fn that returns a pair or a dict"
        )
    return batch, None


def call(model: Callable, inputs: Any) -> Any:
    """The model's outputs: ``model(**inputs)`` for a mapping, else ``model(inputs)``.

    A model that takes no ``labels`` (:func:`takes_labels`) is called without them.

    Example:
        >>> import torch
        >>> call(lambda input_ids: input_ids * 2, {"input_ids": torch.ones(2), "labels": torch.zeros(2)})
        tensor([2., 2.])
    """
    if isinstance(inputs, Mapping):
        if "labels" in inputs and not takes_labels(model):
            # The targets of loss_fn, not an argument of this model (the Hugging Face Trainer pops them too).
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
        return model(**inputs)
    return model(inputs)


_TAKES_LABELS: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def takes_labels(model: Callable) -> bool:
    """True when the model's ``forward`` (inside DDP or ``torch.compile``) has a ``labels`` parameter or ``**kwargs``.

    Example:
        >>> import torch
        >>> takes_labels(torch.nn.Linear(2, 2)), takes_labels(lambda x, **kwargs: x)
        (False, True)
    """
    model = unwrap_parallel_model(model) if isinstance(model, torch.nn.Module) else model
    if not isinstance(model, torch.nn.Module):
        return _accepts_labels(model)
    cls = type(model)
    found = _TAKES_LABELS.get(cls)
    if found is None:  # one signature read per class: this runs at every batch
        found = _TAKES_LABELS[cls] = _accepts_labels(model.forward)
    return found


def _accepts_labels(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass them, as always
        return True
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def check_targets(inputs: Any, targets: Any, loss_fn: Callable | None, what: str) -> None:
    """Refuse a pair-less batch where ``loss_fn`` needs targets (``what``: "training" or "validation")."""
    if targets is None and loss_fn is not None and not isinstance(inputs, Mapping):
        raise ConfigurationError(
            f"{what} batches must be (inputs, targets) pairs, or mappings of keyword arguments for the model; "
            f"got inputs only")


def own_loss(outputs: Any) -> torch.Tensor | None:
    """The ``loss`` an output carries (attribute or key), or None.

    Example:
        >>> import torch
        >>> own_loss({"loss": torch.tensor(1.0)}), own_loss(torch.ones(2))
        (tensor(1.), None)
    """
    if isinstance(outputs, torch.Tensor):
        return None
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    return loss


def loss_of(outputs: Any, targets: Any, loss_fn: Callable | None) -> torch.Tensor:
    """``loss_fn(outputs, targets)``, or with no ``loss_fn`` the output's own loss.

    Raises:
        ConfigurationError: No ``loss_fn`` and no loss in the output (raised at the first
            forward, before any backward or optimizer step).
    """
    if loss_fn is not None:
        return loss_fn(outputs, targets)
    loss = own_loss(outputs)
    if loss is None:
        raise ConfigurationError(f"{NO_LOSS}; the model returned {type(outputs).__name__} without a loss")
    return loss


def size_of(inputs: Any, targets: Any) -> int:
    """Number of samples in a batch: the first dimension of the targets, else of the first tensor of the inputs.

    Example:
        >>> import torch
        >>> size_of({"ids": torch.ones(4, 7)}, None)
        4
    """
    for obj in (targets, inputs):
        first = obj if isinstance(obj, torch.Tensor) else next((t for _, t in tensors(obj) if t.dim() > 0), None)
        if first is not None and first.dim() > 0:
            return first.shape[0]
    raise ValueError("cannot tell the batch size: neither targets nor inputs hold a tensor with a batch dimension")


def sample_count(batch: Any) -> int:
    """Samples in a batch, what its losses are weighted by: :func:`size_of` its :func:`split`, for any batch.

    A batch of more than two parts (a user's step takes any batch) counts
    its first tensor with a batch dimension.

    Example:
        >>> import torch
        >>> sample_count((torch.ones(7, 5, 2), torch.ones(5))), sample_count((torch.ones(3), torch.ones(3), 1))
        (5, 3)
    """
    if ((type(batch) is tuple or type(batch) is list) and len(batch) == 2 and isinstance(batch[1], torch.Tensor)
            and batch[1].dim() > 0):
        return batch[1].shape[0]  # (inputs, targets), the most common batch: what size_of reads, quicker
    if isinstance(batch, (list, tuple)) and len(batch) > 2:
        return size_of(batch, None)
    return size_of(*split(batch))


def head(obj: Any, n: int, rows: int | None = None) -> Any:
    """The first ``n`` samples of a batch-shaped object (tensors in tuples, lists, dicts, dataclasses; scalars kept).

    With ``rows`` (the batch size), a list of ``rows`` entries that holds no tensor is one entry per sample
    (``default_collate`` makes one of a string field) and is cut too.

    Example:
        >>> import torch
        >>> head({"x": torch.arange(3), "name": ["a", "b", "c"]}, 2, rows=3)
        {'x': tensor([0, 1]), 'name': ['a', 'b']}
    """
    if rows is not None:
        obj = _cut_sample_lists(obj, n, rows)
    return apply(obj, lambda t: t[:n] if t.dim() > 0 else t)


def _cut_sample_lists(obj: Any, n: int, rows: int) -> Any:
    if isinstance(obj, list) and len(obj) == rows and next(tensors(obj), None) is None:
        return obj[:n]
    if type(obj) is dict:
        return {k: _cut_sample_lists(v, n, rows) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_cut_sample_lists(v, n, rows) for v in obj)
    return obj


def cut(inputs: Any, targets: Any, n: int, rows: int | None = None) -> tuple[Any, Any]:
    """``(inputs, targets)`` of the batch's first ``n`` of ``rows`` samples (a mapping's labels are cut with it)."""
    if isinstance(inputs, Mapping):
        return split(head(inputs, n, rows))
    return head(inputs, n, rows), head(targets, n, rows)


def move(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with its tensors on ``device``; a mapping that is not a dict (``BatchEncoding``) becomes one."""
    if type(batch) is not tuple and type(batch) is not list:  # a pair, most often: no mapping to convert
        batch = _as_dicts(batch)
    return to_device(batch, device, non_blocking)


def outputs_of(outputs: Any) -> Any:
    """The outputs as metrics see them: every tensor inside detached (a tensor, a tuple, a ``ModelOutput``)."""
    return apply(outputs, torch.Tensor.detach)


def _as_dicts(obj: Any) -> Any:
    # The tree walk rebuilds dicts but passes other mappings through (their
    # constructors vary); the model gets **batch, for which a dict serves.
    if isinstance(obj, Mapping) and (not isinstance(obj, dict) or any(isinstance(v, Mapping) for v in obj.values())):
        return {k: _as_dicts(v) for k, v in obj.items()}
    return obj
