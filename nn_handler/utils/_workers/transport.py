"""Serialisation between the caller and its workers: cloudpickle, with large tensors in shared memory.

Small objects travel as cloudpickle bytes (lambdas, closures and functions
defined in ``__main__`` or a notebook included; their code keeps the name of
its file, see :mod:`.pickler`). A CPU tensor of at least
``SHM_THRESHOLD`` bytes is copied once into a file under ``/dev/shm`` and only
a reference to the file travels; the receiver maps that file (torch owns the
mapping, so it is released with the tensor). The caller's files have no name
from the start: a worker opens them through the caller's descriptor; a
worker's results are named until the caller maps them and unlinks the name
(:mod:`.shm_files`).

Functions travel the same way (:meth:`Encoder.pack_function`), except that
their large tensors are referenced by index rather than embedded: the rest,
the function's body, is the same bytes for the same function in the same
state, so a worker that holds it (:class:`FunctionCache`) gets only its
digest, and every call still carries the tensors' current values in its own
files.

Where the files live (``NN_HANDLER_SHM_DIR``, the temp dir when that is
full), how they are named and who removes them is :mod:`.shm_files`.

A worker's result files are lent rather than given: both sides keep them
open (with no name), and once the caller has dropped a result the worker
writes a later one of the same size into the same file, whose memory exists
already (:mod:`.lending`). A CUDA result goes from the device straight into
its file, through a mapping the worker keeps page-locked.

Why not torch.multiprocessing's shared-memory reducers: they hand over file
descriptors that the *sending* process must stay alive to serve, so a worker
that exits right after sending loses its results (the ``EOFError`` trap). A
result's named file outlives its writer, and its reader needs nobody. The
caller's files need their sender alive, and that is the caller: its workers
serve nobody else.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import gc
import hashlib
import io
import itertools
import os
import pickle
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import lending
from .tensor_bytes import pack_list, reduce_tensor
from .pickler import Pickler
from .function_memo import fresh_copy
from .shm_files import SHM_DIR_ENV, _seen_dirs, _warn_spill, create, named_copy, open_file, remove_files, spill_dir
# Re-exported (their home was here): the pool and the worker name their files through the transport.
from .shm_files import probe, refused, remove_prefixed, remove_process_files, shm_prefix  # noqa: F401
from .shm_files import _Refused, use_named  # noqa: F401  (the worker's, for a caller that turned refused)

# Below this size a tensor is cheaper as bytes in the message than as a file
# to create, map and unlink.
SHM_THRESHOLD = 1 << 20


def _map(fd: int, path: str, nbytes: int, shared: bool) -> torch.UntypedStorage:
    # Through the descriptor: from_file() given a name that is gone would
    # create an empty file and read zeros instead of failing.
    return torch.UntypedStorage.from_file(lending.fd_path(fd) if lending.available() else path, shared=shared,
                                          nbytes=nbytes)


def _rebuild_shared(ref, nbytes: int, dtype: torch.dtype, shape, requires_grad: bool, private: bool):
    # private=True maps copy-on-write: an argument shared by every worker must
    # not see one worker's in-place writes. ``ref``: see shm_files.create.
    fd = open_file(ref, os.O_RDONLY if private else os.O_RDWR)  # FileNotFoundError: removed before it was read
    try:
        storage = _map(fd, ref, nbytes, shared=not private)
    finally:
        os.close(fd)
    if not private and type(ref) is str:
        os.unlink(ref)  # a named file read by one process only: drop the name now
    tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _rebuild_lent(owner: str, key: str, nbytes: int, dtype: torch.dtype, shape, requires_grad: bool):
    # A worker's result: the file stays open here, to go back to the worker once this tensor is gone.
    fd = lending.open_result(owner, key)
    try:
        storage = _map(fd, key, nbytes, shared=True)
    except BaseException:
        os.close(fd)
        raise
    lending.track(owner, key, fd, nbytes, storage)
    tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


# The raw memory of a large tensor, written to its file without a copy (a
# storage has no buffer interface; numpy is not a dependency). Small tensors
# travel as bytes in the message instead: see tensor_bytes.
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PyBUF_READ = 0x100

# Pickled alike by the C pickler and by ours, which costs 2 µs just to set up:
# the common small results and arguments (a number, a short tuple of them) skip it.
_PLAIN_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_MAX_ITEMS = 8


def plain(obj, depth: int = 0) -> bool:
    """Whether ``obj`` holds only numbers, strings and bytes, in a few small tuples, lists or dicts (pickled
    alike by the C pickler, and unpickled without running anything but pickle's own code)."""
    kind = type(obj)
    if kind in _PLAIN_ATOMS:
        return True
    if kind is dict and all(type(k) is str for k in obj):
        obj = obj.values()
    elif kind is not tuple and kind is not list:
        return False
    if depth >= 2 or len(obj) > _PLAIN_MAX_ITEMS:
        return False
    for v in obj:  # a loop, not all(<generator>): this runs on every call's arguments and result
        if type(v) not in _PLAIN_ATOMS and not plain(v, depth + 1):
            return False
    return True


class _Pickler(Pickler):
    def __init__(self, file, prefix: str | None, counter, *, to_cpu: bool, private: bool, spill: bool = False,
                 probe: bool = False, lent: lending.WorkerFiles | None = None, hold: bool = False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._lent = lent
        self._hold = hold
        self._prefix = prefix
        self._counter = counter
        self._to_cpu = to_cpu
        self._private = private
        self._spill = spill
        self._probe = probe
        self.created: list = []  # each file made, as shm_files.create names it
        self.written: list[tuple[str, int, int]] = []  # (name, fd, bytes) of each file written, lent ones open
        self.needs_files = False

    def reducer_override(self, obj):
        # Called for nearly every object pickled (a map chunk's thousands of
        # tensors): the common case, a small tensor, takes two calls here.
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:  # (a subclass keeps its own pickling)
            t = self._sendable(obj)
            if t is not None:
                return reduce_tensor(t) if self._prefix is None or t.nbytes < SHM_THRESHOLD else self._reduce_large(t)
        return super().reducer_override(obj)

    def _sendable(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` as this pickler sends it (detached and on the CPU for results), or ``None``: torch pickles it."""
        if self._to_cpu and (t.requires_grad or not t.is_cpu):
            if self._direct(t):
                return t.detach()  # from its device straight into its file (_write), no pageable copy
            t = t.detach().cpu()
        if not t.is_cpu or t.layout is not torch.strided or t.is_nested or t.is_quantized or t.is_conj() or t.is_neg():
            return None  # torch's own pickling knows these (a nested tensor has no flat bytes)
        if t.requires_grad and not t.is_leaf:
            return None  # let pickle raise its usual error for non-leaf tensors
        if type(t) is torch.nn.Parameter:
            return None  # keep the Parameter type (rare in payloads; torch pickles it, its .data comes back here)
        return t

    def _direct(self, t: torch.Tensor) -> bool:
        return (self._lent is not None and not self._spill and t.nbytes >= SHM_THRESHOLD
                and self._lent.copies_directly(t) and t.layout == torch.strided
                and not (t.is_quantized or t.is_conj() or t.is_neg()))

    def _reduce_large(self, t: torch.Tensor):
        """How ``t`` (sendable, of at least ``SHM_THRESHOLD`` bytes) travels: by the name of a file."""
        if self._probe:
            self.needs_files = True
            return int, ()  # a stand-in: probing checks that the rest pickles, and copies nothing
        path = self._write(t)
        if self._lent is not None:
            return _rebuild_lent, (self._prefix, path, t.nbytes, t.dtype, tuple(t.shape), t.requires_grad)
        return _rebuild_shared, (path, t.nbytes, t.dtype, tuple(t.shape), t.requires_grad, self._private)

    def _write(self, t: torch.Tensor):
        """Copy ``t`` into a spare file of its size (a lending sender), else into a new file; how a reader finds it."""
        taken = self._lent.take(t.nbytes) if self._lent is not None and not self._spill else None
        if taken is not None:
            path, fd = taken
        else:
            path, fd = create(self._prefix, next(self._counter), t.nbytes, spill=self._spill, hold=self._hold)
            self.created.append(path)
        self.written.append((path, fd, t.nbytes))
        try:
            if taken is not None or self._direct(t):  # a spare's memory exists, or a device's copy needs it
                self._lent.write_direct(path, fd, t)  # through a mapping it keeps (page-locked for a device)
                return path
            # write() fills tmpfs at memcpy speed; copying through a fresh
            # mapping page-faults every 4 KiB and runs at about half of it.
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            view = _memory_view(flat.data_ptr(), flat.nbytes, _PyBUF_READ)  # valid while `flat` lives
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], written)
        finally:
            if self._lent is None and type(path) is str:  # (a held file's descriptor is the file)
                os.close(fd)
        return path


class _FunctionPickler(_Pickler):
    """Pickles a function with its large tensors left out of the bytes: each goes to a file, named by its index.

    The bytes are then the same for the same function in the same state,
    whatever the values in its large tensors, so they can name it in a
    worker's cache, while this call's files carry the values. (Through
    reducer_override, not persistent_id: pickle calls that for every object,
    ints and strings included, and it doubled the cost of a small lambda.)
    """

    def __init__(self, file, prefix: str | None, counter, *, spill: bool = False, hold: bool = False):
        super().__init__(file, prefix, counter, to_cpu=False, private=True, spill=spill, hold=hold)
        self.bindings: list[tuple] = []  # per index: how the worker maps this call's file (see _rebuild_shared)

    def _reduce_large(self, t: torch.Tensor):
        # (A small tensor stays in the bytes: a change to it changes the function's digest.)
        _, args = super()._reduce_large(t)  # _rebuild_shared's: this pickler neither probes nor lends
        self.bindings.append(args[:-1])  # (file, nbytes, dtype, shape, requires_grad)
        # Met twice, a tensor is reduced once (pickle's memo): one file, one tensor in the worker.
        return _bound_tensor, (len(self.bindings) - 1,)


def _bound_tensor(index: int):
    """Stands for a function's large tensor in its bytes; :class:`_FunctionUnpickler` puts this call's file there."""
    raise RuntimeError("internal error: a function's bytes were loaded without the files of its large tensors; "
                       "load them with load_function")


class _FunctionUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, bindings, mapped: list):
        super().__init__(io.BytesIO(data))
        self._bindings = bindings
        self._mapped = mapped

    def find_class(self, module, name):
        if name == "_bound_tensor" and module == __name__:
            # Not a bound method: pickle's memo keeps what this returns, and
            # a cycle through the unpickler would keep this call's mappings
            # (the files' memory) alive until the garbage collector runs.
            return functools.partial(_map_bound, self._bindings, self._mapped)
        return super().find_class(module, name)


def _map_bound(bindings, mapped: list, index: int) -> torch.Tensor:
    # Copy-on-write: the function may write to its tensors in place; that
    # stays in this call (the caller removes the file afterwards).
    tensor = _rebuild_shared(*bindings[index], private=True)
    mapped.append(weakref.ref(tensor))
    return tensor


class Encoder:
    """Pickles objects for one side of a pool, naming its shared-memory files with ``prefix``.

    Args:
        prefix: Unique file-name prefix under ``/dev/shm`` for this sender, or
            ``None`` to send every tensor as bytes.
        to_cpu: Detach tensors and move them to CPU (results do this).
        private: Receivers map copy-on-write and leave the file for the sender
            to remove (arguments shared by several workers do this).
        lend: The receiver keeps the file's name and gives it back once it
            drops the tensor; this sender writes a later tensor of the same
            size into it (a worker's results do this; see :mod:`.lending`).
        hold: The files keep no name; this sender holds them open until they
            are removed, and its receivers must read them while it lives
            (the caller's files; see :func:`.shm_files.create`). By default
            unless ``lend``.
    """

    def __init__(self, prefix: str | None, *, to_cpu: bool = False, private: bool = False, lend: bool = False,
                 hold: bool | None = None):
        self.prefix = prefix
        self.to_cpu = to_cpu
        self.private = private
        self.hold = not lend if hold is None else hold
        self.lent = lending.WorkerFiles() if lend and prefix and lending.available() else None
        self._counter = itertools.count()
        if prefix:
            _seen_dirs.add(os.path.dirname(prefix))

    def dumps(self, obj) -> tuple[bytes, list]:
        """Return the bytes and the shared-memory files created for them (for :func:`remove_files`)."""
        if plain(obj):
            return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), []  # nothing for cloudpickle to do: the C pickler
        packed = self._packed(obj)
        if packed is not None:
            return packed, []
        data, pickler = self._with_room(lambda spill: self._dump(obj, spill))
        if self.lent is not None:
            for path, fd, nbytes in pickler.written:
                self.lent.lent(path, fd, nbytes)
        return data, pickler.created

    def named_copies(self, refs) -> dict:
        """``{ref: name}``: a named copy of each file among ``refs`` that this process holds, for workers
        refused ``/proc/<pid>/fd`` (:func:`.shm_files.use_named`); remove them with :func:`remove_files`."""
        copies: dict = {}
        try:
            for ref in refs:
                if type(ref) is tuple and ref not in copies:
                    copies[ref] = named_copy(ref, self.prefix, next(self._counter))
        except BaseException:
            remove_files(list(copies.values()))
            raise
        return copies

    def pack_function(self, fn) -> "PackedFunction":
        """Pickle a function to send, its large tensors (closure, defaults) in files like arguments.

        Raises what :meth:`dumps` raises.
        """
        body, pickler = self._with_room(lambda spill: self._dump(fn, spill, function=True))
        return PackedFunction(hashlib.blake2b(body, digest_size=16).digest(), body, tuple(pickler.bindings),
                              tuple(pickler.created))

    def _with_room(self, dump):
        try:
            return dump(False)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        # The directory filled up while we wrote (others write there too):
        # every file of this message goes to the temp dir instead.
        _warn_spill(os.path.dirname(self.prefix))
        try:
            return dump(True)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, f"no room for the large tensors of this message in "
                                        f"{os.path.dirname(self.prefix)} nor in {spill_dir()}; free space there, "
                                        f"or point {SHM_DIR_ENV} at a larger directory") from exc

    def probe(self, obj) -> bytes | None:
        """Pickle ``obj`` without creating files: its bytes, or ``None`` if it holds a tensor that needs a file.

        Raises what :meth:`dumps` raises for what cannot be pickled, at the
        cost of pickling, not of copying the large tensors.
        """
        packed = self._packed(obj)
        if packed is not None:
            return packed
        buf = io.BytesIO()
        pickler = _Pickler(buf, self.prefix, self._counter, to_cpu=self.to_cpu, private=self.private, probe=True)
        pickler.dump(obj)
        return None if pickler.needs_files else buf.getvalue()

    def _packed(self, obj) -> bytes | None:
        """A list of small tensors of one dtype (a map's chunk, its results) as one block of bytes, or ``None``.

        Small ones only, even where every tensor goes as bytes (no ``prefix``):
        the block is one more copy of them all.
        """
        packed = pack_list(obj, SHM_THRESHOLD)
        return None if packed is None else pickle.dumps(packed, pickle.HIGHEST_PROTOCOL)

    def _dump(self, obj, spill: bool, function: bool = False) -> tuple[bytes, _Pickler]:
        buf = io.BytesIO()
        if function:
            pickler = _FunctionPickler(buf, self.prefix, self._counter, spill=spill, hold=self.hold)
        else:
            pickler = _Pickler(buf, self.prefix, self._counter, to_cpu=self.to_cpu, private=self.private, spill=spill,
                               lent=self.lent, hold=self.hold)
        try:
            pickler.dump(obj)
        except BaseException:
            remove_files(pickler.created)
            if self.lent is not None:
                for path, fd, _ in pickler.written:
                    self.lent.abandon(path, fd)
            raise
        return buf.getvalue(), pickler


def loads(data: bytes):
    """Inverse of :meth:`Encoder.dumps`."""
    return pickle.loads(data)


def load_error(blob: bytes | None) -> BaseException | None:
    """A worker's pickled exception, or ``None`` where it cannot be loaded here: the record of it stays."""
    try:
        return None if blob is None else loads(blob)
    except (Exception, SystemExit):  # e.g. a class only the worker can import
        return None


# ----------------------------------------------------------------------------- functions, sent once per worker
# A worker keeps this many functions (their bytes, large tensors left out),
# the least recently used going first. Both bounds hold on both sides: the
# caller's twin of each worker's cache uses the same numbers.
FUNCTION_CACHE_SIZE = 32
FUNCTION_CACHE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PackedFunction:
    """A function pickled for one call: ``body`` and its ``digest`` name the function, ``files`` hold its large tensors.

    The body holds the function's code and small state (small tensors
    included, by value); each large CPU tensor it reaches (closure cells,
    defaults, attributes of a captured module) is left out and copied into a
    file for this call, as large arguments are. So a worker that already
    holds the body gets only the 16-byte digest, and still every call sees
    the tensors' values of the moment it was made: an in-place change in the
    caller between calls is never missed, and an in-place change made by the
    function in a worker stays in that call (the file is mapped
    copy-on-write), exactly as when the function was sent whole.

    ``release()`` removes the files once the call is over.
    """

    digest: bytes
    body: bytes
    bindings: tuple  # per large tensor: (file, nbytes, dtype, shape, requires_grad) of this call's file
    files: tuple  # this call's files, as shm_files.create names them
    # Everything the function refers to is immutable or importable (see
    # function_memo): a copy of the one loaded before is as good as a new load.
    unchanging: bool = False

    def message(self, known: "FunctionCache") -> tuple:
        """What to send to the worker whose cache ``known`` mirrors; the body only if that worker lacks it."""
        if known.get(self.digest) is not None:
            return self.digest, None, self.bindings, self.unchanging
        known.put(self.digest, len(self.body), True)
        return self.digest, self.body, self.bindings, self.unchanging

    def release(self) -> None:
        remove_files(self.files)


class FunctionCache:
    """The function bodies one worker holds, by digest, least recently used first out.

    The worker keeps the bodies; the caller keeps a twin per worker with the
    same bounds, recording only that the body was sent. Both apply the same
    step to the same message in the same order (a hit refreshes the entry, a
    body sent is added and may evict the oldest), so the twins agree without
    a word between them. A replaced worker starts with an empty cache and so
    must its twin.

    Example:
        >>> cache = FunctionCache(max_functions=2)
        >>> for digest in (b"a", b"b", b"a", b"c"):   # "c" evicts "b", the least recently used
        ...     _ = cache.get(digest) or cache.put(digest, 1, digest)
        >>> sorted(cache.digests())
        [b'a', b'c']
    """

    def __init__(self, max_functions: int = FUNCTION_CACHE_SIZE, max_bytes: int = FUNCTION_CACHE_BYTES):
        self.max_functions = max_functions
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[int, object]] = OrderedDict()
        self._bytes = 0

    def get(self, digest: bytes):
        """The value kept for ``digest`` (now the most recently used), or ``None``."""
        entry = self._entries.get(digest)
        if entry is None:
            return None
        self._entries.move_to_end(digest)
        return entry[1]

    def put(self, digest: bytes, size: int, value) -> None:
        """Keep ``value`` (of ``size`` bytes) as the most recently used; one larger than ``max_bytes`` is not kept."""
        if digest in self._entries:
            self._bytes -= self._entries.pop(digest)[0]
        if size > self.max_bytes:
            return
        self._entries[digest] = (size, value)
        self._bytes += size
        while len(self._entries) > self.max_functions or self._bytes > self.max_bytes:
            self._bytes -= self._entries.popitem(last=False)[1][0]

    def digests(self) -> list[bytes]:
        """The digests kept, least recently used first."""
        return list(self._entries)


def load_function(message: tuple, cache: FunctionCache, mapped: list | None = None):
    """In a worker: the function of ``message`` (from :meth:`PackedFunction.message`), its body kept in ``cache``.

    Every call builds a fresh copy from the body and this call's files, as if
    the function had been sent whole. ``mapped`` receives a weak reference to
    each tensor mapped from those files (see :func:`release_mapped`).
    """
    digest, body, bindings, unchanging = message
    if body is None:
        entry = cache.get(digest)
        if entry is None:
            raise RuntimeError("internal error: the caller sent a function by its digest, and this worker does "
                               "not hold it")
        body = entry[0]
    else:
        # Kept before it is loaded: the caller counts it as held from now on,
        # even if loading it fails here (then it fails again next time, alike).
        entry = [body, None]  # its bytes, and the function loaded from them once (unchanging ones)
        cache.put(digest, len(body), entry)
    if bindings:
        return _FunctionUnpickler(body, bindings, [] if mapped is None else mapped).load()
    if not unchanging:
        return pickle.loads(body)  # no large tensor: the faster C path
    if entry[1] is None:
        entry[1] = pickle.loads(body)  # never called itself: only copied
    fn, position = entry[1]
    return fresh_copy(fn), position


def release_mapped(mapped: list) -> None:
    """Once a function is dropped: make sure the tensors it mapped (``mapped``, from :func:`load_function`) go now.

    Functions of ``__main__`` or a notebook that refer to one another share
    their globals, a reference cycle: what they hold goes only when the
    garbage collector next runs, and the memory of a file mapped in a worker
    counts against ``/dev/shm`` until then. A tensor the function stored on
    purpose (in ``worker_state()``) stays.
    """
    if any(ref() is not None for ref in mapped):
        gc.collect()
    mapped.clear()
