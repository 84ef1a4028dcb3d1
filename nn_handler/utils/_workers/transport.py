"""Serialisation between the caller and its workers: cloudpickle, with large tensors in shared memory.

Small objects travel as cloudpickle bytes (lambdas, closures and functions
defined in ``__main__`` or a notebook included). A CPU tensor of at least
``SHM_THRESHOLD`` bytes is copied once into a file under ``/dev/shm`` and only
its name travels; the receiver maps that file (torch owns the mapping, so it is
released with the tensor) and unlinks the name at once.

``NN_HANDLER_SHM_DIR`` (read at first use) puts these files in another
directory. A tensor that does not fit there (Docker gives containers 64 MiB of
``/dev/shm``) goes to a file under the temp dir instead, with one warning per
process. Files are named ``nnh-<pid of the caller>-<tag>-<n>`` in either
directory: whoever cleans up a sender, a call or a dead caller globs that name.

Why not torch.multiprocessing's shared-memory reducers: they hand over file
descriptors that the *sending* process must stay alive to serve, so a worker
that exits right after sending loses its results (the ``EOFError`` trap). A
named file outlives its writer, and its reader needs nobody.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import io
import itertools
import os
import pickle
import tempfile
import threading
import warnings

import cloudpickle
import torch

SHM_DIR_ENV = "NN_HANDLER_SHM_DIR"
_shm_dir: list = []  # [the directory or None], filled at first use
_seen_dirs: set[str] = set()  # every directory this process named files in (a dead caller's files are there)
_spill_warned = False
# Held while a file is created: a worker that cleans up after its dead caller
# takes it for good, so no file appears after its last look.
_create_lock = threading.Lock()
# Below this size a tensor is cheaper as bytes in the message than as a file
# to create, map and unlink.
SHM_THRESHOLD = 1 << 20


def _rebuild_shared(path: str, nbytes: int, dtype: torch.dtype, shape, requires_grad: bool, private: bool):
    # private=True maps copy-on-write: an argument shared by every worker must
    # not see one worker's in-place writes.
    storage = torch.UntypedStorage.from_file(path, shared=not private, nbytes=nbytes)
    if not private:
        os.unlink(path)  # results are read by one process only: drop the name now
    tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _rebuild_small(data: bytes, dtype: torch.dtype, shape, requires_grad: bool):
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(dtype).reshape(shape)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


# Bytes out of a tensor without numpy (not a dependency: Tensor.numpy() fails
# without it). A torch storage has no buffer interface and bytes() of one goes
# element by element, so the raw memory is read through ctypes: string_at
# copies (as fast as numpy's tobytes), PyMemoryView_FromMemory does not (a
# ctypes array type would do too, but ctypes caches one type per length).
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PyBUF_READ = 0x100


def _reduce_small(t: torch.Tensor):
    # torch's own pickling of a tensor runs torch.save on its storage, which
    # costs tens of microseconds per tensor; raw bytes cost a copy.
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return _rebuild_small, (ctypes.string_at(raw.data_ptr(), raw.nbytes), t.dtype, tuple(t.shape), t.requires_grad)


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file, prefix: str | None, counter, *, to_cpu: bool, private: bool, spill: bool = False,
                 probe: bool = False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._prefix = prefix
        self._counter = counter
        self._to_cpu = to_cpu
        self._private = private
        self._spill = spill
        self._probe = probe
        self.created: list[str] = []
        self.needs_files = False

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = self._reduce_tensor(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _reduce_tensor(self, t: torch.Tensor):
        if self._to_cpu and (t.requires_grad or t.device.type != "cpu"):
            t = t.detach().cpu()
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
            return None  # torch's own pickling knows these
        if t.requires_grad and not t.is_leaf:
            return None  # let pickle raise its usual error for non-leaf tensors
        if type(t) is torch.nn.Parameter:
            return None  # keep the Parameter type (rare in payloads; torch pickles it)
        if self._prefix is None or t.nbytes < SHM_THRESHOLD:
            return _reduce_small(t)
        if self._probe:
            self.needs_files = True
            return int, ()  # a stand-in: probing checks that the rest pickles, and copies nothing
        path, fd = _create(self._prefix, next(self._counter), t.nbytes, spill=self._spill)
        self.created.append(path)
        try:
            # write() fills tmpfs at memcpy speed; copying through a fresh
            # mapping page-faults every 4 KiB and runs at about half of it.
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            view = _memory_view(flat.data_ptr(), flat.nbytes, _PyBUF_READ)  # valid while `flat` lives
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        finally:
            os.close(fd)
        return _rebuild_shared, (path, t.nbytes, t.dtype, tuple(t.shape), t.requires_grad, self._private)


class Encoder:
    """Pickles objects for one side of a pool, naming its shared-memory files with ``prefix``.

    Args:
        prefix: Unique file-name prefix under ``/dev/shm`` for this sender, or
            ``None`` to send every tensor as bytes.
        to_cpu: Detach tensors and move them to CPU (results do this).
        private: Receivers map copy-on-write and leave the file for the sender
            to remove (arguments shared by several workers do this).
    """

    def __init__(self, prefix: str | None, *, to_cpu: bool = False, private: bool = False):
        self.prefix = prefix
        self.to_cpu = to_cpu
        self.private = private
        self._counter = itertools.count()
        if prefix:
            _seen_dirs.add(os.path.dirname(prefix))

    def dumps(self, obj) -> tuple[bytes, list[str]]:
        """Return the bytes and the shared-memory files created for them."""
        try:
            return self._dump(obj)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        # The directory filled up while we wrote (others write there too):
        # every file of this message goes to the temp dir instead.
        _warn_spill(os.path.dirname(self.prefix))
        try:
            return self._dump(obj, spill=True)
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
        buf = io.BytesIO()
        pickler = _Pickler(buf, self.prefix, self._counter, to_cpu=self.to_cpu, private=self.private, probe=True)
        pickler.dump(obj)
        return None if pickler.needs_files else buf.getvalue()

    def _dump(self, obj, spill: bool = False) -> tuple[bytes, list[str]]:
        buf = io.BytesIO()
        pickler = _Pickler(buf, self.prefix, self._counter, to_cpu=self.to_cpu, private=self.private, spill=spill)
        try:
            pickler.dump(obj)
        except BaseException:
            remove_files(pickler.created)
            raise
        return buf.getvalue(), pickler.created


def loads(data: bytes):
    """Inverse of :meth:`Encoder.dumps`."""
    return pickle.loads(data)


def remove_files(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def shm_dir() -> str | None:
    """The directory for large tensors: ``$NN_HANDLER_SHM_DIR``, else ``/dev/shm`` (``None``: none, use the pipe)."""
    if not _shm_dir:
        path = os.environ.get(SHM_DIR_ENV)
        if path and not os.path.isdir(path):
            raise ValueError(f"{SHM_DIR_ENV}={path} is not a directory; create it (a tmpfs is fastest) or unset "
                             f"{SHM_DIR_ENV} to use /dev/shm")
        _shm_dir.append(os.path.abspath(path) if path else "/dev/shm" if os.path.isdir("/dev/shm") else None)
    return _shm_dir[0]


def spill_dir() -> str:
    """Where a tensor goes that does not fit in :func:`shm_dir`."""
    return tempfile.gettempdir()


def shm_prefix(tag: str) -> str | None:
    """A file-name prefix under :func:`shm_dir` for one sender (``None`` where there is no such directory)."""
    directory = shm_dir()
    return f"{directory}/nnh-{tag}-" if directory else None


def _create(prefix: str, number: int, nbytes: int, *, spill: bool) -> tuple[str, int]:
    """Create the file for one tensor: in the prefix's directory if it has room, else in :func:`spill_dir`."""
    directory, name = os.path.split(prefix)
    if not spill:
        st = os.statvfs(directory)
        spill = st.f_bavail * st.f_frsize < nbytes  # a write that is bound to fail costs a copy: skip it
        if spill:
            _warn_spill(directory)
    if spill:
        directory = spill_dir()
        _seen_dirs.add(directory)
    path = f"{directory}/{name}{number}"
    with _create_lock:
        return path, os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)


