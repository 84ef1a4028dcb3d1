"""Launched by torchrun in the tests: rank 1 is late for an all_reduce that rank 0 waits in."""
import sys
import time

import torch
import torch.distributed as dist

from nn_handler.utils.ddp import cleanup_ddp, initialize_ddp, watch_collectives

distributed, rank, local_rank, world_size, device = initialize_ddp(timeout=60, stall_timeout=3)
with watch_collectives():
    if rank == 1:
        time.sleep(60)  # rank 1 is late
    dist.all_reduce(torch.ones(1))
cleanup_ddp()
print("finished", file=sys.stderr)
