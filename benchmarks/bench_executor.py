"""ParallelExecutor against concurrent.futures.ProcessPoolExecutor (spawn) and loky, in one run.

    python benchmarks/bench_executor.py            # all measurements
    python benchmarks/bench_executor.py --quick    # fewer repetitions
    python benchmarks/bench_executor.py --cold     # only the cold start to a first result (before/after a change:
                                                   # PYTHONPATH=<other checkout> python benchmarks/bench_executor.py --cold)
    python benchmarks/bench_executor.py --closure  # only: a 64 MiB tensor in a closure vs as an argument

Two CPU workers each. Prints one table: warm per-call latency of a broadcast
call (one task per worker), the round trip of one ``submit(...).result()``, map throughput over 4000 small tensors (chunks of
64), result throughput for a 64 MiB tensor per worker (the worker keeps the
tensor, so only the transfer is timed), cold start of a whole process, and the
time from a worker's death to the error in the caller. ``--closure`` times a
function that closes over a 64 MiB tensor against the same tensor passed as an
argument (5 calls each, ours only). loky comes from the
`bench` extra; its columns are skipped when it is not installed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import torch

from nn_handler import ParallelExecutor, ParallelExecutionError, worker_state

try:
    import loky
except ImportError:  # optional peer
    loky = None

RESULT_BYTES = 64 << 20


def noop(x=0):
    return x


def noop_dev(x=0, device=None):
    return x


def small_sum(t, device=None):
    return t * 2


def big_result(device=None):
    # A fresh tensor per call, as a real result is (a cached one would let
    # torch's fd-passing reducers send a handle to memory already shared).
    # The baseline "single-process clone" pays the same clone. The source is
    # kept in worker_state(), a dict that lives as long as the worker process
    # in every pool: a global of this script would not do, since nn_handler
    # sends a script's functions by value, with a fresh copy of their globals
    # per call, and each call would build the source again.
    state = worker_state()
    if "big" not in state:
        state["big"] = torch.ones(RESULT_BYTES // 4)
    return state["big"].clone()


def pid(device=None):
    return os.getpid()


def sleep_long(device=None):
    time.sleep(60)


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ----------------------------------------------------------------------------- peers as "broadcast" calls
class Peer:
    def __init__(self, name, make):
        self.name, self.make = name, make
        self.ex = make()

    def broadcast(self, fn, *args):
        futures = [self.ex.submit(fn, *args) for _ in range(2)]
        return [f.result() for f in futures]

    def map(self, fn, items, chunksize):
        return list(self.ex.map(fn, items, chunksize=chunksize))

    def pids(self):
        return list(self.ex._processes)

    def close(self):
        self.ex.shutdown(wait=True, kill_workers=True) if self.name == "loky" else self.ex.shutdown(wait=True)


class Ours:
    name = "nn_handler"

    def __init__(self):
        self.ex = ParallelExecutor(device_ids=["cpu", "cpu"]).start()

    def broadcast(self, fn, *args):
        return self.ex.run(fn, *args)

    def map(self, fn, items, chunksize):
        return list(self.ex.map(fn, items, chunksize=chunksize))

    def pids(self):
        return self.ex.run(pid)

    def close(self):
        self.ex.shutdown()


def make_peers():
    peers = [Ours(), Peer("ProcessPool", lambda: cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")))]
    if loky is not None:
        peers.append(Peer("loky", lambda: loky.get_reusable_executor(max_workers=2, reuse=False)))
    for p in peers:  # warm up: start workers, import torch there
        p.broadcast(noop_dev if isinstance(p, Ours) else noop)
        p.broadcast(small_sum, torch.ones(2))
    return peers


def warm_latency(peer, n):
    fn = noop_dev if isinstance(peer, Ours) else noop
    times = []
    for _ in range(n):
        t = time.perf_counter()
        peer.broadcast(fn, 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6, _percentile(times, 0.99) * 1e6


def submit_latency(peer, n):
    fn = noop_dev if isinstance(peer, Ours) else noop
    if not hasattr(peer.ex, "submit"):  # an nn_handler from before it had one
        return float("nan")
    times = []
    for _ in range(n):
        t = time.perf_counter()
        peer.ex.submit(fn, 1).result()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def map_throughput(peer, n_items=4000, chunksize=64):
    items = [torch.full((16,), float(i)) for i in range(n_items)]
    t = time.perf_counter()
    out = peer.map(small_sum, items, chunksize)
    dt = time.perf_counter() - t
    assert len(out) == n_items and float(out[-1][0]) == 2.0 * (n_items - 1)
    return n_items / dt


def result_throughput(peer, reps):
    peer.broadcast(big_result)  # build the cached tensors
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        out = peer.broadcast(big_result)
        dt = time.perf_counter() - t
        assert out[0].numel() * 4 == RESULT_BYTES
        del out
        best.append(2 * RESULT_BYTES / dt / 1e9)
    return statistics.median(best)


def clone_throughput(reps):
    src = torch.ones(RESULT_BYTES // 4)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        c = src.clone()
        rates.append(RESULT_BYTES / (time.perf_counter() - t) / 1e9)
        del c
    return statistics.median(rates)


def death_to_error(peer):
    victim = peer.pids()[0]
    killed_at = {}

    def kill_soon():
        time.sleep(0.5)
        killed_at["t"] = time.perf_counter()
        os.kill(victim, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    try:
        peer.broadcast(sleep_long)
    except (ParallelExecutionError, cf.process.BrokenProcessPool, Exception):
        return time.perf_counter() - killed_at["t"]
    return float("nan")


def closure_vs_argument(calls=5, nbytes=RESULT_BYTES):
    """Seconds for ``calls`` runs of a function closing over a tensor, and of one taking it as an argument.

    The two kinds of call alternate, so that a busy machine slows both alike.
    """
    weights = torch.ones(nbytes // 4)

    def with_argument(w, device=None):
        return float(w[0])

    def with_closure(device=None):
        return float(weights[0])

    timings = {"argument": 0.0, "closure": 0.0}
    with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
        ex.run(noop_dev)  # warm
        for i in range(calls):
            for name, call in (("argument", lambda: ex.run(with_argument, weights)),
                               ("closure", lambda: ex.run(with_closure))):
                weights[0] = i  # changed in place between calls: each call must see it
                t = time.perf_counter()
                assert call() == [float(i)] * 2, name
                timings[name] += time.perf_counter() - t
    return timings


COLD_OURS = """
import os
from nn_handler import ParallelExecutor
def f(device): return os.getpid()
if __name__ == "__main__":
    with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
        ex.run(f)
