"""Warm latency with the caller and the workers pinned to chosen cores, against the bare round trip pinned alike.

Where the kernel places the workers decides the unpinned figures of ``bench_executor.py``
(the caller's core shared with a worker, or not), and its bare round trip lands where it
lands, apart from ours. Pinned, each layout is measured on its own, ours and the floor in
alternating rounds, so the targets can be read per layout:

    python benchmarks/bench_layout.py              # the layouts 1,1  0,1  0,0 (caller on core 0)
    python benchmarks/bench_layout.py 1,1          # one layout: both workers on core 1
    PYTHONPATH=<other checkout> python benchmarks/bench_layout.py 1,1   # compare checkouts per layout

For each layout: the median of 1000 calls in each of 5 rounds, in microseconds, of a warm
``run`` on a 2-worker pool against 2 echo processes pinned as the workers are (overlapped),
and of ``submit().result()`` against 1 echo process pinned as the first worker; then the
ratios (targets: run <= 1.5, submit <= 2.0). Needs 2 cores.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from bench_executor import EchoProcesses
from nn_handler import ParallelExecutor

ROUNDS, CALLS = 5, 1000


def pid(device=None):
    return os.getpid()


def noop(device=None):
    return None


def _run_times(ex, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        ex.run(noop)
        times.append(time.perf_counter() - start)
    return times


def _submit_times(ex, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        ex.submit(noop).result()
        times.append(time.perf_counter() - start)
    return times


def measure(cores: list[int]) -> dict[str, list[float]]:
    """Round medians (us) of ours and the floors, with this process on core 0 and the workers on ``cores``."""
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    two, one = EchoProcesses(2), EchoProcesses(1)  # as bench_executor's targets
    try:
        with ParallelExecutor(device_ids=["cpu"] * len(cores)) as ex:
            for worker, core in zip(sorted(ex.run(pid)), cores):
                os.sched_setaffinity(worker, {core})
            for child, core in zip(two.children, cores):
                os.sched_setaffinity(child.pid, {core})
            os.sched_setaffinity(one.children[0].pid, {cores[0]})
            _run_times(ex, 500)
            _submit_times(ex, 500)
            rounds = {"run": [], "floor 2": [], "submit": [], "floor 1": []}
            measures = {"run": lambda: _run_times(ex, CALLS), "floor 2": lambda: two.round_trips(CALLS),
                        "submit": lambda: _submit_times(ex, CALLS), "floor 1": lambda: one.round_trips(CALLS)}
            for _ in range(ROUNDS):  # alternating, so that a slow spell of the machine hits all alike
                for name, timed in measures.items():
                    rounds[name].append(statistics.median(timed()) * 1e6)
            return rounds
    finally:
        two.close()
        one.close()
        os.sched_setaffinity(0, everywhere)


def main() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench_layout needs 2 cores")
    layouts = [sys.argv[1]] if len(sys.argv) > 1 else ["1,1", "0,1", "0,0"]
    for layout in layouts:
        cores = [int(c) for c in layout.split(",")]
        rounds = measure(cores)
        median = {name: statistics.median(values) for name, values in rounds.items()}
        print(f"workers on cores {cores}, caller on core 0 (round medians, us):")
        for name, values in rounds.items():
            print(f"  {name:8s} " + " ".join(f"{v:6.1f}" for v in values))
        print(f"  run / floor 2: {median['run'] / median['floor 2']:.2f} [<= 1.5]   "
              f"submit / floor 1: {median['submit'] / median['floor 1']:.2f} [<= 2.0]")


if __name__ == "__main__":
    main()
