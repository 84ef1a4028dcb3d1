"""A tiny Hugging Face GPT-2 on 2 spawned gloo ranks, DDP (compiled too) and FSDP: dict batches, its own loss, export.

The reference is the same handler in this (group-less) process with the global batch: 2 ranks of 4 unshuffled
samples see together what one process sees in a batch of 8; every sample has as many label tokens, so the mean
of the ranks' mean losses is the one process's mean loss.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from helpers import check_ranks, needs
from nn_handler.testing import run_distributed
from scripts import hf_case as H

pytestmark = needs("transformers")

TIMEOUT = 240
N, N_VAL, PER_RANK, EPOCHS = 24, 11, 4, 2  # 11 validation samples: rank 1's last one is padding


def _build(batch, **kwargs):
    from nn_handler import NNHandler

    handler = NNHandler(H.gpt2(), torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, device="cpu", **kwargs)
    handler.set_train_loader(H.lm_samples(N), batch_size=batch, shuffle=False)
    handler.set_val_loader(H.lm_samples(N_VAL, seed=1), batch_size=3)
    return handler


def _outcome(handler):
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in handler.module.state_dict().items()}
    return {"history": {k: handler.history[k] for k in ("train_loss", "val_loss")},
            "weights": {k: v.detach().clone() for k, v in full.items()},
            "logits": handler.predict(H.lm_samples(N_VAL, seed=1), batch_size=3).logits,
            "eval": handler.evaluate(H.lm_samples(N_VAL, seed=1))["loss"]}


def _ranks(rank, root):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    out = {}
    for name, kwargs in (("ddp", {}), ("fsdp", {"strategy": "fsdp", "fsdp_wrap": [GPT2Block]})):
        handler = _build(PER_RANK, **kwargs)
        handler.train(EPOCHS, progress=False)
        out[name] = _outcome(handler)
        handler.export_model(Path(root) / f"{name}.pt")
    # compile=True with the eager backend: torch.compile's capture of model(**batch) under DDP, without
    # inductor; training alone (an evaluation would compile the model's eval mode too).
    compiled = _build(PER_RANK, compile=True, compile_kwargs={"backend": "eager"})
    compiled.val_loader = None
    compiled.train(EPOCHS, progress=False)
    out["compiled"] = {"train_loss": compiled.history["train_loss"],
                       "weights": {k: v.detach().clone() for k, v in compiled.module.state_dict().items()}}
    # FSDP: stopped at max_steps, then resumed from its sharded checkpoint by a new handler.
    ckpt = Path(root) / "ckpt"
    _build(PER_RANK, strategy="fsdp", fsdp_wrap=[GPT2Block], checkpoint_dir=ckpt, seed=0).train(
        max_steps=4, progress=False)
    resumed = _build(PER_RANK, strategy="fsdp", fsdp_wrap=[GPT2Block], checkpoint_dir=ckpt, resume="auto", seed=0)
    resumed.train(EPOCHS, progress=False)
    out["resumed"] = _outcome(resumed)
    return out


def test_a_gpt2_trains_under_ddp_and_fsdp_as_in_one_process_and_exports_to_a_fresh_model(tmp_path):
    from transformers import GPT2LMHeadModel

    single = _build(2 * PER_RANK)
    single.train(EPOCHS, progress=False)
    expected = _outcome(single)
    results = check_ranks(run_distributed(_ranks, 2, args=(str(tmp_path),), timeout=TIMEOUT))
    tol = {"rtol": 1e-5, "atol": 1e-5}
    # AdamW divides by the gradients' root mean square: two ranks' summation order moves the weights by ~1e-4.
    near = {"rtol": 1e-4, "atol": 3e-4}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["compiled"]["train_loss"]),
                                   torch.tensor(expected["history"]["train_loss"]), **tol, msg="compiled")
        for key, value in expected["weights"].items():
            torch.testing.assert_close(r["compiled"]["weights"][key], value, **near, msg=f"compiled {key}")
        for name in ("ddp", "fsdp", "resumed"):
            got = r[name]
            for key in ("train_loss", "val_loss"):
                torch.testing.assert_close(torch.tensor(got["history"][key]), torch.tensor(expected["history"][key]),
                                           **tol, msg=f"{name} {key}")
            torch.testing.assert_close(got["logits"], expected["logits"], **near, msg=name)
            assert got["eval"] == pytest.approx(expected["eval"], rel=1e-4)
            for key, value in expected["weights"].items():
                torch.testing.assert_close(got["weights"][key], value, **near, msg=f"{name} {key}")
    # export_model of the FSDP run: one file that a fresh GPT2LMHeadModel loads, lm_head tied to the embedding.
    for name in ("ddp", "fsdp"):
        fresh = GPT2LMHeadModel(copy.deepcopy(single.module.config))
        fresh.load_state_dict(torch.load(tmp_path / f"{name}.pt", weights_only=True))
        assert fresh.lm_head.weight is fresh.transformer.wte.weight
        fresh.eval()
        with torch.no_grad():
            logits = fresh(input_ids=torch.stack([s["input_ids"] for s in H.lm_samples(N_VAL, seed=1)])).logits
        torch.testing.assert_close(logits, results[0][name]["logits"], **tol, msg=name)
