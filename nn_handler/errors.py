"""Every public exception of nn_handler (and, re-exported, the per-rank failure record).

Configuration mistakes subclass :class:`ValueError`, execution failures
subclass :class:`RuntimeError`, and everything subclasses
:class:`NNHandlerError`, so callers can catch at the level they care about;
the exceptions: :class:`TrainingPreempted` is a :class:`SystemExit` on
purpose, and the helpers' errors keep the builtin base they always had
(:class:`DistributedTimeoutError` an ``AssertionError``, :class:`RemoteFailure`,
:class:`PayloadPicklingError` a ``TypeError``). Errors from another process
carry its traceback as their ``__cause__`` (a :class:`RemoteTraceback`), so
Python prints it above the local one. Other modules re-export the errors
they raise, so every old import path keeps working.

The per-rank failure record and its rendering live in :mod:`nn_handler._failure_record` (re-exported
here). This module imports nothing else from the package (and nothing heavy at all) so that spawned workers
can load it cheaply.
"""

from __future__ import annotations

import pickle
import types

# (The private names too: other modules and old pickles import them from here.)
from ._failure_record import _PEER_GONE, RankFailure, _likely_cause_first, _render, _render_rank_failed  # noqa: F401
from ._failure_record import describe_exit  # noqa: F401

__all__ = [
    "NNHandlerError",
    "LaunchEnvironmentError",
    "DeviceError",
    "ConfigurationError",
    "RankFailure",
    "ParallelExecutionError",
    "WorkerDiedError",
    "RankFailedError",
    "CollectiveStallError",
    "NonFiniteLossError",
    "CheckpointError",
    "CheckpointMismatchError",
    "MissingExtraError",
    "PredictionsError",
    "RemoteTraceback",
    "ExecutorTimeoutError",
    "PayloadPicklingError",
    "TrainingPreempted",
    "PREEMPTED_EXIT_CODE",
    "DistributedTimeoutError",
    "RemoteFailure",
]


class NNHandlerError(Exception):
    """Base class of every error raised by nn_handler."""


class LaunchEnvironmentError(NNHandlerError, ValueError):
    """The launcher's environment variables are missing, malformed or inconsistent."""


class DeviceError(NNHandlerError, ValueError):
    """A device specification names a device that does not exist or is not understood."""


class ConfigurationError(NNHandlerError, ValueError):
    """A setting, or a combination of settings, that cannot work here (the message says why and what to do)."""


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process.

    Set as the ``__cause__`` of :class:`ParallelExecutionError` and
    :class:`RankFailedError` (the trick of CPython's
    ``concurrent.futures.process``), so that Python's own printer shows the
    worker's traceback above the local one, joined by "The above exception
    was the direct cause of the following exception". Never raised by itself.

    Example:
        >>> try:
        ...     raise ParallelExecutionError([RankFailure(0, exc_type="ValueError", message="bad",
        ...                                               traceback="Traceback ...\\nValueError: bad\\n")])
        ... except ParallelExecutionError as err:
        ...     type(err.__cause__).__name__, err.__cause__.tb
        ('RemoteTraceback', 'Traceback ...\\nValueError: bad\\n')
    """

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb.rstrip()}\n"""'


def _remote_cause(failures: tuple[RankFailure, ...]) -> RemoteTraceback | None:
    # The first failure with a traceback: failures come root cause first.
    for f in failures:
        if f.traceback:
            return RemoteTraceback(f.traceback)
    return None


