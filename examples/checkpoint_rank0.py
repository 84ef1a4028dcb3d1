"""The seed's rank-specific example: save a checkpoint from rank 0 only, in a DDP job.

    torchrun --nproc_per_node=2 examples/checkpoint_rank0.py --out /tmp/ckpt
    python examples/checkpoint_rank0.py --out /tmp/ckpt      # one process: it just runs

``main_process_first`` lets rank 0 prepare the data set once while the other
ranks wait; ``@on_rank(0)`` writes the checkpoint from rank 0 alone. If either
fails on rank 0, every rank raises within moments instead of the others
waiting at the next collective until the job's timeout.
"""

import argparse
import os

import torch
import torch.distributed as dist

from nn_handler import cleanup_ddp, initialize_ddp, main_process_first, on_rank


def prepare_data(path):
    """Expensive once (a download, a preprocessing pass); cheap to load afterwards."""
    if not os.path.exists(path):
        g = torch.Generator().manual_seed(0)
        torch.save({"x": torch.randn(64, 8, generator=g), "y": torch.randn(64, 1, generator=g)}, path)
    return torch.load(path)


@on_rank(0)
def save_checkpoint(model, optimizer, epoch, path):
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
    }
    torch.save(checkpoint, path)
    print(f"Checkpoint saved to {path}")
    return path


def main():
    parser = argparse.ArgumentParser(description="save a checkpoint from rank 0")
    parser.add_argument("--out", default="checkpoints")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    distributed, rank, local_rank, world_size, device = initialize_ddp()
    with main_process_first():  # rank 0 writes data.pt; the others then read it
        data = prepare_data(os.path.join(args.out, "data.pt"))
    x, y = data["x"][rank::world_size].to(device), data["y"][rank::world_size].to(device)

    model = torch.nn.Linear(8, 1).to(device)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(1, args.epochs + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # under DDP the gradients are averaged over every rank here
        optimizer.step()
        module = model.module if distributed else model
        path = save_checkpoint(module, optimizer, epoch, os.path.join(args.out, f"epoch{epoch}.pt"))
        # save_checkpoint returned the path on rank 0 and None elsewhere; every rank
        # passes this point only after rank 0's write has finished.
        print(f"rank {rank}/{world_size}: epoch {epoch} loss {loss.item():.4f} saved={path is not None}", flush=True)

    if distributed:
        dist.barrier()
    cleanup_ddp()


if __name__ == "__main__":
    main()
