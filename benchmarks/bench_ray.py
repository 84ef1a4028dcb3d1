"""The Ray backend against the local pool and against Ray actors written by hand, in one run.

    python benchmarks/bench_ray.py              # 200 warm calls, 15 large results per peer, in rounds
    python benchmarks/bench_ray.py --quick      # fewer repetitions

Two workers each (CPU: this benchmark runs anywhere). Peers:

- ``local``: ``ParallelExecutor(device_ids=["cpu", "cpu"])``, worker processes on this machine;
- ``ray``: the same executor with ``backend="ray"``, two Ray actors;
- ``actors``: two plain ``@ray.remote`` actors, called as a Ray user writes it by hand
  (``ray.get([a.f.remote(x) for a in actors])``): the floor the Ray backend is held to.

Rows: a warm broadcast call (one tiny task per worker, the round trip), and a
64 MiB tensor per worker coming back (a fresh tensor per call, as a real
result is). The peers take turns in rounds of a few calls each (the order
rotates from round to round), so that a burst of load on a shared machine
hits all alike. Median and min over every call, in milliseconds; the last
column is the Ray backend over the hand-written actors: the median over the
rounds of the ratio of the two peers' medians in that round (target: within 1.2x).
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


def timed(fns: dict, rounds: int, per_round: int) -> tuple[dict, float]:
    """Median and min milliseconds per peer, and the median over the rounds of ray's round median over actors'."""
    for fn in fns.values():
        fn()  # warm: first call, caches, lazy imports
    times: dict = {name: [] for name in fns}
    ratios = []
    names = list(fns)
    for r in range(rounds):
        medians = {}
        for name in names[r % len(names):] + names[:r % len(names)]:  # each peer first in turn
            fn, these = fns[name], []
            for _ in range(per_round):
                start = time.perf_counter()
                fn()
                these.append((time.perf_counter() - start) * 1000)
            times[name] += these
            medians[name] = statistics.median(these)
        ratios.append(medians["ray"] / medians["actors"])
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}, statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    (rounds, calls), bigs = ((5, 4), (4, 1)) if opts.quick else ((20, 10), (5, 3))  # (rounds, calls a round)

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
        }, rounds, calls)
        rows["64 MiB result (2 x)"] = timed({
            "local": lambda: local.run(big),
            "ray": lambda: ours.run(big),
            "actors": lambda: ray.get([a.big.remote() for a in actors]),
        }, *bigs)
    finally:
        for ex in peers.values():
            ex.shutdown()
        ray.shutdown()

    print(f"{'ms (median / min)':24} {'local':>17} {'ray backend':>17} {'hand-written':>17} {'ray/hand':>9}")
    for name, (row, ratio) in rows.items():
        cells = [f"{row[p][0]:7.2f} / {row[p][1]:6.2f}" for p in ("local", "ray", "actors")]
        print(f"{name:24} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} {ratio:8.2f}x")


if __name__ == "__main__":
    main()
