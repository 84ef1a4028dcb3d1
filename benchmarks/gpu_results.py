"""CUDA results through ParallelExecutor against a page-locked copy and a plain ``.cpu()`` on the same GPU.

    python benchmarks/gpu_results.py                  # 256 MiB results, 5 rounds of 8 calls
    python benchmarks/gpu_results.py --mib 64 --rounds 3 --calls 4

One worker on ``cuda:<--device>`` returns the same CUDA tensor call after
call (kept in ``worker_state()``, so only the transfer is timed); the caller
drops each result before the next call, as a loop that consumes its results
does, so the worker writes each one into the file of the one before. In the
same rounds, alternating with it, this process copies a tensor of the same
size from the same GPU into page-locked memory (``non_blocking=True``, then
waits on the stream: the link's speed) and with a plain ``.cpu()``. Prints
GB/s (medians over rounds; the first call, which creates and page-locks the
file, apart) and the ratio to the target: repeated results >= 10 GB/s.

``benchmarks/bench_gpu.py`` calls :func:`main`. On a machine without a CUDA
GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

TARGET_GBS = 10.0


def _source(nbytes: int, device):
    from nn_handler import worker_state

    state = worker_state()
    if state.get("source") is None or state["source"].nbytes != nbytes:
        state["source"] = torch.ones(nbytes // 4, device=device)
    return state["source"]


def _gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _time_calls(calls: int, one) -> float:
    """Seconds per call of ``one()`` over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        one()
    return (time.perf_counter() - start) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="result size in MiB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--calls", type=int, default=8, help="calls per round and contender (default 8)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_results: no CUDA GPU on this machine; nothing measured")
        return 0
    from nn_handler import ParallelExecutor

    nbytes = args.mib << 20
    device = torch.device("cuda", args.device)
    local = torch.ones(nbytes // 4, device=device)
    pinned = torch.empty(nbytes // 4, pin_memory=True)
    stream = torch.cuda.current_stream(device)

    def pinned_copy():
        pinned.copy_(local, non_blocking=True)
        stream.synchronize()

    def plain_copy():
        local.cpu()

    timings: dict[str, list[float]] = {"executor": [], "page-locked copy": [], "plain .cpu()": []}
    with ParallelExecutor(device_ids=[args.device]) as ex:
        def through_executor():
            result = ex.submit(_source, nbytes).result()
            assert result.nbytes == nbytes and result.device.type == "cpu"
            return result

        start = time.perf_counter()
        result = through_executor()  # creates the worker's file and page-locks it
        first = time.perf_counter() - start
        assert bool((result == 1).all()), "the result arrived with other values than the worker sent"
        del result  # its file goes back to the worker
        for _ in range(args.rounds):
            timings["executor"].append(_time_calls(args.calls, through_executor))
            timings["page-locked copy"].append(_time_calls(args.calls, pinned_copy))
            timings["plain .cpu()"].append(_time_calls(args.calls, plain_copy))

    name = torch.cuda.get_device_name(device)
    print(f"gpu_results: {args.mib} MiB CUDA results, {name}, {args.rounds} rounds x {args.calls} calls "
          f"(median of rounds)")
    print(f"  {'executor, first call':<26} {_gbs(nbytes, first):8.2f} GB/s  (creates and page-locks the file)")
    speeds = {label: _gbs(nbytes, statistics.median(seconds)) for label, seconds in timings.items()}
    for label, speed in speeds.items():
        print(f"  {label:<26} {speed:8.2f} GB/s  {speed / speeds['page-locked copy']:6.2f}x the page-locked copy")
    ok = speeds["executor"] >= TARGET_GBS
    print(f"  target: repeated results >= {TARGET_GBS:g} GB/s: {speeds['executor'] / TARGET_GBS:.2f}x "
          f"({'holds' if ok else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
