"""One GPU: NNHandler's training against a hand-written loop, Lightning Fabric and Accelerate, in fp16 and bf16.

    python benchmarks/bench_gpu.py                     # --part all: the training race, then the results part
    python benchmarks/bench_gpu.py --part train --rounds 5 --models lm
    python benchmarks/bench_gpu.py --part train --models gpt2     # HF GPT-2 124M, bf16, beside the HF Trainer
    python benchmarks/bench_gpu.py --quick             # tiny sizes, 2 rounds: runs on a CPU too (checks the script)
    python benchmarks/bench_gpu.py --part train --profile   # also: cudaStreamSynchronize calls per step

Part 1, ``train``: two models, a tiny MLP (overhead-bound: the figure to
watch when the loop changes) and a small transformer LM (4 layers, d=1024,
seq 256, batch 16). Each contender trains the same model from the same seed
with AdamW, in fp16 (autocast + GradScaler) and in bf16 (autocast, no
scaler): the hand-written loop (pinned loader, non-blocking copies, the
loss summed on the device), NNHandler (``amp="fp16"`` / ``"bf16"``), Fabric
(``precision="16-mixed"`` / ``"bf16-mixed"``) and Accelerate
(``mixed_precision="fp16"`` / ``"bf16"``). Fabric and Accelerate are
optional (the ``bench`` extra): a contender that is not installed is skipped,
and said so. After a warm-up epoch each, every round times one epoch of each
contender, the order rotated round by round; the figure is the median
steps/s, and the ratio the median of the per-round ratios against the
hand-written loop of the same precision.

Targets (from issue 28, on a GPU): NNHandler >= 0.98x the hand-written loop
on the transformer, in fp16 and in bf16.

A third model, ``gpt2`` (issue 37): a Hugging Face ``GPT2LMHeadModel`` of the
124M config (12 layers, d=768, vocab 50257; random init), seq 512, batch 8,
in bf16, fed dict batches ``{"input_ids", "labels"}`` and trained on the
model's own ``loss`` (NNHandler with no ``loss_fn``). The Hugging Face
``Trainer`` joins the race there (AdamW, no clipping, no logging or saving;
each timed epoch is one ``trainer.train()``, its set-up included). Targets:
NNHandler >= 0.98x the hand-written loop and >= the ``Trainer``. Needs
``transformers``; skipped, and said so, without it.

Part 2, ``results``: the executor's CUDA result throughput against a
page-locked copy on the same GPU. It lives in ``benchmarks/gpu_results.py``
(its own ``main(argv)``); this script calls it when that file exists.

``--profile`` counts ``cudaStreamSynchronize`` per step with torch's profiler
for the hand-written loop and NNHandler (the hand-written fp16 loop has one:
the GradScaler's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PRECISIONS = ("fp16", "bf16")
CASE_PRECISIONS = {"gpt2": ("bf16",)}  # the case: GPT-2 is trained in bf16
_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- the models and their data
class TinyLM(nn.Module):
    """A causal transformer LM: token and position embeddings, pre-norm blocks, a linear head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def case(name: str, quick: bool) -> dict:
    """The model factory, loss, data and batch size of a case (``quick``: tiny sizes for a CPU check)."""
    if name == "gpt2":
        return gpt2_case(quick)
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        width, batch, n = (64, 16, 8 * 16) if quick else (512, 64, 200 * 64)
        x, y = torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
        return {"title": f"MLP 256-{width}-{width}-10, batch {batch}",
                "model": lambda: nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                               nn.Linear(width, 10)),
                "loss": nn.CrossEntropyLoss(), "data": TensorDataset(x, y), "batch": batch}
    d, layers, heads, seq, vocab, batch, steps = (64, 2, 4, 32, 256, 4, 6) if quick else (1024, 4, 16, 256, 8192, 16, 60)
    tokens = torch.randint(0, vocab, (steps * batch, seq + 1), generator=g)
    return {"title": f"transformer LM {layers} layers, d={d}, seq {seq}, batch {batch}, vocab {vocab}",
            "model": lambda: TinyLM(vocab, d, layers, heads, seq), "loss": lm_loss,
            "data": TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), "batch": batch}


class DictTokens(torch.utils.data.Dataset):
    """Token rows as Hugging Face batches: ``{"input_ids", "labels"}`` (the model shifts the labels)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def gpt2_case(quick: bool) -> dict:
    """GPT-2 124M (random init) at seq 512, batch 8; ``quick``: 2 layers, d=64, seq 32, for a CPU check."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32, use_cache=False)
        seq, batch, steps = 32, 4, 6
    else:
        config = GPT2Config(use_cache=False)  # the 124M model's sizes are the config's defaults
        seq, batch, steps = 512, 8, 40
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    tokens = torch.randint(0, config.vocab_size, (steps * batch, seq), generator=torch.Generator().manual_seed(0))
    return {"title": f"HF GPT-2 {config.n_layer} layers, d={config.n_embd}, seq {seq}, batch {batch}, "
                     f"vocab {config.vocab_size}, dict batches, the model's own loss",
            "model": lambda: GPT2LMHeadModel(config), "loss": None, "data": DictTokens(tokens), "batch": batch,
            "hf": True}


