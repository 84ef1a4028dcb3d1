"""Large tensors travel through files in /dev/shm: none outlives its call or its process, and a full /dev/shm
is not an error.

Each test lists the files it cares about (``nnh-<pid>-*``, pid of the process that made them) before and after.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers import REPO, kill_group, open_files, pids_alive, run_command
from nn_handler import ParallelExecutor, WorkerDiedError

CPU2 = ["cpu", "cpu"]


def _files(pid: int, *dirs: str) -> list[str]:
    """The transport files of process ``pid`` in ``dirs`` (default /dev/shm)."""
    return sorted(f for d in (dirs or ("/dev/shm",)) for f in glob.glob(f"{d}/nnh-{pid}-*"))


def _held(pid: int) -> dict[str, int]:
    """The transport files process ``pid`` holds open with no name (the caller's), as ``{what /proc shows: size}``."""
    held = {}
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
            if f"/nnh-{pid}-" in target and target.endswith(" (deleted)"):
                held[target] = os.stat(fd).st_size
        except OSError:
            pass
    return held


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def tiny_shm(tmp_path, tmp_path_factory):
    """An 8 MiB tmpfs (Docker gives 64 MiB by default) and an empty directory for what does not fit.

    The directory is the callers' ``TMPDIR``, where multiprocessing puts its forkserver's socket, whose
    path must fit in 107 bytes: a test's own ``tmp_path`` can be too long for it (under pytest-xdist).
    """
    mount = tmp_path / "shm"
    spill = tmp_path_factory.mktemp("spill")
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield str(mount), str(spill)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


# ----------------------------------------------------------------------------- the caller is killed
_KILLED_CALLER = textwrap.dedent("""
    import os, signal, sys, time, torch
    from nn_handler import ParallelExecutor

    def hold(x, device):
        time.sleep(300)

    def big_result(caller, device):
        time.sleep(2)  # the caller has sent the call to both workers
        os.kill(caller, signal.SIGSTOP)  # and now cannot read what follows: the test kills it first
        return torch.ones(8 << 20)  # 32 MiB

    if __name__ == "__main__":
        with ParallelExecutor(device_ids=['cpu', 'cpu']) as ex:
            print('PIDS', *ex.run(lambda device: os.getpid()), flush=True)
            if sys.argv[1] == 'arg':
                ex.run(hold, torch.ones(8 << 20))  # 32 MiB argument, kept in a file while the call runs
            elif sys.argv[1] == 'closure':
                weights = torch.ones(8 << 20)  # 32 MiB in the function's closure: a file too
                ex.run(lambda device: hold(weights, device))
            else:
                ex.run(big_result, os.getpid())
                time.sleep(300)
""")

BIG = 32 << 20


@pytest.mark.timeout(150)
@pytest.mark.parametrize("what, sig, small_shm", [
    ("arg", signal.SIGKILL, False),
    ("arg", signal.SIGTERM, False),
    ("result", signal.SIGKILL, False),
    ("result", signal.SIGTERM, False),
    ("arg", signal.SIGKILL, True),  # the argument went to the fallback directory
    ("closure", signal.SIGKILL, False),
    ("closure", signal.SIGKILL, True),
], ids=["arg-sigkill", "arg-sigterm", "result-sigkill", "result-sigterm", "spilled-arg-sigkill", "closure-sigkill",
        "spilled-closure-sigkill"])
def test_killed_caller_leaves_no_files(tmp_path, request, what, sig, small_shm):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    dirs = ["/dev/shm"]
    if small_shm:
        mount, spill = request.getfixturevalue("tiny_shm")
        env.update(NN_HANDLER_SHM_DIR=mount, TMPDIR=spill)
        dirs = [mount, spill]
    script = tmp_path / "caller.py"
    script.write_text(_KILLED_CALLER)
    proc = subprocess.Popen([sys.executable, str(script), what], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + proc.stdout.read() if proc.poll() is not None else line
        workers = [int(p) for p in line.split()[1:]]

        def written():  # every file this call makes exists with its full size (the caller's have no name)
            files = {f: os.stat(f).st_size for f in _files(proc.pid, *dirs) if os.path.exists(f)}
            files.update(_held(proc.pid))
            full = [f for f, size in files.items() if size == BIG]
            return full if len(full) == (2 if what == "result" else 1) else None

        before = _wait_for(written, 60, f"the {what} files of the caller")
        if small_shm:
            assert all(f.startswith(dirs[1]) for f in before), before
        proc.send_signal(sig)
        if sig != signal.SIGKILL:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped caller acts on SIGTERM once continued
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while (_files(proc.pid, *dirs) or pids_alive(workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _files(proc.pid, *dirs) == [], f"{before} outlived the caller"
        assert not pids_alive(workers), f"workers {workers} outlived their caller"
    finally:
        kill_group(proc)
        for f in _files(proc.pid, *dirs):
            os.unlink(f)


# ----------------------------------------------------------------------------- the whole job is killed
_KILLED_JOB = textwrap.dedent("""
    import os, sys, time

    def holding(weights):  # a function with a large tensor of its own: its files travel with every call
        def hold(x, markers, device=None):
            open(os.path.join(markers, f"{os.getpid()}-{float(x[0] + weights[0]):g}"), "w").close()  # in flight
            time.sleep(300)
        return hold

    if __name__ == "__main__":
        import torch
        from nn_handler import ParallelExecutor

        case, markers = sys.argv[1:]
        big = torch.ones(16 << 20)  # 64 MiB
        hold = holding(torch.ones(4 << 20))
        if case == "submit":  # one worker: the first task runs, the second waits, its files written and unread
            ex = ParallelExecutor(max_workers=1)
            futures = [ex.submit(hold, big * i, markers) for i in (1, 2)]
            open(os.path.join(markers, "submitted"), "w").close()
        else:  # two workers, the second busy: the run's files read by the first, written and unread for the other
            ex = ParallelExecutor(device_ids=["cpu", "cpu"])
            ex.submit(hold, big * 2, markers)
            ex.run(hold, big, markers)
        time.sleep(300)
""")


@pytest.mark.timeout(100)
@pytest.mark.parametrize("case", ["submit", "run"])
def test_a_job_killed_whole_leaves_no_file(tmp_path, tmp_path_factory, case):
    # SIGKILL to the whole process group (`timeout -s KILL`, a cgroup OOM kill, a batch system's hard kill)
    # while a call is in flight: caller, server and workers die at once, and nobody is left to clean up.
    # The spill directory is the job's TMPDIR: short, so that the forkserver's socket goes there (under a
    # deep tmp_path it would go to a private directory in /tmp, which a killed job cannot remove).
    shm, spill, markers = tmp_path / "shm", tmp_path_factory.mktemp("spill"), tmp_path / "markers"
    for d in (shm, markers):
        d.mkdir()
    script = tmp_path / "job.py"
    script.write_text(_KILLED_JOB)
    proc = subprocess.Popen([sys.executable, str(script), case, str(markers)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, NN_HANDLER_SHM_DIR=str(shm), TMPDIR=str(spill)))
    try:
        # submit: the first task runs, the second is submitted; run: one worker runs its share, the other the
        # task submitted before. Either way one task's files are written and not yet read by its worker.
        _wait_for(lambda: len(os.listdir(markers)) >= 2 or proc.poll() is not None, 60, "the tasks to start")
        assert proc.poll() is None, proc.stdout.read()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = _files(proc.pid, str(shm), str(spill))
        assert left == [], f"{left} outlived the job"
    finally:
        kill_group(proc)


# ----------------------------------------------------------------------------- a failed call's late replies
def test_large_late_reply_of_a_failed_call_is_removed():
    def one_dies_other_replies(victim, device):
        if os.getpid() == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1)  # the caller has raised before this reply arrives
        return torch.ones(4 << 20)  # 16 MiB: through shared memory

    with ParallelExecutor(device_ids=CPU2) as ex:
        assert _files(os.getpid()) == []
        for _ in range(2):
            victim = ex.run(lambda device: os.getpid())[0]
            with pytest.raises(WorkerDiedError):
                ex.run(one_dies_other_replies, victim)
            assert ex.run(lambda device: "next") == ["next", "next"]  # reads and discards the late reply
            assert _files(os.getpid()) == []
    assert _files(os.getpid()) == []


# ----------------------------------------------------------------------------- a small /dev/shm
_SMALL_SHM_CALLER = textwrap.dedent("""
    import os, torch
    from nn_handler import ParallelExecutor

    def double(x, device):
        return x * 2

    if __name__ == "__main__":
        big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB: more than the whole 8 MiB tmpfs
        mid = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB: fits, until the two results join it
        with ParallelExecutor(device_ids=['cpu', 'cpu']) as ex:
            for x in (big, mid, big):
                assert all(torch.equal(r, x * 2) for r in ex.run(double, x))
            assert all(torch.equal(r, x * 2) for r, x in zip(ex.map(double, [big, mid, big + 1]), [big, mid, big + 1]))
            assert ex.run(lambda device: float(big[-1])) == [float(big[-1])] * 2  # a closure spills alike
        print('DONE', os.getpid())
""")


@pytest.mark.timeout(150)
def test_small_shm_falls_back_to_the_temp_dir_with_one_warning_per_process(tiny_shm, tmp_path):
    mount, spill = tiny_shm
    script = tmp_path / "caller.py"
    script.write_text(_SMALL_SHM_CALLER)
    result = run_command([sys.executable, str(script)], timeout=120,
                         env={"NN_HANDLER_SHM_DIR": mount, "TMPDIR": spill})
    assert result.returncode == 0, result.stdout
    assert "DONE" in result.stdout, result.stdout
    # the caller (arguments) and each of the two workers (results) warn once, however often they spill
    assert result.stdout.count("--shm-size") == 3, result.stdout
    assert "NN_HANDLER_SHM_DIR" in result.stdout
    pid = int(result.stdout.split("DONE")[1].split()[0])
    assert _files(pid, mount, spill) == []
    assert os.listdir(mount) == [] and os.listdir(spill) == []


def test_shm_dir_that_is_not_a_directory_is_a_clear_error(tmp_path):
    code = ("from nn_handler import ParallelExecutor\n"
            "ParallelExecutor(device_ids=['cpu'])\n")
    result = run_command([sys.executable, "-c", code], timeout=60,
                         env={"NN_HANDLER_SHM_DIR": str(tmp_path / "missing")})
    assert result.returncode != 0
    assert f"NN_HANDLER_SHM_DIR={tmp_path / 'missing'} is not a directory" in result.stdout, result.stdout


# ----------------------------------------------------------------------------- map streams its items
def test_map_keeps_a_few_chunks_per_worker_in_shared_memory_whatever_the_input_size():
    caller = os.getpid()
    item = torch.ones(1 << 21)  # 8 MiB
    n = 100

    # Files an earlier test's pool in this process, left to the garbage collector, may still hold: not ours.
    earlier = set(_held(caller)) | set(glob.glob(f"/dev/shm/nnh-{caller}-*"))

    def peak(x, device):  # what this caller has in shared memory while the item runs, named or held
        sizes = [size for target, size in _held(caller).items() if target not in earlier]
        for f in set(glob.glob(f"/dev/shm/nnh-{caller}-*")) - earlier:
            try:
                sizes.append(os.stat(f).st_size)
            except FileNotFoundError:
                pass
        return x[0], len(sizes), sum(sizes)

    with ParallelExecutor(device_ids=CPU2) as ex:
        out = list(ex.map(peak, [(i, item) for i in range(n)]))
    assert [i for i, _, _ in out] == list(range(n))
    peak_count = max(c for _, c, _ in out)
    peak_bytes = max(b for _, _, b in out)
    # two workers, each with at most its own chunk, its next one and one being written: 6 chunks of 8 MiB
    assert 1 <= peak_count <= 6 and peak_bytes <= 6 * item.nbytes, (peak_count, peak_bytes)
    assert _files(caller) == []


# ----------------------------------------------------------------------------- results' files are lent, then reused
def _filled(value, device=None):
    return torch.full((1 << 20,), float(value))  # 4 MiB: through a file


def _open_result_files(device=None) -> set:
    """The files of the transport this process holds open (they have no name: lent files), by the names
    they had."""
    return open_files("/nnh-")


def test_the_file_of_a_dropped_result_is_written_again_and_no_name_stays():
    before = _open_result_files()  # of pools that earlier tests left to the garbage collector
    with ParallelExecutor(device_ids=CPU2) as ex:
        for call in range(8):
            out = ex.run(_filled, call)
            assert [(float(t.min()), float(t.max())) for t in out] == [(call, call)] * 2
            assert _files(os.getpid()) == []  # mapped: the name went at once
            del out
        # Each worker wrote every result into the same file: one open there, one here
        # (a worker that made a new file per result would hold eight).
        in_workers = ex.run(_open_result_files)
        assert [len(files) for files in in_workers] == [1, 1]
        assert _open_result_files() - before == in_workers[0] | in_workers[1]
    assert not _open_result_files() & (in_workers[0] | in_workers[1])  # closed with the pool


def test_a_result_still_in_use_is_never_written_over():
    with ParallelExecutor(device_ids=CPU2) as ex:
        kept = ex.run(_filled, 1)
        view = ex.run(_filled, 2)[1][-10:]  # only a view of the result is left
        for call in range(3, 9):  # dropped at once: their files are the ones written again
            assert [float(t[0]) for t in ex.run(_filled, call)] == [call, call]
        mapped = list(ex.map(_filled, range(20, 26)))
        assert [float(t.max()) for t in kept] == [1.0, 1.0] and [float(t.min()) for t in kept] == [1.0, 1.0]
        assert torch.equal(view, torch.full((10,), 2.0))
        assert [float(t.min()) for t in mapped] == list(range(20, 26))
    assert [float(t[0]) for t in kept] == [1.0, 1.0]  # valid after the pool is gone


def test_a_file_removed_before_it_is_read_is_an_error_not_zeros():
    from nn_handler.utils._workers import transport

    for kind in ({"to_cpu": True, "lend": True}, {}, {"private": True}):  # a worker's result; a map item; an argument
        encoder = transport.Encoder(transport.shm_prefix(f"{os.getpid()}-gone"), **kind)
        data, created = encoder.dumps(torch.ones(1 << 20))
        transport.remove_files(created)
        with pytest.raises(FileNotFoundError):
            transport.loads(data)  # from_file() would have created an empty file and read zeros
    assert _files(os.getpid()) == []


def test_a_held_file_let_go_is_not_read_through_the_number_another_file_took_since():
    from nn_handler.utils._workers import transport

    encoder = transport.Encoder(transport.shm_prefix(f"{os.getpid()}-reused"), private=True)
    data, [gone] = encoder.dumps(torch.ones(1 << 20))
    transport.remove_files([gone])
    _, [now] = encoder.dumps(torch.zeros(1 << 20))  # the same size, in the descriptor the first one had
    try:
        assert now[:2] == gone[:2]
        with pytest.raises(FileNotFoundError, match="let go before it was read"):
            transport.loads(data)
    finally:
        transport.remove_files([now])
    with open(os.devnull) as other:
        os.dup2(other.fileno(), now[1])  # another file takes the number the held files had
        try:
            transport.remove_files([now, gone])  # let go twice: nothing happens, above all not to this file
            os.fstat(now[1])
        finally:
            os.close(now[1])


_FEW_DESCRIPTORS = textwrap.dedent("""
    import json, os, resource, socket, sys, time
    import torch
    from nn_handler import ParallelExecutor

    def wait_for(path):
        while not os.path.exists(path):
            time.sleep(0.01)

    if __name__ == "__main__":
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        own = [open(os.devnull) for _ in range(120)]  # the program's own files
        out = {}
        with ParallelExecutor(max_workers=1) as ex:
            blocker = ex.submit(wait_for, sys.argv[1])
            try:
                # 1 MiB each: a file per argument, held until its call ends; all queued behind the blocker
                futures = [ex.submit(torch.sum, torch.full((1 << 18,), float(i))) for i in range(150)]
                with socket.socket() as sock:
                    out["socket"] = sock.fileno()  # the program's next descriptor
            finally:
                open(sys.argv[1], "w").close()
            out["sums"] = [float(f.result(timeout=120)) for f in futures]
            more = []
            try:
                while True:
                    more.append(open(os.devnull))  # the program takes every descriptor left
            except OSError:
                pass
            try:
                ex.submit(torch.sum, torch.ones(1 << 18))
            except Exception as exc:
                out["error"] = [type(exc).__name__, isinstance(exc, OSError), str(exc)]
            for f in more:
                f.close()
        print("RESULT", json.dumps(out))
""")


def test_large_arguments_queued_hold_few_descriptors_and_leave_the_programs_low_ones(tmp_path):
    # ulimit -n 256 and 120 files of the program's own: submit raised PayloadPicklingError (a TypeError) saying
    # "Too many open files" (half the limit went to queued arguments), where ProcessPoolExecutor works.
    script = tmp_path / "caller.py"
    script.write_text(_FEW_DESCRIPTORS)
    result = run_command([sys.executable, str(script), str(tmp_path / "go")], timeout=90,
                         env={"PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout[-4000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert out["sums"] == [float(i * (1 << 18)) for i in range(150)]
    assert out["socket"] < 160, out["socket"]  # not above the descriptors held for queued arguments
    kind, is_os_error, message = out["error"]  # no descriptor left at all: ours, and said so
    assert is_os_error and kind != "PayloadPicklingError" and "nn_handler holds" in message, out["error"]


def _refuse_other_processes_descriptors():
    """An initializer: this worker may not open /proc/<another pid>/fd (a caller that is not dumpable, another
    uid, ptrace rules of SELinux or AppArmor, some sandboxes)."""
    import errno

    real = os.open

    def opener(path, flags, *args, **kwargs):
        text = os.fsdecode(path) if isinstance(path, (str, bytes)) else ""
        if text.startswith("/proc/") and "/fd/" in text and not text.startswith("/proc/self/"):
            raise PermissionError(errno.EACCES, "Permission denied", text)
        return real(path, flags, *args, **kwargs)

    os.open = opener


def test_workers_refused_the_callers_descriptors_are_sent_named_files():
    # Every argument of 1 MiB or more failed as ParallelExecutionError[PermissionError], read as the task's own.
    with ParallelExecutor(max_workers=1, initializer=_refuse_other_processes_descriptors) as ex:
        assert float(ex.submit(torch.sum, torch.ones(1 << 19)).result(timeout=60)) == 1 << 19
        assert [float(s) for s in ex.map(torch.sum, [torch.ones(1 << 19)] * 2)] == [1 << 19] * 2
    assert _files(os.getpid()) == []


def _refuse_once_marked(marker: str):
    """An initializer: from the moment ``marker`` exists, this worker may not open /proc/<another pid>/fd, as
    when its caller turns non-dumpable after the pool started. (As root, with CAP_SYS_PTRACE, a worker could
    open them anyway: the kernel's refusal is played by ``os.open``.)"""
    import errno

    real = os.open

    def opener(path, flags, *args, **kwargs):
        text = os.fsdecode(path) if isinstance(path, (str, bytes)) else ""
        if (text.startswith("/proc/") and "/fd/" in text and not text.startswith("/proc/self/")
                and os.path.exists(marker)):
            raise PermissionError(errno.EACCES, "Permission denied", text)
        return real(path, flags, *args, **kwargs)

    os.open = opener


def _logged_sum(log: str, weights, x):
    with open(log, "a") as f:
        f.write("ran\n")
    return float((weights + x).sum())


def _set_dumpable(value: int) -> None:
    import ctypes

    PR_SET_DUMPABLE = 4
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, value, 0, 0, 0) == 0


def test_a_refusal_that_begins_after_start_sends_the_call_again_once_through_named_files(tmp_path):
    # The check at start passed; the caller then turned non-dumpable: every argument of 1 MiB or more failed
    # as ParallelExecutionError[PermissionError], read as the task's own error.
    import functools

    marker, log = tmp_path / "non-dumpable", tmp_path / "ran"
    big = torch.ones(1 << 19)  # 2 MiB: a file of its own
    with ParallelExecutor(max_workers=1, initializer=_refuse_once_marked, initargs=(str(marker),)) as ex:
        assert float(ex.submit(torch.sum, big).result(timeout=60)) == 1 << 19  # held files, opened
        _set_dumpable(0)
        try:
            marker.touch()
            fn = functools.partial(_logged_sum, str(log), big)  # a large tensor of the function's own too
            # The first is refused and sent again; the second was pickled before the refusal was known.
            futures = [ex.submit(fn, big) for _ in range(2)]
            assert [f.result(timeout=60) for f in futures] == [2.0 * (1 << 19)] * 2
            assert log.read_text() == "ran\n" * 2  # each ran once
            assert [float(s) for s in ex.map(torch.sum, [big] * 2)] == [1 << 19] * 2  # named from now on
        finally:
            _set_dumpable(1)
    assert _files(os.getpid()) == []


# ----------------------------------------------------------------------------- CUDA results
@pytest.mark.gpu
def test_cuda_results_arrive_whole_through_files_written_from_the_device_again_and_again():
    def result(step, device):
        torch.manual_seed(step)
        value = torch.randn(8 << 20, device=device)  # 32 MiB: through a page-locked file
        return value, value.sum().item(), value[::2].half()  # a strided view and half precision too

    with ParallelExecutor(device_ids=[0]) as ex:
        for step in range(4):  # from the second call on, each result is written into the last one's file
            value, total, half = ex.submit(result, step).result()
            assert value.device.type == "cpu" and not value.requires_grad
            assert torch.isclose(value.double().sum(), torch.tensor(total, dtype=torch.float64), rtol=1e-3)
            assert torch.equal(half, value[::2].half())
            del value, half
