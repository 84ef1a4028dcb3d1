"""parallel_predict as a batch-inference engine: speed, memory and resume, side by side in one run.

    python benchmarks/bench_inference.py                    # 20,000 sequences; 1,000,000 and 100,000 items for RSS
    python benchmarks/bench_inference.py --items 2000 --rss-items 100000 20000 --resume-items 2000   # a loaded machine
    python benchmarks/bench_inference.py --only speed       # or: rss, resume

Data: token sequences of log-normal lengths (median about 128, 8..512), through a 2-layer transformer encoder
(``nn.TransformerEncoder``, d_model 64 on CPU workers, 256 on GPUs), mean-pooled to one vector per sequence.
Workers: every GPU when there is one, else 2 CPU workers. Every figure is a whole call, cold start included
(worker processes or actors started, the model sent or built), the peers one after the other in one run.

Speed rows (items/s):

- ``fixed``: ``parallel_predict(batch_size=64)``, the input in its own order (as before token budgets);
- ``hand``: a hand-written loop per device (one spawned process per device, each over every other batch of
  ``fixed``'s batches, the outputs sent back through a queue; CPU processes take their share of the cores'
  threads, as the executor's workers do: two processes of torch's default threads each would oversubscribe);
- ``tokens``: ``parallel_predict(max_tokens=..., length=len)``: batches by token budget over length-sorted windows;
- ``ray_data``: Ray Data ``map_batches`` with a pool of one actor per device over ``tokens``'s batches (needs the
  ``ray`` extra; skipped without it). Its cold start is ``ray.init`` (a local Ray of as many CPUs as workers), the
  actors' start and the batches put in the object store once; each actor then gets only a batch's number per call
  (no inputs travel per batch, which favours Ray). Each actor asks for one CPU, so Ray runs its torch on one
  thread, as the executor does with two CPU workers on two cores (each worker's share of the cores).

The executor's workers fork from a server that the process's first call starts (importing torch once there):
later ``parallel_predict`` rows reuse it, as a later call in the same process does; each ``ray_data`` row starts
its Ray anew.

Ratios (targets in brackets): fixed / hand (>= 0.95), tokens / fixed (>= 5), tokens / ray_data (>= 1.2; also
shown without ``ray.init``, as on a cluster whose Ray is already running).

``--rounds N --rows tokens ray_data`` runs the chosen rows N times, interleaved, and gives each ratio as the median
of its per-round ratios (a loaded machine's load drifts between rows run one after the other)::

    python benchmarks/bench_inference.py --only speed --rows tokens ray_data --rounds 3 --items 4000

RSS: the caller's peak RSS above its RSS just before ``parallel_predict(output_dir=...)`` of N items x 256 floats
(a fresh process per N, sampled every 5 ms; target: under 300 MB, and no growth with N).

Resume: a run killed with SIGKILL (its whole process group) once half the items are on disk, then run again: the
items its workers had computed but that were not on disk (computed twice), against the bound of the batches in
flight (``IN_FLIGHT_PER_DEVICE`` per device).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from nn_handler import parallel_predict  # noqa: E402
from nn_handler._inference.batching import SORT_WINDOW, token_batches  # noqa: E402  (the same batches for Ray)
from nn_handler._inference.engine import IN_FLIGHT_PER_DEVICE  # noqa: E402

VOCAB, PAD = 1000, 0


def devices() -> list:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else ["cpu", "cpu"]


def make_sequences(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` token sequences, lengths log-normal with a median of about 128, 8..512."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.7 + math.log(128)).round().clamp(8, 512).int().tolist()
    return [torch.randint(1, VOCAB, (length,), generator=g) for length in lengths]


def pad(sequences: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=PAD)


class Encoder(nn.Module):
    """A 2-layer transformer encoder, mean-pooled over the real tokens."""

    def __init__(self, width: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width, padding_idx=PAD)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        real = tokens != PAD
        hidden = self.encoder(self.embed(tokens), src_key_padding_mask=~real)
        return (hidden * real.unsqueeze(-1)).sum(1) / real.sum(1, keepdim=True)


def load_encoder(device=None) -> nn.Module:
    torch.manual_seed(0)
    return Encoder(256 if torch.cuda.is_available() else 64)


# ----------------------------------------------------------------------------- the peers
def hand_worker(rank: int, world: int, device, batches: list[list[torch.Tensor]], queue, received) -> None:
    """A hand-written loop on one device: every world-th batch, outputs back through the queue."""
    if device == "cpu":  # its share of the cores, as the executor gives each CPU worker (and Ray each actor)
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    model = load_encoder().to(device).eval()
    outputs = []
    with torch.inference_mode():
        for number in range(rank, len(batches), world):
            outputs.append((number, model(pad(batches[number]).to(device)).cpu()))
    queue.put(outputs)
    received.wait()  # torch sends tensors through shared memory: they must outlive their reading


def run_hand(sequences: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    batches = [sequences[i:i + batch_size] for i in range(0, len(sequences), batch_size)]
    ctx = multiprocessing.get_context("spawn")
    queue, received = ctx.Queue(), ctx.Event()
    ids = devices()
    procs = [ctx.Process(target=hand_worker, args=(rank, len(ids), device, batches, queue, received))
             for rank, device in enumerate(ids)]
    for p in procs:
        p.start()
    parts = [(number, out.clone()) for _ in procs for number, out in queue.get(timeout=3600)]
    received.set()
    for p in procs:
        p.join()
    return torch.cat([out for _, out in sorted(parts, key=lambda part: part[0])])


class RayEncoder:
    """Ray Data's actor: the model once, then one of the token-budget batches per row."""

    def __init__(self, batches_ref):
        import ray

        self.batches = ray.get(batches_ref)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load_encoder().to(self.device).eval()

    def __call__(self, rows: dict) -> dict:
        import numpy as np

        out = []
        with torch.inference_mode():
            for number in rows["batch"]:
                out.append(self.model(pad(self.batches[int(number)]).to(self.device)).cpu().numpy())
        return {"batch": rows["batch"], "pooled": np.array(out, dtype=object)}


