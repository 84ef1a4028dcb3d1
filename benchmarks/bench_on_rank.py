"""The cost of an ``@on_rank(0)`` call against a bare ``dist.all_reduce`` of one int, on 2 gloo processes.

    python benchmarks/bench_on_rank.py                # 3000 calls of each
    python benchmarks/bench_on_rank.py --calls 500    # quicker

Both ranks run the same sequence; each call is timed on rank 0, whose clock
includes waiting for rank 1 as any collective does. The variants are measured
in interleaved blocks (all_reduce, on_rank, ..., then again), so drift from
other load on the machine spreads over all of them alike. Prints median and
p90 per call and their ratio to the bare all_reduce; the target for a plain
``@on_rank(0)`` is at most 1.5x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from nn_handler.testing import run_distributed


def _body(rank, calls: int, block: int):
    import torch
    import torch.distributed as dist

    from nn_handler.utils.ddp_decorators import any_rank, on_rank

    from nn_handler.utils import _collectives

    one = torch.tensor([1], dtype=torch.int64)
    two = torch.tensor([0, 0], dtype=torch.int64)

    def bare():
        dist.all_reduce(one)

    def side_only():  # the collective inside on_rank, without its Python around it
        dist.all_reduce(two, group=_collectives.side_group().group)

    @on_rank(0)
    def plain():
        return None

    @on_rank(0, barrier=True)
    def with_barrier():
        return None

    @on_rank(0, broadcast_result=True)
    def broadcast():
        return 42

    def agree():
        any_rank(False)

    variants = {
        "dist.all_reduce (1 int)": bare,
        "all_reduce on the side group (2 int)": side_only,
        "@on_rank(0)": plain,
        "@on_rank(0, barrier=True)": with_barrier,
        "@on_rank(0, broadcast_result=True)": broadcast,
        "any_rank(flag)": agree,
    }
    for fn in variants.values():  # warm up; the first on_rank call also creates the side group
        for _ in range(200):
            fn()
    times = {name: [] for name in variants}
    clock = time.perf_counter_ns
    for _ in range(max(1, calls // block)):
        for name, fn in variants.items():
            samples = times[name]
            for _ in range(block):
                t0 = clock()
                fn()
                samples.append(clock() - t0)
    return times if rank == 0 else None


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per variant (default 3000)")
    parser.add_argument("--block", type=int, default=100, help="calls per interleaved block (default 100)")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    # A generous deadline: the machine may be shared; a collective that hangs
    # ends in the group's own timeout (half of it) first.
    times = run_distributed(_body, nprocs=2, args=(args.calls, args.block), timeout=600)[0]
    if isinstance(times, BaseException):
        raise times

    base_median = statistics.median(times["dist.all_reduce (1 int)"])
    base_p90 = _quantile(times["dist.all_reduce (1 int)"], 0.9)
    print(f"2 gloo processes on 127.0.0.1, {len(next(iter(times.values())))} calls per variant, "
          f"load average {load_before:.2f} before / {os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs")
    print(f"{'variant':<38} {'median us':>10} {'p90 us':>10} {'x median':>9} {'x p90':>7}")
    for name, samples in times.items():
        median, p90 = statistics.median(samples), _quantile(samples, 0.9)
        print(f"{name:<38} {median / 1e3:>10.1f} {p90 / 1e3:>10.1f} {median / base_median:>9.2f} {p90 / base_p90:>7.2f}")


if __name__ == "__main__":
    main()
