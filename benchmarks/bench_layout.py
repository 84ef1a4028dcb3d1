"""Warm ``run`` latency of a 2-worker pool with the caller and the workers pinned to chosen cores.

Where the kernel places the workers decides the unpinned figure of ``bench_executor.py`` (the
caller's core shared with a worker, or not); pinned, two checkouts can be compared per layout:

    python benchmarks/bench_layout.py 1,1                         # caller on core 0, both workers on core 1
    PYTHONPATH=<other checkout> python benchmarks/bench_layout.py 1,1

Prints the median of 1000 calls in each of 5 rounds, in microseconds (needs 2 cores).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from nn_handler import ParallelExecutor


def pid(device=None):
    return os.getpid()


def noop(device=None):
    return None


def main() -> None:
    cores = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "1,1").split(",")]
    os.sched_setaffinity(0, {0})
    with ParallelExecutor(device_ids=["cpu"] * len(cores)) as ex:
        for worker, core in zip(sorted(ex.run(pid)), cores):
            os.sched_setaffinity(worker, {core})
        for _ in range(500):
            ex.run(noop)
        medians = []
        for _ in range(5):
            times = []
            for _ in range(1000):
                start = time.perf_counter()
                ex.run(noop)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times) * 1e6)
    print(f"workers on cores {cores}, caller on core 0: run median per round (us):",
          " ".join(f"{m:.1f}" for m in medians))


if __name__ == "__main__":
    main()
