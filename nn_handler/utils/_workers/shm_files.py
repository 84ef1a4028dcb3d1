"""Where the transport's large-tensor files live, how each is created, and who removes them.

Files go under ``/dev/shm``, or the directory ``NN_HANDLER_SHM_DIR`` names
(read at first use). A tensor that does not fit there (Docker gives containers
64 MiB of ``/dev/shm``) goes to a file under the temp dir instead, with one
warning per process. Files are named ``nnh-<pid of the caller>-<tag>-<n>`` in
either directory: whoever cleans up a sender, a call or a dead caller globs
that name. What goes into the files, and how they are mapped, is
:mod:`.transport`.

The caller's files (arguments, map items, a function's large tensors) keep
no name: each is unlinked the moment it is created, before anything is
written to it, and lives as long as a descriptor of it, which the caller
holds until its call is over (see :func:`create`); a worker opens it through
``/proc/<caller>/fd/<n>`` (where that is refused, the caller names its files
instead, and copies those of calls pickled before: :func:`refused`,
:func:`named_copy`). However the job ends, a kill of the whole process
group included, the kernel frees what nobody holds, and no name is left in
``/dev/shm`` (but an empty one, should the kill land between the two system
calls that create and unlink it). The name still shows in the processes'
``/proc/<pid>/maps``, as ``(deleted)``, for whoever counts what they map.
A worker's results are named until the caller maps them (the caller may
read them after the worker died), and the worker removes what a dead
caller left (see :mod:`.worker`).

Example:
    >>> import tempfile
    >>> prefix = f"{tempfile.mkdtemp()}/nnh-{os.getpid()}-doc-"
    >>> ref, fd = create(prefix, 0, 4, spill=False, hold=True)
    >>> os.write(fd, b"data"), glob.glob(prefix + "*")   # written, and no name
    (4, [])
    >>> reader = open_file(ref, os.O_RDONLY); os.read(reader, 4)
    b'data'
    >>> os.close(reader); remove_files([ref]); remove_files([ref])   # let go once, whoever asks twice
"""

from __future__ import annotations

import errno
import glob
import os
import stat
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


# The caller's files held with no name: descriptor -> inode. A file is let go once, by whoever asks first:
# a descriptor closed twice would close another file that took its number meanwhile.
_held: dict[int, int] = {}
_held_lock = threading.Lock()
# At most this many held at once (fewer under a small `ulimit -n`): the program's own descriptors are not ours
# to spend (thousands of large arguments queued took as many). Past it, files are named until their call ends.
HELD_FILES = 32
_held_max: list = []  # [how many files may be held at once, the lowest number they take], filled at first use


def remove_files(refs) -> None:
    """Remove each file of ``refs`` (as :func:`create` returned them): unlink a name, let go of a held file."""
    for ref in refs:
        if type(ref) is str:
            try:
                os.unlink(ref)
            except FileNotFoundError:
                pass
        else:
            fd, inode = ref[1], ref[3]
            with _held_lock:
                if _held.get(fd) != inode:
                    continue  # let go already
                del _held[fd]
            os.close(fd)


def create(prefix: str, number: int, nbytes: int, *, spill: bool, hold: bool) -> tuple[str | tuple, int]:
    """A new file for one tensor, ``(ref, fd)``: ``ref`` is what a reader passes to :func:`open_file` and
    :func:`remove_files` takes; ``fd`` is open for writing.

    ``hold``: the file keeps no name; ``fd`` stays open until :func:`remove_files` lets it go (the caller's
    files, read while it lives). Otherwise ``ref`` is the file's name and the caller closes ``fd``. Where
    ``/proc`` is missing, or the process holds as many files as it may (:data:`HELD_FILES`: a long queue of
    large arguments), the file is named as it was before.
    """
    path, fd = _create(prefix, number, nbytes, spill=spill)
    if not (hold and _may_hold()):
        return path, fd
    try:
        os.unlink(path)  # at once: from now on the file lasts as long as a descriptor of it, however we end
        fd = _out_of_the_way(fd)
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        remove_files([path])
        raise
    with _held_lock:
        _held[fd] = info.st_ino
    return (os.getpid(), fd, info.st_dev, info.st_ino), fd


class _Refused(PermissionError):
    """A worker may not open its caller's held file through ``/proc/<pid>/fd``: a failure of the transport,
    not of the task (see :func:`open_file`)."""


# In a worker, for the call at hand: held files of the caller -> the named copies it made of them, once it
# learnt that its files are refused (see :func:`named_copy` and the scheduler's "refused" reply).
_named_instead: dict = {}


def use_named(copies: dict | None) -> None:
    """In a worker: open the named copy ``copies[ref]`` instead of each held file ``ref`` (this call's)."""
    if _named_instead or copies:  # (once per call: nothing to do, as a rule)
        _named_instead.clear()
        _named_instead.update(copies or ())


