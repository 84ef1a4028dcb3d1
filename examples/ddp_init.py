"""Basic DDP initialisation: the same script runs under `python`, torchrun, srun or mpirun.

    python examples/ddp_init.py
    torchrun --nproc_per_node=2 examples/ddp_init.py
"""
import time

import torch
import torch.distributed as dist

from nn_handler.utils.ddp import cleanup_ddp, initialize_ddp

start = time.perf_counter()
distributed, rank, local_rank, world_size, device = initialize_ddp()
model = torch.nn.Linear(8, 2).to(device)
if distributed:
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    print(f"rank {rank}/{world_size} on {device}")
else:
    print(f"not distributed; running on {device}")

loss = model(torch.randn(4, 8, device=device)).sum()
loss.backward()  # under DDP the gradients are averaged over every rank here
print(f"rank {rank}: one step done, loss {loss.item():.4f}, {time.perf_counter() - start:.2f}s")
del model
cleanup_ddp()
