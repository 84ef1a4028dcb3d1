"""What tests/pool/test_futures.py runs in ProcessPoolExecutor's workers, in a module that imports nothing heavy.

ProcessPoolExecutor pickles a function by reference: its spawned worker
imports the function's module. Defined in the test module, each worker would
import torch, nn_handler and pytest with it (about 2 s of CPU a worker).
"""

from __future__ import annotations

import errno
import os
import pickle
import time


def square(x):
    return x * x


def add(a, b=0):
    return a + b


def divide(a, b):
    return a / b


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def fail_on(x, bad):
    if x == bad:
        raise KeyError(f"item {x}")
    return x


def pid_of(_=None):
    return os.getpid()


class ErrorAtPickle:
    """A result no worker can send back (as CPython's test_concurrent_futures has it)."""

    def __reduce__(self):
        raise pickle.PicklingError("error at pickle")


def unpicklable_result():
    return ErrorAtPickle()


def exits(code):
    raise SystemExit(code)


def interrupts():
    raise KeyboardInterrupt("stop")


class Dummy:
    pass


def make_dummy(_):
    return Dummy()


class CodedError(Exception):
    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


def raise_as(kind):
    """A task that raises an exception with more to it than a message."""
    if kind == "key":
        raise KeyError("weights")
    if kind == "missing":
        open("/nonexistent/weights.pt")
    if kind == "timeout":
        raise TimeoutError("the device did not answer")
    if kind == "reset":
        raise ConnectionResetError(errno.ECONNRESET, "peer went away")
    if kind == "group":
        raise ExceptionGroup("two failures", [ValueError(1), KeyError(2)])
    if kind in ("runtime", "plain"):  # the bases of ParallelExecutionError itself
        error = (RuntimeError if kind == "runtime" else Exception)(123)
        error.code = 7
        error.add_note("mine")
        raise error
    error = CodedError("too many", 429)
    error.add_note("retry later")
    raise error


def touch(path):
    open(path, "w").close()
    return path


def value_once_there(path, value):
    """``value`` once ``path`` exists (60 s at most): a task that ends when the test lets it, however slow the machine."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value
