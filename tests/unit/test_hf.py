"""Dict batches and models that compute their own loss: tiny Hugging Face models built from configs.

Each is checked against the five-line loop people write for them (``model(**batch).loss``), to 1e-5.
"""

from __future__ import annotations

import copy
from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from helpers import needs
from nn_handler import NNHandler
from nn_handler.errors import ConfigurationError
from scripts import hf_case as H

pytestmark = needs("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()])


def _handler(model, **kwargs):
    return NNHandler(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, device="cpu", **kwargs)


@pytest.mark.slow
def test_a_gpt2_lm_trains_on_its_own_loss_as_the_hand_written_loop():
    samples, val = H.lm_samples(24), H.lm_samples(10, seed=1)
    reference = H.gpt2()
    expected = H.hand_loop(copy.deepcopy(reference), samples, val, epochs=3, batch=4)
    model = copy.deepcopy(reference)
    handler = _handler(model)  # no loss_fn: the output's loss
    handler.set_train_loader(samples, batch_size=4, shuffle=False)
    handler.set_val_loader(val, batch_size=4)
    history = handler.train(3, progress=False)
    for key in ("train_loss", "val_loss"):
        torch.testing.assert_close(torch.tensor(history[key]), torch.tensor(expected[key]), **TOL, msg=key)
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert handler.evaluate(val)["loss"] == pytest.approx(expected["val_loss"][-1], rel=1e-5)


@pytest.mark.slow
def test_a_bert_classifier_with_metrics_equals_the_hand_written_loop_and_loss_fn_on_its_logits():
    samples, val = H.cls_samples(24), H.cls_samples(10, seed=1)
    reference = H.bert()
    expected = H.hand_loop(copy.deepcopy(reference), samples, val, epochs=2, batch=6)
    histories = []
    for loss_fn in (None, lambda out, labels: F.cross_entropy(out.logits, labels)):
        handler = _handler(copy.deepcopy(reference), loss_fn=loss_fn, metrics={"acc": H.accuracy})
        handler.set_train_loader(DataLoader(samples, batch_size=6))  # a loader of dicts, as given
        handler.set_val_loader(val, batch_size=6)
        histories.append(handler.train(2, progress=False))
    for history in histories:
        for key in ("train_loss", "val_loss"):
            torch.testing.assert_close(torch.tensor(history[key]), torch.tensor(expected[key]), **TOL, msg=key)
        assert all(0 <= a <= 1 for a in history["train_acc"] + history["val_acc"])
    assert histories[0]["val_acc"] == histories[1]["val_acc"]


def test_no_loss_fn_and_no_loss_in_the_output_is_a_clear_error_before_any_step():
    model = H.gpt2()
    before = _weights(model)
    handler = _handler(model)
    handler.set_train_loader([{"input_ids": s["input_ids"]} for s in H.lm_samples(8)], batch_size=4)
    with pytest.raises(ConfigurationError, match=r"no loss function: pass loss_fn=.*CausalLMOutput.* without a loss"):
        handler.train(1, progress=False)
    assert handler.global_step == 0
    torch.testing.assert_close(_weights(model), before, rtol=0, atol=0)


def test_a_plain_model_without_loss_fn_names_the_remedy():
    handler = _handler(nn.Linear(3, 1))
    handler.set_train_loader((torch.randn(8, 3), torch.randn(8, 1)), batch_size=4)
    with pytest.raises(ConfigurationError, match=r"no loss function: pass loss_fn= .* returned Tensor"):
        handler.train(1, progress=False)


def test_predict_returns_the_models_output_kind_with_its_batched_tensors_in_input_order():
    model = H.gpt2().eval()
    samples = H.lm_samples(10)
    out = NNHandler(model, device="cpu").predict(samples, batch_size=4)
    with torch.no_grad():
        expected = model(input_ids=torch.stack([s["input_ids"] for s in samples]))
    assert type(out) is type(expected) and list(out.keys()) == ["logits"]  # the loss (a scalar) left out
    torch.testing.assert_close(out.logits, expected.logits, **TOL)
    plain = NNHandler(DictOut(), device="cpu").predict(torch.arange(5.0).reshape(5, 1), batch_size=2)
    assert type(plain) is dict and plain["double"].flatten().tolist() == [0, 2, 4, 6, 8]


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return {"double": 2 * x * self.w, "mean": x.mean(), "name": "not a tensor"}


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_under_amp_evaluate_and_predict_outputs_come_back_in_fp32(amp):
    seen = []
    handler = NNHandler(nn.Linear(4, 2), loss_fn=nn.MSELoss(), device="cpu", amp=amp,
                        metrics={"dtype": lambda out, y: seen.append(out.dtype) or 0.0})
    X, y = torch.randn(6, 4), torch.randn(6, 2)
    assert handler.predict(X).dtype == torch.float32
    handler.evaluate((X, y))
    assert seen and set(seen) == {torch.float32}
    out = NNHandler(H.gpt2(), device="cpu", amp=amp).predict(H.lm_samples(3), batch_size=2)
    assert out.logits.dtype == torch.float32


@pytest.mark.slow
def test_a_batch_encoding_and_nested_mappings_reach_the_model_as_keywords():
    from transformers import BatchEncoding

    seen = []

    def collate(samples):
        ids = torch.stack([s["input_ids"] for s in samples])
        seen.append(len(samples))
        return BatchEncoding({"input_ids": ids, "labels": ids.clone()})

    reference = H.gpt2()
    samples = H.lm_samples(12)
    handler = _handler(copy.deepcopy(reference))
    handler.set_train_loader(DataLoader(samples, batch_size=5, collate_fn=collate))
    history = handler.train(1, progress=False)
    expected = H.hand_loop(copy.deepcopy(reference), samples, samples[:1], epochs=1, batch=5)
    assert history["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5)
    assert seen[:3] == [5, 5, 2]

    class Nested(nn.Module):  # a mapping inside the batch mapping: moved as a dict; size from "labels"
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x, extra, labels):
            return {"loss": F.mse_loss(self.lin(x["a"]) + extra["b"], labels)}

    batch = {"x": UserDict({"a": torch.randn(3, 2)}), "extra": {"b": torch.zeros(3, 1)}, "labels": torch.ones(3, 1)}
    assert NNHandler(Nested(), device="cpu").evaluate([batch, batch])["loss"] > 0


@pytest.mark.slow
def test_max_steps_then_resume_auto_with_dict_batches_equals_an_uninterrupted_run(tmp_path):
    samples = H.lm_samples(20)
    straight = _handler(H.gpt2(), seed=0)
    straight.set_train_loader(samples, batch_size=4)
    straight.train(2, progress=False)
    first = _handler(H.gpt2(), seed=0, checkpoint_dir=tmp_path)
    first.set_train_loader(samples, batch_size=4)
    first.train(max_steps=7, progress=False)  # stops in epoch 2, after 2 of its 5 batches
    resumed = _handler(H.gpt2(seed=3), seed=0, checkpoint_dir=tmp_path, resume="auto")
    resumed.set_train_loader(samples, batch_size=4)
    resumed.train(2, progress=False)
    assert resumed.global_step == straight.global_step == 10
    torch.testing.assert_close(torch.tensor(resumed.history["train_loss"]),
                               torch.tensor(straight.history["train_loss"]), rtol=0, atol=0)
    torch.testing.assert_close(_weights(resumed.module), _weights(straight.module), rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_and_compile_train_dict_batches():
    samples = H.lm_samples(16)
    reference = H.gpt2()
    plain = _handler(copy.deepcopy(reference))
    plain.set_train_loader(samples, batch_size=8, shuffle=False)
    plain.train(2, progress=False)
    # The eager backend: torch.compile's graph capture of model(**batch), without inductor's minutes on a CPU.
    compiled = _handler(copy.deepcopy(reference), compile=True, compile_kwargs={"backend": "eager"})
    compiled.set_train_loader(samples, batch_size=8, shuffle=False)
    compiled.train(2, progress=False)
    torch.testing.assert_close(torch.tensor(compiled.history["train_loss"]),
                               torch.tensor(plain.history["train_loss"]), **TOL)
    bf16 = _handler(copy.deepcopy(reference), amp="bf16")
    bf16.set_train_loader(samples, batch_size=8, shuffle=False)
    bf16.train(2, progress=False)
    torch.testing.assert_close(torch.tensor(bf16.history["train_loss"]),
                               torch.tensor(plain.history["train_loss"]), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_predict_data_parallel_feeds_dict_batches_as_keywords_and_returns_the_same_output():
    model = H.gpt2().eval()
    samples = H.lm_samples(6)
    handler = NNHandler(model, device="cpu")
    spread = handler.predict(samples, batch_size=2, data_parallel=True, device_ids=["cpu", "cpu"])
    here = handler.predict(samples, batch_size=2)
    assert type(spread) is type(here) and list(spread.keys()) == list(here.keys()) == ["logits"]
    torch.testing.assert_close(spread.logits, here.logits, **TOL)
