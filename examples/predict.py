"""Batch inference over a data set on every device at once with ``parallel_predict``.

    python examples/predict.py                 # every GPU, or 2 CPU worker processes
    python examples/predict.py --samples 1000  # smaller

Each worker receives the model (or builds it from a factory) once; batches then
go to whichever device is free, and the outputs come back in input order.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from nn_handler import parallel_predict

DEVICES = None if torch.cuda.is_available() else ["cpu", "cpu"]


class Squares(Dataset):
    """A map-style data set that computes its samples on demand."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g)


def build_model(device):
    """A factory: each worker builds its own copy on its device (nothing large crosses a pipe)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(device)


def main():
    parser = argparse.ArgumentParser(description="parallel_predict over a data set")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()

    data = Squares(args.samples)
    start = time.perf_counter()
    outputs = parallel_predict(build_model, data, batch_size=args.batch_size, device_ids=DEVICES)
    seconds = time.perf_counter() - start

    # The same outputs as one process running the model over the data in order.
    model = build_model("cpu").eval()
    with torch.no_grad():
        expected = model(torch.stack([data[i] for i in range(len(data))]))
    same = torch.allclose(outputs, expected, atol=1e-5)
    print(f"parallel_predict on {DEVICES or 'every GPU'}: {tuple(outputs.shape)} outputs for {len(data)} samples "
          f"in {seconds:.2f} s; equal to a single-process pass in order: {same}")
    if not same:
        raise SystemExit("outputs differ from the single-process pass")


if __name__ == "__main__":
    main()
