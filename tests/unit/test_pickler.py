"""Functions sent by value keep their file's name (cloudpickle >= 3.1 renames it "<dynamic-code>"), and its source."""

from __future__ import annotations

import linecache
import pickle
import traceback

import pytest

from nn_handler.utils._workers import pickler, transport


def _outer():
    def inner(x):
        return [1 / v for v in x]  # a comprehension: code nested twice

    return inner


def test_code_nested_in_a_function_keeps_its_file():
    fn = _outer()
    copy = pickle.loads(pickler.dumps(fn))
    nested = [c for c in copy.__code__.co_consts if hasattr(c, "co_filename")]
    assert copy.__code__.co_filename == __file__ and nested and all(c.co_filename == __file__ for c in nested)
    with pytest.raises(ZeroDivisionError) as info:
        copy([0])
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{__file__}", line {fn.__code__.co_firstlineno + 1}' in text
    assert "return [1 / v for v in x]  # a comprehension" in text


def test_the_source_of_a_file_that_is_not_on_disk_travels_with_the_code(monkeypatch):
    # What a notebook cell is: a file name that linecache knows and the disk does not.
    name = "/no/such/dir/ipykernel_1/cell_7.py"
    source = "def cell(x):\n    return x.missing  # the cell's line\n"
    namespace: dict = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), namespace)
    monkeypatch.setitem(linecache.cache, name, (len(source), None, source.splitlines(True), name))
    data = pickler.dumps(namespace["cell"])
    del linecache.cache[name]  # as in a fresh worker
    copy = pickle.loads(data)
    with pytest.raises(AttributeError) as info:
        copy(1)
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{name}", line 2, in cell\n    return x.missing  # the cell\'s line' in text, text


def test_equal_code_of_two_files_keeps_each_its_own_file():
    # Code objects compare equal whatever their file: each must still travel with its own.
    source = "def same(x):\n    return x\n"
    copies = []
    for name in ("/no/such/a.py", "/no/such/b.py"):
        namespace: dict = {"__name__": "__main__"}
        exec(compile(source, name, "exec"), namespace)
        copies.append(pickle.loads(pickler.dumps(namespace["same"])))
    assert [c.__code__.co_filename for c in copies] == ["/no/such/a.py", "/no/such/b.py"]


def test_a_file_on_disk_is_not_sent_along():
    data = pickler.dumps(_outer())
    assert b"a comprehension: code nested twice" not in data


def test_a_function_pickles_to_the_same_bytes_each_time():
    # The worker's cache names a function's body by the digest of these bytes.
    encoder = transport.Encoder(None, private=True)
    fn = _outer()
    assert encoder.pack_function(fn).digest == encoder.pack_function(fn).digest
    assert pickler.dumps(fn) == pickler.dumps(fn)

