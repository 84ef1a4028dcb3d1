"""Predictions directories (nn_handler/_inference/store.py, reader.py): shards, manifest, resume, reading back.

No processes: shards are written here as a worker would write them; the engine's end-to-end runs (a killed job,
a fresh process opening the result) are in tests/pool.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nn_handler import ConfigurationError, Predictions, PredictionsError
from nn_handler._inference import reader
from nn_handler._inference.layout import MANIFEST
from nn_handler._inference.store import ShardStore, write_shard

IDENTITY = {"n_items": 6, "fingerprint": "abc", "settings": {"batch_size": 2, "max_tokens": None}}


def _store(d, identity=IDENTITY, **kw):
    return ShardStore.open(d, identity=identity, **kw)


def _ragged(i):
    """Item i's per-token output: i + 1 rows of 3 features, each row its item's number."""
    return torch.full((i + 1, 3), float(i))


def _write_all(d, batches, make=_ragged):
    for batch in batches:
        write_shard(d, batch, [make(i) for i in batch])


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("make", [
    lambda i: torch.full((4,), float(i)),                                            # pooled, one vector per item
    _ragged,                                                                         # per-token, ragged
    lambda i: (torch.full((2,), float(i)), torch.tensor(i), None),                   # a tuple with a scalar and None
    lambda i: {"pooled": torch.ones(2) * i, "tokens": _ragged(i).half(),             # a dict, nested, mixed dtypes
               "hidden": [torch.arange(i + 1), (torch.zeros(i, 2, dtype=torch.bool),)]},
], ids=["tensor", "ragged", "tuple", "nested-dict"])
def test_items_come_back_in_input_order_with_their_structure_and_shapes(tmp_path, make):
    store = _store(tmp_path)
    _write_all(tmp_path, [[4, 1], [0, 5, 2], [3]], make)   # non-contiguous, out of order: token-budget batches
    p = store.finish(6)
    assert len(p) == 6 and p.failed == []
    for i in range(6):
        assert _equal(p[i], make(i)), i
    assert all(_equal(a, make(i)) for i, a in enumerate(p))                      # iteration, in input order
    assert all(_equal(a, make(i)) for a, i in zip(p[1:5:2], [1, 3]))              # a slice is a list
    assert _equal(p[-1], make(5)) and p[10:] == []
    with pytest.raises(IndexError, match="item 6 out of range"):
        p[6]


def test_a_shard_is_plain_safetensors_with_its_indices_and_documented_keys(tmp_path):
    _store(tmp_path)
    name = write_shard(tmp_path, [7, 3], [{"pooled": torch.ones(2), "tokens": torch.zeros(5, 2)},
                                          {"pooled": torch.zeros(2), "tokens": torch.zeros(1, 2)}])
    assert name == "shard-000000000003-2.safetensors"
    tensors = load_file(tmp_path / name)  # safetensors alone, no nn_handler
    assert tensors["__indices__"].tolist() == [7, 3]
    assert sorted(tensors) == ["3/pooled", "3/tokens", "7/pooled", "7/tokens", "__indices__"]
    assert tensors["7/tokens"].shape == (5, 2) and tensors["3/tokens"].shape == (1, 2)  # trimmed, no padding
    with safe_open(str(tmp_path / name), "pt") as f:
        assert json.loads(f.metadata()["structure"]) == {"dict": {"pooled": "tensor", "tokens": "tensor"}}
    manifest = json.loads((tmp_path / MANIFEST).read_text())  # human-readable, says how to read the shards
    assert manifest["identity"] == IDENTITY and manifest["complete"] is False and manifest["n_items"] == 6
    assert "__indices__" in manifest["layout"]["indices"] and "'<i>/<path>'" in manifest["layout"]["keys"]


def test_every_dtype_and_shape_is_a_file_safetensors_reads(tmp_path):
    # nn_handler writes the format itself (safetensors.torch.save needs numpy); safetensors validates what it reads.
    _store(tmp_path)
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool]
    item = {str(d): torch.arange(5).reshape(5, 1).to(d) for d in dtypes}
    item.update(scalar=torch.tensor(3, dtype=torch.int8), empty=torch.zeros(0, 4), wide=torch.randn(3, 7).t())
    name = write_shard(tmp_path, [0], [item])
    loaded = load_file(tmp_path / name)
    assert all(_equal(loaded[f"0/{k}"], v) for k, v in item.items())
    with pytest.raises(TypeError, match="complex64"):
        write_shard(tmp_path, [1], [torch.ones(2, dtype=torch.complex64)])


def test_an_item_stored_is_a_copy_of_its_own_not_the_whole_batch_it_is_a_row_of(tmp_path):
    _store(tmp_path)
    batch = torch.arange(40.0).reshape(4, 10)
    name = write_shard(tmp_path, [0, 1, 2, 3], list(batch[:, :3]))  # views sharing the batch's storage
    assert os.path.getsize(tmp_path / name) < 1000
    assert load_file(tmp_path / name)["2"].tolist() == [20.0, 21.0, 22.0]


def test_bad_items_are_refused_with_what_was_wrong(tmp_path):
    _store(tmp_path)
    with pytest.raises(ValueError, match="one item per index"):
        write_shard(tmp_path, [0, 1], [torch.ones(1)])
    with pytest.raises(ValueError, match="distinct"):
        write_shard(tmp_path, [0, 0], [torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match="share one structure"):
        write_shard(tmp_path, [0, 1], [torch.ones(1), (torch.ones(1),)])
    with pytest.raises(TypeError, match=r"item 1's output\['label'\] holds a str"):
        write_shard(tmp_path, [1], [{"label": "cat"}])
    assert not list(tmp_path.glob("shard-*")) and not list(tmp_path.glob(".*tmp*"))


# ----------------------------------------------------------------------------- resume bookkeeping
def test_after_a_kill_the_shards_on_disk_are_done_and_the_writers_temp_files_go(tmp_path):
    store = _store(tmp_path)
    _write_all(tmp_path, [[0, 1], [4]])
    # Killed: a shard renamed but nothing else updated, and a writer's temporary file half written.
    stray = tmp_path / ".shard-000000000002-2.safetensors.tmp.4242.deadbeef"
    stray.write_bytes(b"half a shard")
    foreign = tmp_path / ".notes.tmp.1"
    foreign.write_text("not ours")
    resumed = _store(tmp_path)  # the rerun
    assert not stray.exists() and foreign.exists()
    assert resumed.done_mask().tolist() == [True, True, False, False, True, False]
    assert resumed.done_count() == 3 and store.done_count() == 3
    _write_all(tmp_path, [[2, 3], [5]])
    p = resumed.finish(6)
    assert [t.shape[0] for t in p] == [1, 2, 3, 4, 5, 6]


def test_a_rerun_of_a_batch_replaces_its_shard(tmp_path):
    store = _store(tmp_path)
    _write_all(tmp_path, [[0, 1], [0, 1]])
    assert len(list(tmp_path.glob("shard-*"))) == 1 and store.done_count() == 2


def test_outputs_nested_in_two_ways_are_refused_at_the_end_with_the_way_out(tmp_path):
    # What a model that returns a list of two batched outputs leaves: its batches of two items were read as one
    # output per item (a tensor each), the others' items as a list of two tensors.
    store = _store(tmp_path)
    _write_all(tmp_path, [[0, 1]], lambda i: torch.full((2,), float(i)))
    _write_all(tmp_path, [[2, 3, 4], [5]], lambda i: [torch.ones(2) * i, torch.zeros(2)])
    with pytest.raises(PredictionsError) as info:
        store.finish(6)
    message = str(info.value)
    assert str(tmp_path) in message and "nested in 2 ways" in message and "shard-000000000000-2" in message
    assert "tuple or a dict" in message and "overwrite=True" in message
    with pytest.raises(PredictionsError, match="incomplete"):
        Predictions.open(tmp_path)
    assert _store(tmp_path, overwrite=True).done_count() == 0


def test_an_iterable_run_knows_its_length_at_the_end(tmp_path):
    store = _store(tmp_path, identity={"n_items": None, "fingerprint": "gen"})
    assert store.done_mask().tolist() == []
    _write_all(tmp_path, [[0, 1], [3]])
    assert store.done_mask().tolist() == [True, True, False, True]  # up to the last item on disk
    with pytest.raises(PredictionsError, match="1 of 4 items have neither an output on disk nor a recorded failure"):
        store.finish(4)
    with pytest.raises(PredictionsError, match="incomplete"):
        Predictions.open(tmp_path)
    _write_all(tmp_path, [[2]])
    assert len(store.finish(4)) == 4
    assert json.loads((tmp_path / MANIFEST).read_text())["n_items"] == 4
    rerun = _store(tmp_path, identity={"n_items": None, "fingerprint": "gen"})  # the generator now yields more
    assert rerun.done_mask().tolist() == [True] * 4
    with pytest.raises(PredictionsError, match="predictions of 4 items, this run's input had 5: other data"):
        rerun.finish(5)


def test_a_rerun_with_other_data_or_settings_is_refused_naming_the_dir_and_each_difference(tmp_path):
    _store(tmp_path)
    _write_all(tmp_path, [[0, 1]])
    other = {**IDENTITY, "n_items": 7, "settings": {"batch_size": 2, "max_tokens": 512}}
    with pytest.raises(ConfigurationError) as info:
        _store(tmp_path, identity=other)
    message = str(info.value)
    assert str(tmp_path) in message and "n_items: 6 -> 7" in message and "settings.max_tokens: null -> 512" in message
    assert "batch_size" not in message and "overwrite=True" in message
    assert _store(tmp_path, identity=IDENTITY).done_count() == 2  # refused, nothing touched


def test_overwrite_starts_over_and_leaves_other_files_alone(tmp_path):
    _store(tmp_path)
    _write_all(tmp_path, [[0, 1], [2]])
    (tmp_path / "README.txt").write_text("mine")
    store = _store(tmp_path, identity={"n_items": 2}, overwrite=True)
    assert store.done_count() == 0 and not list(tmp_path.glob("shard-*"))
    assert (tmp_path / "README.txt").read_text() == "mine"


def test_shards_without_a_manifest_or_a_foreign_manifest_are_refused(tmp_path):
    _store(tmp_path)
    _write_all(tmp_path, [[0]])
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(ConfigurationError, match="shards but no manifest.json.*overwrite=True"):
        _store(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / MANIFEST).write_text('{"name": "something else"}')
    with pytest.raises(ConfigurationError, match="not the manifest of nn_handler predictions"):
        _store(other)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigurationError, match="is a file"):
        _store(tmp_path / "notes.txt")


# ----------------------------------------------------------------------------- failures
def test_failures_are_recorded_surfaced_and_cleared_by_a_rerun(tmp_path):
    store = _store(tmp_path)
    _write_all(tmp_path, [[0, 1], [4, 5]])
    store.record_failure([3, 2], "OutOfMemoryError: too long\nTraceback (most recent call last): ...")
    p = store.finish(6)
    assert p.failed == [{"start": 2, "stop": 4, "error": "OutOfMemoryError: too long\nTraceback (most recent call "
                                                           "last): ..."}]
    assert "2 failed" in repr(p)
    with pytest.raises(PredictionsError, match="item 3 of .* has no output: it failed .* OutOfMemoryError: too long"):
        p[3]
    with pytest.raises(PredictionsError, match="2 items .* have no output"):
        p.stack()
    assert _equal(p[5], _ragged(5))
    rerun = _store(tmp_path)
    assert rerun.failed == p.failed
    rerun.clear_failures()
    with pytest.raises(PredictionsError, match="incomplete"):  # until the failed items are computed
        Predictions.open(tmp_path)
    with pytest.raises(PredictionsError, match="2 of 6 items"):
        rerun.finish(6)
    _write_all(tmp_path, [[2, 3]])
    assert rerun.finish(6).failed == [] and _store(tmp_path).failed == []


def test_non_contiguous_failures_are_listed_by_index(tmp_path):
    store = _store(tmp_path, identity={"n_items": 3})
    store.record_failure([2, 0], "ValueError: bad input")
    assert store.failed == [{"indices": [0, 2], "error": "ValueError: bad input"}]


# ----------------------------------------------------------------------------- reading
def test_stack_stacks_fixed_shapes_and_refuses_ragged_ones_with_a_way_out(tmp_path):
    store = _store(tmp_path)
    _write_all(tmp_path, [[3, 0], [1, 2, 4, 5]], lambda i: {"pooled": torch.full((2,), float(i)), "n": torch.tensor(i)})
    stacked = store.finish(6).stack()
    assert stacked["pooled"][:, 0].tolist() == [0, 1, 2, 3, 4, 5] and stacked["n"].tolist() == [0, 1, 2, 3, 4, 5]
    ragged = tmp_path / "ragged"
    store = _store(ragged)
    _write_all(ragged, [[0, 1, 2], [3, 4, 5]], lambda i: (torch.ones(2), _ragged(i)))
    p = store.finish(6)
    with pytest.raises(PredictionsError, match=r"item 1's output '1' is \(2, 3\), item 0's \(1, 3\).*pad_sequence"):
        p.stack()
    assert p.stack(0).shape == (6, 2) and p.stack(part=-2).shape == (6, 2)  # a fixed-shape part beside ragged ones
    with pytest.raises(PredictionsError, match=r"stack\(part='pooled'\): item 0's output has no such part"):
        p.stack("pooled")


def test_reading_is_lazy_one_open_per_shard_and_none_to_open(tmp_path, monkeypatch):
    store = _store(tmp_path, identity={"n_items": 40})
    _write_all(tmp_path, [list(range(k, k + 4)) for k in range(0, 40, 4)])
    store.finish(40)
    opened = []
    real = reader._open_shard
    monkeypatch.setattr(reader, "_open_shard", lambda path: opened.append(path.name) or real(path))
    p = Predictions.open(tmp_path)
    assert opened == []  # the manifest and the index, no shard
    assert p[5].shape == (6, 3) and p[6].shape == (7, 3) and p[4].shape == (5, 3)
    assert opened == ["shard-000000000004-4.safetensors"]
    assert sum(t.shape[0] for t in p) == sum(range(1, 41))
    assert sorted(opened) == sorted(set(opened)) and len(opened) == 10  # iteration: each other shard once


def test_without_the_index_the_shards_index_lists_are_read(tmp_path):
    store = _store(tmp_path)
    _write_all(tmp_path, [[4, 1], [0, 5, 2], [3]])
    store.finish(6)
    (tmp_path / "index.safetensors").unlink()
    assert [t.shape[0] for t in Predictions.open(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_missing_or_damaged_shard_is_named(tmp_path):
    store = _store(tmp_path)
    _write_all(tmp_path, [[0, 1, 2], [3, 4, 5]])
    store.finish(6)
    (tmp_path / "shard-000000000003-3.safetensors").write_bytes(b"\x00" * 10)
    p = Predictions.open(tmp_path)
    assert p[0].shape == (1, 3)
    with pytest.raises(PredictionsError, match="shard-000000000003-3.safetensors cannot be read"):
        p[4]
    assert _store(tmp_path).done_mask().tolist() == [True] * 3 + [False] * 3  # a rerun computes them again
    with pytest.raises(PredictionsError, match="incomplete"):
        Predictions.open(tmp_path)
    with pytest.raises(PredictionsError, match="no predictions"):
        Predictions.open(tmp_path / "elsewhere")


def test_predictions_travel_as_their_directory(tmp_path):
    import pickle
    store = _store(tmp_path, identity={"n_items": 1})
    _write_all(tmp_path, [[0]])
    p = pickle.loads(pickle.dumps(store.finish(1)))
    assert p.output_dir == tmp_path and p[0].shape == (1, 3)
