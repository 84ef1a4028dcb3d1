"""Serialisation between the caller and its workers: cloudpickle, with large tensors in shared memory.

Small objects travel as cloudpickle bytes (lambdas, closures and functions
defined in ``__main__`` or a notebook included). A CPU tensor of at least
``SHM_THRESHOLD`` bytes is copied once into a file under ``/dev/shm`` and only
its name travels; the receiver maps that file (torch owns the mapping, so it is
released with the tensor) and unlinks the name at once.

Why not torch.multiprocessing's shared-memory reducers: they hand over file
descriptors that the *sending* process must stay alive to serve, so a worker
that exits right after sending loses its results (the ``EOFError`` trap). A
named file outlives its writer, and its reader needs nobody.
"""

from __future__ import annotations

import ctypes
import glob
import io
import itertools
import os
import pickle

import cloudpickle
import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
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
    def __init__(self, file, prefix: str | None, counter, *, to_cpu: bool, private: bool):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._prefix = prefix
        self._counter = counter
        self._to_cpu = to_cpu
        self._private = private
        self.created: list[str] = []

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
        path = f"{self._prefix}{next(self._counter)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
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
        self.prefix = prefix if SHM_DIR else None
        self.to_cpu = to_cpu
        self.private = private
        self._counter = itertools.count()

    def dumps(self, obj) -> tuple[bytes, list[str]]:
        """Return the bytes and the shared-memory files created for them."""
        buf = io.BytesIO()
        pickler = _Pickler(buf, self.prefix, self._counter, to_cpu=self.to_cpu, private=self.private)
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


def shm_prefix(tag: str) -> str | None:
    """A file-name prefix under ``/dev/shm`` for one sender (``None`` where there is no /dev/shm)."""
    return f"{SHM_DIR}/nnh-{tag}-" if SHM_DIR else None


def remove_prefixed(prefix: str | None) -> None:
    """Remove every file left under ``prefix`` (a sender died before its reader unlinked)."""
    if prefix:
        remove_files(glob.glob(glob.escape(prefix) + "*"))