def _loss(model, batch, loss_fn, device=None):
    """A batch's loss: ``model(**batch).loss`` for a dict batch, else ``loss_fn(model(x), y)`` (moved when asked)."""
    if isinstance(batch, dict):
        if device is not None:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        return model(**batch).loss
    x, y = batch
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return loss_fn(model(x), y)


# ----------------------------------------------------------------------------- the contenders
# Each returns ``epoch()``: one pass over the case's data, in the given precision, on ``device``.
def _loader(c: dict, device: torch.device) -> DataLoader:
    return DataLoader(c["data"], batch_size=c["batch"], shuffle=True, pin_memory=device.type == "cuda", drop_last=True)


def hand_written(c: dict, precision: str, device: torch.device):
    """What a careful user writes: autocast, a GradScaler for fp16 only, non-blocking copies, the loss summed on the device."""
    torch.manual_seed(0)
    model = c["model"]().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    loader, loss_fn = _loader(c, device), c["loss"]

    def epoch():
        model.train()
        total = torch.zeros((), device=device)
        for batch in loader:
            with torch.autocast(device.type, dtype=_DTYPE[precision]):
                loss = _loss(model, batch, loss_fn, device)
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            total += loss.detach()
        return total

    return epoch


def nn_handler(c: dict, precision: str, device: torch.device):
    from nn_handler import NNHandler

    torch.manual_seed(0)
    handler = NNHandler(c["model"](), torch.optim.AdamW, c["loss"], optimizer_kwargs={"lr": 1e-4}, device=device,
                        amp=precision, use_distributed=False)
    handler.set_train_loader(c["data"], batch_size=c["batch"], shuffle=True, pin_memory=device.type == "cuda",
                             drop_last=True)
    return lambda: handler.train(handler.epoch + 1, progress=False)


