"""Training overhead of NNHandler against a hand-written loop (and Lightning Fabric / Accelerate / Ignite where installed).

An MLP 256-1024-1024-10 on synthetic data, batch 64 per process, 200 steps
per timed epoch, on 1 and 2 processes (gloo, one thread each). Every
contender runs in the same processes, interleaved round by round, so machine
noise hits them alike; the figure is the median steps/s over the rounds,
each round timing one 200-step epoch after a warm-up epoch.

    python benchmarks/bench_training.py [--rounds 3] [--steps 200] [--procs 1 2] [--hidden 1024] \
        [--strategy ddp|fsdp|both]

``--hidden 64`` gives a small model whose step is bound by the trainer's
per-step overhead rather than by the matrix products: the figure to watch
when the loop changes.

Targets: NNHandler >= 0.97x the hand-written loop's steps/s; on the
overhead-bound ``--hidden 64`` model >= 0.93x on 1 process, >= 0.97x on 2.

``--loggers`` times NNHandler with each logger attached (``TensorBoardLogger``,
``CSVLogger``, ``MLflowLogger`` in a ``sqlite:///`` store, ``WandbLogger``
offline; each with its defaults, ``log_every_n_steps=50``) against none, in the
same process, interleaved round by round. Each round is one ``train()`` call
of one epoch; what is timed is the epoch, from its start to its end: the
steady state of training. The tracker's run start and end of each
``train()`` call (``wandb.init``, MLflow's run opened on its sender thread,
which the clock waits for, and the final sends) are reported apart, as
seconds. Figures: the median over rounds of each round's steps/s ratio to no
logger (min-max beside it), in wall time, and in CPU time of the training
process (all its threads: MLflow's sender, TensorBoard's writer), which shows
a logger's cost despite other load on the machine; W&B's service process's CPU
per round is shown apart, and so is each logger's own share of its epoch (the
time in its per-step hook, the CPU of the process's other threads), which load
inflates alike on both sides. Target: within 1 % (ratios >= 0.99). A steady
state needs long epochs:

    python benchmarks/bench_training.py --hidden 64 --procs 1 --loggers --steps 2000 --rounds 7

``--strategy fsdp`` times ``NNHandler(strategy="fsdp")`` against a
hand-written FSDP2 loop (``fully_shard`` on every layer, then the root, as
NNHandler's default policy does); ``both`` runs the DDP and the FSDP pairs in
the same processes, so the two overheads (each NNHandler against its own
hand-written loop) compare under the same noise. Target: FSDP's overhead no
larger than DDP's.

Fabric, Accelerate and Ignite are not project requirements (they are in the
``bench`` extra); to include them without touching the environment, install
them into a scratch directory:

    pip install --target /tmp/benchdeps --no-deps lightning-fabric lightning-utilities \
        accelerate pyyaml huggingface_hub safetensors pytorch-ignite
    PYTHONPATH=/tmp/benchdeps python benchmarks/bench_training.py

Every contender uses its library's defaults (NNHandler's DDP has
gradient_as_bucket_view=True, torch's and the hand-written loop's False).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import statistics
import time

BATCH = 64
SIZES = (256, 1024, 1024, 10)


def _model():
    from torch import nn

    # SIZES is set from --hidden in main() and again in each rank by _body.
    layers = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _data(steps: int, world: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    n = steps * BATCH * world
    return TensorDataset(torch.randn(n, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (n,), generator=g))


def _hand_written(steps: int):
    """What a careful user writes: DDP when launched, DistributedSampler, loss summed on the device."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    model = _model()
    if distributed:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    data = _data(steps, world)
    sampler = DistributedSampler(data) if distributed else None
    loader = DataLoader(data, batch_size=BATCH, shuffle=sampler is None, sampler=sampler)

    def epoch(e):
        if sampler is not None:
            sampler.set_epoch(e)
        model.train()
        total = torch.zeros(())
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach()
        return total.item()

    return epoch


