"""The cloudpickle every message to a worker goes through: a function sent by value keeps the name of its file.

cloudpickle 3.1 and later rename the file of every code object it sends to
``<dynamic-code>`` (so a function's bytes do not depend on where it was
defined). A worker's traceback then reads ``File "<dynamic-code>", line 226``
with no source line, and a stall report cannot tell the user's frame from
the library's. :class:`Pickler` sends each code object as cloudpickle does
and puts its file's name back on load; older cloudpickle kept it already.

The traceback printer reads the source through :mod:`linecache`, from the
file itself. Where the caller has no such file (a notebook cell, an IPython
session) but :mod:`linecache` holds its lines, they travel too and are put
into the worker's :mod:`linecache`.

Example:
    >>> import traceback
    >>> def fails():
    ...     raise ValueError("boom")
    >>> copy = pickle.loads(dumps(fails))
    >>> copy.__code__.co_filename == fails.__code__.co_filename
    True
    >>> try:
    ...     copy()
    ... except ValueError:
    ...     print(traceback.format_exc().splitlines()[-2].strip())
    raise ValueError("boom")
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import types
import weakref
from collections import ChainMap

import cloudpickle

__all__ = ["Pickler", "dumps"]

# cloudpickle's own reducer for code objects (the attribute is public in every version the package allows).
_cloudpickle_code_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]
# By identity: code objects compare equal across files (co_filename is not
# compared), so a WeakKeyDictionary would hand one file's name to another.
_reduced: dict[int, tuple[weakref.ref, tuple]] = {}


def _readable(filename: str) -> bool:
    """Whether a worker can read ``filename``'s source itself (or none exists: ``<stdin>``, ``<string>``)."""
    return filename.startswith("<") or os.path.isfile(filename)


def _reduce_code(code: types.CodeType):
    # A code object cannot change, nor can its reduction: made once, it costs a
    # dictionary look-up (cloudpickle's own copies every tuple each time).
    key = id(code)
    entry = _reduced.get(key)
    if entry is None or entry[0]() is not code:
        entry = _reduced[key] = (weakref.ref(code, lambda _, key=key: _reduced.pop(key, None)),
                                 _reduce_code_once(code))
    return entry[1]


def _reduce_code_once(code: types.CodeType):
    rebuild, args = _cloudpickle_code_reduce(code)
    filename = code.co_filename
    # The source travels only where the worker could not read it from the file (it is the caller's own).
    lines = None if _readable(filename) else linecache.getlines(filename)
    return _code_in_file, (rebuild, args, filename, lines or None)  # one list per file: pickled once


def _code_in_file(rebuild, args: tuple, filename: str, lines: list | None) -> types.CodeType:
    """In the worker: the code object as cloudpickle rebuilds it, in its own file again."""
    code = rebuild(*args)
    if lines is not None and filename not in linecache.cache:
        # mtime None: linecache.checkcache keeps an entry it cannot compare with a file.
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


class Pickler(cloudpickle.Pickler):
    """``cloudpickle.Pickler``, with code objects keeping their ``co_filename``."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)`` through :class:`Pickler`; ``pickle.loads`` reads it."""
    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