def _warn_spill(directory: str) -> None:
    global _spill_warned
    if _spill_warned:
        return
    _spill_warned = True
    try:
        st = os.statvfs(directory)
        free = f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB"
    except OSError:
        free = "size unknown"
    warnings.warn(
        f"{directory} ({free}) is too small for the large tensors sent to and from workers; those that do not fit "
        f"go through files under {spill_dir()} instead, which is slower. In Docker, start the container with "
        f"--shm-size=8g (or --ipc=host), or set {SHM_DIR_ENV} to a larger tmpfs.",
        RuntimeWarning, stacklevel=2)


def remove_prefixed(prefix: str | None) -> None:
    """Remove every file left under ``prefix``, spilled ones too (a sender died before its reader unlinked)."""
    if prefix:
        directory, name = os.path.split(prefix)
        for d in {directory, spill_dir()}:
            remove_files(glob.glob(os.path.join(glob.escape(d), glob.escape(name) + "*")))


def remove_process_files(pid: int, *, final: bool = False) -> None:
    """Remove every file made for the caller ``pid`` (it died: nobody else will).

    ``final``: this process is about to exit; no file is created after this.
    """
    if final:
        _create_lock.acquire()  # never released: the process ends
    for directory in _seen_dirs | {spill_dir()}:
        remove_files(glob.glob(os.path.join(glob.escape(directory), f"nnh-{pid}-*")))
