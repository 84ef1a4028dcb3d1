"""nn_handler in one run: work on every device at once, then rank-restricted code in a DDP group.

    python examples/quickstart.py            # GPUs if there are any, else 2 CPU worker processes
    python examples/quickstart.py --size 64  # smaller matrices

1. ``@parallelize_on_gpus``: one call runs the function on every device.
2. ``ParallelExecutor.map``: a list of tasks spread over the devices as they free up.
3. ``NNHandler.launch`` starts a 2-process DDP group; in it, ``@on_rank(0)`` runs
   a step on rank 0 only and hands its result to every rank.

It prints the devices it used, the results, and how long each part took.
"""

import argparse
import json
import os
import tempfile
import time

import torch

from nn_handler import NNHandler, ParallelExecutor, on_rank, parallelize_on_gpus

# Every GPU, or two CPU worker processes standing in for them on a machine without one.
DEVICES = None if torch.cuda.is_available() else ["cpu", "cpu"]


@parallelize_on_gpus(device_ids=DEVICES)
def matrix_power_trace(size, device):
    """Runs in one worker process per device; ``device`` is that worker's device."""
    torch.manual_seed(0)
    a = torch.randn(size, size, device=device) / size**0.5
    trace = float(torch.linalg.matrix_power(a, 4).trace())
    return {"device": str(device), "pid": os.getpid(), "trace": round(trace, 4)}


def norm_of_seed(seed, device):
    """One task of the map: a small computation that depends on its input."""
    g = torch.Generator().manual_seed(seed)
    return round(float(torch.randn(1000, generator=g).to(device).norm()), 3)


def in_every_rank(out_dir):
    """Runs in each process of the DDP group started by NNHandler.launch."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    @on_rank(0, broadcast_result=True)
    def write_summary():
        # Only rank 0 writes the file; if it raised, every rank would raise too
        # (instead of the others waiting forever at the next collective).
        path = os.path.join(out_dir, "summary.json")
        with open(path, "w") as f:
            json.dump({"world_size": world, "written_by_pid": os.getpid()}, f)
        return path

    path = write_summary()  # the same path on every rank
    with open(path) as f:
        summary = json.load(f)
    # A tensor, not all_gather_object: torch's object collectives need numpy,
    # which neither torch nor nn_handler installs.
    seen = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(seen, torch.tensor([rank, os.getpid(), summary["written_by_pid"]]))
    return [dict(zip(("rank", "pid", "read"), t.tolist())) for t in seen]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="matrix size for part 1")
    parser.add_argument("--tasks", type=int, default=8, help="number of tasks for part 2")
    args = parser.parse_args()

    start = time.perf_counter()
    where = (f"{torch.cuda.device_count()} CUDA device(s)" if DEVICES is None
             else "no CUDA device: 2 CPU worker processes")
    print(f"nn_handler quickstart: torch {torch.__version__}, {where}")

    t = time.perf_counter()
    results = matrix_power_trace(args.size)
    print(f"[1] @parallelize_on_gpus on {', '.join(r['device'] for r in results)} "
          f"(pids {', '.join(str(r['pid']) for r in results)}): trace(A^4) = "
          f"{[r['trace'] for r in results]}  {time.perf_counter() - t:.2f} s")
    matrix_power_trace.shutdown()  # the warm pool would otherwise stay up for keep_alive seconds

    t = time.perf_counter()
    with ParallelExecutor(device_ids=DEVICES) as executor:
        norms = list(executor.map(norm_of_seed, range(args.tasks)))
        used = executor.devices
    print(f"[2] ParallelExecutor.map over {len(norms)} tasks on {', '.join(used)}: {norms}  "
          f"{time.perf_counter() - t:.2f} s")

    t = time.perf_counter()
    nprocs = torch.cuda.device_count() or 2
    with tempfile.TemporaryDirectory() as out_dir:
        seen = NNHandler.launch(in_every_rank, out_dir, nprocs=nprocs, timeout=300)
    readers = ", ".join(f"rank {s['rank']} (pid {s['pid']}) read pid {s['read']}'s file" for s in seen)
    print(f"[3] NNHandler.launch, {nprocs} ranks, @on_rank(0) wrote summary.json once: {readers}  "
          f"{time.perf_counter() - t:.2f} s")

    print(f"done in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
