"""A Hugging Face model trained by NNHandler: dict batches, the model's own loss, export to a fresh model.

    python examples/hf_finetune.py                     # a tiny GPT-2 on the CPU, in seconds
    torchrun --nproc_per_node=2 examples/hf_finetune.py  # the same script on 2 DDP ranks
    python examples/hf_finetune.py --strategy fsdp --nprocs 2   # FSDP on 2 local ranks, GPT2Block by GPT2Block

The model is built from a small config (no download). Each batch is a dict
``{"input_ids", "labels"}``: NNHandler calls ``model(**batch)`` and, with no
``loss_fn``, trains on the output's ``loss``, as the Hugging Face ``Trainer``
does. ``predict`` returns the model's output type (``logits`` over every
sample), and ``export_model`` writes weights that a fresh ``GPT2LMHeadModel``
loads. Needs ``pip install 'nn_handler[hf]'`` (transformers).
"""

# needs-extra: hf (the newcomer CI path, which installs no extras, skips this example)
import argparse
import tempfile
from pathlib import Path

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
except ImportError as exc:
    raise SystemExit(f"this example needs Hugging Face transformers ({exc}): pip install 'nn_handler[hf]'") from None

from nn_handler import NNHandler

VOCAB, SEQ = 128, 16


def make_config() -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ,
                      bos_token_id=0, eos_token_id=0, use_cache=False)


def make_samples(n: int) -> list[dict]:
    """Sequences that count up modulo the vocabulary from a random start: a pattern an LM learns fast."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(0))
    ids = (starts + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]  # the model shifts the labels itself


def main(epochs: int, strategy: str, out_dir: Path) -> None:
    torch.manual_seed(0)
    handler = NNHandler(GPT2LMHeadModel(make_config()), torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2},
                        strategy=strategy, fsdp_wrap=[GPT2Block] if strategy == "fsdp" else None)
    handler.set_train_loader(make_samples(128), batch_size=16)
    handler.set_val_loader(make_samples(64), batch_size=16)
    history = handler.train(epochs, progress=False)
    out = handler.predict(make_samples(8), batch_size=4)  # a CausalLMOutput: its logits over every sample
    handler.export_model(out_dir / "gpt2.pt")
    if handler.is_main_process:
        print(f"train_loss {history['train_loss'][0]:.3f} -> {history['train_loss'][-1]:.3f}, "
              f"val_loss {history['val_loss'][-1]:.3f}")
        print(f"predict: {type(out).__name__} logits {tuple(out.logits.shape)}")
        fresh = GPT2LMHeadModel(make_config())
        fresh.load_state_dict(torch.load(out_dir / "gpt2.pt", weights_only=True))
        print(f"exported weights load into a fresh GPT2LMHeadModel (lm_head tied: "
              f"{fresh.lm_head.weight is fresh.transformer.wte.weight})")
    handler.close()


def launched(epochs: int, strategy: str, out_dir: str) -> None:
    main(epochs, strategy, Path(out_dir))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--nprocs", type=int, default=0, help="start this many local ranks (gloo on a CPU)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.nprocs:
            NNHandler.launch(launched, args.epochs, args.strategy, tmp, nprocs=args.nprocs)
        else:
            main(args.epochs, args.strategy, Path(tmp))
