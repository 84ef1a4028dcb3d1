"""compile=True on 2 spawned gloo ranks, under DDP and FSDP2: equal to one plain process, plain keys, shared checkpoints.

Each rank sees 8 unshuffled samples of a batch that one process sees as 16,
so 2 compiled ranks must train as one plain (uncompiled) process does, to
inductor's rounding. Inductor compiles for the CPU here (about 20 s a rank).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import check_ranks
from nn_handler.testing import run_distributed
from scripts.handler_case import make_model

TIMEOUT = 300
N, PER_RANK, EPOCHS = 64, 8, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


def build(batch, **kwargs):
    from nn_handler import NNHandler
    from scripts.handler_case import make_data

    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.05, "momentum": 0.9},
                        clip_grad_norm=0.5, device="cpu", seed=2, **kwargs)
    handler.set_train_loader(make_data(N), batch_size=batch, shuffle=False)
    return handler


def flat(handler) -> torch.Tensor:
    state = handler.module.state_dict()
    return torch.cat([(v.full_tensor() if hasattr(v, "full_tensor") else v).detach().flatten() for v in state.values()])


def _compiled_ranks(rank, root, strategy):
    handler = build(PER_RANK, strategy=strategy, compile=True, checkpoint_dir=Path(root) / strategy)
    handler.train(EPOCHS, progress=False)
    handler.export_model(Path(root) / f"{strategy}.pt")
    compiled = [type(m).__name__ for m in handler.module.modules() if m._compiled_call_impl is not None]
    return {"weights": flat(handler), "loss": handler.history["train_loss"], "compiled": compiled,
            "keys": list(handler.state_dict()["model"]) if strategy == "ddp" else None}


@pytest.mark.parametrize("strategy, compiled", [("ddp", ["Sequential"]), ("fsdp", ["FSDPLinear", "FSDPLinear"])])
def test_compiled_ranks_train_as_one_plain_process_and_share_checkpoints(tmp_path, strategy, compiled):
    plain = build(2 * PER_RANK, checkpoint_dir=tmp_path / "plain")
    plain.train(EPOCHS, progress=False)
    results = check_ranks(run_distributed(_compiled_ranks, 2, args=(str(tmp_path), strategy), timeout=TIMEOUT))
    for r in results:
        # DDP: the whole model, compiled before DDP wraps it; FSDP: each block, compiled before fully_shard.
        assert r["compiled"] == compiled
        torch.testing.assert_close(r["weights"], flat(plain), **TOL)
        torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(plain.history["train_loss"]), **TOL)
    if strategy == "ddp":
        assert results[0]["keys"] == list(make_model().state_dict())
    exported = torch.load(tmp_path / f"{strategy}.pt", weights_only=True)
    make_model().load_state_dict(exported)  # plain keys: no "_orig_mod.", no "module."

    # The compiled ranks' checkpoint continues in one plain process, as the plain run does from its own.
    mine = build(2 * PER_RANK, resume=tmp_path / strategy / "epoch-0001.ckpt")
    mine.train(EPOCHS, progress=False)
    plain_again = build(2 * PER_RANK, resume=tmp_path / "plain" / "epoch-0001.ckpt")
    plain_again.train(EPOCHS, progress=False)
    torch.testing.assert_close(flat(mine), flat(plain_again), **TOL)
    torch.testing.assert_close(flat(mine), flat(plain), **TOL)