def fabric(c: dict, precision: str, device: torch.device):
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric

    f = Fabric(accelerator=device.type, devices=1, precision="16-mixed" if precision == "fp16" else "bf16-mixed")
    torch.manual_seed(0)
    model = c["model"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = f.setup(model, opt)
    return _wrapped_epoch(model, opt, f.setup_dataloaders(_loader(c, device)), c["loss"], f.backward, device)


def accelerate(c: dict, precision: str, device: torch.device):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one per process otherwise: the next precision is refused
    acc = Accelerator(mixed_precision=precision, cpu=device.type == "cpu")
    torch.manual_seed(0)
    model = c["model"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, loader = acc.prepare(model, opt, _loader(c, device))
    return _wrapped_epoch(model, opt, loader, c["loss"], acc.backward, device)


def _wrapped_epoch(model, opt, loader, loss_fn, backward, device: torch.device):
    """An epoch of a library that wraps model, optimizer and loader itself (autocast, scaler, copies inside)."""

    def epoch():
        total = torch.zeros((), device=device)
        for batch in loader:
            loss = _loss(model, batch, loss_fn)
            opt.zero_grad(set_to_none=True)
            backward(loss)
            opt.step()
            total += loss.detach()
        return total

    return epoch


def hf_trainer(c: dict, precision: str, device: torch.device):
    """The Hugging Face ``Trainer``, set to train as the others do: torch's AdamW, no clipping, logging or saving."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench_hf_"), per_device_train_batch_size=c["batch"], num_train_epochs=1,
        learning_rate=1e-4, weight_decay=0.01, optim="adamw_torch", max_grad_norm=0.0, lr_scheduler_type="constant",
        bf16=precision == "bf16", fp16=precision == "fp16", use_cpu=device.type == "cpu", report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True,
        dataloader_pin_memory=device.type == "cuda")
    trainer = Trainer(model=c["model"](), args=args, train_dataset=c["data"])
    return lambda: trainer.train()


CONTENDERS = {
    "hand-written": (hand_written, ()),
    "NNHandler": (nn_handler, ()),
    "Lightning Fabric": (fabric, ("lightning", "lightning_fabric")),
    "Accelerate": (accelerate, ("accelerate",)),
    "HF Trainer": (hf_trainer, ("transformers",)),  # Hugging Face models only: the gpt2 case
}
HF_ONLY = {"HF Trainer"}
BASELINE = "hand-written"


def _installed(modules: tuple) -> bool:
    return not modules or any(importlib.util.find_spec(m) is not None for m in modules)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def race(case_name: str, precision: str, names: list[str], device: torch.device, rounds: int, quick: bool,
         profile: bool) -> dict:
    """Median steps/s of each contender and its median per-round ratio to the hand-written loop."""
    c = case(case_name, quick)
    names = [n for n in names if n not in HF_ONLY or c.get("hf")]
    steps = len(c["data"]) // c["batch"]
    epochs, failed = {}, {}
    for name in names:
        try:
            epochs[name] = CONTENDERS[name][0](c, precision, device)
            epochs[name]()  # warm-up: allocator, cuDNN/cuBLAS choices, first-call costs
        except Exception as exc:  # a contender that cannot run this precision here is reported, not fatal
            failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
            epochs.pop(name, None)
    ran = list(epochs)
    rates: dict[str, list[float]] = {name: [] for name in ran}
    for r in range(rounds):
        for name in ran[r % len(ran):] + ran[:r % len(ran)]:  # rotated: a load change hits each alike
            _sync(device)
            start = time.perf_counter()
            epochs[name]()
            _sync(device)
            rates[name].append(steps / (time.perf_counter() - start))
    print(f"\n{c['title']}, {precision}, {steps} steps/epoch, {rounds} rounds, {device}:")
    for name, why in failed.items():
        print(f"  {name:<17} could not run: {why}")
    result = {"case": case_name, "precision": precision, "median_steps_per_s": {}, "median_ratio": {}}
    for name in ran:
        median = statistics.median(rates[name])
        line = f"  {name:<17} {median:8.2f} steps/s"
        if BASELINE in rates:
            ratio = statistics.median(a / b for a, b in zip(rates[name], rates[BASELINE]))
            result["median_ratio"][name] = ratio
            line += f"  {ratio:.3f}x {BASELINE}"
        result["median_steps_per_s"][name] = median
        print(line + "; rounds: " + ", ".join(f"{v:.1f}" for v in rates[name]))
    if profile and device.type == "cuda":
        for name in (n for n in (BASELINE, "NNHandler") if n in epochs):
            result.setdefault("syncs_per_step", {})[name] = syncs_per_step(epochs[name], steps)
            print(f"  {name:<17} {result['syncs_per_step'][name]:.2f} cudaStreamSynchronize per step")
    print("JSON " + json.dumps(result))
    return result


def syncs_per_step(epoch, steps: int) -> float:
    """``cudaStreamSynchronize`` calls per step over one epoch, counted by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        epoch()
        torch.cuda.synchronize()
    count = sum(e.count for e in prof.key_averages() if e.key == "cudaStreamSynchronize")
    return count / steps


# ----------------------------------------------------------------------------- part 2: CUDA results (another file)
def results_part(argv: list[str]) -> None:
    """HOOK for part 2: the executor's CUDA result throughput, ``benchmarks/gpu_results.py`` with ``main(argv)``."""
    path = Path(__file__).with_name("gpu_results.py")
    if not path.exists():
        print("\nresults part: benchmarks/gpu_results.py is not here yet; skipped")
        return
    spec = importlib.util.spec_from_file_location("gpu_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("train", "results", "all"), default="all")
    parser.add_argument("--models", nargs="+", choices=("mlp", "lm", "gpt2"), default=["mlp", "lm", "gpt2"])
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 rounds (runs on a CPU)")
    parser.add_argument("--profile", action="store_true", help="count cudaStreamSynchronize per step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args, rest = parser.parse_known_args(argv)  # the rest goes to the results part
    if args.part in ("train", "all"):
        device = torch.device(args.device)
        if device.type == "cuda":
            print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
        else:
            print(f"no GPU: {device}, torch {torch.__version__} (use --quick for a check of the script)")
        names = [n for n, (_, modules) in CONTENDERS.items() if _installed(modules)]
        skipped = [n for n in CONTENDERS if n not in names]
        if skipped:
            print(f"not installed, skipped: {', '.join(skipped)} (pip install 'nn_handler[bench]')")
        rounds = 2 if args.quick else args.rounds
        for case_name in args.models:
            if case_name == "gpt2" and not _installed(("transformers",)):
                print("\ngpt2: transformers is not installed, skipped (pip install 'nn_handler[bench]')")
                continue
            for precision in args.precisions:
                if precision in CASE_PRECISIONS.get(case_name, PRECISIONS):
                    race(case_name, precision, names, device, rounds, args.quick, args.profile)
    if args.part in ("results", "all"):
        results_part(rest + (["--quick"] if args.quick and "--quick" not in rest else []))


if __name__ == "__main__":
    main(sys.argv[1:])
