"""What predict() returns for dynamically padded batches, tuple outputs and output fields that are not tensors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nn_handler import NNHandler
from scripts.promises_case import LENGTHS, Tagger, pad_each_batch, token_samples

def one_by_one(model):
    """Each sample alone (no padding at all), as the reference rows."""
    with torch.no_grad():
        return [model(s["input_ids"][None]) for s in token_samples()]


def test_dynamically_padded_batches_are_padded_to_the_longest_with_minus_100_and_tuples_kept():
    model = Tagger()
    out = NNHandler(model).predict(DataLoader(token_samples(), batch_size=3, collate_fn=pad_each_batch))
    scores, (hidden, first), loss = out
    assert scores.shape == (7, 7) and hidden.shape == (7, 7, 2) and first.shape == (7, 1, 2) and loss is None
    for i, (ref_scores, (ref_hidden, ref_first), _) in enumerate(one_by_one(model)):
        n, batch_longest = LENGTHS[i], max(LENGTHS[i // 3 * 3:i // 3 * 3 + 3])
        assert torch.equal(scores[i, :n], ref_scores[0])  # the sample's own tokens
        # Past the sample: the collate's padding (scored by the model) up to its batch's longest, then -100.
        assert (scores[i, batch_longest:] == -100).all() and (hidden[i, batch_longest:] == -100).all()
        assert torch.equal(hidden[i, :n], ref_hidden[0]) and torch.equal(first[i], ref_first[0])
    loader = DataLoader(token_samples(), batch_size=3, collate_fn=pad_each_batch)
    again = NNHandler(model).predict(loader, padding_value=0)
    assert torch.equal(again[0], torch.where(scores == -100, 0.0, scores))


def test_a_mapping_output_keeps_its_tuple_fields_and_names_what_it_leaves_out(caplog):
    pytest.importorskip("transformers")
    from scripts import hf_case as H

    model = H.gpt2()
    model.config.output_hidden_states = True
    model.config.use_cache = True  # a Cache object: not concatenated, and said so
    with caplog.at_level(logging.WARNING, logger="nn_handler"):
        out = NNHandler(model).predict(DataLoader(token_samples(), batch_size=3, collate_fn=pad_each_batch))
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (7, 7, H.VOCAB) and len(out.hidden_states) == 3
    assert all(h.shape == (7, 7, 32) for h in out.hidden_states)
    model.eval()
    with torch.no_grad():
        alone = model(input_ids=token_samples()[3]["input_ids"][None])  # the longest sample: no padding in its batch
    torch.testing.assert_close(out.hidden_states[-1][3], alone.hidden_states[-1][0])
    dropped = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(dropped) == 1 and "output['cache'] (a DynamicCache)" in dropped[0]


def test_outputs_of_another_rank_per_batch_or_nothing_batched_are_refused_by_name():
    class Ragged(nn.Module):
        def forward(self, x):
            return x if x.shape[0] > 1 else x[0]  # the last batch's output loses its batch dimension

    with pytest.raises(ValueError, match=r"outputs with \[1, 2\] dimensions"):
        NNHandler(Ragged()).predict(torch.ones(5, 3), batch_size=2)

    class Scalar(nn.Module):
        def forward(self, x):
            return (x.sum(),)

    with pytest.raises(TypeError, match="tensors with a batch dimension .* got tuple"):
        NNHandler(Scalar()).predict(torch.ones(5, 3))
