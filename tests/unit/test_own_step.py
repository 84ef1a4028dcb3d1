"""Your own training step: several models and optimizers, against a hand-written loop as the truth (one process).

The 2-rank half (DDP and FSDP, one model per wrapper) is tests/ranks/test_own_step_ranks.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from nn_handler import Callback, NNHandler
from nn_handler.errors import CheckpointMismatchError, ConfigurationError
from scripts import gan_case as gan

TOL = {"rtol": 0, "atol": 1e-6}


@pytest.mark.parametrize("amp, accum", [(False, 1), ("bf16", 1), ("fp16", 1), ("fp16", 2)])
def test_a_gan_step_equals_the_hand_written_loop(amp, accum):
    handler = gan.make_handler(amp, grad_accum_steps=accum)
    history = handler.train(2, progress=False)
    G, D, want = gan.reference(amp, accum=accum)
    torch.testing.assert_close(gan.flat(handler.models["G"], handler.models["D"]), gan.flat(G, D), **TOL)
    for key in ("train_loss", "train_d", "train_g"):
        torch.testing.assert_close(torch.tensor(history[key]), torch.tensor(want[key]), **TOL, msg=key)
    assert handler.global_step == 2 * 64 // (8 * accum)  # training steps, not optimizer calls
    assert history["lr_G"] == [gan.LR_G] * 2 and history["lr_D"] == [gan.LR_D] * 2
    if amp == "fp16":
        assert handler.scaler.get_scale() > 0  # one scaler for both optimizers, updated once per step


def _two_views(ctx, batch):
    """One model, two forward calls (the input and its mirror), one loss."""
    x, y = batch
    with ctx.autocast():
        loss = nn.functional.mse_loss(ctx.model(x), y) + 0.5 * nn.functional.mse_loss(ctx.model(-x), -y)
    ctx.backward(loss)
    ctx.step()
    return loss


def _one_model_case(n=72, batch=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(3)
    X = torch.randn(n, 5, generator=g)
    return model, X, X.sum(1, keepdim=True) * 2


def test_one_model_two_forward_calls_with_accumulation_clipping_and_a_per_step_schedule():
    epochs, n, batch, accum = 2, 72, 8, 2  # 9 batches an epoch: groups of 2, 2, 2, 2 and a last one of 1
    model, X, y = _one_model_case(n, batch)
    steps_per_epoch = 5
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=epochs * steps_per_epoch)
    handler = NNHandler(model, opt, training_step=_two_views, scheduler=sched, grad_accum_steps=accum,
                        clip_grad_norm=0.5, device="cpu")
    handler.set_train_loader((X, y), batch_size=batch, shuffle=False)
    history = handler.train(epochs, progress=False)

    ref, _, _ = _one_model_case(n, batch)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    rsched = torch.optim.lr_scheduler.OneCycleLR(ropt, max_lr=0.2, total_steps=epochs * steps_per_epoch)
    means, lrs = [], []
    for _ in range(epochs):
        lrs.append(ropt.param_groups[0]["lr"])
        total = 0.0
        for i in range(0, n, batch):
            x, t = X[i:i + batch], y[i:i + batch]
            loss = nn.functional.mse_loss(ref(x), t) + 0.5 * nn.functional.mse_loss(ref(-x), -t)
            (loss / accum).backward()
            total += float(loss.detach()) * len(x)
            if (i // batch + 1) % accum == 0 or i + batch >= n:
                nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                ropt.step()
                rsched.step()
                ropt.zero_grad(set_to_none=True)
        means.append(total / n)
    torch.testing.assert_close(gan.flat(handler.module), gan.flat(ref), **TOL)
    torch.testing.assert_close(torch.tensor(history["train_loss"]), torch.tensor(means), **TOL)
    assert history["lr"] == pytest.approx(lrs, abs=1e-12)
    assert handler.global_step == epochs * steps_per_epoch


class _Hooks(Callback):
    def __init__(self):
        self.calls = []

    def on_batch_end(self, handler, step, loss):
        self.calls.append(("batch", step))

    def on_before_optimizer_step(self, handler, step):
        self.calls.append(("before", step))

    def on_optimizer_step(self, handler, step):
        self.calls.append(("after", step, handler.global_step))


def test_hooks_run_around_each_optimizer_step_with_the_training_steps_number():
    hooks = _Hooks()
    handler = gan.make_handler(grad_accum_steps=2, callbacks=[hooks])  # 8 batches: 4 groups an epoch
    handler.train(1, progress=False)
    assert handler.global_step == 4
    expected = []
    for n in range(1, 5):  # per group of 2 micro-batches: D's step, then G's, both numbered n
        expected += [("batch", 2 * n - 2), ("before", n), ("after", n, n), ("before", n), ("after", n, n),
                     ("batch", 2 * n - 1)]
    assert hooks.calls == expected


def test_max_steps_then_resume_auto_is_bit_identical_to_the_straight_run(tmp_path):
    straight = gan.make_handler("fp16", checkpoint_dir=tmp_path / "straight", validation_step=gan.gan_validation)
    straight.set_val_loader(gan.make_data(24, seed=5), batch_size=8)
    straight.train(3, progress=False)

    first = gan.make_handler("fp16", checkpoint_dir=tmp_path / "stopped", validation_step=gan.gan_validation)
    first.set_val_loader(gan.make_data(24, seed=5), batch_size=8)
    first.train(3, max_steps=11, progress=False)  # stops 3 batches into epoch 2
    assert first.global_step == 11 and first.partial_epoch
    resumed = gan.make_handler("fp16", checkpoint_dir=tmp_path / "stopped", resume="auto",
                               validation_step=gan.gan_validation)
    resumed.set_val_loader(gan.make_data(24, seed=5), batch_size=8)
    resumed.train(3, progress=False)

    for name in ("G", "D"):
        for a, b in zip(straight.models[name].state_dict().values(), resumed.models[name].state_dict().values()):
            assert torch.equal(a, b)
        assert str(straight.optimizers[name].state_dict()) == str(resumed.optimizers[name].state_dict())
    assert straight.scaler.state_dict() == resumed.scaler.state_dict()
    assert straight.global_step == resumed.global_step == 24
    for key in ("epoch", "train_loss", "train_d", "train_g", "val_loss", "val_d_real", "lr_G", "lr_D"):
        assert straight.history[key] == resumed.history[key], key
    assert {"train_d", "train_g", "val_loss", "val_d_real"} <= set(straight.history.keys())


def test_checkpoints_export_and_predict_by_name(tmp_path):
    G, D = gan.make_models()
    opts = gan.make_optimizers(G, D)
    scheds = {"D": torch.optim.lr_scheduler.StepLR(opts["D"], step_size=1, gamma=0.5)}
    handler = NNHandler(nn.ModuleDict({"G": G, "D": D}), opts, training_step=gan.gan_step, scheduler=scheds,
                        validation_step=gan.gan_validation, device="cpu")
    handler.set_train_loader(gan.make_data(), batch_size=8)
    handler.set_val_loader(gan.make_data(24, seed=5), batch_size=8)
    handler.train(2, progress=False)
    assert handler.history["lr_D"] == [gan.LR_D, gan.LR_D / 2]
    assert set(handler.models) == {"G", "D"} and handler.models["G"] is G  # unwrapped, by name
    with pytest.raises(AttributeError, match=r"handler.model: this handler has 2 models \('G', 'D'\); use "
                                             r"handler.models\[name\]"):
        handler.model  # noqa: B018
    assert not hasattr(handler, "module")  # an AttributeError: TrainerView checks say no, as for any missing name

    handler.save_checkpoint(tmp_path / "a.ckpt")
    payload = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert set(payload["models"]) == set(payload["optimizers"]) == {"G", "D"} and set(payload["schedulers"]) == {"D"}
    assert payload["optimizer_classes"] == {"G": "torch.optim.adam.Adam", "D": "torch.optim.sgd.SGD"}
    fresh = gan.make_handler(validation_step=gan.gan_validation)
    fresh.set_scheduler({"D": torch.optim.lr_scheduler.StepLR(fresh.optimizers["D"], step_size=1, gamma=0.5)})
    assert fresh.load_checkpoint(tmp_path / "a.ckpt") == 2
    torch.testing.assert_close(gan.flat(fresh.models["G"], fresh.models["D"]), gan.flat(G, D), rtol=0, atol=0)
    assert str(fresh.optimizers["G"].state_dict()) == str(handler.optimizers["G"].state_dict())
    assert fresh.schedulers["D"].last_epoch == 2 and fresh.history == handler.history

    handler.export_model(tmp_path / "models.pt")
    exported = torch.load(tmp_path / "models.pt", weights_only=True)  # one file: each model's state dict by name
    assert set(exported) == {"G", "D"}
    G2, _ = gan.make_models(seed=9)
    G2.load_state_dict(exported["G"])  # one model of it, without nn_handler
    z = gan.make_data(10)[1]
    torch.testing.assert_close(G2(z), G(z))
    other = gan.make_handler()
    other.load_model(tmp_path / "models.pt")
    torch.testing.assert_close(gan.flat(other.models["G"], other.models["D"]), gan.flat(G, D), rtol=0, atol=0)

    torch.testing.assert_close(handler.predict(z, model="G"), G(z).detach())
    with pytest.raises(ConfigurationError, match=r"predict\(\): this handler has 2 models \('G', 'D'\): pass "
                                                 r"model='G'"):
        handler.predict(z)
    evaluated = handler.evaluate(gan.make_data(24, seed=5))
    assert set(evaluated) == {"loss", "d_real"} and evaluated["loss"] == pytest.approx(handler.history["val_loss"][-1])


def test_a_checkpoint_of_other_models_is_refused_naming_both(tmp_path):
    handler = gan.make_handler()
    handler.train(1, progress=False)
    handler.save_checkpoint(tmp_path / "gan.ckpt")
    G, D = gan.make_models()
    renamed = NNHandler({"gen": G, "disc": D}, {"gen": torch.optim.SGD(G.parameters(), lr=0.1),
                                                 "disc": torch.optim.SGD(D.parameters(), lr=0.1)},
                        training_step=gan.gan_step)
    with pytest.raises(CheckpointMismatchError, match=r"holds the models 'G', 'D' and this handler has 'gen', "
                                                      r"'disc'"):
        renamed.load_checkpoint(tmp_path / "gan.ckpt")
    single = NNHandler(nn.Linear(3, 1), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.1})
    with pytest.raises(CheckpointMismatchError, match=r"holds the models 'G', 'D' and this handler has 'model'"):
        single.load_checkpoint(tmp_path / "gan.ckpt")


def _distill_case():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).eval().requires_grad_(False)
    student = nn.Linear(4, 2)
    return teacher, student


def _distill(ctx, batch):
    x, y = batch
    with torch.no_grad():
        soft = ctx.models["teacher"](x).softmax(-1)
    logits = ctx.models["student"](x)
    loss = nn.functional.cross_entropy(logits, y) + nn.functional.kl_div(logits.log_softmax(-1), soft,
                                                                         reduction="batchmean")
    ctx.backward(loss)
    ctx.step()
    return loss


def test_a_frozen_teacher_keeps_its_mode_and_the_loss_fn_serves_validation(caplog):
    teacher, student = _distill_case()
    X, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    handler = NNHandler({"teacher": teacher, "student": student}, torch.optim.SGD(student.parameters(), lr=0.1),
                        training_step=_distill, device="cpu")
    handler.set_train_loader((X, y), batch_size=8)
    handler.set_val_loader((X, y), batch_size=8)
    with caplog.at_level(logging.WARNING, logger="nn_handler"):
        history = handler.train(1, progress=False)
    assert not teacher.training and student.training  # the teacher's dropout stays off
    assert "val_loss" not in history.keys()  # two models, no validation_step, no loss_fn: skipped, said once
    assert [r.getMessage() for r in caplog.records if "validation skipped" in r.getMessage()] == [
        "validation skipped: no validation step: with training_step (or several models) pass "
        "validation_step=fn(ctx, batch), or, with one model, a loss_fn"]

    one = NNHandler(nn.Linear(4, 2), torch.optim.SGD, nn.CrossEntropyLoss(), optimizer_kwargs={"lr": 0.1},
                    training_step=lambda ctx, b: _step_ce(ctx, b), device="cpu")
    one.set_train_loader((X, y), batch_size=8)
    one.set_val_loader((X, y), batch_size=8)
    history = one.train(1, progress=False)  # training_step trains; loss_fn validates
    assert history["val_loss"][-1] == pytest.approx(one.evaluate((X, y))["loss"])


def _step_ce(ctx, batch):
    x, y = batch
    loss = nn.functional.cross_entropy(ctx.model(x), y)
    ctx.backward(loss)
    ctx.step()
    return loss


# ----------------------------------------------------------------------------- bad input, raised at once
def _gan_handler(step, **kwargs):
    G, D = gan.make_models()
    handler = NNHandler({"G": G, "D": D}, gan.make_optimizers(G, D), training_step=step, device="cpu", **kwargs)
    handler.set_train_loader(gan.make_data(16), batch_size=8)
    return handler


def _steps_unknown(ctx, batch):
    ctx.step("generator")


def _steps_unnamed(ctx, batch):
    ctx.step()


def _returns_nothing(ctx, batch):
    gan.gan_step(ctx, batch)


def _returns_a_vector(ctx, batch):
    return torch.ones(8)


def _returns_no_loss(ctx, batch):
    return {"d": gan.gan_step(ctx, batch)["d"]}


@pytest.mark.parametrize("step, message", [
    (_steps_unknown, r"ctx.step\('generator'\): no optimizer of that name; this handler's are 'G', 'D'"),
    (_steps_unnamed, r"ctx.step\(\) needs the optimizer's name: this handler has 'G', 'D'"),
    (_returns_nothing, r"training_step must return the loss \(a scalar tensor\) or a mapping with a 'loss' key "
                       r".*got None \(does the step end with `return loss`\?\)"),
    (_returns_a_vector, r"training_step must return the loss .*got a tensor of shape \(8,\)"),
    (_returns_no_loss, r"got a mapping without 'loss' \(keys: d\)"),
])
def test_a_step_that_misuses_its_context_or_returns_no_loss_is_named_at_the_first_batch(step, message):
    handler = _gan_handler(step)
    with pytest.raises(ConfigurationError, match=message):
        handler.train(1, progress=False)
    assert handler.global_step <= 2 and len(handler.history) == 0  # raised at the batch that did it


def _backward_in_validation(ctx, batch):
    ctx.backward(ctx.models["D"](batch[0]).mean())


def test_backward_in_a_validation_step_is_refused():
    handler = _gan_handler(gan.gan_step, validation_step=_backward_in_validation)
    handler.set_val_loader(gan.make_data(8), batch_size=8)
    with pytest.raises(ConfigurationError, match=r"ctx.backward\(\) in validation_step: validation runs without "
                                                 r"gradients"):
        handler.train(1, progress=False)


def _gan(**kwargs):
    G, D = gan.make_models()
    args = {"model": {"G": G, "D": D}, "optimizer": gan.make_optimizers(G, D), "training_step": gan.gan_step,
            "device": "cpu"}
    args.update(kwargs)
    return NNHandler(**args)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"training_step": None}, ConfigurationError,
     r"the built-in step trains one model and this handler has 2 \('G', 'D'\): pass training_step=fn\(ctx, batch\)"),
    ({"model": nn.Linear(3, 1), "training_step": None}, ConfigurationError,
     r"optimizer 'G' holds 4 parameter\(s\) that belong to no model of this handler"),
    ({"loss_fn": nn.MSELoss(), "validation_step": gan.gan_validation}, ConfigurationError,
     r"loss_fn would be used by no step: training_step and validation_step compute their own losses"),
    ({"loss_fn": nn.MSELoss()}, ConfigurationError,
     r"loss_fn serves the built-in validation, which calls one model, and this handler has 2 \('G', 'D'\): pass "
     r"validation_step"),
    ({"metrics": {"acc": lambda o, t: 0.0}}, ConfigurationError,
     r"metrics= are computed by the built-in steps, and this handler runs neither"),
    ({"optimizer": [torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)]}, TypeError,
     r"optimizer must be a torch.optim.Optimizer, an optimizer class, or a mapping name -> optimizer .*got list"),
    ({"optimizer": torch.optim.SGD, "optimizer_kwargs": {"lr": 0.1}}, ConfigurationError,
     r"an optimizer class builds one optimizer over one model, and this handler has 2 \('G', 'D'\): pass instances"),
    ({"training_step": "gan_step"}, ConfigurationError,
     r"training_step must be a function fn\(ctx, batch\)"),
    ({"scheduler": {"H": torch.optim.lr_scheduler.StepLR}}, ConfigurationError,
     r"scheduler: no optimizer named 'H'; this handler's are 'G', 'D'"),
])
def test_bad_settings_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        _gan(**kwargs)


def test_optimizers_and_models_that_share_or_stray_are_refused():
    G, D = gan.make_models()
    with pytest.raises(ConfigurationError, match=r"optimizer 'D' holds 1 parameter\(s\) that belong to no model"):
        NNHandler({"G": G, "D": D}, {"G": torch.optim.SGD(G.parameters(), lr=0.1),
                                     "D": torch.optim.SGD([*D.parameters(), nn.Parameter(torch.ones(1))], lr=0.1)},
                  training_step=gan.gan_step)
    with pytest.raises(ConfigurationError, match=r"optimizers 'G' and 'D' both hold a parameter of model 'D'"):
        NNHandler({"G": G, "D": D}, {"G": torch.optim.SGD([*G.parameters(), *D.parameters()], lr=0.1),
                                     "D": torch.optim.SGD(D.parameters(), lr=0.1)}, training_step=gan.gan_step)
    with pytest.raises(ConfigurationError, match=r"models 'G' and 'H' share parameters"):
        NNHandler({"G": G, "H": nn.Sequential(G[0])}, training_step=gan.gan_step)
    with pytest.raises(ConfigurationError, match=r"the built-in step steps one optimizer and this handler has 2"):
        NNHandler(nn.Sequential(G, D), {"G": torch.optim.SGD(G.parameters(), lr=0.1),
                                        "D": torch.optim.SGD(D.parameters(), lr=0.1)})


def test_the_step_context_is_public_and_typed():
    import nn_handler
    from nn_handler._training.context import StepContext

    assert "StepContext" in nn_handler.__all__ and nn_handler.StepContext is StepContext
    seen = []

    def step(ctx, batch):
        seen.append((type(ctx), list(ctx.models), list(ctx.optimizers), ctx.device, ctx.epoch, ctx.global_step,
                     ctx.is_last_micro_batch, ctx.training))
        return gan.gan_step(ctx, batch)

    _gan_handler(step, grad_accum_steps=2).train(2, progress=False)  # 2 batches an epoch: one group
    cpu, names = torch.device("cpu"), ["G", "D"]
    assert seen == [(StepContext, names, names, cpu, epoch, epoch - 1, last, True)
                    for epoch in (1, 2) for last in (False, True)]


def _critic_twice(ctx, batch):
    """A WGAN-style step: the critic stepped twice per generator step (its inner loop)."""
    real, z = batch
    G, D = ctx.models["G"], ctx.models["D"]
    for _ in range(2):
        with ctx.autocast():
            loss_d = D(G(z).detach()).mean() - D(real).mean()
        ctx.backward(loss_d)
        ctx.step("D")
    with ctx.autocast():
        loss_g = -D(G(z)).mean()
    ctx.backward(loss_g)
    ctx.step("G")
    return loss_d + loss_g


def test_an_optimizer_stepped_twice_in_one_step_under_fp16():
    hooks = _Hooks()
    handler = _gan_handler(_critic_twice, amp="fp16", callbacks=[hooks])  # torch's scaler refuses 2 steps per update
    handler.train(1, progress=False)
    assert handler.global_step == 2
    assert [c for c in hooks.calls if c[0] == "after"] == [("after", n, n) for n in (1, 1, 1, 2, 2, 2)]
    assert torch.isfinite(gan.flat(handler.models["G"], handler.models["D"])).all()


def _critics_then_generator(G, D, real, z, backward, step, autocast, n_critic, poisoned):
    """A GAN step with ``n_critic`` critic steps, written once for the handler and for the hand loop.

    ``poisoned(k)`` (``k``: the critic's step, or ``"G"``) makes that backward's gradients infinite (a hook on its
    loss; the loss itself stays finite), so that the fp16 scaler skips that optimizer step and backs off.
    """
    ones = torch.ones(real.size(0), 1)
    for k in range(n_critic):
        with autocast():
            loss_d = gan._bce(D(real), ones) + gan._bce(D(G(z).detach()), torch.zeros_like(ones))
        if poisoned(k):
            loss_d.register_hook(lambda grad: grad * float("inf"))
        backward(loss_d)
        step("D")
    with autocast():
        loss_g = gan._bce(D(G(z)), ones)
    if poisoned("G"):
        loss_g.register_hook(lambda grad: grad * float("inf"))
    backward(loss_g)
    step("G")
    return {"loss": loss_d + loss_g, "g": loss_g}


# Which backward's gradients are infinite, by the training step (from 0) of 6: a critic's step, G's, or both.
_POISON = {1: {0}, 2: {"G"}, 3: {0, "G"}, 4: {1, 2}}


@pytest.mark.parametrize("n_critic, accum", [(1, 1), (3, 1), (1, 2)])
def test_fp16_updates_the_scale_after_every_optimizer_step_as_the_hand_written_loop(n_critic, accum):
    epochs, n = 1, 48 * accum  # 6 training steps

    def step(ctx, batch):
        poisoned = _POISON.get(ctx.global_step, set()).__contains__ if ctx.is_last_micro_batch else lambda k: False
        return _critics_then_generator(ctx.models["G"], ctx.models["D"], *batch, ctx.backward, ctx.step,
                                       ctx.autocast, n_critic, poisoned)

    handler = gan.make_handler("fp16", n=n, step=step, grad_accum_steps=accum)
    handler.train(epochs, progress=False)

    # The hand-written loop: torch's recipe, scaler.step(opt) then scaler.update() after every optimizer step.
    G, D = gan.make_models()
    opts = gan.make_optimizers(G, D)
    scaler = torch.amp.GradScaler("cpu")
    real_all, z_all = gan.make_data(n)
    autocast = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731

    def hand_step(name):
        if not last:
            return
        waiting = [p for m in (G, D) for p in m.parameters() if p.grad is not None]
        scaler.step(opts[name])
        opts[name].zero_grad(set_to_none=True)
        before = scaler.get_scale()
        scaler.update()
        for p in waiting:  # with accumulation: the other optimizer's gradients, made at the old scale, follow it
            if p.grad is not None:
                p.grad *= scaler.get_scale() / before

    for epoch in range(epochs):
        for i, start in enumerate(range(0, n, 8)):
            if i % accum == 0:
                for opt in opts.values():
                    opt.zero_grad(set_to_none=True)
            last = (i + 1) % accum == 0
            poisoned = _POISON.get(epoch * 6 + i // accum, set()).__contains__ if last else lambda k: False
            _critics_then_generator(G, D, real_all[start:start + 8], z_all[start:start + 8],
                                    lambda loss: scaler.scale(loss / accum if accum > 1 else loss).backward(),
                                    hand_step, autocast, n_critic, poisoned)
    assert handler.scaler.get_scale() == scaler.get_scale() <= 2.0 ** 16 / 16  # every skipped step backed off
    torch.testing.assert_close(gan.flat(handler.models["G"], handler.models["D"]), gan.flat(G, D), **TOL)


def test_a_refused_setting_leaves_the_handler_as_it_was():
    model = nn.Linear(3, 1)
    handler = NNHandler(model, torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.1})
    before = handler.optimizer
    halves = {"weight": torch.optim.SGD([model.weight], lr=0.1), "bias": torch.optim.SGD([model.bias], lr=0.1)}
    with pytest.raises(ConfigurationError, match=r"the built-in step steps one optimizer and this handler has 2"):
        handler.set_optimizer(halves)
    assert handler.optimizer is before and handler.optimizers == {"optimizer": before}
    G, D = gan.make_models()
    with pytest.raises(ConfigurationError, match=r"the built-in step trains one model and this handler has 2"):
        handler.set_model({"G": G, "D": D})
    assert handler.model is model


def test_an_unsized_loader_ending_inside_a_group_steps_what_its_last_micro_batch_asked_for():
    from torch.utils.data import DataLoader, IterableDataset

    real, z = gan.make_data(40)

    class Unsized(IterableDataset):
        def __iter__(self):
            return iter(zip(real, z))

    hooks = _Hooks()
    handler = gan.make_handler(grad_accum_steps=2, callbacks=[hooks])
    handler.set_train_loader(DataLoader(Unsized(), batch_size=8))  # 5 batches: groups of 2, 2 and 1
    handler.train(1, progress=False)
    assert handler.global_step == 3
    assert [c for c in hooks.calls if c[0] == "after"] == [("after", n, n) for n in (1, 1, 2, 2, 3, 3)]


# ----------------------------------------------------------------------------- an optimizer stepped by hand
def _plain_pytorch(ctx, batch):
    """What a plain-PyTorch hand types first: its own backward and optimizer step."""
    real, _ = batch
    loss = ctx.models["D"](real).pow(2).mean()
    loss.backward()
    ctx.optimizers["D"].step()
    return loss


def test_an_optimizer_stepped_by_hand_in_the_step_is_refused_at_its_first_occurrence():
    handler = gan.make_handler(step=_plain_pytorch, grad_accum_steps=2)
    before = gan.flat(handler.models["D"])
    with pytest.raises(ConfigurationError, match=r"optimizer 'D' was stepped by hand \(optimizer.step\(\)\) in the "
                                                 r"training step: call ctx.backward\(loss\) and ctx.step\('D'\)"):
        handler.train(1, progress=False)
    # Refused before it stepped, on the first (non-final) micro-batch, where DDP ranks would have diverged.
    assert handler.global_step == 0 and torch.equal(gan.flat(handler.models["D"]), before)
    handler.optimizers["D"].step()  # outside a training step it is the user's own business
    assert not any(opt._optimizer_step_pre_hooks for opt in handler.optimizers.values())  # nothing left behind


# ----------------------------------------------------------------------------- keys on some batches only
def _wgan_generator_every_other_step(ctx, batch):
    """The critic every step, the generator every other one: its loss is returned on its own steps only."""
    real, z = batch
    G, D = ctx.models["G"], ctx.models["D"]
    loss_d = D(G(z).detach()).mean() - D(real).mean()
    ctx.backward(loss_d)
    ctx.step("D")
    if ctx.global_step % 2 == 0:
        return {"loss": loss_d, "d": loss_d}
    loss_g = -D(G(z)).mean()
    ctx.backward(loss_g)
    ctx.step("G")
    return {"loss": loss_d, "g": loss_g, "d": loss_d}


def test_a_key_returned_on_some_batches_is_averaged_over_those_and_resumes_bit_identically(tmp_path):
    n = 48  # 6 batches of 8 an epoch: the generator's loss on 3 of them
    straight = gan.make_handler(n=n, step=_wgan_generator_every_other_step)
    history = straight.train(2, progress=False)
    G, D = gan.make_models()
    opts = gan.make_optimizers(G, D)
    real_all, z_all = gan.make_data(n)
    want = {"train_loss": [], "train_d": [], "train_g": []}
    for epoch in range(2):
        d, g = [], []
        for i, start in enumerate(range(0, n, 8)):
            real, z = real_all[start:start + 8], z_all[start:start + 8]
            for opt in opts.values():
                opt.zero_grad(set_to_none=True)
            loss_d = D(G(z).detach()).mean() - D(real).mean()
            loss_d.backward()
            opts["D"].step()
            opts["D"].zero_grad(set_to_none=True)
            d.append(loss_d.item())
            if (epoch * 6 + i) % 2 == 1:
                loss_g = -D(G(z)).mean()
                loss_g.backward()
                opts["G"].step()
                g.append(loss_g.item())
        want["train_loss"].append(sum(d) / len(d))
        want["train_d"].append(sum(d) / len(d))
        want["train_g"].append(sum(g) / len(g))  # over the generator's batches only, as Lightning's self.log
    for key, values in want.items():
        assert history[key] == pytest.approx(values, abs=1e-6), key
    torch.testing.assert_close(gan.flat(straight.models["G"], straight.models["D"]), gan.flat(G, D), **TOL)

    stopped = gan.make_handler(n=n, step=_wgan_generator_every_other_step, checkpoint_dir=tmp_path)
    stopped.train(2, max_steps=9, progress=False)  # 3 batches into epoch 2: "g" came with 1 of them (2 on resume)
    resumed = gan.make_handler(n=n, step=_wgan_generator_every_other_step, checkpoint_dir=tmp_path, resume="auto")
    resumed.train(2, progress=False)
    for key in ("epoch", "train_loss", "train_d", "train_g"):
        assert resumed.history[key] == straight.history[key], key
    torch.testing.assert_close(gan.flat(resumed.models["G"], resumed.models["D"]), gan.flat(G, D), **TOL)


# ----------------------------------------------------------------------------- optimizer steps that never happen
def _steps_nothing(ctx, batch):
    loss = ctx.models["D"](batch[0]).pow(2).mean()
    ctx.backward(loss)
    return loss  # no ctx.step: nothing trains


def _steps_d_too_early(ctx, batch):
    """D asked to step on the group's first micro-batch only: dropped, since optimizers step on the last."""
    real, z = batch
    loss_d = ctx.models["D"](real).pow(2).mean()
    ctx.backward(loss_d)
    if not ctx.is_last_micro_batch:
        ctx.step("D")
    loss_g = ctx.models["D"](ctx.models["G"](z)).mean()
    ctx.backward(loss_g)
    ctx.step("G")
    return loss_d + loss_g


@pytest.mark.parametrize("step, accum, said", [
    (_steps_nothing, 1, "training step 1 called no ctx.step(): optimizer 'G', optimizer 'D' did not step, so the "
                        "step trained nothing"),
    (_steps_d_too_early, 2, "training step 1: ctx.step('D') was called on an earlier micro-batch of its accumulation "
                            "group but not on the last, where an optimizer steps: optimizer 'D' did not step"),
])
def test_an_optimizer_step_that_never_happens_is_said_once_naming_the_optimizer(step, accum, said, caplog):
    handler = gan.make_handler(n=32, step=step, grad_accum_steps=accum)
    with caplog.at_level(logging.WARNING, logger="nn_handler"):
        handler.train(2, progress=False)
    warnings = [r.getMessage() for r in caplog.records if "ctx.step" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(said), warnings


def _plain_backward(ctx, batch):
    real, _ = batch
    loss = ctx.models["D"](real).pow(2).mean()
    loss.backward()  # neither scaled under fp16 nor divided by grad_accum_steps
    ctx.step("D")
    return loss


@pytest.mark.parametrize("amp, accum, why", [("fp16", 1, "not scaled for fp16"),
                                             (False, 2, "not divided by grad_accum_steps")])
def test_a_plain_backward_before_ctx_step_is_refused_where_its_gradients_would_be_wrong(amp, accum, why):
    handler = gan.make_handler(amp, n=16, step=_plain_backward, grad_accum_steps=accum)
    before = gan.flat(handler.models["D"])
    with pytest.raises(ConfigurationError, match=rf"ctx.step\('D'\) after no ctx.backward in this accumulation group: "
                                                 rf"gradients from a plain loss.backward\(\) are {why}; call "
                                                 rf"ctx.backward\(loss\)"):
        handler.train(1, progress=False)
    assert torch.equal(gan.flat(handler.models["D"]), before)
    gan.make_handler(n=16, step=_plain_backward).train(1, progress=False)  # fp32, no accumulation: the same numbers
