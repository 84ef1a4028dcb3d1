"""DDP training with NNHandler: the same function under torchrun, or started from plain python.

    python examples/train_ddp.py --out runs/demo                              # NNHandler.launch: 2 processes
    torchrun --nproc_per_node=2 examples/train_ddp.py --out runs/demo         # torchrun starts them, launch trains
    python examples/train_ddp.py --nprocs 1 --out runs/demo                   # a single process

A small regression model on synthetic data; validation, a metric, early
stopping, a checkpoint every epoch, a CSV log and, at the end, a loss-curve
PNG from ``plot_history`` when matplotlib is installed (``pip install
'nn_handler[plot]'``; without it the PNG is skipped, with one line saying so
before training starts).
The History is the same on every rank (losses are averaged over all ranks,
weighted by sample count), and a run under torchrun gives the same numbers as
one started with ``NNHandler.launch``.
"""

import argparse
import importlib.util
import os
import time

import torch
from torch import nn

from nn_handler import CSVLogger, EarlyStopping, ModelCheckpoint, NNHandler, get_rank


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def train(out, epochs, samples, plot=True):
    """Runs on every rank: build the handler, train, save; returns the History and where it ran."""
    torch.manual_seed(0)  # the same initial weights in every run (DDP then copies rank 0's to all)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    handler = NNHandler(
        model, torch.optim.Adam, nn.MSELoss(), optimizer_kwargs={"lr": 1e-2},
        metrics={"mae": lambda out, y: (out - y).abs().mean()},
        seed=0,
        callbacks=[EarlyStopping("val_loss", patience=3),
                   ModelCheckpoint(os.path.join(out, "ckpt"), save_best_only=True),
                   CSVLogger(os.path.join(out, "history.csv"))],
    )
    handler.set_train_loader(make_data(samples, seed=0), batch_size=16)
    handler.set_val_loader(make_data(samples // 4 + 3, seed=1), batch_size=16)  # uneven on purpose
    history = handler.train(epochs, progress=False)
    if plot:
        handler.plot_history(os.path.join(out, "loss_curve.png"))  # rank 0 writes it
    handler.save_model(os.path.join(out, "model.pt"))
    return {"rank": handler.rank, "world_size": handler.world_size, "device": str(handler.device),
            "train_loss": history["train_loss"], "val_loss": history["val_loss"]}


def main():
    parser = argparse.ArgumentParser(description="DDP training with NNHandler")
    parser.add_argument("--out", default="runs/train_ddp")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--nprocs", type=int, default=2, help="processes (under torchrun/srun/mpirun: as many "
                                                                "as it started)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    plot = not args.no_plot
    if plot and importlib.util.find_spec("matplotlib") is None:
        plot = False
        if get_rank() == 0:  # one line, not one per rank (under torchrun, each rank runs this)
            print("no loss_curve.png: matplotlib is not installed (pip install 'nn_handler[plot]')")

    start = time.perf_counter()
    # Starts nprocs processes and trains in each; under torchrun/srun/mpirun, which
    # started them, trains in this one (and returns this rank's result).
    result = NNHandler.launch(train, args.out, args.epochs, args.samples, plot, nprocs=args.nprocs)
    if result["rank"] == 0:
        losses = ", ".join(f"{v:.4f}" for v in result["val_loss"])
        print(f"{result['world_size']} rank(s) on {result['device']}, "
              f"{len(result['train_loss'])} epochs in {time.perf_counter() - start:.1f} s")
        print(f"val_loss per epoch: {losses}")
        print(f"wrote {sorted(os.listdir(args.out))} to {args.out}")


if __name__ == "__main__":
    main()
