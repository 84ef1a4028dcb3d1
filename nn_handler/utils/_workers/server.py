"""Where every worker comes from: a forkserver spawned with the caller's ``sys.path``, or ``spawn``.

No worker is ever a fork of the caller: a copy of the caller would carry
whatever state the caller has (CUDA marked unusable in a fork as soon as the
driver was queried, torch's inter-op pool, a lock held by another thread, a
half-imported module, the caller's memory and open files). Workers are forked
instead from a server that is a fresh interpreter: it imports torch and the
worker module once (so a new worker does not pay ``import torch``), never
touches CUDA, runs no thread, and then only forks.

The server is the stdlib's forkserver (:mod:`multiprocessing.forkserver`: its
loop, its way of passing descriptors, watching and reaping the workers), started
the way :meth:`~multiprocessing.forkserver.ForkServer.ensure_running` starts it,
but with the caller's ``sys.path`` in place before it imports anything: Python
3.11's server ignores the path it is given, so it would import torch and
nn_handler with the current directory first (a copy of ``nn_handler`` there is
what the workers would run). A worker then gets what a spawned process gets
(the caller's ``sys.path`` and current directory, see
:func:`multiprocessing.spawn.prepare`), and :func:`inheritance`: the caller's
environment as it is when the worker starts, the main module to import once
that is in place, and its own random seeds (:func:`base_seed` of its pool,
which leaves the caller's generator as it was, and its worker id);
:func:`.worker.inherit` applies the environment in the worker, :func:`.worker.seed_streams` the seeds once
the worker's imports are done.

:func:`context` decides how workers start; ``spawn`` is used where there is
no forkserver (not POSIX), in a child made with ``os.fork()`` (its parent's
server is not its own to check on), and where the stdlib's forkserver is not
the one this module knows how to start.

Example:
    >>> context().get_start_method() in ("forkserver", "spawn")
    True
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import os
import socket
import sys
import types

# What the server imports once for every worker it forks.
PRELOAD = ["torch", "nn_handler.utils._workers.worker"]
# The attributes of 3.8-3.13's ForkServer (a later one, with an authkey, gets ``spawn``).
_LAYOUT = {"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock",
           "_preload_modules"}
_user: int | None = None  # the process whose forkserver this module started


def context():
    """The multiprocessing context every worker is started from (never ``fork``)."""
    global _user
    from multiprocessing import forkserver

    server = forkserver._forkserver
    usable = ("forkserver" in mp.get_all_start_methods() and set(vars(server)) == _LAYOUT
              and _user in (None, os.getpid()))
    if not usable:
        return mp.get_context("spawn")
    _user = os.getpid()
    # Should the server die between our check and a start, the stdlib starts its own: with the same imports.
    server.set_forkserver_preload(PRELOAD)
    _ensure_server(server)
    return mp.get_context("forkserver")


def base_seed() -> int:
    """A pool's base seed: a hash of the caller's torch generator state, read without drawing from it, and of how
    many pools this process seeded before; see :func:`.worker.seed_streams`.

    The caller's next numbers are the ones it would draw without any pool (``ProcessPoolExecutor`` draws
    nothing either); after ``torch.manual_seed`` the workers draw the same numbers run to run; two pools of one
    process never share a base seed.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0); a = base_seed(); first = torch.rand(1)
        >>> _ = torch.manual_seed(0); b = base_seed(); a != b, torch.equal(first, torch.rand(1))
        (True, True)
    """
    import hashlib

    import torch

    state = bytes(torch.get_rng_state().tolist())  # (the seed and the position in the stream)
    digest = hashlib.blake2b(state + next(_pools_seeded).to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


_pools_seeded = itertools.count()  # pools of this process given a base seed: one more term of the hash


def inheritance(seed: int, worker_id: int, *, main: bool = True) -> tuple:
    """What a new worker gets from the caller, for :func:`.worker.worker_main`: the environment as it is now, the
    main module to import once the environment is in place (``main=False``: none), its pool's ``seed`` and its
    own ``worker_id`` (unique in the pool, replacements included)."""
    from multiprocessing import spawn

    module = {}
    if main:
        data = spawn.get_preparation_data("nn_handler-worker")  # reads the caller's __main__, changes nothing
        module = {k: v for k, v in data.items() if k in _MAIN_KEYS}
        if not os.path.isfile(module.get("init_main_from_path", __file__)):
            module = {}  # a script fed on stdin (`python - < train.py`) is named "<stdin>": no file to import
    return dict(os.environ), module, seed, worker_id


def process(ctx, **kwargs) -> mp.process.BaseProcess:
    """A process of ``ctx`` (``Process(**kwargs)``, not started) that starts without importing the caller's
    main script: the worker imports it itself, once it has the caller's environment (see :func:`inheritance`).

    The start reads the caller's ``__main__`` and changes nothing of it, so another thread of the caller (its
    own ``__file__``, a ``ProcessPoolExecutor`` starting processes of its own) sees it as it is throughout.
    """
    cls = {"forkserver": _ForkServerWorker, "spawn": _SpawnWorker}.get(ctx.get_start_method())
    return (cls or ctx.Process)(**kwargs)


def cut_off(process) -> str | None:
    """Why ``process``, a worker whose end was just seen, is lost, when it is not its own end: its server died.

    A forkserver tells of each worker's end through a pipe; when the server
    dies, every such pipe closes and multiprocessing reports exit code 255
    for workers that may well be running. They end by themselves (see
    :func:`.worker._watch_parent`); this says what happened, e.g.
    ``"its forkserver (pid 42) was killed by signal SIGKILL"``, or
    returns ``None`` while the server runs.
    """
    pid = getattr(process, "server_pid", None)
    if pid is None:
        return None
    from .worker import _parent_alive

    try:  # WNOWAIT: looked at, left for _ensure_server to reap
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            if _parent_alive(pid):
                return None
            # Exiting: its pipes closed before it became a zombie, which it is about to be.
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return f"its forkserver (pid {pid}) has ended"  # reaped already: a new one started since
    from ...errors import describe_exit

    killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    how = describe_exit(-info.si_status if killed else info.si_status)
    return f"its forkserver (pid {pid}) was {how}" if killed else f"its forkserver (pid {pid}) ended ({how})"


# What the preparation data of a spawned or forkserver child says of the main module.
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")


class _SpawnWithoutMain:
    """Stands for :mod:`multiprocessing.spawn` in a ``Popen._launch``: its preparation data names no main module."""

    def __getattr__(self, name):
        return getattr(_spawn(), name)

    @staticmethod
    def get_preparation_data(name: str) -> dict:
        data = _spawn().get_preparation_data(name)
        for key in _MAIN_KEYS:
            data.pop(key, None)
        return data


def _spawn():
    from multiprocessing import spawn

    return spawn


@functools.cache
def _without_main(popen: type) -> type:
    """``popen`` (the stdlib's ``Popen`` of a start method), its ``_launch`` run with :class:`_SpawnWithoutMain`
    as its ``spawn``: this Python's own code, not a copy of it, and no module changed for anyone else."""
    launch = popen._launch
    own = types.FunctionType(launch.__code__, dict(launch.__globals__, spawn=_SpawnWithoutMain()), launch.__name__,
                             launch.__defaults__, launch.__closure__)
    return type(popen.__name__, (popen,), {"_launch": own, "__module__": __name__})


if sys.platform != "win32":  # (on Windows a spawned child gets the main module at its bootstrap, as usual)
    class _ForkServerWorker(mp.context.ForkServerProcess):
        server_pid: int | None = None  # the server that forked it (see cut_off)

        @staticmethod
        def _Popen(process_obj):
            from multiprocessing import forkserver, popen_forkserver

            process_obj.server_pid = forkserver._forkserver._forkserver_pid
            return _without_main(popen_forkserver.Popen)(process_obj)

    class _SpawnWorker(mp.context.SpawnProcess):
        @staticmethod
        def _Popen(process_obj):
            from multiprocessing import popen_spawn_posix

            return _without_main(popen_spawn_posix.Popen)(process_obj)
else:
    _ForkServerWorker = _SpawnWorker = None


def _ensure_server(server) -> None:
    """Start the server unless the one recorded in the stdlib's forkserver singleton still runs."""
    from multiprocessing import connection, resource_tracker, spawn, util

    with server._lock:
        if server._forkserver_pid is not None:
            try:
                pid, _ = os.waitpid(server._forkserver_pid, os.WNOHANG)
            except ChildProcessError:
                pid = -1
            if not pid:
                return  # still running
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
        resource_tracker.ensure_running()  # the stdlib's order: its descriptor is then the caller's
        cmd = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); sys.path[:] = %r; "
               "from multiprocessing.forkserver import main; main(%d, %d, %r)")
        address = _socket_address(connection.arbitrary_address("AF_UNIX"))
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # the server ends at EOF: the caller and every worker gone
            try:
                # sys.path is the caller's, set before the server imports anything (a Ctrl-C of the caller's
                # terminal does not end it half-way through its imports: the caller decides).
                code = cmd % (list(sys.path), listener.fileno(), alive_r, PRELOAD)
                exe = spawn.get_executable()
                args = [exe, *util._args_from_interpreter_flags(), "-c", code]
                pid = util.spawnv_passfds(exe, args, [listener.fileno(), alive_r])
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


# A Unix socket's path holds at most 107 bytes (Linux; 103 on macOS).
_MAX_SOCKET_PATH = 100


def _socket_address(address: str) -> str:
    """``address`` (in multiprocessing's temporary directory, under ``TMPDIR``), or, where that path is too long
    for a Unix socket (a deep ``TMPDIR``, as batch systems set per job), one in a private directory under
    ``/tmp``, removed at exit, as CPython 3.13's multiprocessing does.

    Example:
        >>> _socket_address("/tmp/pymp-x/listener-y")
        '/tmp/pymp-x/listener-y'
        >>> len(_socket_address("/" + "d" * 200 + "/listener-y")) < _MAX_SOCKET_PATH
        True
    """
    if len(os.fsencode(address)) <= _MAX_SOCKET_PATH:
        return address
    import shutil
    import tempfile
    from multiprocessing import util

    directory = tempfile.mkdtemp(prefix="nnh-", dir="/tmp")  # mode 0700: this user's alone
    util.Finalize(None, shutil.rmtree, args=(directory,), kwargs={"ignore_errors": True}, exitpriority=-100)
    return os.path.join(directory, "server")
