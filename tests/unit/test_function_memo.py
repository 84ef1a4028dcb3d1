"""A function's pickle is kept between calls only while it cannot have changed; every change still reaches a worker.

"What a worker gets" is the function rebuilt from the bytes the caller would send now (``cloudpickle.loads``), so
these tests start no process. Script functions are made with ``exec`` in a namespace that is not an importable
module, so that cloudpickle sends them by value, as it does a function of a script or a notebook.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref

import cloudpickle
import pytest

from nn_handler.utils._workers import executor
from nn_handler.utils._workers.function_memo import FunctionMemo, fresh_copy
from nn_handler.utils._workers.transport import Encoder


@pytest.fixture
def packs(monkeypatch):
    """How many times a function was actually pickled."""
    count = []
    real = executor._pack

    def counting(*args):
        count.append(args[0])
        return real(*args)

    monkeypatch.setattr(executor, "_pack", counting)
    monkeypatch.setattr(executor, "_packed", FunctionMemo())  # nothing kept from other tests
    return count


ENCODER = Encoder(None, private=True)
seen = None


def script(source: str, **globals_):
    """The function ``f`` (and its globals) defined by ``source`` as in a script: sent by value."""
    namespace = {"__name__": "a_script_nobody_can_import", **globals_}
    exec(source, namespace)
    return namespace["f"], namespace


def sent(fn):
    """The function a worker would run if it were called now."""
    packed = executor._pickle_call(fn, False, ENCODER)
    func, _position = cloudpickle.loads(packed.body)
    return func


def test_an_unchanged_function_is_pickled_once(packs):
    f, _ = script("import math\ndef f(x, k=2, *, name='n'):\n    return math.floor(x * k * SCALE)", SCALE=1.5)
    first = executor._pickle_call(f, False, ENCODER)
    assert all(executor._pickle_call(f, False, ENCODER) is first for _ in range(3))
    assert len(packs) == 1
    assert sent(f)(3) == 9


def test_a_rebound_global_reaches_the_worker(packs):
    f, namespace = script("def f():\n    return SCALE", SCALE=1)
    assert sent(f)() == 1
    namespace["SCALE"] = 2
    assert sent(f)() == 2
    del namespace["SCALE"]
    with pytest.raises(NameError):
        sent(f)()
    namespace["SCALE"] = 3  # defined again
    assert sent(f)() == 3


def test_an_in_place_change_to_a_mutable_global_reaches_the_worker(packs):
    f, namespace = script("def f():\n    return SETTINGS['lr']", SETTINGS={"lr": 0.1})
    assert sent(f)() == 0.1
    namespace["SETTINGS"]["lr"] = 0.5  # same object, changed in place: only a new pickle carries it
    assert sent(f)() == 0.5
    assert len(packs) == 2  # a function over a dict is pickled on every call


def test_a_rebound_closure_cell_reaches_the_worker(packs):
    def make():
        k = 1

        def f():
            return k

        def set_k(value):
            nonlocal k
            k = value

        return f, set_k

    f, set_k = make()
    assert sent(f)() == 1
    set_k(2)
    assert sent(f)() == 2


def test_changed_defaults_keyword_defaults_attributes_and_code_reach_the_worker(packs):
    f, namespace = script("def f(a=1, *, b=10):\n    return a + b")
    assert sent(f)() == 11
    f.__defaults__ = (2,)
    assert sent(f)() == 12
    f.__kwdefaults__["b"] = 20  # the dict changed in place
    assert sent(f)() == 22
    f.tag = "v1"
    assert sent(f).tag == "v1"
    f.tag = "v2"
    assert sent(f).tag == "v2"
    g, _ = script("def f(a=1, *, b=10):\n    return a * b")
    f.__code__ = g.__code__
    assert sent(f)() == 40


def test_a_function_calling_another_script_function_is_pickled_every_time(packs):
    f, namespace = script("def helper():\n    return 1\ndef f():\n    return helper()")
    assert sent(f)() == 1
    exec("def helper():\n    return 2", namespace)
    assert sent(f)() == 2
    helper = namespace["helper"]
    helper.__code__ = (lambda: 3).__code__  # the same helper object, changed: still seen
    assert sent(f)() == 3
    assert len(packs) == 3


def test_a_module_imported_since_the_last_call_means_a_new_pickle(packs, monkeypatch):
    f, _ = script("def f():\n    return 1")
    sent(f)
    sent(f)
    monkeypatch.setitem(sys.modules, "nnh_imported_meanwhile", types.ModuleType("nnh_imported_meanwhile"))
    sent(f)
    assert len(packs) == 2


def test_the_device_position_is_part_of_what_is_kept(packs):
    f, _ = script("def f(device=None, x=0):\n    return x")  # (a default: a pool without devices calls it too)
    with_device = executor._pickle_call(f, True, ENCODER)
    without = executor._pickle_call(f, False, ENCODER)
    assert cloudpickle.loads(with_device.body)[1] == 0
    assert cloudpickle.loads(without.body)[1] is None


def test_a_function_that_needs_its_device_given_is_checked_at_every_call(packs):
    # Without devices (pass_device=False) such a function is never kept: a call that gives no device must
    # still be told, though one that gave it came before.
    f, _ = script("def f(x, device):\n    return x")
    assert executor._pickle_call(f, False, ENCODER, 2).body
    assert executor._pickle_call(f, False, ENCODER, 1, {"device": "cpu"}).body
    with pytest.raises(TypeError, match="f needs a `device` argument"):
        executor._pickle_call(f, False, ENCODER, 1)
    assert len(packs) == 2


def test_only_immutable_or_importable_objects_make_a_function_unchanging():
    memo = FunctionMemo()
    import math
    cases = {
        "numbers, strings, tuples, a module, an importable function": ("def f():\n    return (A, B, C, math, floor)",
                                                                       True),
        "a list": ("def f():\n    return L", False),
        "a tuple holding a list": ("def f():\n    return T", False),
        "a local class": ("def f():\n    return K", False),
    }
    for label, (source, kept) in cases.items():
        f, _ = script(source, A=1, B="b", C=(1.0, None, b"x"), math=math, floor=math.floor, L=[1], T=(1, [2]),
                      K=type("K", (), {}))
        memo.put(f, None, "pickle")
        assert (memo.get(f, None) == "pickle") is kept, label


def test_the_memo_does_not_keep_its_functions_alive():
    memo = FunctionMemo()
    f, namespace = script("def f():\n    return 1")
    memo.put(f, None, "pickle")
    ref = weakref.ref(f)
    del f, namespace
    gc.collect()
    assert ref() is None


def test_a_fresh_copy_shares_nothing_a_call_can_rebind():
    def make():
        total = 10

        def f(x, *, scale=2):
            nonlocal total
            global seen
            total += x * scale
            seen = total
            return total

        return f

    prototype = make()
    prototype.__globals__.setdefault("seen", None)
    prototype.tag = "kept"
    copies = [fresh_copy(prototype) for _ in range(2)]
    assert [c(1) for c in copies] == [12, 12]  # each its own cell
    copies[0].__kwdefaults__["scale"] = 5
    assert copies[1](1) == 14 and prototype.__kwdefaults__ == {"scale": 2}
    cells = dict(zip(prototype.__code__.co_freevars, prototype.__closure__))
    assert cells["total"].cell_contents == 10
    assert all(c.tag == "kept" and c.__qualname__ == prototype.__qualname__ for c in copies)
    assert seen is None  # the copies wrote to their own globals, not this module's
