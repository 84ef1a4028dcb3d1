"""Per-step cost of the uneven-data check (ranks agree on "one more batch?") on an IterableDataset.

NNHandler on 2 gloo processes trains the small overhead-bound MLP of
bench_training.py (256-64-64-10, batch 64) from an IterableDataset that
yields each rank its own shard: with the check as shipped (one all-reduce per
window of batches, overlapping the previous window's training), with one
overlapped all-reduce per step, with one blocking all-reduce per step, and
with no check. Interleaved round by round in the same processes; the
figures are the median of the per-round ratios and, less sensitive to
other load on a shared machine, the ratio of the best rounds.

    python benchmarks/bench_uneven.py [--rounds 7] [--steps 200] [--hidden 64]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

BATCH = 64


def _body(rank: int, steps: int, rounds: int, hidden: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset

    import nn_handler._training.uneven as U
    from nn_handler import NNHandler

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    X, y = torch.randn(steps * BATCH, 256, generator=g), torch.randint(0, 10, (steps * BATCH,), generator=g)

    class Shard(IterableDataset):
        def __iter__(self):
            return iter(zip(X, y))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    handler = NNHandler(model, torch.optim.SGD, nn.CrossEntropyLoss(), optimizer_kwargs={"lr": 0.01}, device="cpu")
    handler.train_loader = DataLoader(Shard(), batch_size=BATCH)
    shipped, mode = U.agreed, U.check_mode

    def synchronous(batches, first, epoch):
        # The same agreement, waited for before each step instead of overlapped with it.
        side = U.side_group()
        counts = torch.zeros(side.size, dtype=torch.int64)
        end = object()
        for batch in itertools.chain(batches, [end]):
            counts.zero_()
            counts[side.rank] = batch is not end
            dist.all_reduce(counts, group=side.group)
            if not all(counts.tolist()):
                return
            yield batch

    variants = {
        f"window {U.WINDOW} (shipped)": lambda: setattr(U, "agreed", shipped),
        "every step, overlapped": lambda: setattr(U, "agreed", lambda b, f, e: shipped(b, f, e, window=1)),
        "every step, blocking": lambda: setattr(U, "agreed", synchronous),
        "no check": lambda: setattr(U, "check_mode", lambda loader, n: None),
    }
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in names}
    done = 0
    for r in range(rounds + 1):  # round 0: warm-up
        for name in names[r % len(names):] + names[:r % len(names)]:
            U.agreed, U.check_mode = shipped, mode
            variants[name]()
            dist.barrier()
            start = time.perf_counter()
            done += steps
            handler.train(max_steps=done, progress=False)
            if r:
                rates[name].append(steps / (time.perf_counter() - start))
    U.agreed, U.check_mode = shipped, mode
    return rates


def main() -> None:
    from nn_handler.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    results = run_distributed(_body, nprocs=2, args=(args.steps, args.rounds, args.hidden), timeout=1800)
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            raise SystemExit(f"rank {rank} failed: {r!r}\n{getattr(r, 'remote_traceback', '')}")
    rates = results[0]
    base = rates["no check"]
    print(f"MLP 256-{args.hidden}-{args.hidden}-10, batch {BATCH}/process, IterableDataset shards, 2 gloo processes, "
          f"{args.steps} steps x {args.rounds} rounds")
    for name, values in rates.items():
        ratio = statistics.median(a / b for a, b in zip(values, base))
        print(f"  {name:<24} {statistics.median(values):7.1f} steps/s  {ratio:.3f}x no check (median of per-round "
              f"ratios), best round {max(values) / max(base):.3f}x; rounds: {', '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
