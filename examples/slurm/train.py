"""NNHandler on a SLURM allocation: srun starts the ranks, nothing else is needed.

    srun -N1 -n2 python examples/slurm/train.py --out runs/slurm     # 2 tasks; initialize_ddp reads SLURM's variables
    sbatch examples/slurm/train.sbatch                               # the same as a batch job
    torchrun --nproc_per_node=2 examples/slurm/train.py --out runs/slurm
    python examples/slurm/train.py --out runs/slurm                  # one process

Whatever started it, the script trains the same way: a checkpoint after every
epoch in OUT/checkpoints, and rerunning the same command continues from the
newest one (``resume="auto"``), after a crash, a ``torchrun --max-restarts``
restart or a preemption. SIGTERM (``scancel``, a preempting job, the time
limit with ``#SBATCH --signal=TERM@60``) makes every rank finish its step,
rank 0 write a checkpoint, and the job exit with code 75
(``nn_handler.PREEMPTED_EXIT_CODE``). At the end rank 0 writes OUT/model.pt
and OUT/history.json.
"""

import argparse
import json
import os

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from nn_handler import NNHandler
from nn_handler.utils.ddp import detect_launch_env
from nn_handler.utils.ddp_decorators import on_rank


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


@on_rank(0)
def write_history(history, path):
    """Rank 0 writes; if it fails, every rank raises (no rank is left waiting)."""
    with open(path, "w") as f:
        json.dump(history.state_dict(), f)


# @record: under torchrun, a failing rank's exception and traceback go into
# torchrun's error file and its end-of-job summary ("Root Cause ... rank: N").
@record
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/slurm")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights for every launch (DDP copies rank 0's to all)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    # `with`: the DDP model is released before the process group, which
    # avoids an abort at interpreter exit (see NNHandler.close).
    with NNHandler(model, torch.optim.Adam, nn.MSELoss(), optimizer_kwargs={"lr": 1e-2},
                   metrics={"mae": lambda out, y: (out - y).abs().mean()}, seed=0,
                   checkpoint_dir=os.path.join(args.out, "checkpoints"), resume="auto") as handler:
        handler.set_train_loader(make_data(args.samples, seed=0), batch_size=16)
        handler.set_val_loader(make_data(args.samples // 4, seed=1), batch_size=64)
        history = handler.train(args.epochs, progress=False)
        handler.save_model(os.path.join(args.out, "model.pt"))
        write_history(history, os.path.join(args.out, "history.json"))
        if handler.is_main_process:
            print(f"{detect_launch_env().launcher}: {handler.world_size} rank(s), {handler.epoch} epochs, "
                  f"val_loss {history['val_loss'][-1]:.4f}; wrote {args.out}/model.pt", flush=True)


if __name__ == "__main__":
    main()
