"""amp="fp16" with a GradScaler on 2 spawned gloo ranks, under FSDP2 and DDP: the ranks skip the same steps.

FSDP2's gradients are DTensor shards; torch's plain GradScaler serves them
(DTensor reduces its found-inf flag over the shards). One rank's loss
overflows at one step: both ranks back the scale off, skip that step and
keep equal weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import check_ranks
from nn_handler.testing import run_distributed
from scripts.handler_case import make_model

TIMEOUT = 150


def _fp16_ranks(rank, strategy):
    import torch.distributed as dist

    from nn_handler import NNHandler
    from scripts.handler_case import make_data

    calls = {"n": 0}
    mse = nn.MSELoss()

    def loss_fn(outputs, targets):
        calls["n"] += 1
        loss = mse(outputs, targets)
        # Step 3, on rank 1 only: a loss whose scaled gradients overflow fp16.
        return loss * 1e30 if calls["n"] == 3 and dist.get_rank() == 1 else loss

    handler = NNHandler(make_model(), torch.optim.SGD, loss_fn, optimizer_kwargs={"lr": 0.05}, device="cpu",
                        strategy=strategy, amp="fp16", finite_check_every=None)
    handler.set_train_loader(make_data(64), batch_size=8, shuffle=False)
    scales = []
    for _ in range(2):
        handler.train(handler.epoch + 1, progress=False)
        scales.append(handler.scaler.get_scale())
    state = handler.module.state_dict()
    weights = torch.cat([(v.full_tensor() if hasattr(v, "full_tensor") else v).flatten() for v in state.values()])
    return {"scales": scales, "weights": weights}


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_fp16_ranks_skip_the_same_overflowing_step(strategy):
    results = check_ranks(run_distributed(_fp16_ranks, 2, args=(strategy,), timeout=TIMEOUT))
    first, second = results
    assert first["scales"] == second["scales"] and first["scales"][0] < 2.0 ** 16  # backed off once, on both
    torch.testing.assert_close(first["weights"], second["weights"], rtol=0, atol=0)
    assert torch.isfinite(first["weights"]).all()
