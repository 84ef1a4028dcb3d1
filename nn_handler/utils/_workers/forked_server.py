"""The forkserver made by forking the caller, when that is safe: a cold start without a second ``import torch``.

multiprocessing's forkserver is a fresh interpreter that imports torch
(about a second of CPU) before it forks the first worker, after the caller
paid the same import. A caller that has imported torch and is still
single-threaded can instead fork that server from itself: the copy has torch
already. :func:`start` does so and hands the copy to the stdlib's forkserver
machinery (its singleton holds the address, the "alive" pipe and the pid, as
``ForkServer.ensure_running`` would have set them), so workers are still made,
passed their file descriptors, watched and reaped by the stdlib's forkserver
code; only how the server came to be differs. If the copy dies, the stdlib
starts its own spawned server on the next start, as it would for its own.

Forking is safe only when no other thread can hold a lock or a pool the copy
would need: :func:`unsafe_reason` says why not, else ``None``. The copy keeps
nothing of the caller that could tie either one's lifetime to the other (the
caller's sockets, pipes and shared memory become ``/dev/null`` in it; stdin,
stdout, stderr, regular files and devices stay), and none of the caller's
Python signal handlers.

Example:
    >>> unsafe_reason(environ={"NN_HANDLER_WORKER_SERVER": "forkserver"})
    'NN_HANDLER_WORKER_SERVER=forkserver'
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import stat
import sys
import threading
import warnings

_ENV = "NN_HANDLER_WORKER_SERVER"  # "forkserver": never fork the caller
_NAME = b"nnh-forkserver"  # the copy's /proc/<pid>/comm, so that tools (and the tests' hygiene) can tell it
# Above this resident set the copy would keep too much of the caller alive: pages the caller frees later stay
# with the server, which lives as long as the caller.
MAX_CALLER_RSS = 2 << 30


def unsafe_reason(environ=os.environ) -> str | None:
    """Why the caller may not fork its forkserver now (``None``: it may)."""
    if environ.get(_ENV, "").strip().lower() == "forkserver":
        return f"{_ENV}=forkserver"
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        # The threads check below knows where an OpenMP pool thread sleeps on x86-64 Linux only.
        return "not x86-64 Linux"
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch is not imported (the spawned server imports it once for all workers)"
    if torch.cuda.is_initialized():
        return "CUDA is initialized in the caller"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():  # its workers would think so too
        return "the caller is in a process group"
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return "the caller is a child still importing its main module"
    if threading.active_count() != 1 or threading.current_thread() is not threading.main_thread():
        return "the caller runs other Python threads"
    if (why := _native_threads_unsafe()) is not None:
        return why
    if _resident_bytes() > MAX_CALLER_RSS:
        return f"the caller holds more than {MAX_CALLER_RSS >> 30} GiB"
    return None


def _native_threads_unsafe() -> str | None:
    """Why the caller's threads outside Python forbid a fork, or ``None``.

    A thread asleep in a system call of the C library (numpy's OpenBLAS pool,
    which re-creates itself after a fork; a faulthandler watchdog) holds no
    lock a child needs. A running thread, or one asleep in any other code,
    may: GNU OpenMP's pool threads (torch's intra-op pool, once a parallel op
    ran) sleep in libgomp's own futex call, and a forked child of such a
    process hangs on its first parallel op.
    """
    me = threading.get_native_id()
    try:
        others = [int(t) for t in os.listdir("/proc/self/task") if int(t) != me]
        if not others:
            return None
        libc = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                name = os.path.basename(fields[5]) if len(fields) > 5 else ""
                if "x" in fields[1] and name.startswith(("libc.so", "libc-", "libpthread")):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    libc.append((start, end))
        for tid in others:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                state = f.read().split()
            if not state or state[0] in ("running", "-1"):
                return f"thread {tid} of the caller is running"
            pc = int(state[-1], 16)
            if not any(start <= pc < end for start, end in libc):
                return f"thread {tid} of the caller waits outside the C library (an OpenMP pool?)"
    except (OSError, ValueError) as exc:
        return f"the caller's threads could not be read ({exc})"
    return None


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return MAX_CALLER_RSS + 1


def start(in_server=None) -> bool:
    """Fork the stdlib's forkserver from this process if none runs yet and :func:`unsafe_reason` allows it.

    Returns whether the forkserver is now a copy of this process (``False``:
    the stdlib spawns its own on first use, as before). ``in_server``: called
    in the copy before it serves (module state that must not carry over).
    """
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = forkserver._forkserver
    expected = {"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock",
                "_preload_modules"}
    if set(vars(server)) != expected:  # another Python's forkserver (e.g. with an authkey): leave it be
        return False
    if server._forkserver_pid is not None or unsafe_reason() is not None:
        return False
    resource_tracker.ensure_running()  # the stdlib's order: its pipe is then the caller's, not the copy's
    for stream in (sys.stdout, sys.stderr):  # what is buffered must not be written twice
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    alive_r = alive_w = pid = None
    try:
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends at EOF: the caller and every worker gone
        with warnings.catch_warnings():  # Python >= 3.12 warns of any other thread; unsafe_reason() vetted them
            warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, in_server)  # never returns
        with server._lock:
            server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
        alive_w = pid = None
        return True
    except OSError:  # no socket, no pipe, no fork (out of memory or processes): the stdlib's server then
        return False
    finally:
        listener.close()
        if alive_r is not None:
            os.close(alive_r)
        if alive_w is not None:
            os.close(alive_w)  # not recorded (Ctrl-C right after the fork): the copy sees EOF and ends
        if pid is not None:
            os.waitpid(pid, 0)  # and is reaped


def _serve(listener_fd: int, alive_r: int, alive_w: int, in_server) -> None:
    """The copy: shed the caller's descriptors and handlers, then run the stdlib's forkserver loop."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the caller decides
        os.close(alive_w)
        _set_name()
        _close_inherited_fds(keep={0, 1, 2, listener_fd, alive_r})
        _reset_signal_handlers()
        import faulthandler

        if faulthandler.is_enabled():  # it may have written to a descriptor closed above
            faulthandler.enable(file=sys.__stderr__ or 2)
        if in_server is not None:
            in_server()
        from multiprocessing import forkserver

        forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit:  # the loop's way to end: the alive pipe reached EOF
        code = 0
    except BaseException:
        try:
            sys.excepthook(*sys.exc_info())
            sys.stderr.flush()
        except BaseException:
            pass
    finally:
        os._exit(code)  # nothing of the caller's exit (atexit, finalizers, buffers) runs twice