class ParallelExecutionError(NNHandlerError, RuntimeError):
    """A function run by a :class:`~nn_handler.ParallelExecutor` failed on one or more workers.

    Mostly raised as the task's own exception that is also this: see :meth:`create`.

    Attributes:
        failures: One :class:`RankFailure` per failed worker, root cause first.
        exceptions: The original exception objects by worker index (those that
            could be rebuilt in this process). Where the task's exception has
            an attribute of one of these names (an ExceptionGroup's
            ``exceptions``), that one stays.
        function: The name of the function that was run.
    """

    def __init__(self, failures, exceptions=None, function: str = "call"):
        _attach(self, tuple(sorted(failures, key=_likely_cause_first)), dict(exceptions or {}), function)
        # BaseException's own __init__, as RankFailedError does: see there.
        # The root's traceback is left out of the message: it is the __cause__, which Python prints above it
        # (in the message too, it printed twice: once per failure is the rule, root cause first).
        BaseException.__init__(self, _render(self._failures, function, root_traceback=False))
        # Set here, not at the raise: an error rebuilt from its records (unpickled) gets it too.
        self.__cause__ = _remote_cause(self._failures)

    original_type: type[BaseException] | None = None  # set on the classes made by create()

    def __str__(self) -> str:
        return BaseException.__str__(self)  # (a class derived with KeyError's first renders as KeyError does)

    def __reduce__(self):
        # Exceptions with a custom __init__ do not unpickle by default; keep the records, not the exception objects.
        return (type(self), (self._failures, {}, self._function))

    @classmethod
    def create(cls, failures, exceptions=None, function: str = "call") -> "ParallelExecutionError":
        """The error for a failed call: the root failure's own exception (type, ``args``, attributes,
        ``__notes__``), an instance of ``cls`` too, as ``cls[KeyError]``; where and on which process it failed is a
        note, the remote traceback its ``__cause__``. Without the original (a death, a class this process cannot
        import): a plain ``cls`` whose message tells it all.

        Example:
            >>> failure = RankFailure(rank=0, pid=42, exc_type="KeyError", message="'weights'")
            >>> err = ParallelExecutionError.create([failure], {0: KeyError("weights")}, "f")
            >>> isinstance(err, KeyError), isinstance(err, ParallelExecutionError), err.args
            (True, True, ('weights',))
            >>> err.__notes__
            ["f failed on rank 0 (?, pid 42): KeyError: 'weights'"]
        """
        error = cls(failures, exceptions, function)
        root = error._failures[0] if error._failures else None
        original = error._exceptions.get(root.rank) if root is not None and not root.died else None
        combined = _combine(cls, original, error._failures, error._exceptions, function)
        return error if combined is None else combined


def _attach(error: BaseException, failures: tuple, exceptions: dict, function: str) -> None:
    """The records of a call's failure; the public names only where the task's exception has no such attribute."""
    error._failures, error._exceptions, error._function = failures, exceptions, function
    for name, value in (("failures", failures), ("exceptions", exceptions), ("function", function)):
        if not hasattr(error, name):
            setattr(error, name, value)


class _CooperativeEnd(Exception):
    """Where a task type's ``super().__init__(...)`` lands in a combined class: Exception's own."""

    def __init__(self, *args, **kwargs):
        BaseException.__init__(self, *args, **kwargs)


def _copy_as(original: BaseException, cls: type) -> BaseException:
    """``original``'s state in a new instance of ``cls``, made without running any ``__init__``: the original
    was built already (unpickled: one constructor call, as in ``ProcessPoolExecutor``'s caller), and a
    constructor may count, log or open things."""
    made = cls.__new__(cls, *original.args)
    made.__dict__.update(vars(original))  # what its __init__ and __setstate__ set (a custom __reduce__'s too)
    if "__notes__" in vars(made):
        made.__notes__ = list(made.__notes__)  # ours are added to the copy only
    # Slots: errno, filename, ... of the builtins; a class's own __slots__.
    fields = [name for klass in type(original).__mro__[:-2] for name, slot in vars(klass).items()
              if type(slot) in (types.MemberDescriptorType, types.GetSetDescriptorType)
              and name not in ("__dict__", "__weakref__")]
    for name in fields:  # (not BaseException's nor object's: args, __class__)
        try:
            if getattr(original, name) is not getattr(made, name, None):
                setattr(made, name, getattr(original, name))
        except (AttributeError, TypeError):
            pass  # read-only (an ExceptionGroup's exceptions: set by the constructor) or unset
    made.args = original.args  # exact, even where __init__ reworded them
    return made


def _combine(base: type, original, failures: tuple, exceptions: dict, function: str):
    """``original`` as an instance of ``base[type(original)]`` with the failure records; ``None`` if impossible."""
    try:
        made = _copy_as(original, _derived_class(type(original), base))
    except Exception:  # no original, no class (a final type), a constructor that will not take its own args
        return None
    _attach(made, failures, exceptions, function)
    made._original = original
    made.add_note(_render(failures, function, root_traceback=False))
    made.__cause__ = _remote_cause(failures)
    return made


