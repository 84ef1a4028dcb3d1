"""A task's exception as the caller gets it (``ParallelExecutionError.create``): itself, rebuilt once."""

from __future__ import annotations

import pickle

from nn_handler.errors import ParallelExecutionError, RankFailure


class Counted(Exception):
    made = 0

    def __init__(self, *args):
        Counted.made += 1
        super().__init__(*args)


class Reduced(Exception):
    """Pickles through its own ``__reduce__``: its ``args`` are not what its constructor takes."""

    def __init__(self, path, line):
        super().__init__(f"{path}:{line}")
        self.path, self.line = path, line

    def __reduce__(self):
        return Reduced, (self.path, self.line)


class Slotted(Exception):
    __slots__ = ("code",)

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return Slotted, (self.args[0], self.code)


def _as_the_caller_gets_it(exc: BaseException) -> BaseException:
    original = pickle.loads(pickle.dumps(exc))  # as it comes from the worker
    record = RankFailure(rank=0, device="cpu", pid=1, exc_type=type(exc).__qualname__, message=str(exc))
    return ParallelExecutionError.create([record], {0: original}, "f")


def test_the_exception_is_built_once_in_the_caller():
    exc = Counted("once")
    Counted.made = 0
    err = _as_the_caller_gets_it(exc)
    assert Counted.made == 1  # the unpickling's call, as ProcessPoolExecutor makes it; none for the copy
    assert isinstance(err, Counted) and isinstance(err, ParallelExecutionError) and err.args == ("once",)


def test_what_a_constructor_set_comes_along_without_running_it_again():
    err = _as_the_caller_gets_it(Reduced("train.py", 12))
    assert isinstance(err, Reduced) and (err.path, err.line) == ("train.py", 12) and err.args == ("train.py:12",)
    err = _as_the_caller_gets_it(Slotted("busy", 429))
    assert isinstance(err, Slotted) and err.code == 429 and err.args == ("busy",)


def test_the_notes_added_to_the_copy_stay_off_the_original():
    exc = Counted("noted")
    exc.add_note("mine")
    original = pickle.loads(pickle.dumps(exc))
    err = ParallelExecutionError.create([RankFailure(rank=0, exc_type="Counted", message="noted")], {0: original}, "f")
    assert err.__notes__[0] == "mine" and len(err.__notes__) == 2 and original.__notes__ == ["mine"]