def _set_name() -> None:
    try:
        import ctypes

        PR_SET_NAME = 15
        ctypes.CDLL(None).prctl(PR_SET_NAME, _NAME, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _close_inherited_fds(keep: set[int]) -> None:
    """Let go of the caller's sockets, pipes, devices' events and shared memory: a worker must not hold them (a
    peer would never see EOF, memory would stay). Each becomes ``/dev/null`` rather than closed, so that its
    number is never reused for a worker's own pipe: an object of the caller that still writes to it (a
    ``SysLogHandler``'s socket) cannot corrupt the worker's messages. Regular files, terminals and other
    devices stay (a logging handler keeps writing to its file)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in keep or fd == null:
                continue
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISREG(mode):
                    keep_it = not os.readlink(f"/proc/self/fd/{fd}").startswith(("/dev/shm/", "/memfd:"))
                else:
                    keep_it = stat.S_ISCHR(mode) or stat.S_ISDIR(mode) or stat.S_ISBLK(mode)
                if not keep_it:
                    os.dup2(null, fd, inheritable=os.get_inheritable(fd))
            except OSError:  # the descriptor of the listdir itself, gone by now
                pass
    finally:
        os.close(null)


def _reset_signal_handlers() -> None:
    """The caller's Python handlers (SIGTERM clean-ups and the like) are the caller's business, not a worker's."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError, RuntimeError):
                pass
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