def _reduce_combined(self):
    # The class is made at run time: pickled are the task's original exception (else its nearest importable
    # type and args) and the records, combined again on load.
    original = self._original
    try:
        pickle.dumps(original)
    except Exception:
        original = None
    refs = _type_refs(self.original_type, ParallelExecutionError)
    return _rebuild_parallel_error, (self._failures, self._function, refs, original, self.args, type(self).__bases__[-1])


def _rebuild_parallel_error(failures, function, type_refs, original=None, args=(), base=ParallelExecutionError):
    try:
        original = _load_type(type_refs)(*args) if original is None else original
        original.args = args  # as raised, even where its __init__ rewords them
    except Exception:
        original = None
    combined = _combine(base, original, tuple(failures), {}, function)
    return base(failures, {}, function) if combined is None else combined


class WorkerDiedError(ParallelExecutionError):
    """A worker process ended without raising (``os._exit``, a signal, the OOM killer)."""


class ExecutorTimeoutError(ParallelExecutionError, TimeoutError):
    """A call ran past the executor's ``timeout``; the stuck workers were replaced."""


class PayloadPicklingError(TypeError):
    """The arguments of a call could not be pickled (raised before anything is sent)."""


class RankFailedError(NNHandlerError, RuntimeError):
    """Raised on every rank when a rank-restricted call failed on another rank.

    The rank that failed re-raises its own exception; every other rank raises
    this error instead. Where the original exception type can be rebuilt here
    and subclassed, the error is also an instance of it (its class is then
    named ``RankFailedError[ValueError]``), so ``except ValueError`` works on
    every rank alike. Otherwise it is a plain ``RankFailedError``.

    Attributes:
        function: Name of the decorated function (or block) that failed.
        failures: One :class:`RankFailure` per rank that raised, by rank.
        original_type: The exception class this error also is an instance of,
            or ``None``.

    Example:
        >>> failure = RankFailure(rank=0, exc_type="ValueError", message="bad", traceback="...")
        >>> err = RankFailedError.create("save", [failure], ValueError)
        >>> isinstance(err, ValueError), err.ranks
        (True, (0,))
        >>> str(err)   # rank 0's traceback is its __cause__, printed above it
        'save failed on rank 0 (?): ValueError: bad'
    """

    original_type: type[BaseException] | None = None

    def __init__(self, function: str, failures):
        self.function = function
        self.failures = tuple(sorted(failures, key=lambda f: f.rank))
        self._text = _render_rank_failed(function, self.failures)
        # BaseException.__init__ directly, not super(): in a class derived
        # from a user's exception type, super() could reach that type's own
        # __init__, whose signature we do not know.
        BaseException.__init__(self, self._text)
        self.__cause__ = _remote_cause(self.failures)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that raised, ascending."""
        return tuple(f.rank for f in self.failures)

    def __str__(self) -> str:
        # Fixed here so that a derived class does not render through the
        # original type's __str__ (KeyError would quote the whole text).
        return self._text

    def __reduce__(self):
        # Derived classes are made at run time and cannot be pickled by name:
        # rebuild from the records and the original type, which travels as
        # pickled references to its bases so that an unimportable type falls
        # back to its nearest importable base.
        return (_rebuild_rank_failed_error, (self.function, self.failures, _type_refs(self.original_type)))

    @classmethod
    def create(cls, function: str, failures, exc_type: type[BaseException] | None = None) -> "RankFailedError":
        """Build the error, an instance of ``exc_type`` too where that is possible.

        Args:
            function: Name of the function (or block) that failed.
            failures: :class:`RankFailure` records of the ranks that raised.
            exc_type: The original exception class (of the lowest failed rank).

        Returns:
            A ``RankFailedError[exc_type.__name__]`` or, when ``exc_type`` is
            ``None``, not an ``Exception`` subclass, or cannot be combined
            with this class, a plain :class:`RankFailedError`.
        """
        derived = _derived_class(exc_type)
        if derived is not None:
            try:
                return derived(function, failures)
            except Exception:  # a type whose __new__ rejects our arguments
                pass
        return RankFailedError(function, failures)


_DERIVED: dict[tuple, type] = {}  # (base, original type) -> derived class


def _derived_class(exc_type, base: type | None = None) -> type | None:
    """``base[exc_type]`` (``RankFailedError`` by default), made once per type; ``None`` when it cannot or need
    not exist. A ParallelExecutionError's puts the task's type first: its methods and ``__init__`` win."""
    base = base or RankFailedError
    task_first = issubclass(base, ParallelExecutionError)
    if isinstance(exc_type, type) and issubclass(exc_type, ParallelExecutionError if task_first else base):
        exc_type = exc_type.original_type  # an error relayed again: keep the root type
    # Only Exception subclasses: an error that is also a KeyboardInterrupt or
    # SystemExit would escape `except Exception` where nothing was interrupted.
    if not isinstance(exc_type, type) or not issubclass(exc_type, Exception):
        return None
    if (above := issubclass(base, exc_type)) and not task_first:  # RuntimeError, Exception: a base of ours
        return None
    cls = _DERIVED.get((base, exc_type))
    if cls is None:
        name = f"{base.__name__}[{exc_type.__name__}]"
        namespace = dict(__module__=__name__, __qualname__=name, original_type=exc_type)
        namespace.update(dict(__reduce__=_reduce_combined) if task_first else {})
        try:
            # (A base of ours cannot come first in the MRO: there _CooperativeEnd alone takes the task's args.)
            bases = (_CooperativeEnd, base) if above else (exc_type, _CooperativeEnd, base)
            cls = types.new_class(name, bases if task_first else (base, exc_type), {}, lambda ns: ns.update(namespace))
        except TypeError:  # what Python forbids: a final class, a metaclass or layout conflict
            return None
        cls = _DERIVED.setdefault((base, exc_type), cls)
    return cls


def _type_refs(exc_type, base: type | None = None) -> tuple[bytes, ...]:
    """Pickled references to ``exc_type`` and its bases, most derived first, stopping at a base we already are."""
    refs = []
    for cls in getattr(exc_type, "__mro__", ()):
        if issubclass(base or RankFailedError, cls):
            break
        try:
            refs.append(pickle.dumps(cls))
        except Exception:  # a local or dynamic class: try its bases
            continue
    return tuple(refs)


def _load_type(refs) -> type | None:
    """The first class in ``refs`` that can be imported here, else ``None``."""
    for ref in refs:
        try:
            cls = pickle.loads(ref)
        except Exception:
            continue
        if isinstance(cls, type):
            return cls
    return None


def _rebuild_rank_failed_error(function, failures, type_refs):
    return RankFailedError.create(function, failures, _load_type(type_refs))


class CollectiveStallError(NNHandlerError, RuntimeError):
    """A rank waited in a collective longer than ``stall_timeout`` for ranks that did not come (or died).

    Raised on every live rank of the group instead of waiting for the
    process group's timeout; each rank wrote a report (every rank's place,
    stack and time there) to the log and to ``report_path``.

    Attributes:
        collective: The collective that stalled (``"all_reduce"``, ``"on_rank(save) status"``).
        missing: Ranks that were alive but elsewhere.
        dead: Ranks that stopped beating and whose process is gone.
        report_path: This rank's report file.

    Example:
        >>> err = CollectiveStallError("all_reduce stalled on rank 0: rank 1 is at train.py:12", "all_reduce", [1])
        >>> err.missing, isinstance(err, RuntimeError)
        ((1,), True)
    """

    def __init__(self, message: str, collective: str = "", missing=(), dead=(), report_path: str | None = None):
        self.collective, self.missing, self.dead = collective, tuple(missing), tuple(dead)
        self.report_path = report_path
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.collective, self.missing, self.dead, self.report_path))


class NonFiniteLossError(NNHandlerError, RuntimeError):
    """The training loss became NaN or infinite; raised on every rank at the same point.

    Attributes:
        epoch: The epoch in which the loss was first non-finite, counted from 1
            as in the History.
        step: The batch index within that epoch (from 0) where it first happened.
        value: The offending loss value (``nan``, ``inf``), when known.
        ranks: The ranks that saw it, when known (empty for a single process).
    """

    def __init__(self, epoch: int, step: int, value: float = float("nan"), ranks=()):
        self.epoch, self.step, self.value, self.ranks = epoch, step, value, tuple(ranks)
        where = f" on rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}" if self.ranks else ""
        super().__init__(
            f"loss is {value} at epoch {epoch}, step {step}{where}; lower the learning rate, set clip_grad_norm, "
            f"or check the inputs of that batch for NaN/inf"
        )

    def __reduce__(self):
        return (type(self), (self.epoch, self.step, self.value, self.ranks))


class CheckpointError(NNHandlerError, RuntimeError):
    """A checkpoint file is missing, corrupt, truncated, or not an nn_handler checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's weights do not fit the model (another model, or a changed architecture).

    Attributes:
        missing: Keys the model has and the checkpoint lacks.
        unexpected: Keys the checkpoint has and the model lacks.
        mismatched: ``(key, checkpoint shape, model shape)`` for keys whose shapes differ.
    """

    def __init__(self, message: str, missing=(), unexpected=(), mismatched=()):
        self.missing, self.unexpected, self.mismatched = tuple(missing), tuple(unexpected), tuple(mismatched)
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.missing, self.unexpected, self.mismatched))


class PredictionsError(NNHandlerError, RuntimeError):
    """A predictions directory (``parallel_predict(output_dir=...)``) cannot give what was asked: it is incomplete,
    a shard is unreadable, or the item failed (``on_error="skip"``); the message names the directory and the item."""


class MissingExtraError(NNHandlerError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


#: Exit code of a process that stopped training because it was preempted and
#: wrote a checkpoint first: ``EX_TEMPFAIL`` from ``sysexits.h``, "temporary
#: failure, retry later". It differs from 143 (128 + SIGTERM), which a shell or
#: scheduler reports for a process that the signal killed before it could save.
PREEMPTED_EXIT_CODE = 75


class TrainingPreempted(SystemExit):
    """Training stopped on a preemption signal after writing a checkpoint; raised on every rank.

    A :class:`SystemExit` on purpose, not an error: left uncaught, the process
    exits quietly with :data:`PREEMPTED_EXIT_CODE` (torchrun's ``@record``
    re-raises it without writing an error file), and ``except Exception`` in
    user code does not swallow it. Rerunning the same command with
    ``resume="auto"`` continues from :attr:`checkpoint`.

    Attributes:
        checkpoint: The checkpoint written (or already on disk) for this stop.
        epoch: The epoch in progress when training stopped (from 1).
        batches: Batches of that epoch already trained (0: the epoch is complete).
        signal_name: The signal that asked for the stop, e.g. ``"SIGTERM"``.

    Example:
        >>> exc = TrainingPreempted("ckpt/epoch-0002.ckpt", 2, 0, "SIGTERM")
        >>> exc.code, isinstance(exc, Exception)
        (75, False)
    """

    def __init__(self, checkpoint: str, epoch: int, batches: int, signal_name: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.checkpoint, self.epoch, self.batches, self.signal_name = str(checkpoint), epoch, batches, signal_name

    def __str__(self) -> str:
        where = f"after {self.batches} batches of epoch {self.epoch}" if self.batches else f"after epoch {self.epoch}"
        return (f"training preempted by {self.signal_name} {where}; wrote {self.checkpoint}; "
                f"exit code {PREEMPTED_EXIT_CODE}: rerun the same command (resume='auto') to continue")

    def __reduce__(self):
        return (type(self), (self.checkpoint, self.epoch, self.batches, self.signal_name))


class DistributedTimeoutError(AssertionError):
    """:func:`nn_handler.testing.run_distributed`: some ranks did not finish in time (they were killed).

    Attributes:
        unfinished: The ranks that were still running.
        results: What every rank returned or raised; ``None`` for the unfinished ones.
    """

    def __init__(self, message: str, unfinished: list[int], results: list):
        super().__init__(message)
        self.unfinished = unfinished
        self.results = results


class RemoteFailure(Exception):
    """:func:`nn_handler.testing.run_distributed`: stands in for a rank's exception that could not come back as
    itself, or for a rank that died."""
