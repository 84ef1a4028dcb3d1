"""Large results' files, lent by a worker to its caller and given back to be written again.

A worker sends a large result tensor as a file in shared memory that the
caller maps (see :mod:`.transport`). Writing into a new file costs twice as
much as writing into one whose memory exists already (and on a virtual
machine whose memory the host has not backed yet, up to ten times as much),
so a worker writes the next result of the same size into the file of a
result the caller has dropped.

No name is kept for this: the caller unlinks a result's file as soon as it
maps it, as for any file, and both sides hold an open descriptor of it
instead. So the files go with the processes, however they end. The caller
decides (:func:`settle`, when it sends the worker its next task) which files
come back, once torch has freed every tensor mapped from them, and which
are dropped for good; the worker (:class:`WorkerFiles`) only does as told.

A CUDA result goes from device memory straight into its file: the worker
maps the file and page-locks the mapping at its first write
(:class:`CudaHostMemory`), keeps both while it holds the file, and copies
into it without blocking, then waits on the stream; no pageable copy on the
way (a copy into page-locked memory runs at the link's speed, a pageable one
at a small part of it). A CPU result written into a file given back goes
through a mapping the worker keeps too (not page-locked): a plain copy into
memory mapped already, where ``write()`` walks the file page by page (64 MiB:
9 ms against 14 ms on a VM).

Example (a worker's side):
    >>> import tempfile
    >>> files = WorkerFiles()
    >>> fd, path = tempfile.mkstemp()
    >>> files.lent(path, fd, 1024)
    >>> files.update(given_back=[path], dropped=[])   # the caller dropped that result
    >>> files.take(1024) == (path, fd)
    True
    >>> files.update(given_back=[], dropped=[path]); os.unlink(path)
"""

from __future__ import annotations

import os
import threading
import warnings

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# The caller keeps at most this many bytes of files given back per worker:
# memory the pool holds while idle, as a caching allocator does.
SPARE_BYTES = 512 << 20
SPARE_FILES = 4
# Results still in use whose files may come back, per worker; older ones are
# let go (the tensors stay valid; their files are simply not reused).
TRACKED_RESULTS = 16


def fd_path(fd: int) -> str:
    """A path that opens what ``fd`` is open on, even with no name left."""
    return f"/proc/self/fd/{fd}"


def available() -> bool:
    """Whether files can be lent here: both sides need :func:`fd_path`."""
    return os.path.isdir("/proc/self/fd")


# ----------------------------------------------------------------------------- the caller's side
class _Files:
    """The caller's record of one worker's files: results in use, and spares the worker may write."""

    def __init__(self):
        self.lent: dict[str, tuple[int, int, StorageWeakRef]] = {}  # key -> (fd, bytes, its storage)
        self.spare: dict[str, tuple[int, int]] = {}  # key -> (fd, bytes), oldest first


_lock = threading.Lock()  # results are loaded by the engine thread, tasks sent from any caller's thread
_owners: dict[str, _Files] = {}  # a worker's file prefix -> its files


def open_result(owner: str, key: str) -> int:
    """A descriptor of the file of a result from ``owner``; the caller keeps it while the file is tracked.

    A spare the worker wrote again is open already; a new file is opened by
    its name, which goes at once. Raises ``FileNotFoundError`` if the file
    was removed before it could be read, rather than reading zeros.
    """
    with _lock:
        files = _owners.get(owner)
        spare = files.spare.pop(key, None) if files is not None else None
    if spare is not None:
        return spare[0]
    fd = os.open(key, os.O_RDWR)
    os.unlink(key)
    return fd


def track(owner: str, key: str, fd: int, nbytes: int, storage) -> None:
    """Remember that ``storage`` maps the file ``key`` of ``owner`` (open on ``fd``)."""
    with _lock:
        _owners.setdefault(owner, _Files()).lent[key] = (fd, nbytes, StorageWeakRef(storage))


def settle(owner: str) -> tuple[list[str], list[str]]:
    """``(given_back, dropped)`` to tell ``owner`` with its next task.

    ``given_back``: files whose results torch has freed here, which the
    worker may write again; ``dropped``: files it should close. Call it only
    when every reply of ``owner`` has been loaded, so that each file it took
    back since is known.
    """
    files = _owners.get(owner)
    if files is None or not (files.lent or files.spare):  # the common case, without the lock
        return [], []
    with _lock:
        given = [key for key, (_, _, ref) in files.lent.items() if ref.expired()]
        for key in given:
            fd, nbytes, _ = files.lent.pop(key)
            files.spare[key] = (fd, nbytes)
        dropped = []
        while len(files.lent) > TRACKED_RESULTS:
            dropped.append(_close(files.lent, next(iter(files.lent))))
        while files.spare and (len(files.spare) > SPARE_FILES
                               or sum(n for _, n in files.spare.values()) > SPARE_BYTES):
            dropped.append(_close(files.spare, next(iter(files.spare))))
        return [key for key in given if key in files.spare], dropped


def forget(owner: str) -> None:
    """``owner`` is gone: close its files here (results mapped from them stay valid)."""
    with _lock:
        files = _owners.pop(owner, None)
        for table in (files.lent, files.spare) if files is not None else ():
            for key in list(table):
                _close(table, key)


def spares_dropped(owner: str, keys) -> None:
    """``owner`` let go of its spares ``keys`` (above its memory limit): close them here too, freeing them."""
    with _lock:
        files = _owners.get(owner)
        for key in keys if files is not None else ():
            if key in files.spare:
                _close(files.spare, key)


