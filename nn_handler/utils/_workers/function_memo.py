"""A function's pickle, kept between calls for as long as it cannot have changed.

cloudpickle sends a function of a script or notebook by value: its code and
the globals, closure cells, defaults and attributes it refers to. Pickling
that again on every call cost 17 µs here, more than a sixth of a warm call.
The bytes can only change if one of those objects changes. So where each is
immutable (numbers, strings, code, tuples of them) or travels by reference
(a module, an importable function or class), the same objects give the same
bytes: the memo keeps the pickle with the objects it was made from, and hands
it out again while the function still refers to exactly those objects.

A function that refers to anything else (a list, a dict, a tensor, a model,
another function of the script) is pickled on every call, as before: an
in-place change to such an object between calls must reach the workers.

The worker keeps the same promise from its side: it loads such a function
once and runs a :func:`fresh_copy` of it on each call, which is what a new
load would give.

Example:
    >>> memo = FunctionMemo()
    >>> def scale(x, factor=2):
    ...     return x * factor
    >>> memo.get(scale, None) is None
    True
    >>> memo.put(scale, None, "its pickle")
    >>> memo.get(scale, None)
    'its pickle'
    >>> scale.__defaults__ = (3,)          # a different object: pickled again
    >>> memo.get(scale, None) is None
    True
"""

from __future__ import annotations

import itertools
import operator
import sys
import types
import weakref
from typing import NamedTuple

import cloudpickle

# Immutable, and pickled by value in full: the same object gives the same bytes.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, types.CodeType, type(Ellipsis)})
_MISSING = object()  # a global the function names that does not exist (yet)
_EMPTY = object()  # a closure cell not filled yet
_END = object()  # ends each mapping flattened into the inputs
_MISSINGS = itertools.repeat(_MISSING)
# cloudpickle copies these from the function's module into the rebuilt function's globals.
_MODULE_GLOBALS = ("__package__", "__name__", "__path__", "__file__")


class FunctionMemo:
    """Pickled functions by function object; an entry is handed out only while its function's inputs are the same objects."""

    def __init__(self):
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, fn, key):
        """The value kept for ``(fn, key)`` if ``fn`` still refers to the objects it was pickled from, else ``None``.

        ``key``: whatever else the value was made from (the executor's ``pass_device``)."""
        entry = self._entries.get(fn) if type(fn) is types.FunctionType else None
        if entry is None or entry.key != key or entry.modules != len(sys.modules):
            return None  # modules: one imported since may have to go along with the function
        inputs = _inputs(fn, entry.names)
        if len(inputs) != len(entry.inputs) or not all(map(operator.is_, inputs, entry.inputs)):
            return None
        return entry.value

    @staticmethod
    def unchanging(fn) -> bool:
        """Whether every object ``fn`` refers to cannot change (so its pickle cannot either): only such are kept."""
        # Not a bound method (a new object per access) nor a partial (mutable state).
        return type(fn) is types.FunctionType and all(map(_unchanging, _inputs(fn, _global_names(fn.__code__))))

    def put(self, fn, key, value) -> None:
        """Keep ``value`` (the pickle of ``fn``, made with ``key``) if ``fn`` is :meth:`unchanging`."""
        if not self.unchanging(fn):
            return
        names = _global_names(fn.__code__)
        self._entries[fn] = _Entry(key, len(sys.modules), names, _inputs(fn, names), value)


class _Entry(NamedTuple):
    key: object
    modules: int  # len(sys.modules) when it was pickled
    names: tuple[str, ...]
    inputs: list
    value: object


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Every name ``code`` and the code nested in it may look up in the globals (a superset, as cloudpickle's)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


def _inputs(fn: types.FunctionType, names: tuple[str, ...]) -> list:
    """The objects cloudpickle makes ``fn``'s pickle from, in a fixed order (mutable dicts flattened into it)."""
    lookup = fn.__globals__.get
    inputs = [fn.__code__, fn.__defaults__, fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__]
    inputs.extend(map(lookup, _MODULE_GLOBALS, _MISSINGS))
    inputs.extend(map(lookup, names, _MISSINGS))
    for cell in fn.__closure__ or ():
        try:
            inputs.append(cell.cell_contents)
        except ValueError:
            inputs.append(_EMPTY)
    for mapping in (fn.__kwdefaults__, fn.__annotations__, fn.__dict__):
        if mapping:
            for item in mapping.items():
                inputs.extend(item)
        inputs.append(_END)
    return inputs


def _unchanging(value, depth: int = 0) -> bool:
    """Whether ``value`` pickles to the same bytes for as long as it is the same object."""
    kind = type(value)
    if kind in _ATOMS or value is _MISSING or value is _EMPTY or value is _END:
        return True
    if kind in (tuple, frozenset):
        return depth < 4 and all(_unchanging(v, depth + 1) for v in value)
    if isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)):
        return _by_reference(value)
    return False


def _by_reference(obj) -> bool:
    """Whether cloudpickle sends ``obj`` by name (an importable module, function or class), not by value."""
    if isinstance(obj, types.ModuleType):
        module = obj
    else:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        if module is None or module.__name__ == "__main__":
            return False
        found = module
        for part in getattr(obj, "__qualname__", "<").split("."):
            found = getattr(found, part, None)
        if found is not obj:
            return False  # a local function or class, or one shadowed in its module: sent by value
    if sys.modules.get(module.__name__) is not module:
        return False
    registered = cloudpickle.list_registry_pickle_by_value()
    return not any(module.__name__ == name or module.__name__.startswith(name + ".") for name in registered)


# ----------------------------------------------------------------------------- in the worker
def fresh_copy(fn: types.FunctionType) -> types.FunctionType:
    """A function like ``fn`` with its own globals, closure cells and attributes, as loading it again would give.

    For a function whose every global, cell and attribute is immutable or a
    module-level object (what ``unchanging`` promises), this is what a new
    load makes, at a third of the cost: a call that rebinds a global or a
    cell changes only its own copy.

    Example:
        >>> def count():
        ...     global calls
        ...     calls += 1
        ...     return calls
        >>> namespace = {"calls": 0}
        >>> prototype = types.FunctionType(count.__code__, namespace)
        >>> fresh_copy(prototype)(), fresh_copy(prototype)(), namespace["calls"]
        (1, 1, 0)
    """
    closure = None if fn.__closure__ is None else tuple(map(_new_cell, fn.__closure__))
    copy = types.FunctionType(fn.__code__, dict(fn.__globals__), fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else fn.__kwdefaults__
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__annotations__ = dict(fn.__annotations__)
    if fn.__dict__:
        copy.__dict__.update(fn.__dict__)
    return copy


def _new_cell(cell) -> types.CellType:
    try:
        return types.CellType(cell.cell_contents)
    except ValueError:  # empty
        return types.CellType()
