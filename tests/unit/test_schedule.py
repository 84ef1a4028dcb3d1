"""Per-step LR schedules, optimizer-step hooks, EMA and seed_everything, against hand-written loops (issue 38)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, TensorDataset

from nn_handler import Callback, ConfigurationError, NNHandler
from scripts.handler_case import LR, MOMENTUM, make_data, make_model

BATCH, N, EPOCHS, DECAY = 8, 40, 3, 0.8  # 5 batches an epoch


def EMA(decay):  # imported on use: each test fails on its own where the callback is missing
    from nn_handler.callbacks import EMA

    return EMA(decay=decay)


def warmup(opt):
    return lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** max(0, s - 4))


def steps_per_epoch(accum: int) -> int:
    return -(-(N // BATCH) // accum)


def one_cycle(accum: int):
    return lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=EPOCHS * steps_per_epoch(accum))


class StepLog(Callback):
    """Records, per optimizer step, the step number, the LR it used and the global step in each hook."""

    def __init__(self):
        self.before, self.after, self.lrs, self.batches = [], [], [], 0

    def on_before_optimizer_step(self, handler, step):
        self.before.append((step, handler.global_step))

    def on_optimizer_step(self, handler, step):
        self.after.append((step, handler.global_step))
        self.lrs.append(handler.optimizer.param_groups[0]["lr"])

    def on_batch_end(self, handler, step, loss):
        self.batches += 1


def reference(make_scheduler, accum: int, epochs: int = EPOCHS):
    """The hand-written loop: per-step scheduler, EMA by its formula (the first step copies the weights)."""
    X, y = make_data(N)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sched = make_scheduler(opt)
    mse, lrs, ema = nn.MSELoss(), [], None
    batches = [(X[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)]
    for _ in range(epochs):
        for i, (xb, yb) in enumerate(batches):
            (mse(model(xb), yb) / accum).backward()
            if (i + 1) % accum == 0 or i + 1 == len(batches):
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                opt.zero_grad()
                weights = [p.detach().clone() for p in model.parameters()]
                ema = weights if ema is None else [e + (1 - DECAY) * (w - e) for e, w in zip(ema, weights)]
                sched.step()
    return model, lrs, ema


def handler_for(scheduler, accum, callbacks, loss=None, **kwargs):
    X, y = make_data(N)
    handler = NNHandler(make_model(), torch.optim.SGD, loss or nn.MSELoss(),
                        optimizer_kwargs={"lr": LR, "momentum": MOMENTUM}, scheduler=scheduler,
                        grad_accum_steps=accum, callbacks=callbacks, device="cpu", **kwargs)
    handler.set_train_loader(DataLoader(TensorDataset(X, y), batch_size=BATCH))  # in order, as the reference
    return handler


def close(a, b, atol=1e-7):
    return all(torch.allclose(x, y, rtol=0, atol=atol) for x, y in zip(a, b))


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("kind", ["warmup_step", "one_cycle_default"])
def test_per_step_schedule_and_ema_match_a_hand_written_loop(kind, accum):
    make = warmup if kind == "warmup_step" else one_cycle(accum)
    ref_model, ref_lrs, ref_ema = reference(make, accum)
    log, ema = StepLog(), EMA(decay=DECAY)
    handler = handler_for(None, accum, [log, ema], **({"scheduler_interval": "step"} if kind == "warmup_step" else {}))
    handler.set_scheduler(make(handler.optimizer))
    handler.train(EPOCHS, progress=False)
    assert handler.global_step == EPOCHS * steps_per_epoch(accum) == len(ref_lrs)
    assert log.lrs == pytest.approx(ref_lrs, abs=1e-12)
    assert close(list(handler.module.parameters()), list(ref_model.parameters()))
    assert close(list(ema.module.module.parameters()), ref_ema)
    if kind == "one_cycle_default":
        assert handler.scheduler_interval is None and max(log.lrs) == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize("accum", [1, 2, 3, 7])  # 13 batches: 2 and 3 leave a short last group, 7 one of 6
def test_steps_per_epoch_counts_the_optimizer_steps_an_epoch_takes_and_sizes_a_warm_up(accum):
    X, y = make_data(100)
    log = StepLog()
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": LR},
                        scheduler_interval="step", grad_accum_steps=accum, callbacks=[log], device="cpu")
    handler.set_train_loader((X, y), batch_size=8)
    total = 2 * handler.steps_per_epoch
    warm = max(1, total // 4)  # a linear warm-up, then a linear decay that would reach 0 one step after the last
    handler.set_scheduler(lr_scheduler.LambdaLR(
        handler.optimizer, lambda s: (s + 1) / warm if s < warm else (total - s) / (total - warm)))
    handler.train(1, progress=False)
    assert handler.steps_per_epoch == len(log.after) == -(-13 // accum)
    handler.train(2, progress=False)
    assert handler.global_step == total
    assert log.lrs[warm - 1] == pytest.approx(LR)
    assert log.lrs[-1] == pytest.approx(LR / (total - warm))  # the schedule's last step is the run's last


def test_steps_per_epoch_needs_a_sized_training_loader():
    handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": LR})
    with pytest.raises(ConfigurationError, match=r"call set_train_loader\(\) first"):
        handler.steps_per_epoch

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(*make_data(16)))

    handler.set_train_loader(DataLoader(Stream(), batch_size=4))
    with pytest.raises(ConfigurationError, match=r"has no length .*train\(max_steps=N\)"):
        handler.steps_per_epoch


def test_one_cycle_leaves_its_warm_up_without_an_interval_given():
    # The report: per epoch, OneCycleLR never left its warm-up (0.0004 -> 0.000555 over 12 epochs).
    handler = handler_for(lr_scheduler.OneCycleLR, 1, [], scheduler_kwargs={"max_lr": 1e-2, "total_steps": 5 * 4})
    handler.train(4, progress=False)
    assert handler.scheduler.last_epoch == 20  # stepped per optimizer step (per epoch: 4)
    assert handler.history["lr"][2] == pytest.approx(1e-2 * 0.75, rel=0.1)  # epoch 3 starts past the peak


def test_epoch_interval_keeps_stepping_per_epoch():
    handler = handler_for(lr_scheduler.StepLR, 1, [], scheduler_kwargs={"step_size": 1, "gamma": 0.5})
    handler.train(3, progress=False)
    assert handler.history["lr"] == pytest.approx([LR, LR / 2, LR / 4])


def test_step_interval_is_refused_for_plateau_and_bad_values():
    with pytest.raises(ConfigurationError, match="scheduler_interval='step' cannot drive ReduceLROnPlateau"):
        handler_for(lr_scheduler.ReduceLROnPlateau, 1, [], scheduler_interval="step")
    with pytest.raises(ConfigurationError, match="scheduler_interval must be one of 'epoch', 'step' or None"):
        handler_for(None, 1, [], scheduler_interval="batch")
    plateau = handler_for(None, 1, [], scheduler_interval="step")
    with pytest.raises(ConfigurationError, match="ReduceLROnPlateau"):
        plateau.set_scheduler(lr_scheduler.ReduceLROnPlateau(plateau.optimizer))


def test_optimizer_step_hooks_run_once_per_step_with_clipped_gradients():
    norms = []

    class Norms(StepLog):
        def on_before_optimizer_step(self, handler, step):
            super().on_before_optimizer_step(handler, step)
            norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in handler.module.parameters()])))

    log = Norms()
    handler = handler_for(None, 2, [log], clip_grad_norm=1e-3)
    handler.train(2, progress=False)
    assert log.batches == 10  # on_batch_end: per micro-batch
    assert log.before == [(n, n - 1) for n in range(1, 7)]  # 3 optimizer steps an epoch
    assert log.after == [(n, n) for n in range(1, 7)]
    assert all(float(n) <= 1e-3 * (1 + 1e-5) for n in norms)


def _first_grad_norm(amp):
    seen = []

    class First(Callback):
        def on_before_optimizer_step(self, handler, step):
            seen.append(float(torch.stack([p.grad.norm() for p in handler.module.parameters()]).norm()))

    # Small enough that fp16 does not overflow at the scaler's first scale (65536).
    handler_for(None, 1, [First()], loss=lambda out, t: nn.functional.mse_loss(out, t) * 1e-3,
                amp=amp).train(max_steps=1, progress=False)
    return seen[0]


def test_before_optimizer_step_sees_unscaled_fp16_gradients():
    fp32, fp16 = _first_grad_norm(False), _first_grad_norm("fp16")
    assert fp16 == pytest.approx(fp32, rel=0.05)  # scaled, they would be 65536 times larger


def test_a_step_the_grad_scaler_skipped_counts_and_steps_a_per_step_scheduler():
    X, y = make_data(N)
    log = StepLog()
    handler = NNHandler(make_model(), torch.optim.SGD, lambda out, t: (out.float() * 1e4).mean(),
                        optimizer_kwargs={"lr": LR}, amp="fp16", scheduler_interval="step",
                        callbacks=[log], device="cpu")
    handler.set_scheduler(warmup(handler.optimizer))
    handler.set_train_loader(DataLoader(TensorDataset(X, y), batch_size=BATCH))
    before = [p.detach().clone() for p in handler.module.parameters()]
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # torch's: the optimizer did not step
        handler.train(max_steps=3, progress=False)
    assert close(list(handler.module.parameters()), before, atol=0)  # every step was skipped (fp16 overflow)
    assert handler.scaler.get_scale() < 65536.0
    assert handler.global_step == 3 and handler.scheduler.last_epoch == 3 and len(log.after) == 3


@pytest.mark.parametrize("accum, stop", [(1, 7), (2, 4)])
def test_a_max_steps_stop_and_resume_give_the_uninterrupted_lrs_and_average(tmp_path, accum, stop):
    X, y = make_data(N)

    def run(directory, **train):
        log, ema = StepLog(), EMA(decay=DECAY)
        handler = NNHandler(make_model(), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": LR},
                            scheduler_interval="step", grad_accum_steps=accum, callbacks=[log, ema], seed=0,
                            checkpoint_dir=directory, resume="auto", device="cpu")
        handler.set_scheduler(warmup(handler.optimizer))
        handler.set_train_loader((X, y), batch_size=BATCH)  # shuffled: the resume replays the order
        handler.train(**train, progress=False)
        return handler, log, ema

    whole, whole_log, whole_ema = run(tmp_path / "straight", epochs=EPOCHS)
    first, first_log, _ = run(tmp_path / "stopped", epochs=EPOCHS, max_steps=stop)
    assert first.global_step == stop and first.partial_epoch
    second, second_log, second_ema = run(tmp_path / "stopped", epochs=EPOCHS)
    assert first_log.lrs + second_log.lrs == whole_log.lrs  # exactly: the scheduler's state resumed mid-epoch
    assert [s for s, _ in first_log.after + second_log.after] == list(range(1, whole.global_step + 1))
    assert close(list(second.module.parameters()), list(whole.module.parameters()), atol=0)
    assert close(list(second_ema.module.module.parameters()), list(whole_ema.module.module.parameters()), atol=0)


def test_seed_everything_is_public_and_seeds_random_numpy_torch_and_loader_workers():
    from nn_handler import seed_everything

    np = pytest.importorskip("numpy")

    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.tensor([random.random(), float(np.random.rand()), float(torch.rand(()))])

    def draws():
        assert seed_everything(123) == 123
        here = (random.random(), float(np.random.rand()), float(torch.rand(())))
        workers = torch.cat(list(DataLoader(Draws(), batch_size=2, num_workers=2)))
        return here, workers

    (a, wa), (b, wb) = draws(), draws()
    assert a == b and torch.equal(wa, wb)
    assert len({tuple(row.tolist()) for row in wa}) == 4  # the workers' streams differ from each other
    with pytest.raises(ConfigurationError, match="seed must be an int"):
        seed_everything("0")


class NamedSteps(Callback):
    """Hooks written with the third parameter: they get the optimizer's name."""

    def __init__(self):
        self.calls = []

    def on_before_optimizer_step(self, handler, step, name):
        self.calls.append(("before", step, name))

    def on_optimizer_step(self, handler, step, name):
        self.calls.append(("after", step, name, handler.optimizers[name].param_groups[0]["lr"]))


