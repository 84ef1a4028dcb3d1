"""One call that seeds every random stream a training script draws from.

Example:
    >>> import random, torch
    >>> from nn_handler import seed_everything
    >>> seed_everything(7)
    7
    >>> a = (random.random(), torch.rand(1).item())
    >>> _ = seed_everything(7)
    >>> a == (random.random(), torch.rand(1).item())
    True
"""

from __future__ import annotations

import random

import torch

from ._checks import check_int

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, NumPy's global generator (when NumPy is installed) and torch, CPU and CUDA.

    ``torch.manual_seed`` seeds the CPU generator and that of every CUDA
    device. DataLoader workers need nothing more: each worker's ``random``,
    torch and NumPy streams are seeded by torch from a base seed that the
    loader draws from the (now seeded) torch generator at each epoch, plus
    the worker's id; so the same seed gives the same worker streams, with any
    number of workers and any start method. Under DDP every rank that calls
    this with the same seed draws the same streams (as model initialisation
    needs); for augmentations that differ by rank, seed each rank's loader
    generator apart (``DataLoader(..., generator=torch.Generator().manual_seed(seed + rank))``).
    ``PYTHONHASHSEED`` is left alone: it only takes effect in a new interpreter.
    :class:`~nn_handler.NNHandler` calls this with its ``seed``.

    Args:
        seed: An int; NumPy takes it modulo ``2**32``.

    Returns:
        ``seed``.

    Raises:
        ConfigurationError: ``seed`` is not an int.
    """
    check_int("seed", seed)
    random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device too
    try:
        import numpy as np  # not a requirement: seeded only where the user has it
    except ImportError:
        return seed
    np.random.seed(seed % 2**32)
    return seed
