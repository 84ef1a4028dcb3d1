"""Embed protein sequences on every device, streamed to disk; the job killed half-way, resumed, checked against a loop.

    python examples/embed_sequences.py                       # a tiny ESM on 2 CPU workers, about a minute
    python examples/embed_sequences.py --sequences 20000 --max-tokens 16384 --devices 0 1   # two GPUs

1. Writes synthetic protein sequences (log-normal lengths, as real proteins have) to a FASTA file.
2. Embeds them with an ESM model built from ``transformers.EsmConfig`` (small, random weights: no download):
   one vector per sequence (the mean over its residues) and one per residue. ``parallel_predict`` reads the
   FASTA file as it goes (a generator), forms batches by a token budget over length-sorted windows, and each
   worker writes its finished batches to the output directory at once.
3. Runs that in a child process and kills the child and its workers (SIGKILL to the process group) once half
   the items are on disk; then makes the same call again here: the batches on disk are kept, only the missing
   ones are computed.
4. Checks every embedding against a plain loop over the sequences, one at a time, in this process.

Needs ``pip install 'nn_handler[hf]'`` (transformers).
"""

# needs-extra: hf (the newcomer CI path, which installs no extras, skips this example)
import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

if importlib.util.find_spec("transformers") is None:
    raise SystemExit("this example needs Hugging Face transformers: pip install 'nn_handler[hf]'")

from nn_handler import Predictions, parallel_predict

# ESM-2's vocabulary: <cls> 0, <pad> 1, <eos> 2, <unk> 3, then the residues.
CLS, PAD, EOS = 0, 1, 2
RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"
TOKEN = {a: 4 + i for i, a in enumerate(RESIDUES)}


def write_fasta(path: Path, n: int, max_length: int) -> list[int]:
    """``n`` random sequences of the 20 common amino acids, lengths log-normal around 128 (20..max_length)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.6 + 4.85).round().clamp(20, max_length).int().tolist()
    with open(path, "w") as f:
        for i, length in enumerate(lengths):
            seq = "".join(RESIDUES[j] for j in torch.randint(0, 20, (length,), generator=g).tolist())
            f.write(f">seq{i}\n" + "\n".join(seq[k:k + 60] for k in range(0, length, 60)) + "\n")
    return lengths


def read_fasta(path: Path):
    """The sequences of a FASTA file, one at a time (the file is never held whole)."""
    parts: list[str] = []
    with open(path) as f:
        for line in f:
            if line.startswith(">"):
                if parts:
                    yield "".join(parts)
                parts = []
            else:
                parts.append(line.strip())
    if parts:
        yield "".join(parts)


def collate(sequences: list[str]) -> dict:
    """A batch: ``<cls> residues <eos>``, padded to the longest with ``<pad>``, and the attention mask."""
    longest = max(map(len, sequences)) + 2
    ids = torch.full((len(sequences), longest), PAD)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq) + 2] = torch.tensor([CLS, *(TOKEN[a] for a in seq), EOS])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long()}


class Embedder(nn.Module):
    """ESM's last hidden state: per residue (``<cls>`` dropped) and its mean over the residues."""

    def __init__(self, esm: nn.Module):
        super().__init__()
        self.esm = esm

    def forward(self, input_ids, attention_mask):
        hidden = self.esm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        per_residue = hidden[:, 1:-1]  # (batch, longest, hidden): parallel_predict cuts each to its length
        residue = (input_ids[:, 1:-1] > EOS).unsqueeze(-1)  # neither <eos> nor <pad>
        pooled = (per_residue * residue).sum(1) / residue.sum(1)
        return {"pooled": pooled, "per_residue": per_residue}


def load_encoder() -> nn.Module:
    """Built in each worker (the same weights everywhere: seeded); a real run would load ESM-2's weights here."""
    # Imported here, where the model is built: the process that only reads the FASTA file and hands out batches
    # (the killed child below) never pays for importing transformers.
    from transformers import EsmConfig, EsmModel

    torch.manual_seed(0)
    config = EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=1026, pad_token_id=PAD, mask_token_id=32,
                       position_embedding_type="rotary", token_dropout=False)
    return Embedder(EsmModel(config, add_pooling_layer=False))


def embed(args) -> Predictions:
    return parallel_predict(load_encoder, read_fasta(args.fasta), collate_fn=collate, max_tokens=args.max_tokens,
                            length=len, output_dir=args.out, device_ids=args.devices)


def items_on_disk(out: Path) -> int:
    """Items in the finished shards: their names say how many (``shard-<first item>-<count>.safetensors``)."""
    return sum(int(p.name.split("-")[2].split(".")[0]) for p in out.glob("shard-*.safetensors"))


def run_and_kill_half_way(args, n: int) -> int:
    """Start the embedding in a child process; SIGKILL it and its workers once half the items are on disk."""
    child = subprocess.Popen([sys.executable, __file__, "--child", *sys.argv[1:], "--fasta", str(args.fasta),
                              "--out", str(args.out)], start_new_session=True)  # its own group: workers included
    deadline = time.monotonic() + 600
    try:
        while items_on_disk(args.out) < n // 2 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the directory: the shards are the event
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    return items_on_disk(args.out)


def embed_kill_resume_and_check(args) -> None:
    """Steps 1 to 4 of the module's docstring, in ``args.fasta`` and ``args.out``."""
    lengths = write_fasta(args.fasta, args.sequences, args.max_length)
    print(f"wrote {len(lengths)} sequences to {args.fasta} (lengths {min(lengths)}..{max(lengths)}, median "
          f"{sorted(lengths)[len(lengths) // 2]})", flush=True)

    start = time.perf_counter()
    kept = run_and_kill_half_way(args, len(lengths))
    print(f"killed the run with {kept} of {len(lengths)} items on disk", flush=True)
    preds = embed(args)  # the same call again: resumes
    print(f"resumed: {len(lengths) - kept} items computed, {kept} kept; {time.perf_counter() - start:.1f} s in all",
          flush=True)

    later = Predictions.open(args.out)  # as any other process would, without the model
    pooled = later.stack("pooled")
    model = load_encoder().eval()
    same = len(later) == len(lengths) == len(preds)
    with torch.inference_mode():
        for i, seq in enumerate(read_fasta(args.fasta)):
            out = model(**collate([seq]))
            item = later[i]
            same &= item["per_residue"].shape == (len(seq), 32)
            same &= torch.allclose(item["per_residue"], out["per_residue"][0], atol=1e-5)
            same &= torch.allclose(pooled[i], out["pooled"][0], atol=1e-5)
    print(f"pooled {tuple(pooled.shape)}, per residue (length, 32) each; equal to a plain loop, one sequence at a "
          f"time: {bool(same)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=300)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget per batch")
    parser.add_argument("--devices", nargs="+", default=None,
                        help="device ids (all GPUs by default; 2 CPU workers without CUDA)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory, kept (by default a temporary one, removed at the end)")
    parser.add_argument("--fasta", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.devices is None:
        args.devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else ["cpu", "cpu"]
    args.devices = [int(d) if str(d).isdigit() else d for d in args.devices]
    if args.child:
        embed(args)
        return

    # The FASTA file (and the embeddings, without --out) live in a temporary directory, removed at the end.
    with tempfile.TemporaryDirectory(prefix="embed_sequences-") as work:
        args.fasta = Path(work) / "sequences.fasta"
        args.out = args.out or Path(work) / "embeddings"
        embed_kill_resume_and_check(args)


if __name__ == "__main__":
    main()
