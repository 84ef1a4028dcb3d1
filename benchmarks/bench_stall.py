"""What the stall watchdog costs the training thread per step, and what its heartbeat costs.

The training thread only enters/leaves ``watch_collectives`` and ``watching``
(attribute sets) and calls ``new_wait`` and ``note_step``; the heartbeat
(store I/O, the stack look-up, reading the store host's heartbeat) runs on
the watchdog's own thread once a second. This times both on one process
with a real TCPStore, as rank 1 of 2 (rank 0 hosts the store):

    python benchmarks/bench_stall.py [--calls 200000]

For the end-to-end figure, compare ``benchmarks/bench_training.py --hidden 64``
with ``NN_HANDLER_STALL_TIMEOUT=none`` (no watchdog) and without it.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta


def main() -> None:
    import torch.distributed as dist

    from nn_handler.utils import _stall
    from nn_handler.utils.ddp import find_free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    port = find_free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store = _stall.client_store("127.0.0.1", port, "bench", timedelta(seconds=30))

    def per_step(n: int) -> float:
        start = time.perf_counter()
        with _stall.watch_collectives():
            for i in range(n):  # what the trainer adds to one step
                _stall.new_wait()
                with _stall.watching("backward (DDP's gradient all_reduce)"):
                    pass
                _stall.note_step(i)
        return (time.perf_counter() - start) / n

    off = per_step(args.calls)
    dog = _stall.start(store, 1, 2, timeout=300, store_host=0)
    store.set("hb/0", json.dumps({"rank": 0, "host": "h", "pid": 1, "step": 7, "collective": None, "task": None,
                                  "inside": None, "where": "train.py:9 (main)", "for_s": 0.0, "beat": 1,
                                  "time": 0.0}))  # rank 0's heartbeat, which rank 1 reads at each of its own
    on = per_step(args.calls)
    start = time.perf_counter()
    for _ in range(200):
        dog._tick()  # one heartbeat: look at the stack, write it, read rank 0's, check for a request
    beat = (time.perf_counter() - start) / 200
    _stall.stop()
    del server
    print(f"per training step, training thread: {off * 1e6:.2f} us without a watchdog, {on * 1e6:.2f} us with one")
    print(f"one heartbeat (watchdog thread, once a second): {beat * 1e6:.0f} us")


if __name__ == "__main__":
    main()