def run_ray_data(batches: list[list[torch.Tensor]]) -> tuple[float, float]:
    """Seconds for Ray Data's ``map_batches`` over ``batches`` with one actor per device, Ray's start included;
    and the seconds of ``ray.init`` alone."""
    import logging

    import ray

    start = time.perf_counter()
    ray.init(num_cpus=max(2, len(devices())), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    started = time.perf_counter()
    try:
        logging.getLogger("ray.data").setLevel(logging.ERROR)  # its progress lines every few seconds
        ray.data.DataContext.get_current().enable_progress_bars = False
        ref = ray.put(batches)
        ds = ray.data.from_items([{"batch": i} for i in range(len(batches))])
        gpus = 1 if torch.cuda.is_available() else 0
        ds = ds.map_batches(RayEncoder, fn_constructor_kwargs={"batches_ref": ref}, batch_size=1,
                            concurrency=len(devices()), num_gpus=gpus, num_cpus=1)
        rows = ds.take_all()
        assert len(rows) == len(batches)
        return time.perf_counter() - start, started - start
    finally:
        ray.shutdown()


SPEED_ROWS = ("fixed", "hand", "tokens", "ray_data")


def speed(args) -> None:
    sequences = make_sequences(args.items)
    n = len(sequences)
    tokens = sum(len(s) for s in sequences)
    ids = devices()
    print(f"speed: {n:,} sequences ({tokens:,} tokens, median length {sorted(map(len, sequences))[n // 2]}), "
          f"devices {ids}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    wanted = [name for name in args.rows if name != "ray_data" or _has_ray()]
    if "ray_data" in args.rows and "ray_data" not in wanted:
        print("  ray_data  skipped: pip install 'nn_handler[ray]'")
    fixed_padded = sum(len(b) * max(map(len, b)) for b in
                       (sequences[i:i + args.batch_size] for i in range(0, n, args.batch_size)))
    batches = [b for b in token_batches(enumerate(sequences), args.max_tokens, len, None)]
    token_padded = sum(len(b) * max(b.lengths) for b in batches)
    reference: dict[str, torch.Tensor] = {}
    rounds: list[dict[str, float]] = []

    def row(name, seconds, padded_tokens, note=""):
        rounds[-1][name] = n / seconds
        print(f"  {name:9} {seconds:8.1f} s {n / seconds:9.1f} items/s   padding {1 - tokens / padded_tokens:5.1%}"
              f"  {note}", flush=True)

    def check(name, out):
        if reference:
            assert torch.allclose(out, next(iter(reference.values())), atol=1e-4), f"{name} changed the outputs"
        reference.setdefault(name, out)

    for number in range(args.rounds):
        rounds.append({})
        if args.rounds > 1:
            print(f" round {number + 1} of {args.rounds} (load average {os.getloadavg()[0]:.1f})", flush=True)
        for name in wanted:
            start = time.perf_counter()
            if name == "fixed":
                check(name, parallel_predict(load_encoder, sequences, collate_fn=pad, batch_size=args.batch_size,
                                             device_ids=ids))
                row(name, time.perf_counter() - start, fixed_padded, f"batch_size={args.batch_size}")
            elif name == "hand":
                check(name, run_hand(sequences, args.batch_size))
                row(name, time.perf_counter() - start, fixed_padded, "same batches, a spawned loop per device")
            elif name == "tokens":
                check(name, parallel_predict(load_encoder, sequences, collate_fn=pad, max_tokens=args.max_tokens,
                                             length=len, device_ids=ids))
                row(name, time.perf_counter() - start, token_padded,
                    f"max_tokens={args.max_tokens}, windows of {SORT_WINDOW}")
            else:
                seconds, init = run_ray_data([b.samples for b in batches])
                row(name, seconds, token_padded, f"the same batches as tokens; ray.init {init:.1f} s of it")
                rounds[-1]["ray_data_started"] = n / (seconds - init)

    def ratio(a, b):
        per_round = [r[a] / r[b] for r in rounds if a in r and b in r]
        return statistics.median(per_round) if per_round else None

    print("ratios (targets in brackets)" + (f", medians of {args.rounds} rounds:" if args.rounds > 1 else ":"))
    for a, b, target in (("fixed", "hand", ">= 0.95"), ("tokens", "fixed", ">= 5"), ("tokens", "ray_data", ">= 1.2"),
                         ("tokens", "ray_data_started", "Ray already running")):
        value = ratio(a, b)
        if value is not None:
            print(f"  {a} / {b:16} {value:6.2f}x  ({target})")


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- the caller's memory
class Wide(nn.Module):
    """256 floats per item, from one number: the outputs are what weighs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(1, 256)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(n: int, batch_size: int) -> None:
    """In a fresh process: the peak RSS above the RSS before one parallel_predict(output_dir=...) call."""
    data = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    out = tempfile.mkdtemp(prefix="bench_inference-")
    before = rss_bytes()
    peak, running = [before], True

    def sample():
        while running:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    preds = parallel_predict(Wide(), data, batch_size=batch_size, output_dir=out, device_ids=devices())
    seconds = time.perf_counter() - start
    running = False
    sampler.join()
    assert len(preds) == n and torch.equal(preds[n - 1], torch.full((256,), float(n - 1)))
    size = sum(p.stat().st_size for p in Path(out).iterdir())
    print(f"  {n:>9,} items x 256 floats ({size / 1e9:.2f} GB on disk) in {seconds:6.1f} s: peak RSS "
          f"{(peak[0] - before) / 1e6:6.1f} MB above the {before / 1e6:.0f} MB before the call", flush=True)
    subprocess.run(["rm", "-rf", out], check=False)


def rss(args) -> None:
    print(f"caller's RSS with output_dir (batch_size {args.rss_batch_size}; target: under 300 MB above, flat in N):")
    for n in args.rss_items:
        subprocess.run([sys.executable, __file__, "--rss-child", str(n), "--rss-batch-size", str(args.rss_batch_size)],
                       check=True)


# ----------------------------------------------------------------------------- resume after a kill
class Counted(nn.Module):
    """The encoder, logging each finished forward's item count to a file (what the workers computed)."""

    def __init__(self, log: str):
        super().__init__()
        self.model, self.log = load_encoder(), log

    def forward(self, tokens):
        out = self.model(tokens)
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{tokens.shape[0]}\n".encode())
        os.close(fd)
        return out


def computed(log: Path) -> int:
    return sum(int(line) for line in log.read_text().split()) if log.exists() else 0


def resume_run(args, out: str, log: str):
    return parallel_predict(Counted(log), make_sequences(args.resume_items), collate_fn=pad,
                            max_tokens=args.max_tokens, length=len, output_dir=out, device_ids=devices())


def on_disk(out: Path) -> int:
    return sum(int(p.name.split("-")[2].split(".")[0]) for p in out.glob("shard-*.safetensors"))


def resume(args) -> None:
    n = args.resume_items
    work = Path(tempfile.mkdtemp(prefix="bench_inference-"))
    out, log = work / "out", work / "computed.log"
    child = subprocess.Popen([sys.executable, __file__, "--resume-child", str(work), "--resume-items", str(n),
                              "--max-tokens", str(args.max_tokens)], start_new_session=True)
    deadline = time.monotonic() + 1800
    while on_disk(out) < n // 2 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the shards are the event
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    kept, first = on_disk(out), computed(log)
    reference = parallel_predict(load_encoder, make_sequences(n), collate_fn=pad, max_tokens=args.max_tokens,
                                 length=len, device_ids=devices())
    preds = resume_run(args, str(out), str(log))
    second = computed(log) - first
    batches = list(token_batches(enumerate(make_sequences(n)), args.max_tokens, len, None))
    largest = sorted((len(b) for b in batches), reverse=True)[:IN_FLIGHT_PER_DEVICE * len(devices())]
    print(f"resume: {n:,} items, killed with {kept:,} on disk; the killed run had computed {first:,}, the rerun "
          f"computed {second:,}: {first + second - n:,} items computed twice (bound: the batches in flight, "
          f"{IN_FLIGHT_PER_DEVICE} per device, here at most {sum(largest):,} items); equal to an uninterrupted "
          f"run: {torch.allclose(preds.stack(), reference, atol=1e-5)}")
    subprocess.run(["rm", "-rf", str(work)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=20_000, help="sequences for the speed rows")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16_384)
    parser.add_argument("--rss-items", type=int, nargs="+", default=[1_000_000, 100_000])
    parser.add_argument("--rss-batch-size", type=int, default=1024)
    parser.add_argument("--resume-items", type=int, default=5_000)
    parser.add_argument("--only", choices=["speed", "rss", "resume"])
    parser.add_argument("--rows", nargs="+", choices=SPEED_ROWS, default=list(SPEED_ROWS), help="speed rows to run")
    parser.add_argument("--rounds", type=int, default=1, help="run the speed rows this many times, interleaved")
    parser.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--resume-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        return rss_child(args.rss_child, args.rss_batch_size)
    if args.resume_child:
        work = Path(args.resume_child)
        resume_run(args, str(work / "out"), str(work / "computed.log"))
        return
    print(f"torch {torch.__version__}, {'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}")
    for name, fn in (("speed", speed), ("rss", rss), ("resume", resume)):
        if args.only in (None, name):
            fn(args)


if __name__ == "__main__":
    main()
