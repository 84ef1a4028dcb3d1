"""Your own training step on 2 spawned gloo ranks: a GAN under DDP and FSDP equals one process on the global batch.

One launch runs every check (each launch costs seconds): the truth is the
hand-written loop of ``scripts.gan_case`` in this (group-less) process on the
global batch. Each model is wrapped on its own (one DDP, or ``fully_shard``,
per model), so whichever model the step calls, its gradients are averaged:
one DDP around both models, whose submodules the step then calls directly,
would average none, and each rank would train on its own half of the data.
"""

from __future__ import annotations

import torch

from helpers import check_ranks
from nn_handler.testing import run_distributed
from scripts import gan_case as gan

TIMEOUT = 200
PER_RANK, N, EPOCHS = 4, 32, 2  # 4 steps an epoch: 2 ranks of 4 are the global batch of 8
TOL = {"rtol": 0, "atol": 1e-5}


def _full(handler) -> torch.Tensor:
    states = [handler.models[name].state_dict() for name in ("G", "D")]
    return torch.cat([(v.full_tensor() if hasattr(v, "full_tensor") else v).detach().flatten().float()
                      for state in states for v in state.values()])


def _counting_all_reduces(counts):
    """A step that counts the gradient all-reduces of each DDP model (a comm hook), then runs the GAN step."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def step(ctx, batch):
        if not counts:
            for name, model in ctx.models.items():
                counts[name] = 0

                def hook(state, bucket, name=name):
                    counts[name] += 1
                    return allreduce_hook(None, bucket)

                model.register_comm_hook(None, hook)
        return gan.gan_step(ctx, batch)

    return step


def _ranks(rank, root):
    from pathlib import Path

    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from nn_handler import ConfigurationError

    root, out = Path(root), {}
    ddp = gan.make_handler(batch_size=PER_RANK, n=N)
    out["ddp_wrappers"] = sorted(type(m).__name__ for m in ddp._models.trained.values())
    assert all(isinstance(m, DistributedDataParallel) for m in ddp._models.trained.values())
    ddp.train(EPOCHS, progress=False)
    out["ddp"], out["ddp_history"] = _full(ddp), ddp.history.state_dict()
    ddp.save_checkpoint(root / "ddp.ckpt")  # one file, the models and optimizers by name

    counts: dict[str, int] = {}
    accum = gan.make_handler(batch_size=PER_RANK, n=N, grad_accum_steps=2, step=_counting_all_reduces(counts))
    accum.train(1, progress=False)
    out["accum"], out["all_reduces"] = _full(accum), dict(counts)
    accum.close()

    fsdp = gan.make_handler(batch_size=PER_RANK, n=N, strategy="fsdp", checkpoint_dir=root / "straight")
    assert all(isinstance(m, FSDPModule) for m in fsdp._models.trained.values())
    fsdp.train(EPOCHS, progress=False)
    out["fsdp"], out["fsdp_history"] = _full(fsdp), fsdp.history.state_dict()
    fsdp.export_model(root / "models.pt")
    stopped = gan.make_handler(batch_size=PER_RANK, n=N, strategy="fsdp", checkpoint_dir=root / "stopped")
    stopped.train(EPOCHS, max_steps=5, progress=False)  # a sharded checkpoint 1 batch into epoch 2
    resumed = gan.make_handler(batch_size=PER_RANK, n=N, strategy="fsdp", checkpoint_dir=root / "stopped",
                               resume="auto")
    resumed.train(EPOCHS, progress=False)
    out["fsdp_resumed"], out["fsdp_resumed_history"] = _full(resumed), resumed.history.state_dict()
    # The DDP run's file resumes an FSDP run: each rank takes its shards of both models and both optimizers.
    crossed = gan.make_handler(batch_size=PER_RANK, n=N, strategy="fsdp")
    crossed.load_checkpoint(root / "ddp.ckpt")
    for handler in (crossed, ddp):
        handler.train(EPOCHS + 1, progress=False)
    out["crossed"], out["continued"] = _full(crossed), _full(ddp)
    for handler in (ddp, fsdp, stopped, resumed, crossed):
        handler.close()

    twice = gan.make_handler(batch_size=PER_RANK, n=N, step=_two_passes_through_one_forward)
    try:
        twice.train(1, progress=False)
    except ConfigurationError as exc:
        out["two_passes"] = (str(exc), twice.global_step)
    twice.close()

    by_hand = gan.make_handler(batch_size=PER_RANK, n=N, grad_accum_steps=2, step=_stepped_by_hand)
    try:
        by_hand.train(1, progress=False)
    except ConfigurationError as exc:  # on every rank, at the first micro-batch: no rank waits for another
        out["by_hand"] = (str(exc), by_hand.global_step)
    by_hand.close()

    keyed = gan.make_handler(batch_size=PER_RANK, n=N, step=_keys_of_this_rank, validation_step=_keys_of_this_rank)
    keyed.set_val_loader(gan.make_data(16, seed=5), batch_size=PER_RANK)
    keyed.train(1, progress=False)
    out["keyed"] = {k: v for k, v in keyed.history.last().items() if k.startswith(("train_", "val_"))}
    keyed.close()
    return out


def _keys_of_this_rank(ctx, batch):
    """Keys that differ between the ranks, in name and in number: rank 0 returns "r0", rank 1 "r1" and "extra"."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if ctx.training:
        gan.gan_step(ctx, batch)
    values = {"loss": torch.tensor(1.0), f"r{rank}": torch.tensor(rank + 1.0)}
    return {**values, "extra": 5.0} if rank == 1 else values