"""
COLD_SPAWN = """
import torch.multiprocessing as mp
def f(rank): pass
if __name__ == "__main__":
    mp.spawn(f, nprocs=2)
"""
COLD_IMPORT = "import torch"
# From just after `import torch` to the first result of a 2-worker executor: what nn_handler adds to a cold start
# (importing it, the forkserver with its preload, the workers, one call), without torch's own import in the caller.
COLD_FIRST_RESULT = """
import time
import torch
t0 = time.perf_counter()
from nn_handler import ParallelExecutor
def f(device): return 0
if __name__ == "__main__":
    with ParallelExecutor(device_ids=["cpu", "cpu"]) as ex:
        ex.run(f)
        print(time.perf_counter() - t0)
"""


def cold_first_result(reps, tmpdir="/tmp"):
    """Seconds from after ``import torch`` to the first result, measured inside each of ``reps`` fresh processes."""
    path = os.path.join(tmpdir, "nnh_cold_first_result.py")
    with open(path, "w") as f:
        f.write(COLD_FIRST_RESULT)
    return [float(subprocess.run([sys.executable, path], check=True, timeout=120, capture_output=True,
                                 text=True).stdout.split()[-1]) for _ in range(reps)]


def cold_start(code, reps, tmpdir="/tmp"):
    path = os.path.join(tmpdir, f"nnh_cold_{abs(hash(code))}.py")
    with open(path, "w") as f:
        f.write(code)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([sys.executable, path], check=True, timeout=120)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cold", action="store_true", help="only the cold start to a first result")
    parser.add_argument("--closure", action="store_true", help="only the closure-vs-argument comparison")
    args = parser.parse_args()
    if args.cold:
        times = cold_first_result(3 if args.quick else 9)
        print(f"cold start to the first result of a 2-worker executor, minus import torch (s): "
              f"median {statistics.median(times):.3f}  min {min(times):.3f}  "
              f"(runs: {' '.join(f'{t:.2f}' for t in times)})")
        return
    if args.closure:
        t = closure_vs_argument()
        print(f"64 MiB tensor, 5 calls on 2 workers: as an argument {t['argument']:.3f} s, "
              f"in a closure {t['closure']:.3f} s ({t['closure'] / t['argument']:.2f}x)")
        return
    n_lat, reps = (300, 3) if args.quick else (2000, 7)
    torch.set_num_threads(1)

    peers = make_peers()
    rows = {p.name: {} for p in peers}
    try:
        for p in peers:
            rows[p.name]["run median (us)"], rows[p.name]["run p99 (us)"] = warm_latency(p, n_lat)
        for p in peers:
            rows[p.name]["submit().result() (us)"] = submit_latency(p, n_lat)
        for p in peers:
            rows[p.name]["map 4000 small (items/s)"] = map_throughput(p)
        for p in peers:
            rows[p.name]["64 MiB results (GB/s)"] = result_throughput(p, reps)
        for p in peers:
            rows[p.name]["death to error (s)"] = death_to_error(p)
    finally:
        for p in peers:
            p.close()
    clone = clone_throughput(reps)
    cold_ours = cold_start(COLD_OURS, reps)
    cold_spawn = cold_start(COLD_SPAWN, reps)
    cold_import = cold_start(COLD_IMPORT, reps)

    metrics = list(next(iter(rows.values())))
    names = list(rows)
    print(f"{'metric':28}" + "".join(f"{n:>14}" for n in names))
    for m in metrics:
        print(f"{m:28}" + "".join(f"{rows[n][m]:>14.4g}" for n in names))
    print(f"{'single-process clone (GB/s)':28}{clone:>14.4g}")
    print(f"{'cold start, whole process (s)':28} nn_handler {cold_ours:.2f}   torch.multiprocessing.spawn {cold_spawn:.2f}"
          f"   import torch alone {cold_import:.2f}")
    ours = rows["nn_handler"]
    print("\nratios (targets in brackets):")
    if "loky" in rows:
        print(f"  run median vs loky            {ours['run median (us)'] / rows['loky']['run median (us)']:.2f}x  [<= 0.5]")
        print(f"  map vs loky                   {ours['map 4000 small (items/s)'] / rows['loky']['map 4000 small (items/s)']:.2f}x  [>= 1.5]")
    ppe = rows["ProcessPool"]
    print(f"  results vs ProcessPool        {ours['64 MiB results (GB/s)'] / ppe['64 MiB results (GB/s)']:.2f}x  [>= 1.0]")
    print(f"  results vs single clone       {ours['64 MiB results (GB/s)'] / clone:.2f}x  [>= 0.85]")
    print(f"  run median                    {ours['run median (us)']:.0f} us  [<= 100]")
    print(f"  submit().result()             {ours['submit().result() (us)']:.0f} us  [<= 150]")
    print(f"  map 4000 small                {ours['map 4000 small (items/s)']:.0f} items/s  [>= 60000]")
    print(f"  cold start above import torch {cold_ours - cold_import:.2f} s  [<= 1.0]")
    print(f"  cold start vs mp.spawn        {cold_ours / cold_spawn:.2f}x  [<= 1.0]")
    print(f"  death to error                {ours['death to error (s)']:.3f}s  [< 0.1]")


if __name__ == "__main__":
    main()
