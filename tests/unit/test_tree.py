"""nn_handler._tree: the one walk over tensors in nested containers, and the sites that use it (no processes)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from nn_handler._training import batches as training_batches
from nn_handler._tree import apply, combine, detach_cpu, tensors, to_device
from nn_handler.utils._models import placement as _placement
from nn_handler._inference.engine import assemble

Pair = namedtuple("Pair", "inputs targets")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str = "train"
    extra: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    x: torch.Tensor
    n: int = 0

    def __post_init__(self):
        raise AssertionError("a walk must not rerun __init__")  # pragma: no cover - only when __init__ reruns


class Tagged(dict):
    """A dict subclass, as a batch of named inputs may be."""


META = torch.device("meta")  # a device every machine has: moving there is observable without a GPU


def _nested():
    return {"a": (torch.ones(2), [torch.zeros(1), 3]), "b": Pair(torch.ones(1), None), "c": "text"}


# ----------------------------------------------------------------------------- apply / to_device / detach_cpu
def test_apply_reaches_every_tensor_and_leaves_the_rest():
    out = apply(_nested(), lambda t: t + 1)
    assert out["a"][0].tolist() == [2.0, 2.0] and out["a"][1][0].tolist() == [1.0]
    assert out["a"][1][1] == 3 and out["c"] == "text" and out["b"].targets is None


def test_containers_keep_their_types():
    tree = (OrderedDict(x=torch.ones(1)), Tagged(y=torch.ones(1)), Pair(torch.ones(1), [torch.ones(1)]),
            defaultdict(list, z=torch.ones(1)), torch.Size([2, 3]))
    out = to_device(tree, META)
    assert type(out) is tuple
    assert [type(o) for o in out] == [OrderedDict, Tagged, Pair, defaultdict, torch.Size]
    assert out[3].default_factory is list and out[4] == torch.Size([2, 3])
    assert [t.device for _, t in tensors(out)] == [META] * 5


def test_dataclasses_are_copied_with_their_tensors_moved():
    batch = Batch(torch.ones(2), extra=[torch.zeros(1)])
    out = to_device(batch, META)
    assert type(out) is Batch and out is not batch
    assert out.x.device == META and out.extra[0].device == META and out.label == "train"
    assert batch.x.device.type == "cpu"  # the original is left alone


def test_frozen_slotted_dataclasses_are_rebuilt_without_rerunning_init():
    frozen = object.__new__(Frozen)
    object.__setattr__(frozen, "x", torch.ones(1))
    object.__setattr__(frozen, "n", 4)
    out = to_device(frozen, META)
    assert type(out) is Frozen and out.x.device == META and out.n == 4


def test_to_device_keeps_tensors_already_there():
    t = torch.ones(3)
    assert to_device([t], "cpu")[0] is t


def test_detach_cpu():
    y = torch.ones(2, requires_grad=True) * 2
    out = detach_cpu(Pair(y, {"k": y}))
    assert not out.inputs.requires_grad and not out.targets["k"].requires_grad
    assert isinstance(out, Pair)


def test_dataclass_classes_and_non_dict_mappings_are_leaves():
    from types import MappingProxyType
    proxy = MappingProxyType({"x": torch.ones(1)})
    assert apply([Batch, proxy], lambda t: t + 1) == [Batch, proxy]


# ----------------------------------------------------------------------------- combine / tensors
def test_combine_merges_same_shaped_trees():
    outs = [Pair(torch.tensor([1]), {"n": 1}), Pair(torch.tensor([2, 3]), {"n": 2})]
    merged = combine(outs, lambda leaves: torch.cat(leaves) if isinstance(leaves[0], torch.Tensor) else leaves)
    assert isinstance(merged, Pair) and merged.inputs.tolist() == [1, 2, 3] and merged.targets == {"n": [1, 2]}


def test_combine_of_leaves_hands_them_all_to_fn():
    assert combine(["a", "b"], list) == ["a", "b"]


def test_tensors_names_where_each_tensor_sits():
    found = [p for p, _ in tensors([Batch(torch.ones(1), extra=[torch.ones(1)]), _nested()], "arg")]
    assert found == ["arg[0].x", "arg[0].extra[0]", "arg[1]['a'][0]", "arg[1]['a'][1][0]", "arg[1]['b'][0]"]


# ----------------------------------------------------------------------------- the sites (each failed on the old walks)
def test_training_head_keeps_namedtuples():
    out = training_batches.head(Pair(torch.arange(4), torch.arange(4) * 2), 2)
    assert isinstance(out, Pair) and out.inputs.tolist() == [0, 1] and out.targets.tolist() == [0, 2]


def test_training_to_device_keeps_dict_subclasses_and_moves_dataclasses():
    out = to_device((Tagged(x=torch.ones(1)), Batch(torch.ones(1))), META)
    assert type(out[0]) is Tagged and out[0]["x"].device == META
    assert out[1].x.device == META


def test_placement_hook_moves_defaultdict_arguments():
    args, kwargs = _placement._input_mover(META)(None, (defaultdict(list, x=torch.ones(1)),), {"b": Batch(torch.ones(1))})
    assert type(args[0]) is defaultdict and args[0]["x"].device == META
    assert kwargs["b"].x.device == META


def test_predict_concat_keeps_the_output_type():
    outs = [OrderedDict(y=torch.ones(2)), OrderedDict(y=torch.zeros(1))]
    merged = assemble([([0, 1], outs[0], False), ([2], outs[1], False)], -100)
    assert type(merged) is OrderedDict and merged["y"].tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("scalar_batches", [[torch.tensor(1.0), torch.tensor(2.0)]])
def test_predict_concat_of_scalars_and_other_leaves(scalar_batches):
    assert assemble([([0], scalar_batches[0], False), ([1], scalar_batches[1], False)], -100).tolist() == [1.0, 2.0]
    assert assemble([([0], "a", False), ([1], "b", False)], -100) == ["a", "b"]
