"""NNHandler inside Ray Train: Ray's TorchTrainer starts the workers and their process group, NNHandler uses it.

    python examples/ray_train.py                  # 2 CPU workers (gloo) on a local Ray
    python examples/ray_train.py --workers 4 --gpu   # on a GPU cluster (RAY_ADDRESS=...): NCCL, one GPU each

``TorchTrainer`` creates the process group before ``train_loop`` runs, so
``NNHandler`` (and ``initialize_ddp()``, which returns ``None`` then) finds it
and uses it: ranks, world size and the device come from that group and from
the GPU Ray gave the worker; no second group is created. Needs
``pip install 'nn_handler[ray]' 'ray[train]'``.
"""

# needs-extra: ray (the newcomer CI path, which installs no extras, skips this example)
import argparse
import os
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local Ray for this example only

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

try:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
except ImportError as exc:
    raise SystemExit(f"this example needs Ray Train ({exc}): pip install 'nn_handler[ray]' 'ray[train]'") from None

from nn_handler import NNHandler, initialize_ddp  # noqa: E402


def train_loop(config):
    group_before = dist.group.WORLD
    assert initialize_ddp() is None  # the group exists already: Ray Train made it
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1)
    handler = NNHandler(nn.Linear(8, 1), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.1})
    handler.set_train_loader((x, y), batch_size=32)
    history = handler.train(config["epochs"], progress=False)
    same_group = dist.group.WORLD is group_before
    ray.train.report({"rank": handler.rank, "world_size": handler.world_size, "device": str(handler.device),
                      "same_group": same_group, "first_loss": history["train_loss"][0],
                      "last_loss": history["train_loss"][-1]})
    print(f"RESULT rank={handler.rank} world_size={handler.world_size} device={handler.device} "
          f"same_group={same_group} loss {history['train_loss'][0]:.4f} -> {history['train_loss'][-1]:.4f}",
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--gpu", action="store_true")
    opts = parser.parse_args()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"epochs": opts.epochs},
        scaling_config=ScalingConfig(num_workers=opts.workers, use_gpu=opts.gpu),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="ray-train-")),
    )
    result = trainer.fit()
    print("DONE", "failed" if result.error else "ok", flush=True)


if __name__ == "__main__":
    main()
