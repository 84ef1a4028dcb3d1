"""The Ray backend against the local pool and against Ray actors written by hand, in one run.

    python benchmarks/bench_ray.py              # 200 warm calls, 15 large results per peer
    python benchmarks/bench_ray.py --quick      # fewer repetitions

Two workers each (CPU: this benchmark runs anywhere). Peers:

- ``local``: ``ParallelExecutor(device_ids=["cpu", "cpu"])``, worker processes on this machine;
- ``ray``: the same executor with ``backend="ray"``, two Ray actors;
- ``actors``: two plain ``@ray.remote`` actors, called as a Ray user writes it by hand
  (``ray.get([a.f.remote(x) for a in actors])``): the floor the Ray backend is held to.

Rows (the peers take turns call by call): a warm broadcast call (one tiny task per worker, the round trip),
and a 64 MiB tensor per worker coming back (a fresh tensor per call, as a real
result is). Median and min over the repeats, in milliseconds; the last column
is the Ray backend over the hand-written actors (target: within 1.2x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from nn_handler import ParallelExecutor  # noqa: E402

RESULT_ELEMENTS = (64 << 20) // 4


def tiny(x, device=None):
    return x


def big(device=None):
    return torch.ones(RESULT_ELEMENTS)


@ray.remote(num_cpus=1)
class HandWritten:
    def tiny(self, x):
        return x

    def big(self):
        return torch.ones(RESULT_ELEMENTS)


def timed(fns: dict, repeats: int) -> dict:
    """Median and min milliseconds per peer; the peers take turns, so that load on the machine hits all alike."""
    for fn in fns.values():
        fn()  # warm: first call, caches, lazy imports
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    calls, bigs = (20, 4) if opts.quick else (200, 15)

    # 4 logical CPUs: both pairs of actors live at once (one CPU each); only one pair works at a time.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    actors = [HandWritten.remote() for _ in range(2)]
    peers = {
        "local": ParallelExecutor(device_ids=["cpu", "cpu"]).start(),
        "ray": ParallelExecutor(device_ids=["cpu", "cpu"], backend="ray"),
    }
    local, ours = peers["local"], peers["ray"]
    rows = {}
    try:
        rows["warm run (2 x tiny)"] = timed({
            "local": lambda: local.run(tiny, 1),
            "ray": lambda: ours.run(tiny, 1),
            "actors": lambda: ray.get([a.tiny.remote(1) for a in actors]),
        }, calls)
        rows["64 MiB result (2 x)"] = timed({
            "local": lambda: local.run(big),
            "ray": lambda: ours.run(big),
            "actors": lambda: ray.get([a.big.remote() for a in actors]),
        }, bigs)
    finally:
        for ex in peers.values():
            ex.shutdown()
        ray.shutdown()

    print(f"{'ms (median / min)':24} {'local':>15} {'ray backend':>15} {'hand-written':>15} {'ray/hand':>9}")
    for name, row in rows.items():
        cells = [f"{row[p][0]:7.1f} / {row[p][1]:5.1f}" for p in ("local", "ray", "actors")]
        print(f"{name:24} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15} {row['ray'][0] / row['actors'][0]:8.2f}x")


if __name__ == "__main__":
    main()
