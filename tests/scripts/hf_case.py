"""Tiny Hugging Face models built from configs (no download), their dict batches, and a hand-written loop.

Imported by the dict-batch tests (as ``scripts.hf_case``); needs ``transformers``
(the ``test`` extra), which the tests check with ``pytest.importorskip`` first.
Dropout is off so that NNHandler and the hand-written loop draw nothing random.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

VOCAB, SEQ = 128, 12


def gpt2(seed: int = 0):
    """A 2-layer GPT-2 LM (tied ``lm_head``) with 32-wide embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(config)


def bert(seed: int = 0, labels: int = 3):
    """A 2-layer BERT sequence classifier."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=labels,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForSequenceClassification(config)


def lm_samples(n: int, seed: int = 0) -> list[dict]:
    """``n`` samples ``{"input_ids", "labels"}`` (labels = the ids: the model shifts them)."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def cls_samples(n: int, seed: int = 0, labels: int = 3) -> list[dict]:
    """``n`` samples ``{"input_ids", "attention_mask", "labels"}`` whose label is the first token's residue."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[: n // 2, SEQ - 3:] = 0  # padded tails on half of them
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i, 0] % labels} for i in range(n)]


def accuracy(outputs, labels) -> torch.Tensor:
    return (outputs.logits.argmax(-1) == labels).float().mean()


def hand_loop(model, samples: list[dict], val: list[dict], epochs: int, batch: int, lr: float = 1e-2) -> dict:
    """The five-line loop: AdamW on ``model(**batch).loss``; per epoch the loss means weighted by batch size."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    history: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    for _ in range(epochs):
        model.train()
        total, count = 0.0, 0
        for b in DataLoader(samples, batch_size=batch):
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            total, count = total + loss.item() * len(b["labels"]), count + len(b["labels"])
        history["train_loss"].append(total / count)
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for b in DataLoader(val, batch_size=batch):
                total, count = total + model(**b).loss.item() * len(b["labels"]), count + len(b["labels"])
        history["val_loss"].append(total / count)
    return history