def _hand_written_fsdp(steps: int):
    """The hand-written loop with FSDP2 when launched: ``fully_shard`` on each layer with parameters, then the root."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    # One process has no group: the plain model, as NNHandler(strategy="fsdp") trains it there.
    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    model = _model()
    if distributed:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    data = _data(steps, world)
    sampler = DistributedSampler(data) if distributed else None
    loader = DataLoader(data, batch_size=BATCH, shuffle=sampler is None, sampler=sampler)

    def epoch(e):
        if sampler is not None:
            sampler.set_epoch(e)
        model.train()
        total = torch.zeros(())
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach()
        return total.item()

    return epoch


def _nn_handler(steps: int, strategy: str = "auto"):
    import torch
    from torch import nn

    from nn_handler import NNHandler

    torch.manual_seed(0)
    handler = NNHandler(_model(), torch.optim.SGD, nn.CrossEntropyLoss(), optimizer_kwargs={"lr": 0.01}, device="cpu",
                        strategy=strategy)
    handler.set_train_loader(_data(steps, handler.world_size), batch_size=BATCH, shuffle=True)

    def epoch(e):
        handler.train(max_steps=(e + 1) * steps, progress=False)  # one epoch: `steps` optimizer steps

    return epoch


def _nn_handler_logged(steps: int, logger: str | None = None):
    """NNHandler with one logger attached (None: none); see the module's docstring for what is timed.

    Each call trains one epoch and returns ``{"seconds", "cpu", "outside", "tracker_cpu"}``: the epoch's wall
    and process CPU seconds, the rest of the ``train()`` call (the tracker's run start and end) in seconds, and
    the CPU seconds of the process's children (W&B's service) during the epoch.
    """
    import tempfile

    import torch
    from torch import nn

    from nn_handler import Callback, CSVLogger, NNHandler

    where = tempfile.mkdtemp(prefix="bench-logger-")
    if logger == "TensorBoard":
        from nn_handler import TensorBoardLogger
        callbacks = [TensorBoardLogger(where)]
    elif logger == "CSV":
        callbacks = [CSVLogger(f"{where}/log.csv")]
    elif logger == "MLflow":
        from nn_handler import MLflowLogger
        callbacks = [MLflowLogger(f"sqlite:///{where}/mlflow.db", experiment_name="bench", fallback_dir=where)]
    elif logger == "W&B":
        from nn_handler import WandbLogger
        callbacks = [WandbLogger(project="bench", dir=where, mode="offline")]
    else:
        callbacks = []
    children_cpu, threads_cpu = _children_cpu(), _other_threads_cpu()
    in_hooks = [0.0]  # seconds inside the logger's per-step hook on the training thread
    for cb in callbacks:
        cb.on_batch_end = _timed(cb.on_batch_end, in_hooks)

    class EpochClock(Callback):
        def on_epoch_begin(self, handler, epoch):
            sender = getattr(callbacks[0], "_sender", None) if callbacks else None
            if sender is not None:
                sender.flush(None)  # MLflow's run is opened on its thread: the run's start, not the steps'
            self.children, self.threads, in_hooks[0] = children_cpu(), threads_cpu(), 0.0
            self.cpu = time.process_time()
            self.start = time.perf_counter()

        def on_epoch_end(self, handler, epoch, logs):
            self.seconds = time.perf_counter() - self.start
            self.cpu = time.process_time() - self.cpu
            self.children = children_cpu() - self.children
            self.threads = threads_cpu() - self.threads
            self.in_hooks = in_hooks[0]

    clock = EpochClock()  # first: its epoch begins after the logger's train begins, and ends before its epoch end
    torch.manual_seed(0)
    handler = NNHandler(_model(), torch.optim.SGD, nn.CrossEntropyLoss(), optimizer_kwargs={"lr": 0.01}, device="cpu",
                        callbacks=[clock, *callbacks])
    handler.set_train_loader(_data(steps, handler.world_size), batch_size=BATCH, shuffle=True)

    def epoch(e):
        start = time.perf_counter()
        handler.train(max_steps=(e + 1) * steps, progress=False)
        whole = time.perf_counter() - start
        return {"seconds": clock.seconds, "cpu": clock.cpu, "outside": whole - clock.seconds,
                "tracker_cpu": clock.children, "threads_cpu": clock.threads, "in_hooks": clock.in_hooks}

    return epoch


def _timed(hook, total: list[float]):
    """``hook`` (a bound ``on_batch_end``), adding the seconds spent in it to ``total[0]``."""
    def on_batch_end(handler, step, loss, outputs=None):
        start = time.perf_counter()
        hook(handler, step, loss, outputs)
        total[0] += time.perf_counter() - start

    return on_batch_end


def _other_threads_cpu():
    """A function giving the CPU seconds so far of this process's threads but the calling one (a tracker's
    sender, TensorBoard's writer); 0 without psutil."""
    import threading

    try:
        import psutil
    except ImportError:
        return lambda: 0.0
    me, mine = psutil.Process(), threading.get_native_id()
    return lambda: sum(t.user_time + t.system_time for t in me.threads() if t.id != mine)


def _children_cpu():
    """A function giving the CPU seconds of this process's children so far (W&B's service); 0 without psutil."""
    try:
        import psutil
    except ImportError:
        return lambda: 0.0
    me = psutil.Process()

    def seconds() -> float:
        total = 0.0
        for child in me.children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    return seconds


