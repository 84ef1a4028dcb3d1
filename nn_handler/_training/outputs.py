"""What ``predict()`` returns: each batch's outputs kept, padded to a common shape, concatenated, put in order.

A model's output per batch is a tensor, a tuple of them (``return_dict=False``), or a mapping (a Hugging Face
``ModelOutput``) whose fields may be tuples too (``hidden_states``, ``past_key_values``), nested alike. Every
tensor with a batch dimension is kept and concatenated along it. Batches padded each to their own longest row
(the usual Hugging Face collate) give outputs of different lengths: they are padded to the longest along each
mismatched dimension with ``padding_value`` (-100, as the Hugging Face ``Trainer``'s ``nested_concat``), the
same in one process and for the shards that the ranks gather under DDP: :func:`nn_handler._padding.pad_concat`,
the helper the inference engine shares.

What has no batch dimension is not concatenated: a scalar (a loss) is left out of a mapping and is None in a
tuple; anything else (a ``Cache`` object, a string) likewise, with a warning that names it.

Private: :class:`~nn_handler.NNHandler` is the public face.

Example:
    >>> import torch
    >>> from nn_handler._padding import pad_concat
    >>> short, long = torch.ones(2, 3), torch.full((1, 5), 2.0)
    >>> pad_concat([short, long], -100)
    tensor([[   1.,    1.,    1., -100., -100.],
            [   1.,    1.,    1., -100., -100.],
            [   2.,    2.,    2.,    2.,    2.]])
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from .._tree import apply

log = logging.getLogger(__name__)


def batched_cpu(out: Any, dropped: set[str], where: str = "output") -> Any:
    """``out`` with its batched tensors detached on the CPU; scalars None, other leaves None and named in ``dropped``.

    A mapping becomes a dict without the None entries.

    Example:
        >>> import torch
        >>> dropped = set()
        >>> kept = batched_cpu({"logits": torch.ones(2, 3), "loss": torch.tensor(1.0), "cache": object()}, dropped)
        >>> list(kept), dropped
        (['logits'], {"output['cache'] (a object)"})
    """
    if isinstance(out, torch.Tensor):
        return out.detach().cpu() if out.dim() > 0 else None
    if isinstance(out, Mapping):
        kept = {k: batched_cpu(v, dropped, f"{where}[{k!r}]") for k, v in out.items()}
        return {k: v for k, v in kept.items() if v is not None}
    if isinstance(out, (list, tuple)):
        values = [batched_cpu(v, dropped, f"{where}[{i}]") for i, v in enumerate(out)]
        return type(out)(*values) if hasattr(out, "_fields") else type(out)(values)
    if out is not None:
        dropped.add(f"{where} (a {type(out).__name__})")
    return None


def warn_dropped(dropped: set[str]) -> None:
    if dropped:
        log.warning("predict() left out %s: it concatenates tensors with a batch dimension, alone or in tuples, "
                    "lists and mappings", ", ".join(sorted(dropped)))


def in_order(out: Any, indices: list[int], n: int) -> Any:
    """Rows ``out`` (sample ``indices[i]`` in row ``i``) rearranged in dataset order; each of ``n`` samples once.

    Example:
        >>> import torch
        >>> in_order({"y": torch.tensor([10, 30, 20])}, [0, 2, 1], 3)
        {'y': tensor([10, 20, 30])}
    """
    idx = torch.as_tensor(indices, dtype=torch.long)
    counts = torch.bincount(idx, minlength=n) if len(indices) else torch.zeros(n, dtype=torch.long)
    if (counts > 1).any():
        raise RuntimeError("predict(): a sample came back from two ranks; the sampler is not a partition")
    if (counts == 0).any() or len(counts) > n:
        raise RuntimeError(f"predict(): {int((counts == 0).sum())} samples came back from no rank")
    order = torch.argsort(idx)
    return apply(out, lambda t: t[order] if t.dim() > 0 else t)


def as_kind(kind: type | None, local: Any) -> Any:
    """A dict of outputs as the mapping type the model returned (a ``ModelOutput`` takes its fields as keywords)."""
    if kind is None or not issubclass(kind, Mapping) or kind is dict:
        return local
    try:
        return kind(**local)
    except TypeError:  # a mapping whose constructor takes no keywords
        return local
