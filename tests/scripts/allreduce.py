"""Launched by torchrun / mpirun / srun in the tests: join the group, all-reduce, report."""
import json

import torch
import torch.distributed as dist

from nn_handler.utils.ddp import cleanup_ddp, initialize_ddp
from nn_handler.utils._env import detect_launch_env

distributed, rank, local_rank, world_size, device = initialize_ddp(timeout=60)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print("RESULT " + json.dumps({"launcher": detect_launch_env().launcher, "distributed": distributed, "rank": rank,
                              "local_rank": local_rank, "world_size": world_size, "device": str(device),
                              "sum": t.item()}), flush=True)
cleanup_ddp()
