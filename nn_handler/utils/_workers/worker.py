"""The child's loop: pin the device, split the cores, run calls, send results or the remote traceback.

Messages from the pool are ``(call_id, kind, fn_blob, payload_blob, files)``:
``kind`` is ``"run"`` (payload ``(args, kwargs)``) or ``"map"`` (payload: a
chunk of items); ``fn_blob`` is ``None`` when the function is the one already
loaded for this ``call_id`` (a ``map`` sends it once per worker), else a
:meth:`~.transport.PackedFunction.message`: its digest, its body unless this
worker holds it from an earlier call, and this call's files for its large
tensors (see :class:`~.transport.FunctionCache`); ``files`` is
``(given_back, dropped)``, what the caller says of earlier results' files
(see :mod:`.lending`), and the named copies of this call's files where
the caller's are refused to its workers (:func:`.shm_files.use_named`). Replies are
``(status, call_id, body)`` with ``status`` in ``ok`` (``body``: the
result pickled), ``val`` (``body``: a :func:`~.transport.plain` result itself), ``err``, ``exit`` (an error, and the
worker ends: the function raised ``SystemExit``), ``end`` (``body``: the task's own reply, after which the
worker ends: an item of a ``return_exceptions`` map raised ``SystemExit``), ``refused`` (``body``: why; it may not
open the caller's files, and nothing of the task ran), ``main`` (it imports the caller's
main script), ``init`` (started, the initializer runs) or ``ready``; a ``"memory"``
message (payload: the limit) is answered with ``("mem", call_id, (bytes in use, files let go))`` (worker
recycling, see :func:`memory_report`).
"""

from __future__ import annotations

import gc
import os
import pickle
import re
import select
import signal
import sys
import threading
import time
import traceback

from . import pipes
from . import transport as _transport
from .task_errors import failure_record, unpicklable_result

_index: int | None = None  # this worker's position in its pool; None outside a worker
_state: dict = {}
_ending = False  # the task asked this worker to end once its reply is sent (see end_after_task)


def worker_state() -> dict:
    """A dict that belongs to the current worker process and lives as long as it does.

    The place for per-worker state: an ``initializer`` loads a model into it
    once, every later call on that worker finds it there. It works for
    functions defined in a script or a notebook too, which travel by value
    with their own copy of their globals (so a global set by the initializer
    would not be seen by later calls). In the calling process it is just
    that process's own dict.

    Example:
        >>> from nn_handler import worker_state
        >>> def load(device):
        ...     worker_state()["model"] = torch.nn.Linear(4, 2).to(device)
        >>> def predict(x, device):
        ...     return worker_state()["model"](x.to(device))
        >>> # ParallelExecutor(initializer=load).map(predict, batches)
    """
    return _state


def end_after_task() -> None:
    """End this worker once the reply of its current task is sent (the pool then replaces it).

    For a ``SystemExit`` that :class:`~.sweep.Settled` caught for one item of a chunk: the item gets its
    error, the rest of the chunk its results, and the worker ends as the function asked.
    """
    global _ending
    _ending = True


def worker_index() -> int | None:
    """The position of the current worker in its pool (0, 1, ...), or ``None`` outside a worker.

    An initializer can use it to take a rank, e.g. to join a process group.
    """
    return _index


# Seconds between checks that the caller is still alive. A worker blocked in
# recv() learns of the caller's death from EOF at once; this catches the
# worker that is busy computing when the caller is killed.
_WATCHDOG_PERIOD = 0.5


def _watch_parent(parent_pid: int, reply_fd: int | None = None, results: str | None = None) -> None:
    # However this worker ends (EOF from a dead caller, a broken pipe while it
    # replied), the files its caller left in shared memory go with it: a caller
    # killed by a signal cleans nothing, and nobody else knows these names.
    import multiprocessing
    from multiprocessing import util

    util.Finalize(None, _clean_if_orphaned, args=(parent_pid,), exitpriority=0)
    server = getattr(multiprocessing.current_process(), "server_pid", None)  # the forkserver that forked us
    while _parent_alive(parent_pid):
        if server is not None and os.getppid() != server:
            # Our server died: the caller learns of our end from it, so it counts us gone (see server.cut_off)
            # and nobody would see us end later. We end now, leaving its files to it; our results' files too,
            # unless the caller no longer reads our pipe (it ran os.execv(): the same pid, nobody to read them).
            if reply_fd is not None and pipes.reader_gone(reply_fd):
                _transport.remove_prefixed(results, final=True)
            os._exit(1)
        time.sleep(_WATCHDOG_PERIOD)
    _transport.remove_process_files(parent_pid, final=True)
    os._exit(1)  # nobody is left to read our results


