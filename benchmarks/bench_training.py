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
of one epoch; what is timed is the epoch, from its start to its end, with
what the logger gathered in it handed over by then, inside the timed span
(the loggers hand values over every few seconds, and an epoch here is
shorter): TensorBoard's events written (``flush()``), MLflow's and W&B's
records in the pipe to the process of their own that runs their client
(whose CPU is shown apart): the steady state of training. The tracker's run start and end of each
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

``--gan`` times a GAN with its own training step (examples/gan.py's: two
models of ``--hidden`` 64 by default, two Adams, ``ctx.backward``/``ctx.step``
for D then G) against the same GAN hand-written (and in Fabric where
installed), every contender on the same batches (in-memory tensors, one
``index_select`` a batch, in the order NNHandler's sampler draws), after a
check that the hand-written loop and NNHandler give the same losses and
weights bit for bit over 5 steps. Target: NNHandler >= 0.99x.

    python benchmarks/bench_training.py --gan --procs 1 --rounds 7

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
            for cb in callbacks:  # what the logger gathered in the epoch, handed over within the timed span
                sender = getattr(cb, "_sender", None)
                if sender is not None:
                    # MLflow's and W&B's clients run in a process of their own: the training process's work
                    # ends when the records are in the pipe (waiting for that process is not training's work).
                    sender._forwarder.flush(None)
                elif hasattr(cb, "flush"):
                    cb.flush()
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


# --gan: a GAN with its own training step (two models, two optimizers), as examples/gan.py, against the same
# training hand-written. Every contender gets the same batches: rows of in-memory tensors gathered by index.
NOISE = 2


def _gan_models():
    import torch
    from torch import nn

    torch.manual_seed(0)
    width = SIZES[1]
    G = nn.Sequential(nn.Linear(NOISE, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2),
                      nn.Linear(width, 2))
    D = nn.Sequential(nn.Linear(2, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2),
                      nn.Linear(width, 1))
    return G, D


def _gan_optimizers(G, D):
    import torch

    return {"G": torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            "D": torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))}


def _gan_data(steps: int, world: int):
    """``(real points on a ring of radius 2, noise)``: the noise is data too, drawn once."""
    import math

    import torch

    n = steps * BATCH * world
    g = torch.Generator().manual_seed(1)
    angle = 2 * math.pi * torch.rand(n, generator=g)
    real = 2 * torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(n, 2, generator=g)
    return real, torch.randn(n, NOISE, generator=g)


def _gan_losses(G, D, real, z):
    """PyTorch's DCGAN recipe: ``(fake, loss_d)``; the generator's loss is taken after D's step."""
    import torch
    from torch.nn.functional import binary_cross_entropy_with_logits as bce

    ones = torch.ones(real.size(0), 1, device=real.device)
    fake = G(z)
    return fake, ones, bce(D(real), ones) + bce(D(fake.detach()), torch.zeros_like(ones))


def gan_step(ctx, batch):
    """The own training step of examples/gan.py."""
    from torch.nn.functional import binary_cross_entropy_with_logits as bce

    real, z = batch
    G, D = ctx.models["G"], ctx.models["D"]
    with ctx.autocast():
        fake, ones, loss_d = _gan_losses(G, D, real, z)
    ctx.backward(loss_d)
    ctx.step("D")
    with ctx.autocast():
        loss_g = bce(D(fake), ones)
    ctx.backward(loss_g)
    ctx.step("G")
    return {"loss": loss_d + loss_g, "d": loss_d, "g": loss_g}


