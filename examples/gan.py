"""A GAN with its own training step: two models, two optimizers, one NNHandler.

    python examples/gan.py                    # DDP: NNHandler.launch starts 2 processes (gloo on CPU)
    torchrun --nproc_per_node=2 examples/gan.py   # the same script: launch runs train in each of torchrun's ranks
    python examples/gan.py --nprocs 1         # one process

The generator learns to draw points on a ring from 2-d noise; the data is
synthetic (no download). The step is PyTorch's DCGAN recipe: the
discriminator's loss, its backward and step, then the generator's. Each
model is wrapped on its own under DDP, so both are averaged over the ranks;
the same step runs with ``amp``, ``grad_accum_steps``, ``checkpoint_dir`` and
``resume="auto"``, or ``strategy="fsdp"``. Prints both losses per epoch.
"""

import argparse
import math
import os
import time

import torch
from torch import nn

from nn_handler import NNHandler

NOISE = 2
bce = nn.BCEWithLogitsLoss()


def ring(n, seed):
    """``(real points on a ring of radius 2, noise)``: the noise is part of the data, drawn once."""
    g = torch.Generator().manual_seed(seed)
    angle = 2 * math.pi * torch.rand(n, generator=g)
    real = 2 * torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(n, 2, generator=g)
    return real, torch.randn(n, NOISE, generator=g)


def gan_step(ctx, batch):
    """One training step: D on real and fake, then G through D (called once per micro-batch)."""
    real, z = batch
    G, D = ctx.models["G"], ctx.models["D"]
    ones = torch.ones(real.size(0), 1, device=real.device)
    with ctx.autocast():
        fake = G(z)
        loss_d = bce(D(real), ones) + bce(D(fake.detach()), torch.zeros_like(ones))
    ctx.backward(loss_d)
    ctx.step("D")
    with ctx.autocast():
        loss_g = bce(D(fake), ones)
    ctx.backward(loss_g)
    ctx.step("G")
    return {"loss": loss_d + loss_g, "d": loss_d, "g": loss_g}  # History: train_loss, train_d, train_g


def train(epochs, samples, out):
    """Runs on every rank; returns rank 0's view of the run."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(NOISE, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 2))
    D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    optimizers = {"G": torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                  "D": torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))}
    handler = NNHandler({"G": G, "D": D}, optimizers, training_step=gan_step, seed=0)
    handler.set_train_loader(ring(samples, seed=1), batch_size=64)
    history = handler.train(epochs, progress=False)
    radius = handler.predict(torch.randn(256, NOISE), model="G").norm(dim=1)  # every rank gets all samples
    if out:
        handler.export_model(os.path.join(out, "gan.pt"))  # {"G": state_dict, "D": state_dict}, from rank 0
    return {"rank": handler.rank, "world_size": handler.world_size, "d": history["train_d"],
            "g": history["train_g"], "radius": (radius.mean().item(), radius.std().item())}


def main():
    parser = argparse.ArgumentParser(description="a GAN with its own training step")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--nprocs", type=int, default=2, help="processes (under torchrun/srun/mpirun: as many "
                                                                "as it started)")
    parser.add_argument("--out", default="", help="a directory for gan.pt (the exported models)")
    args = parser.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    # Starts the processes; under torchrun/srun/mpirun, which started them, runs train in this one.
    result = NNHandler.launch(train, args.epochs, args.samples, args.out, nprocs=args.nprocs)
    if result["rank"] != 0:  # each rank gets its own result under a launcher
        return
    for epoch, (d, g) in enumerate(zip(result["d"], result["g"]), start=1):
        print(f"epoch {epoch}: loss_d={d:.4f} loss_g={g:.4f}")
    mean, std = result["radius"]
    print(f"{result['world_size']} rank(s), {len(result['d'])} epochs in {time.perf_counter() - start:.1f} s; "
          f"generated points lie at radius {mean:.2f} +- {std:.2f} (the ring's is 2)")


if __name__ == "__main__":
    main()