def _fabric(steps: int):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric

    world = dist.get_world_size() if dist.is_initialized() else 1
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()  # the processes and the group exist already: Fabric only attaches to them
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(_data(steps, world), batch_size=BATCH, shuffle=True))
    loss_fn = nn.CrossEntropyLoss()

    def epoch(e):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()

    return epoch


def _accelerate(steps: int):
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch import nn
    from torch.utils.data import DataLoader

    world = dist.get_world_size() if dist.is_initialized() else 1
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(_data(steps, world), batch_size=BATCH, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    loss_fn = nn.CrossEntropyLoss()

    def epoch(e):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()

    return epoch


def _ignite(steps: int):
    """Ignite's own supervised trainer, with its ``auto_model`` / ``auto_dataloader`` for the process group."""
    import torch
    from ignite import distributed as idist
    from ignite.engine import create_supervised_trainer
    from torch import nn

    torch.manual_seed(0)
    model = idist.auto_model(_model())  # DDP when a group exists, as its docs recommend
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = idist.auto_dataloader(_data(steps, idist.get_world_size()), batch_size=BATCH * idist.get_world_size(),
                                   shuffle=True)  # auto_dataloader divides the batch size by the world size
    trainer = create_supervised_trainer(model, opt, nn.CrossEntropyLoss())

    def epoch(e):
        trainer.run(loader, max_epochs=e + 1)  # one more epoch of `steps` iterations

    return epoch


def _installed(*modules: str) -> bool:
    return any(importlib.util.find_spec(m) is not None for m in modules)


CONTENDERS = {
    "hand-written": (_hand_written, ()),
    "NNHandler": (_nn_handler, ()),
    "Lightning Fabric": (_fabric, ("lightning", "lightning_fabric")),
    "Accelerate": (_accelerate, ("accelerate",)),
    "Ignite": (_ignite, ("ignite",)),
    "hand-written FSDP": (_hand_written_fsdp, ()),
    "NNHandler FSDP": (functools.partial(_nn_handler, strategy="fsdp"), ()),
}
FSDP = ("hand-written FSDP", "NNHandler FSDP")
# --loggers: NNHandler with each logger against none, each timed within its epochs.
LOGGED = {"NNHandler, no logger": (functools.partial(_nn_handler_logged, logger=None), ()),
          "+ TensorBoardLogger": (functools.partial(_nn_handler_logged, logger="TensorBoard"), ("tensorboard",)),
          "+ CSVLogger": (functools.partial(_nn_handler_logged, logger="CSV"), ()),
          "+ MLflowLogger": (functools.partial(_nn_handler_logged, logger="MLflow"), ("mlflow",)),
          "+ WandbLogger": (functools.partial(_nn_handler_logged, logger="W&B"), ("wandb",))}
CONTENDERS.update(LOGGED)


def _baseline(name: str) -> str:
    """Each contender is compared with the hand-written loop of its own strategy; a logger with no logger."""
    if name in LOGGED:
        return "NNHandler, no logger"
    return "hand-written FSDP" if name in FSDP else "hand-written"


def _body(rank: int, names: list[str], steps: int, rounds: int, hidden: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    global SIZES
    SIZES = (SIZES[0], hidden, hidden, SIZES[-1])

    torch.set_num_threads(1)
    epochs = {name: CONTENDERS[name][0](steps) for name in names}
    for name in names:  # warm-up epoch: allocator, DDP buckets, first-call costs
        epochs[name](0)
    rates: dict[str, list[float]] = {name: [] for name in names}
    measures: dict[str, list[dict]] = {name: [] for name in names}  # a contender that times itself: its figures
    for r in range(rounds):
        # Rotate who goes first, so a load change in the middle of a round
        # does not always hit the same contender.
        for name in names[r % len(names):] + names[:r % len(names)]:
            if dist.is_initialized():
                dist.barrier()  # start every contender's epoch together on all ranks
            start = time.perf_counter()
            measured = epochs[name](r + 1)
            seconds = time.perf_counter() - start
            if isinstance(measured, dict):
                measures[name].append(measured)
                seconds = measured["seconds"]
            rates[name].append(steps / seconds)
    # Free the DDP models (they sit in reference cycles) before the process
    # group is destroyed: a gloo group torn down under a live DDP model can
    # abort the process at exit.
    epochs.clear()
    gc.collect()
    return {"rates": rates, "measures": measures}


def main() -> None:
    from nn_handler.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=1024,
                        help="width of the two hidden layers (64: a small, overhead-bound model)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "both"), default="ddp",
                        help="DDP contenders, the FSDP pair (NNHandler and a hand-written fully_shard loop), or both")
    parser.add_argument("--loggers", action="store_true",
                        help="NNHandler with each logger attached (TensorBoard, CSV, MLflow, W&B offline) against none")
    args = parser.parse_args()
    global SIZES
    SIZES = (SIZES[0], args.hidden, args.hidden, SIZES[-1])
    wanted = [n for n in CONTENDERS if n not in LOGGED
              and ((n in FSDP) == (args.strategy == "fsdp") or args.strategy == "both")]
    if args.loggers:
        wanted = list(LOGGED)
    names = [n for n in wanted if not CONTENDERS[n][1] or _installed(*CONTENDERS[n][1])]
    skipped = [n for n in wanted if n not in names]
    print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}/process, {args.steps} steps/epoch, "
          f"{args.rounds} timed rounds, gloo, 1 thread/process; load {_load()}")
    if skipped:
        print(f"not installed, skipped: {', '.join(skipped)}")
    for nprocs in args.procs:
        results = run_distributed(_body, nprocs=nprocs, args=(names, args.steps, args.rounds, args.hidden), timeout=1800)
        for rank, r in enumerate(results):
            if isinstance(r, BaseException):
                raise SystemExit(f"rank {rank} failed: {r!r}\n{getattr(r, 'remote_traceback', '')}")
        # A step takes as long as the slowest rank: take rank 0's view (all ranks move in lockstep).
        rates, measures = results[0]["rates"], results[0]["measures"]
        medians = {name: statistics.median(rates[name]) for name in names}
        # Paired: each round's rate against the hand-written loop's in the same round.
        ratios = {name: statistics.median(a / b for a, b in zip(rates[name], rates[_baseline(name)])) for name in names}
        print(f"\n{nprocs} process{'es' if nprocs > 1 else ''}:")
        for name in names:
            rounds = ", ".join(f"{v:.1f}" for v in rates[name])
            best = max(rates[name]) / max(rates[_baseline(name)])  # least disturbed by other load
            print(f"  {name:<17} {medians[name]:7.1f} steps/s  {ratios[name]:.3f}x {_baseline(name)} (median of "
                  f"per-round ratios), best round {best:.3f}x; rounds: {rounds}")
        report = {"nprocs": nprocs, "median_steps_per_s": medians, "median_ratio": ratios,
                  "rounds": {n: rates[n] for n in names}, "load": os.getloadavg()}
        if args.loggers:
            report["loggers"] = _logger_report(names, rates, measures)
        print("JSON " + json.dumps(report))