def _shuffled_batches(n: int, epoch: int):
    """The batches' indices as NNHandler's loader draws them: ``RandomSampler``'s order in one process (a seed
    from the global generator, after the ``DataLoader`` iterator's own draw), ``DistributedSampler``'s shard
    (seed 0 + epoch) under DDP; one ``randperm``, split into batches."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        g = torch.Generator().manual_seed(epoch)
        order = torch.randperm(n, generator=g)[dist.get_rank()::dist.get_world_size()]
    else:
        torch.empty((), dtype=torch.int64).random_()  # the DataLoader iterator's base seed
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order.split(BATCH)


def _gan_hand_written(steps: int, record: list | None = None):
    """The GAN step as a careful user writes it: D's loss, backward, step; G's through D; losses summed on the
    device; each batch one ``index_select`` of the in-memory tensors; DDP on each model when launched."""
    import torch
    import torch.distributed as dist
    from torch.nn.functional import binary_cross_entropy_with_logits as bce
    from torch.nn.parallel import DistributedDataParallel

    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    G, D = _gan_models()
    if distributed:
        G, D = DistributedDataParallel(G), DistributedDataParallel(D)
    opts = _gan_optimizers(G, D)
    opt_g, opt_d = opts["G"], opts["D"]
    real_all, z_all = _gan_data(steps, world)

    def epoch(e):
        G.train()
        D.train()
        total, total_d, total_g = torch.zeros(()), torch.zeros(()), torch.zeros(())
        for index in _shuffled_batches(len(real_all), e):
            real, z = real_all.index_select(0, index), z_all.index_select(0, index)
            opt_d.zero_grad(set_to_none=True)  # the generator's backward reached D too
            fake, ones, loss_d = _gan_losses(G, D, real, z)
            loss_d.backward()
            opt_d.step()
            opt_d.zero_grad(set_to_none=True)
            loss_g = bce(D(fake), ones)
            loss_g.backward()
            opt_g.step()
            opt_g.zero_grad(set_to_none=True)
            loss = loss_d + loss_g
            total += loss.detach()
            total_d += loss_d.detach()
            total_g += loss_g.detach()
            if record is not None:
                record.append((loss_d.item(), loss_g.item()))
        return None if record is None else (G, D)

    return epoch


def _gan_nn_handler(steps: int, record: list | None = None):

    from nn_handler import Callback, NNHandler

    G, D = _gan_models()
    callbacks = []
    if record is not None:
        class Record(Callback):
            def on_batch_end(self, handler, step, loss, outputs):
                record.append((outputs["d"].item(), outputs["g"].item()))
        callbacks.append(Record())
    handler = NNHandler({"G": G, "D": D}, _gan_optimizers(G, D), training_step=gan_step, device="cpu",
                        callbacks=callbacks)
    handler.set_train_loader(_gan_data(steps, handler.world_size), batch_size=BATCH, shuffle=True)

    def epoch(e):
        handler.train(max_steps=(e + 1) * steps, progress=False)  # one epoch: `steps` training steps
        return None if record is None else (G, D)

    return epoch


def _gan_fabric(steps: int):
    """Fabric's GAN example's step, on the same gathered batches (Fabric moves them to its device)."""
    import torch.distributed as dist
    from torch.nn.functional import binary_cross_entropy_with_logits as bce

    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric

    world = dist.get_world_size() if dist.is_initialized() else 1
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()
    G, D = _gan_models()
    opts = _gan_optimizers(G, D)
    G, opt_g = fabric.setup(G, opts["G"])
    D, opt_d = fabric.setup(D, opts["D"])
    real_all, z_all = _gan_data(steps, world)

    def epoch(e):
        for index in _shuffled_batches(len(real_all), e):
            real, z = fabric.to_device((real_all.index_select(0, index), z_all.index_select(0, index)))
            opt_d.zero_grad()
            fake, ones, loss_d = _gan_losses(G, D, real, z)
            fabric.backward(loss_d)
            opt_d.step()
            opt_d.zero_grad()
            loss_g = bce(D(fake), ones)
            fabric.backward(loss_g)
            opt_g.step()
            opt_g.zero_grad()

    return epoch


def check_gan_contenders_agree(steps: int = 5) -> None:
    """The hand-written GAN loop and NNHandler's own step give the same losses step by step, and the same
    weights after ``steps`` steps (one process), so the benchmark times the same work."""
    import torch

    seen, weights = {}, {}
    for name, build in (("hand-written", _gan_hand_written), ("NNHandler", _gan_nn_handler)):
        torch.manual_seed(1234)  # the global generator the shuffle draws from, alike for both
        seen[name] = []
        G, D = build(steps, record=seen[name])(0)
        weights[name] = torch.cat([p.detach().flatten() for m in (G, D) for p in m.parameters()])
    if seen["hand-written"] != seen["NNHandler"] or not torch.equal(weights["hand-written"], weights["NNHandler"]):
        raise SystemExit(f"the GAN contenders do not compute the same: (loss_d, loss_g) per step "
                         f"{seen['hand-written']} against NNHandler's {seen['NNHandler']}, weights off by "
                         f"{(weights['hand-written'] - weights['NNHandler']).abs().max().item():.3g}")
    print(f"GAN check: hand-written and NNHandler agree bit for bit over {steps} steps "
          f"(losses and weights; last loss_d, loss_g = {seen['NNHandler'][-1][0]:.6f}, {seen['NNHandler'][-1][1]:.6f})")


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
# --gan: the GAN's own step against the same GAN hand-written (and in Fabric, where installed).
GAN = {"hand-written GAN": (_gan_hand_written, ()),
       "NNHandler GAN": (_gan_nn_handler, ()),
       "Fabric GAN": (_gan_fabric, ("lightning", "lightning_fabric"))}
CONTENDERS.update(GAN)


def _baseline(name: str) -> str:
    """Each contender is compared with the hand-written loop of its own strategy; a logger with no logger."""
    if name in LOGGED:
        return "NNHandler, no logger"
    if name in GAN:
        return "hand-written GAN"
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
    parser.add_argument("--hidden", type=int, default=None,
                        help="width of the two hidden layers (64: a small, overhead-bound model; the default: "
                             "1024, and 64 with --gan)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "both"), default="ddp",
                        help="DDP contenders, the FSDP pair (NNHandler and a hand-written fully_shard loop), or both")
    parser.add_argument("--loggers", action="store_true",
                        help="NNHandler with each logger attached (TensorBoard, CSV, MLflow, W&B offline) against none")
    parser.add_argument("--gan", action="store_true",
                        help="a GAN with its own training step (two models, two optimizers) against the same GAN "
                             "hand-written (and in Fabric), after a check that they compute the same")
    args = parser.parse_args()
    if args.hidden is None:
        args.hidden = 64 if args.gan else 1024
    global SIZES
    SIZES = (SIZES[0], args.hidden, args.hidden, SIZES[-1])
    wanted = [n for n in CONTENDERS if n not in LOGGED and n not in GAN
              and ((n in FSDP) == (args.strategy == "fsdp") or args.strategy == "both")]
    if args.loggers:
        wanted = list(LOGGED)
    if args.gan:
        wanted = list(GAN)
    names = [n for n in wanted if not CONTENDERS[n][1] or _installed(*CONTENDERS[n][1])]
    skipped = [n for n in wanted if n not in names]
    if args.gan:
        print(f"GAN: G {NOISE}-{args.hidden}-{args.hidden}-2, D 2-{args.hidden}-{args.hidden}-1, two Adams, own "
              f"training step; batch {BATCH}/process, {args.steps} steps/epoch, {args.rounds} timed rounds, gloo, "
              f"1 thread/process; load {_load()}")
        import torch
        torch.set_num_threads(1)
        check_gan_contenders_agree()
    else:
        print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}/process, {args.steps} steps/epoch, "
              f"{args.rounds} timed rounds, gloo, 1 thread/process; load {_load()}")
    if skipped:
        print(f"not installed (the bench extra), skipped: {', '.join(skipped)}")
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