def _stepped_by_hand(ctx, batch):
    """Plain PyTorch in a step: off the group's last micro-batch, each rank would step on its own gradients."""
    real, _ = batch
    loss = ctx.models["D"](real).pow(2).mean()
    loss.backward()
    ctx.optimizers["D"].step()
    return loss


def _two_passes_through_one_forward(ctx, batch):
    real, _ = batch
    loss = ctx.models["D"](real).pow(2).mean()
    ctx.backward(loss, retain_graph=True)
    ctx.backward(0.1 * loss)  # DDP would not average this one: refused
    ctx.step("D")
    return loss


def test_a_gan_trains_on_2_ranks_as_one_process_on_the_global_batch_under_ddp_and_fsdp(tmp_path):
    results = check_ranks(run_distributed(_ranks, 2, args=(str(tmp_path),), timeout=TIMEOUT))
    G, D, want = gan.reference(epochs=EPOCHS, batch_size=PER_RANK, n=N, world_size=2)
    G1, D1, _ = gan.reference(epochs=1, batch_size=PER_RANK, n=N, world_size=2, accum=2)
    for rank, got in enumerate(results):
        assert got["ddp_wrappers"] == ["DistributedDataParallel", "DistributedDataParallel"]
        for kind in ("ddp", "fsdp", "fsdp_resumed"):
            torch.testing.assert_close(got[kind], gan.flat(G, D), **TOL, msg=f"rank {rank}, {kind}")
            for key in ("train_loss", "train_d", "train_g"):
                torch.testing.assert_close(torch.tensor(got[f"{kind}_history"][key]), torch.tensor(want[key]),
                                           **TOL, msg=f"rank {rank}, {kind}, {key}")
        torch.testing.assert_close(got["accum"], gan.flat(G1, D1), **TOL, msg=f"rank {rank}, accumulation")
        # 2 groups of 2 micro-batches: G's gradients are averaged once a group, D's twice (D's loss and G's
        # loss both reach it); the first micro-batch of each group keeps them on its rank (no_sync).
        assert got["all_reduces"] == {"G": 2, "D": 4}
        torch.testing.assert_close(got["crossed"], got["continued"], **TOL, msg=f"rank {rank}, DDP file into FSDP")
        message, steps = got["two_passes"]
        assert steps == 0 and message.startswith("ctx.backward after a ctx.backward(..., retain_graph=True): under "
                                                 "DDP a second backward through the same forward is not averaged")
        message, steps = got["by_hand"]
        assert steps == 0 and message.startswith("optimizer 'D' was stepped by hand (optimizer.step()) in the "
                                                 "training step: call ctx.backward(loss) and ctx.step('D')")
        # The union of the ranks' keys, each averaged over the batches that reported it, never one in another's column.
        assert got["keyed"] == {"train_loss": 1.0, "train_r0": 1.0, "train_r1": 2.0, "train_extra": 5.0,
                                "val_loss": 1.0, "val_r0": 1.0, "val_r1": 2.0, "val_extra": 5.0}, f"rank {rank}"
    # The resumed run's history of the part-way epoch is the straight run's (no row of the part is left).
    assert results[0]["fsdp_resumed_history"]["epoch"] == [1, 2]
    torch.testing.assert_close(results[0]["ddp"], results[1]["ddp"], rtol=0, atol=0)  # the ranks agree
    exported = torch.load(tmp_path / "models.pt", weights_only=True)
    assert set(exported) == {"G", "D"}
    torch.testing.assert_close(torch.cat([v.flatten() for name in ("G", "D") for v in exported[name].values()]),
                               gan.flat(G, D), **TOL)