def _logger_report(names: list[str], rates: dict[str, list[float]], measures: dict[str, list[dict]]) -> dict:
    """Print and return each logger's per-round ratios to no logger (wall and CPU), its run start and end."""
    base = "NNHandler, no logger"
    cpu_rates = {n: [1.0 / m["cpu"] for m in measures[n]] for n in names}  # steps per CPU second, relative
    out = {}
    print(f"  steady state against no logger: median of per-round ratios [min-max]; load {_load()}")
    for name in names:
        wall = [a / b for a, b in zip(rates[name], rates[base])]
        cpu = [a / b for a, b in zip(cpu_rates[name], cpu_rates[base])]
        outside = statistics.median(m["outside"] for m in measures[name])
        tracker = statistics.median(m["tracker_cpu"] for m in measures[name])
        # The logger's own share of its epoch, which other load on the machine inflates alike on both sides:
        # its per-step hook on the training thread, and the CPU of the process's other threads (its sender).
        hook = statistics.median(m["in_hooks"] / m["seconds"] for m in measures[name])
        threads = statistics.median(m["threads_cpu"] / m["seconds"] for m in measures[name])
        out[name] = {"wall_ratio": statistics.median(wall), "wall_rounds": wall, "cpu_ratio": statistics.median(cpu),
                     "cpu_rounds": cpu, "start_end_s": outside, "tracker_process_cpu_s": tracker,
                     "hook_share": hook, "threads_share": threads}
        # W&B's service, once started, is a child of this process in every contender's epoch: its CPU is shown
        # for each, and W&B's own is the figure above the others'.
        print(f"  {name:<21} wall {statistics.median(wall):.3f}x [{min(wall):.3f}-{max(wall):.3f}]  "
              f"CPU {statistics.median(cpu):.3f}x [{min(cpu):.3f}-{max(cpu):.3f}]  "
              f"in on_batch_end {hook:.2%}, other threads {threads:.2%} of the epoch  "
              f"start+end {outside:.2f} s/train()  child processes' CPU {tracker:.3f} s/epoch")
    return out


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg()) + " (1/5/15 min)"

if __name__ == "__main__":
    main()