def _three_critic_steps(ctx, batch):
    real, z = batch
    G, D = ctx.models["G"], ctx.models["D"]
    for _ in range(3):
        loss_d = D(G(z).detach()).mean() - D(real).mean()
        ctx.backward(loss_d)
        ctx.step("D")
    loss_g = -D(G(z)).mean()
    ctx.backward(loss_g)
    ctx.step("G")
    return loss_d + loss_g


def test_a_per_step_schedule_steps_once_per_training_step_under_an_inner_loop():
    from scripts import gan_case as gan

    G, D = gan.make_models()
    opts = gan.make_optimizers(G, D)
    epochs, steps = 2, 4  # 32 samples in batches of 8
    one_cycle_d = lr_scheduler.OneCycleLR(opts["D"], max_lr=0.1, total_steps=epochs * steps)  # sized in training steps
    named = NamedSteps()
    handler = NNHandler({"G": G, "D": D}, opts, training_step=_three_critic_steps, scheduler={"D": one_cycle_d},
                        callbacks=[named], device="cpu")
    handler.set_train_loader(gan.make_data(32), batch_size=8, shuffle=False)
    assert handler.steps_per_epoch == steps
    handler.train(epochs, progress=False)  # the critic's 24 optimizer steps would overrun the 8-step cycle
    assert one_cycle_d.last_epoch == epochs * steps
    reference = lr_scheduler.OneCycleLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), max_lr=0.1,
                                        total_steps=epochs * steps)
    want = []
    for n in range(1, epochs * steps + 1):
        lr = reference.get_last_lr()[0]
        want += [("before", n, "D"), ("after", n, "D", lr)] * 3 + [("before", n, "G"), ("after", n, "G", gan.LR_G)]
        reference.step()
    assert [c[:3] for c in named.calls] == [c[:3] for c in want]
    assert [c[3] for c in named.calls if c[0] == "after"] == pytest.approx([c[3] for c in want if c[0] == "after"])
