"""One script for every launcher: ``NNHandler.launch(body, nprocs=N)`` under the main guard, as training.md has it.

Run by tests/launch/test_launch_under_launchers.py with ``python``, torchrun,
srun and mpirun. Each caller prints ``RESULT {json}``: what ``launch``
returned, and the caller's own pid and group state after it.
"""
import json
import logging
import os
import sys

import torch.distributed as dist

from nn_handler import NNHandler


def body(tag):
    import torch

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "pid": os.getpid(), "sum": t.item(),
            "tag": tag}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
    result = NNHandler.launch(body, "from the script", nprocs=int(sys.argv[1]), timeout=60)
    print("RESULT " + json.dumps({**result, "caller": os.getpid(), "group_left": not dist.is_initialized()}),
          flush=True)
