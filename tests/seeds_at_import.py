"""A module that seeds at its top level, as many training scripts do: an actor that imports it (for the
initializer) must still draw numbers of its own (see cluster/test_ray_lifecycle.py)."""

import random

import torch

torch.manual_seed(0)
random.seed(0)


def nothing(device):
    pass