def _clean_if_orphaned(parent_pid: int) -> None:
    if not _parent_alive(parent_pid):
        _transport.remove_process_files(parent_pid)


def _parent_alive(pid: int) -> bool:
    """False once ``pid`` has exited or is exiting (its pipe ends close before it becomes a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        PF_EXITING = 0x4
        return fields[0] not in ("Z", "X") and not int(fields[6]) & PF_EXITING
    except OSError:
        pass
    try:  # gone, or no /proc here: ask the kernel (it counts a zombie as alive)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def threads_wanted(share: int, environ=os.environ) -> int:
    """The torch threads of a worker: ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``, which wins) where the caller's
    environment sets it, as torch takes them in a process of its own (no more than the machine's cores), else
    ``share`` (its share of the cores).

    Example:
        >>> threads_wanted(4, {}), threads_wanted(4, {"OMP_NUM_THREADS": "1"}), threads_wanted(4, {"OMP_NUM_THREADS": ""})
        (4, 1, 4)
    """
    wanted = share
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        try:
            value = int(environ.get(name, "").split(",")[0])  # (OpenMP's nested form "4,2": the outer level)
        except ValueError:
            continue  # unset, or not a number: torch ignores it too
        if value > 0:
            wanted = min(value, os.cpu_count() or value)
    return wanted


def call_with_device(fn_and_position, args: tuple, kwargs: dict, device, pass_device: bool):
    """Call ``fn`` with ``device`` where its signature takes it (``position``: a positional slot, else by keyword)."""
    fn, position = fn_and_position
    if not pass_device:
        return fn(*args, **kwargs)
    if position is not None and len(args) > position:
        # def f(device, data) called with (data,): the device takes its slot
        return fn(*args[:position], device, *args[position:], **kwargs)
    return fn(*args, **kwargs, device=device)


def call_each(fn_and_position, items, device, pass_device: bool) -> list:
    """``call_with_device`` for each item of a map chunk, with the branch taken once for the chunk.

    Example:
        >>> call_each((lambda x, device: (x, device), None), [1, 2], "cpu", True)
        [(1, 'cpu'), (2, 'cpu')]
    """
    fn, position = fn_and_position
    if not pass_device:
        return [fn(item) for item in items]
    if position == 0:  # (a later slot is past the one item: by keyword, as call_with_device does)
        return [fn(device, item) for item in items]
    return [fn(item, device=device) for item in items]


def worker_main(conn, index: int, device_str: str, threads: int, init_blob: bytes | None, pass_device: bool,
                shm_prefix: str | None, parent_pid: int, reads=None, started=None, inherited=None,
                probe=None) -> None:
    """Entry point of one worker process (started by :class:`~nn_handler.utils._workers.pool.WorkerPool`).

    ``reads``: a shared counter of the messages this worker has read in full (see the pool's ``_Slot.reads``).
    ``started``: where it stamps (``time.monotonic()``) each call's start, once function and arguments are loaded.
    ``inherited``: ``(environ, main, base_seed, worker_id)``, see :func:`inherit` and :func:`seed_streams`.
    ``probe``: a file the caller holds, to open as its files are (see :func:`.shm_files.refused`).
    """
    global _index
    _index = index
    environ, main, *seed = inherited or (None, None)
    if environ is not None:
        inherit(environ)
    # Ctrl-C in a terminal reaches the whole process group; the caller decides
    # what happens to its workers, so they must not die half-way on their own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid, conn.writer.fileno(), shm_prefix), daemon=True,
                     name="parent-watchdog").start()
    import torch

    torch.set_num_threads(threads_wanted(threads))
    device = torch.device(device_str)
    encoder = _transport.Encoder(shm_prefix, to_cpu=True, lend=True)

    def call(fn_and_position, args, kwargs):
        return call_with_device(fn_and_position, args, kwargs, device, pass_device)

    try:
        if main:  # the pool tells a death here (a script's top level) from one before (nn_handler not importable)
            conn.send_bytes(pickle.dumps(("main", None, os.getpid())))
        _import_main(main)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if init_blob is not None:
            conn.send_bytes(pickle.dumps(("init", None, os.getpid())))  # start-up is over (see the pool's bound)
            initializer, initargs = _transport.loads(init_blob)
        if seed:
            # After the imports (the main script, the initializer's module), as DataLoader seeds its workers:
            # a script that seeds at its top level seeds every worker alike when imported.
            seed_streams(*seed)
        if init_blob is not None:
            call(initializer, initargs, {})
        # What is alive now (torch's ~170k objects, the initializer's model)
        # lives as long as the worker: leave it out of garbage collections,
        # so that a full one costs well under a millisecond instead of ~85 ms
        # (release_mapped runs one after some calls).
        gc.freeze()
        conn.send_bytes(pickle.dumps(("ready", None, None if probe is None else _transport.refused(probe))))
    except BaseException as exc:
        record, blob = failure_record(index, device_str, exc, traceback.format_exc())
        conn.send_bytes(pickle.dumps(("err", None, (record, blob))))
        return

    functions = _transport.FunctionCache()  # bodies of functions sent before; the pool keeps a twin
    cached_call, cached_fn = None, None
    mapped: list = []  # weak references to the tensors cached_fn mapped from its call's files
    inbox, fd = pipes.Inbox(conn), conn.writer.fileno()
    pipe = select.poll()
    pipe.register(conn.fileno(), select.POLLIN)
    spinning = False
    while True:
        # After a reply, a worker spins before it blocks in read() (see pipes.spin), while its last task came
        # within the spin: a caller's loop of warm calls then wakes no sleeping worker (submit().result()
        # took 51 us without, 27 us with); a worker whose tasks come seldom, or behind a busy caller, sleeps.
        waited = time.perf_counter()
        if spinning and not inbox.has_message():
            pipes.spin(pipe)
        message = inbox.receive()  # the envelope: plain tuples and bytes, no code of the user's runs
        spinning = time.perf_counter() - waited < pipes.SPIN
        if message is None:
            # Our caller is gone, or closed our pipe without a word (it ran os.execv(): its pid lives on, so
            # nobody cleans after it): the results it did not map, nobody will.
            _transport.remove_prefixed(shm_prefix)
            return
        # Counted before anything of it runs (unpickling the payload may run
        # user code): a worker that dies with the count short of a task never
        # started it, so the pool can give it to a replacement without running
        # anything twice.
        if reads is not None:
            reads.value += 1
        call_id, kind, fn_blob, payload_blob, (given_back, dropped, *named) = message
        if (given_back or dropped) and encoder.lent is not None:
            encoder.lent.update(given_back, dropped)
        if kind == "stop":
            return
        if kind == "memory":  # worker_memory_limit: what this worker holds once its task is done
            report = memory_report(device, shm_prefix, encoder.lent, payload_blob)
            pipes.write_message(fd, pickle.dumps(("mem", call_id, report)))
            continue
        running = False
        try:
            _transport.use_named(named[0] if named else None)  # (the caller's files named, for this call)
            if fn_blob is not None:
                # The previous call's function goes first, and the memory of its files with it.
                cached_call = cached_fn = None
                _transport.release_mapped(mapped)
                cached_fn = _transport.load_function(fn_blob, functions, mapped)
                cached_call = call_id
            elif cached_call != call_id:
                raise RuntimeError("internal error: no function was sent for this call")
            payload = _transport.loads(payload_blob)
            if started is not None:  # the task's timeout counts from here, not from its module's first import
                started.value = time.monotonic()
            running = True
            if kind == "run":
                args, kwargs = payload
                result = call(cached_fn, args, kwargs)
            else:
                result = call_each(cached_fn, payload, device, pass_device)
            if _transport.plain(result):
                # A number, a short tuple of them: inside the reply itself, which
                # the pool loads at once (nothing of the user's runs in that load).
                reply = ("val", call_id, result)
            else:
                try:
                    body, _ = encoder.dumps(result)
                except Exception as exc:
                    # return_exceptions (sweep.Settled): a result that cannot be pickled is its own item's
                    # error, not its chunk's. Asked of the function, so that this loop knows no sweep.
                    settle = getattr(cached_fn[0], "settle_unpicklable", None) if kind == "map" else None
                    if settle is None:
                        raise unpicklable_result(cached_fn[0], exc) from exc
                    body, _ = encoder.dumps(settle(result, encoder.probe, device_str))
                reply = ("ok", call_id, body)
        except BaseException as exc:
            if not running and isinstance(exc, _transport._Refused):
                # The caller's files are refused to us since the pool started (it turned non-dumpable): a
                # transport failure, and nothing of the task ran. The caller sends it again, named.
                cached_call = cached_fn = None
                reply = ("refused", call_id, str(exc))
            else:
                failure = failure_record(index, device_str, exc, traceback.format_exc())
                if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                    # The function asked this process to end: say so, so that the
                    # pool replaces it at once instead of sending it the next call.
                    pipes.write_message(fd, pickle.dumps(("exit", call_id, failure)))
                    return
                reply = ("err", call_id, failure)
        if _ending:  # an item of a settled map raised SystemExit: its chunk's reply, then this worker ends
            reply = ("end", call_id, reply)
        try:
            pipes.write_message(fd, pickle.dumps(reply))
        except OSError:
            _transport.remove_prefixed(shm_prefix)  # the files written for it (see above, at EOF)
            return  # the pool closed our pipe: nobody is left to read it
        if _ending:
            return
        # Let go of the task now, not when the next one comes: a large
        # result is freed while the caller maps it (not in the next call's
        # time), and the memory probe (worker_memory_limit) does not count it.
        message = payload_blob = payload = args = kwargs = result = body = reply = failure = None


def inherit(environ: dict) -> None:
    """Give this new worker the caller's ``os.environ`` as it was when the worker started (the server it was
    forked from has the one of its own start).

    Its random streams are seeded later (:func:`seed_streams`), once the main script and the initializer's
    module are imported: top-level code that seeds would seed every worker alike.
    """
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


def seed_streams(base_seed: int, worker_id: int) -> None:
    """Seed ``torch``, ``random`` and ``numpy`` (when imported) of this worker from its pool's seed and its id.

    As :class:`~torch.utils.data.DataLoader` seeds its workers, after their imports: ``base_seed``
    (:func:`.server.base_seed`: the caller's torch generator state when the pool was made, read without
    drawing from it, and the pool's number in its process) plus ``worker_id`` (unique in its pool,
    replacements included), and numpy from the two mixed: independent across workers, pools and
    replacements, the same run to run after ``torch.manual_seed`` in the caller. A Ray actor gets the same.

    Example:
        >>> import random, torch
        >>> saved = random.getstate(), torch.get_rng_state()
        >>> seed_streams(1234, 0); a = random.random(), float(torch.rand(1))
        >>> seed_streams(1234, 0); a == (random.random(), float(torch.rand(1)))
        True
        >>> seed_streams(1234, 1); a == (random.random(), float(torch.rand(1)))
        False
        >>> random.setstate(saved[0]); torch.set_rng_state(saved[1])
    """
    import random

    import torch
    from torch.utils.data._utils.worker import _generate_state

    seed = (base_seed + worker_id) % (1 << 64)
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(_generate_state(base_seed, worker_id))


def _import_main(main: dict | None) -> None:
    """Import the caller's main module as ``__mp_main__``, as a spawned child does, but after :func:`inherit`:
    its top-level code (``import transformers`` reading ``HF_HOME``) sees the caller's environment."""
    if not main:
        return
    from multiprocessing import process, spawn

    process.current_process()._inheriting = True  # what guard_against_bootstrap looks for, as in spawn's child
    try:
        spawn.prepare(main)
    finally:
        del process.current_process()._inheriting


def memory_report(device, results: str | None, lent, limit: int) -> tuple[int, list[str]]:
    """What the memory probe answers (``worker_memory_limit``): ``(bytes, dropped)``.

    :func:`memory_in_use`, plus on the CPU the whole of the result files the caller gave back and this worker
    keeps to write results into (``lent``'s spares: no result of the caller's lives in them; its results'
    files, in use there or on their way, are the caller's memory). Above ``limit`` it lets go of those first,
    as a cache: ``dropped`` names them, for the caller to close too; the worker is replaced only if it is
    still above the limit without them.
    """
    held = memory_in_use(device, results)
    spares = lent.spare_bytes() if lent is not None and device.type != "cuda" else 0
    if spares and held + spares > limit:
        return held, lent.drop_spares()
    return held + spares, []


def memory_in_use(device, results: str | None = None) -> int:
    """Bytes this worker holds: the CUDA caching allocator's reserve on a GPU; on the CPU its private pages
    (``Private_*`` of ``/proc/self/smaps_rollup``: what it wrote since it was forked, ``share_memory_()``
    tensors and ``MAP_SHARED`` mappings it alone maps) plus the whole of every argument file it still maps,
    touched or not, less the result files (``results*``) it writes again through mappings it keeps, which
    the caller maps too.
    The pages it shares with the server and the other workers (torch's import: most of an idle worker's
    resident set) do not count."""
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    try:
        held = _private_bytes()
    except (OSError, ValueError):  # no /proc: the peak resident set instead (kilobytes on Linux, bytes on macOS)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    if not results:
        return held
    results_private, arguments_private, arguments_whole = _mapped_files(results)
    return held - results_private - arguments_private + arguments_whole


def _private_bytes() -> int:
    """This process's private pages (mapped by it alone), from ``/proc/self/smaps_rollup``; where the kernel
    has none (before Linux 4.14), its anonymous and shared resident pages from ``/proc/self/status``."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            lines = [line for line in f if line.startswith(("Private_Clean:", "Private_Dirty:"))]
    except FileNotFoundError:
        with open("/proc/self/status") as f:
            lines = [line for line in f if line.startswith(("RssAnon:", "RssShmem:"))]
    return sum(int(line.split(":", 1)[1].split()[0]) for line in lines) << 10


# An argument's file, as the pool names them (nnh-<pid>-<pool>-a-<n>: run and submit, -m-: map items).
_ARGUMENT_FILE = re.compile(r"nnh-\d+-\d+-[am]-\d+(?: \(deleted\))?$")


def _mapped_files(results: str) -> tuple[int, int, int]:
    """``(private bytes of this worker's result files results*, private bytes of the argument files it maps,
    their whole size)``, unlinked since or not, in the shared-memory directory.

    A task that keeps a view (``t[:10]``) of an argument keeps its whole file in shared memory, though the
    resident set counts only the pages the worker touched. Files spilled elsewhere (no room in the
    shared-memory directory) are not shared memory: counted neither way.
    """
    directory = os.path.realpath(os.path.dirname(results)) + os.sep  # as /proc shows it
    results = directory + os.path.basename(results)

    def kind(path: str) -> str | None:
        if path.startswith(results):
            return "results"
        if path.startswith(directory) and _ARGUMENT_FILE.match(path, len(directory)):
            return "argument"
        return None

    try:
        with open("/proc/self/maps") as f:  # cheap; smaps (tens of ms with torch's mappings) only when needed
            if not any(directory in line and kind(line.split(maxsplit=5)[-1].rstrip("\n")) for line in f):
                return 0, 0, 0
        results_private, files, mapping = 0, {}, None
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:  # a mapping's header
                    fields = line.split(maxsplit=5)
                    found = kind(fields[5].rstrip("\n")) if len(fields) == 6 else None
                    mapping = None if found is None else (found, fields[4])  # (kind, inode)
                elif mapping is not None and line.startswith(("Size:", "Private_Clean:", "Private_Dirty:")):
                    size = int(line.split()[1]) << 10
                    if mapping[0] == "results":
                        results_private += size if line[0] == "P" else 0
                    else:  # per file: its size (the largest mapping of it), and its private pages
                        whole, private = files.get(mapping[1], (0, 0))
                        files[mapping[1]] = (max(whole, size), private) if line[0] == "S" else (whole, private + size)
        return (results_private, sum(private for _, private in files.values()),
                sum(whole for whole, _ in files.values()))
    except (OSError, ValueError):
        return 0, 0, 0


def guard_against_bootstrap() -> None:
    """Raise a helpful error when a pool is started while a child is still importing ``__main__``."""
    import multiprocessing

    # _inheriting is True while a spawn/forkserver child runs its bootstrap
    # (importing the parent's main module); parent_process() is not yet set then.
    if getattr(multiprocessing.current_process(), "_inheriting", False) and _importing_main():
        raise RuntimeError(
            "a ParallelExecutor was started while a worker process was importing your main module. "
            "Start it under a main guard:\n\n    if __name__ == \"__main__\":\n        main()\n"
        )


def _importing_main() -> bool:
    # The spawn/forkserver bootstrap runs the main script under the name
    # __mp_main__; a frame of that module on the stack means we are inside it.
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False