def open_file(ref, flags: int) -> int:
    """A descriptor of the file ``ref`` (from :func:`create`, maybe of another process), opened with ``flags``.

    Raises ``FileNotFoundError`` when it is gone: its name removed, or its holder let go of it (the number it
    had may now be another file's: that is checked, not read); a ``PermissionError`` (:class:`_Refused`)
    when ``/proc/<pid>/fd`` is refused (see :func:`refused`).
    """
    if type(ref) is str:
        return os.open(ref, flags)
    if ref in _named_instead:
        return os.open(_named_instead[ref], flags)
    pid, fd, device, inode = ref
    gone = FileNotFoundError(errno.ENOENT, f"a shared-memory file of process {pid} was let go before it was read")
    try:
        # O_NONBLOCK: if the number is a pipe's now, opening it must not wait for a writer
        own = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_NONBLOCK | os.O_NOCTTY)
    except PermissionError as exc:
        raise _Refused(exc.errno, f"this worker may not open its caller's files through /proc/{pid}/fd "
                                  f"({exc.strerror}): the caller is not dumpable, runs under another uid, or "
                                  f"ptrace rules (Yama, SELinux, AppArmor, a sandbox) forbid it",
                       exc.filename) from exc
    except OSError as exc:
        raise gone from exc
    info = os.fstat(own)
    if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (device, inode):
        os.close(own)
        raise gone
    return own


def probe(prefix: str | None) -> tuple | None:
    """A held file of one byte for new workers to open as they would the caller's files (see :func:`refused`),
    or ``None`` where files are named anyway. Remove it with :func:`remove_files` (``[probe]``)."""
    if not prefix:
        return None
    ref, fd = create(prefix, 0, 1, spill=False, hold=True)
    if type(ref) is str:
        os.close(fd)
        remove_files([ref])
        return None
    return ref


def refused(ref) -> str | None:
    """In a worker: why it cannot open the caller's held file ``ref`` (from :func:`probe`), or ``None``.

    ``/proc/<pid>/fd`` is refused where the caller is not dumpable, runs under another uid, or ptrace rules
    (Yama, SELinux, AppArmor, some sandboxes) forbid it: the caller then names its files instead.
    """
    try:
        os.close(open_file(ref, os.O_RDONLY))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def named_copy(ref, prefix: str, number: int) -> str:
    """A named copy of the file ``ref`` that this process holds (see :func:`create`), for workers refused
    ``/proc/<pid>/fd``; the caller removes it (:func:`remove_files`) with the call's other files."""
    source = os.open(f"/proc/self/fd/{ref[1]}", os.O_RDONLY)  # (ours: never refused) its descriptor writes only
    try:
        size = os.fstat(source).st_size
        path, out = _create(prefix, number, size, spill=False)
        try:
            copied = 0
            while copied < size:  # in the kernel, from file to file
                sent = os.sendfile(out, source, copied, size - copied)
                if not sent:
                    raise OSError(errno.EIO, f"a shared-memory file ended at {copied} of its {size} bytes")
                copied += sent
        except BaseException:
            remove_files([path])
            raise
        finally:
            os.close(out)
    finally:
        os.close(source)
    return path


def _may_hold() -> bool:
    if not _held_max:
        limit = _open_files_limit()
        most = min(HELD_FILES, limit // 8) if os.path.isdir("/proc/self/fd") else 0
        # Held files take numbers from here up, below the limit and apart from the low ones the program's own
        # files and sockets take (select() takes none above 1023): they do not push the program's next ones up.
        _held_max.extend((most, max(3, min(limit, 4096) - 2 * most)))
        os.register_at_fork(after_in_child=_forget_held)
    return len(_held) < _held_max[0]


def _open_files_limit() -> int:
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return 1 << 16 if limit == resource.RLIM_INFINITY else limit
    except (ImportError, ValueError, OSError):
        return 1024


def _out_of_the_way(fd: int) -> int:
    """``fd``, moved to a number at or above the held files' lowest (see :func:`_may_hold`) where one is free."""
    import fcntl

    if fd >= _held_max[1]:
        return fd
    try:
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _held_max[1])
    except OSError:
        return fd  # none free up there: it stays where it is
    os.close(fd)
    return moved


def _forget_held() -> None:
    """In a child made with ``os.fork()``: the parent's files are the parent's (its calls, its workers)."""
    global _held_lock
    _held_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


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
        try:
            return path, os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise OSError(exc.errno, f"{exc.strerror} while creating a shared-memory file for a large tensor "
                                     f"(ulimit -n is {_open_files_limit()}; nn_handler holds {len(_held)} "
                                     f"descriptors, its files for the large arguments of calls in flight): close "
                                     f"some of your program's files, or raise the limit (ulimit -n, "
                                     f"resource.setrlimit)", path) from exc


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


def remove_prefixed(prefix: str | None, *, final: bool = False) -> None:
    """Remove every file left under ``prefix``, spilled ones too (a sender died before its reader unlinked).

    ``final``: this process is about to exit; no file is created after this.
    """
    if final:
        _create_lock.acquire()  # never released: the process ends
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
