"""Where the transport's large-tensor files live, how each is created, and who removes them.

Files go under ``/dev/shm``, or the directory ``NN_HANDLER_SHM_DIR`` names
(read at first use). A tensor that does not fit there (Docker gives containers
64 MiB of ``/dev/shm``) goes to a file under the temp dir instead, with one
warning per process. Files are named ``nnh-<pid of the caller>-<tag>-<n>`` in
either directory: whoever cleans up a sender, a call or a dead caller globs
that name. What goes into the files, and how they are mapped, is
:mod:`.transport`.
"""

from __future__ import annotations

import glob
import os
import tempfile
import threading
import warnings


SHM_DIR_ENV = "NN_HANDLER_SHM_DIR"
_shm_dir: list = []  # [the directory or None], filled at first use
_seen_dirs: set[str] = set()  # every directory this process named files in (a dead caller's files are there)
_spill_warned = False
# Held while a file is created: a worker that cleans up after its dead caller
# takes it for good, so no file appears after its last look.
_create_lock = threading.Lock()


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