def _close(table: dict, key: str) -> str:
    os.close(table.pop(key)[0])
    return key


# ----------------------------------------------------------------------------- the worker's side
class CudaHostMemory:
    """Page-locks host memory for copies from CUDA devices, with torch's own ``cudaHostRegister`` helpers.

    The seam between a worker's files and the device: tests give
    :class:`WorkerFiles` a stand-in whose ``devices`` name the CPU.
    """

    devices = frozenset({"cuda"})  # tensors on these go straight into their file (WorkerFiles.write_direct)

    def register(self, ptr: int, nbytes: int) -> None:
        from torch.cuda import _pin_memory_utils  # cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable)

        _pin_memory_utils.pin_memory(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.unpin_memory(ptr)

    def synchronize(self, tensor: torch.Tensor) -> None:
        torch.cuda.current_stream(tensor.device).synchronize()


HOST_MEMORY = CudaHostMemory()  # what a new WorkerFiles page-locks with
_register_warned = False


class WorkerFiles:
    """A worker's result files: each open, lent to the caller or given back as a spare.

    A file written from a device, or from the CPU into a spare, stays mapped
    here (page-locked for a device) from that write until it is dropped
    (:meth:`write_direct`).
    """

    # More than the caller tracks: a file it never heard of (a reply it did not load) is closed in time.
    MAX_FILES = TRACKED_RESULTS + SPARE_FILES + 16

    def __init__(self, host=None):
        self._files: dict[str, tuple[int, int]] = {}  # key -> (fd, bytes), oldest first
        self._spare: set[str] = set()
        self.host = host if host is not None else HOST_MEMORY
        self._mapped: dict[str, tuple[torch.Tensor, bool]] = {}  # key -> (the file as uint8, page-locked)

    def lent(self, key: str, fd: int, nbytes: int) -> None:
        """A result was written to ``key`` (open on ``fd``) and sent."""
        self._files[key] = (fd, nbytes)
        while len(self._files) > self.MAX_FILES:
            self._drop(next(iter(self._files)))

    def update(self, given_back, dropped) -> None:
        """Apply what the caller said with a task (see :func:`settle`)."""
        for key in dropped:
            self._drop(key)
        self._spare.update(key for key in given_back if key in self._files)

    def take(self, nbytes: int) -> tuple[str, int] | None:
        """A spare of exactly ``nbytes`` to write a result into, ``(key, fd)``; ``None`` if there is none."""
        for key in self._spare:
            fd, size = self._files[key]
            if size == nbytes:
                self._spare.discard(key)
                del self._files[key]  # lent again once written (lent() puts it back, newest)
                return key, fd
        return None

    def copies_directly(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s device copies straight into a file (:meth:`write_direct`): CUDA, not the CPU."""
        return tensor.device.type in self.host.devices

    def write_direct(self, key: str, fd: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the file ``key`` (open on ``fd``), whose size is ``tensor.nbytes``.

        The file is mapped at its first write (and page-locked, for a device
        that copies directly) and stays so while this worker holds it; a
        device's copy runs without blocking, and this waits for it on the stream.
        """
        device = self.copies_directly(tensor)
        host = self._mapped.get(key)
        if host is None:
            host = self._map(key, fd, tensor.nbytes, pin=device)
        source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        host[0].copy_(source, non_blocking=host[1] and device)
        if host[1] and device:
            self.host.synchronize(source)

    def spare_bytes(self) -> int:
        """The size of the files given back, kept to write results into (the caller holds none of their results)."""
        return sum(self._files[key][1] for key in self._spare)

    def drop_spares(self) -> list[str]:
        """Let go of every file given back (above the memory limit: a cache, not the task's); their keys, for
        the caller to close too (:func:`spares_dropped`)."""
        keys = list(self._spare)
        for key in keys:
            self._drop(key)
        return keys

    def abandon(self, key: str, fd: int) -> None:
        """A message that took ``key`` (open on ``fd``) failed before it was sent: let the file go."""
        self._files.pop(key, None)
        self._drop(key)
        os.close(fd)

    def _map(self, key: str, fd: int, nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
        global _register_warned
        # The memory now, or ENOSPC now (the caller then spills to a file
        # elsewhere); a write through a mapping of a full tmpfs is a SIGBUS.
        os.posix_fallocate(fd, 0, nbytes)
        storage = torch.UntypedStorage.from_file(fd_path(fd), shared=True, nbytes=nbytes)
        try:
            if pin:
                self.host.register(storage.data_ptr(), nbytes)
            locked = pin
        except RuntimeError as exc:  # still correct through pageable memory, at a fraction of the speed
            locked = False
            if not _register_warned:
                _register_warned = True
                warnings.warn(f"could not page-lock a result's shared-memory file ({exc}); CUDA results are "
                              f"copied through pageable memory, which is slower", RuntimeWarning, stacklevel=3)
        self._mapped[key] = entry = (torch.empty(0, dtype=torch.uint8).set_(storage), locked)
        return entry

    def _drop(self, key: str) -> None:
        entry = self._files.pop(key, None)
        self._spare.discard(key)
        mapped = self._mapped.pop(key, None)
        if mapped is not None and mapped[1]:
            try:
                self.host.unregister(mapped[0].data_ptr())
            except Exception as exc:  # a broken CUDA context: this worker must still serve its next task
                warnings.warn(f"could not unregister a result file's page-locked memory: {exc}", RuntimeWarning)
        del mapped  # the worker's mapping of the file goes with its tensor
        if entry is not None:
            os.close(entry[0])
