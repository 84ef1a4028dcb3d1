"""The objects one train / evaluate / save call works on, handed over explicitly by the public face.

Private: :class:`~nn_handler.NNHandler` keeps what it trains in a
:class:`Models` (the models as trained, their optimizers and schedulers, by
name, each checked as it is set) and builds a :class:`Parts` from it, its
loaders and its callbacks at the start of each call.

A model given alone is named ``"model"`` and an optimizer given alone
``"optimizer"``; a scheduler is named by its optimizer. Several models are
each wrapped on their own (:func:`wrap_model`: one DDP, or ``fully_shard``,
per model), so that whichever model a step calls, its gradients are averaged
over the ranks: one DDP around a container whose models are then called
directly would average none of them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..callbacks import TrainerView
from ..errors import ConfigurationError
from ..utils.ddp import is_distributed
from ..utils.parallel import MultiGPUConfig, prepare_model, unwrap_parallel_model
from .config import TrainingConfig
from .data import check_not_empty
from .precision import Precision
from .schedule import build_scheduler
from .sharding import is_sharded, shard_model

log = logging.getLogger(__name__)

MODEL, OPTIMIZER = "model", "optimizer"  # the names of a model and an optimizer given alone
OWN_STEP = "pass training_step=fn(ctx, batch) (docs/training.md, 'Your own training step')"


@dataclass(eq=False)
class Parts:
    """Models, optimizers, loaders, callbacks and placement of one call."""

    view: TrainerView  # what callbacks receive as ``handler``
    models: dict[str, nn.Module]  # as trained, by name: DDP-wrapped when distributed, sharded under FSDP
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]  # by the name of their optimizer
    scaler: Any  # a GradScaler (fp16) or None
    loss_fn: Callable | None
    train_loader: DataLoader | None
    val_loader: DataLoader | None
    callbacks: list
    device: torch.device
    distributed: bool
    rank: int
    world_size: int
    precision: Precision  # the autocast dtype, asked by the step, evaluation and sharding
    strategy: str = "ddp"  # "fsdp": sharded models (in a group) and sharded checkpoint directories

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The models themselves (unwrapped), by name."""
        return {name: unwrap_parallel_model(model) for name, model in self.models.items()}

    @property
    def named(self) -> bool:
        """Checkpoints and exports keep the models by name (False: one model, at most one optimizer, as given alone)."""
        return set(self.models) != {MODEL} or not set(self.optimizers) <= {OPTIMIZER}

    @property
    def sharded(self) -> bool:
        return any(is_sharded(m) for m in self.models.values())

    @property
    def in_group(self) -> bool:
        """Distributed, and the process group still exists (a handler told ``use_distributed=False`` decides alone)."""
        return self.distributed and is_distributed()

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def module(self, name: str | None = None, what: str = "NNHandler") -> nn.Module:
        """Model ``name`` itself (the one, when left out); ``what`` names the call in the error."""
        return self.modules[one_name(self.models, name, "model", what)]


def one_name(named: Mapping[str, Any], name: str | None, kind: str, what: str) -> str:
    """``name`` if ``named`` holds it, else (left out) the only name there is.

    Example:
        >>> one_name({"G": 1, "D": 2}, None, "model", "predict()")
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: predict(): this handler has 2 models ('G', 'D'): pass model='G' (or another)
    """
    names = ", ".join(map(repr, named))
    if name is None:
        if len(named) == 1:
            return next(iter(named))
        first = next(iter(named), None)
        raise ConfigurationError(f"{what}: this handler has {len(named)} {kind}s ({names}): pass "
                                 f"{kind}={first!r} (or another)")
    if name not in named:
        raise ConfigurationError(f"{what}: no {kind} named {name!r}; this handler's are {names}")
    return name


class Models:
    """What a handler trains, by name: the models as trained, their optimizers, the optimizers' schedulers.

    Args:
        wrap: Makes a model what is trained (moved, compiled, DDP-wrapped or sharded): :func:`wrap_model`'s.
        interval: ``scheduler_interval`` (a per-step ``ReduceLROnPlateau`` is refused as it is set).
        check: Called after models or optimizers are set (:func:`check_steps`); when it (or any check)
            refuses them, the models and optimizers there were are kept.
    """

    def __init__(self, wrap: Callable[[nn.Module], nn.Module], interval: str | None = None,
                 check: Callable[["Models"], None] | None = None):
        self.wrap, self.interval, self.check = wrap, interval, check
        self.trained: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self._factory: Callable | None = None  # an optimizer given as a class: rebuilt with a new model

    @property
    def modules(self) -> dict[str, nn.Module]:
        return {name: unwrap_parallel_model(model) for name, model in self.trained.items()}

    def one(self, kind: str) -> Any:
        """The one model as trained (``kind="model"``), optimizer or scheduler; None when there is none."""
        named = {"model": self.trained, "optimizer": self.optimizers, "scheduler": self.schedulers}[kind]
        if len(named) > 1:  # an AttributeError: hasattr() and TrainerView checks say "no"
            raise AttributeError(f"handler.{kind}: this handler has {len(named)} {kind}s "
                                 f"({', '.join(map(repr, named))}); use handler.{kind}s[name]")
        return next(iter(named.values()), None)

    def set_models(self, models: Any, optimizer: Any = None, kwargs: Mapping[str, Any] | None = None) -> None:
        """Use ``models`` (a module, or a mapping name -> module) from now on, each wrapped on its own.

        ``optimizer``: the optimizers to set with them (:meth:`set_optimizers`); an instance built over the
        models before they were sharded is moved onto their shards.
        """
        with self._all_or_nothing():
            self._set_models(models, optimizer, kwargs)

    def _set_models(self, models: Any, optimizer: Any, kwargs: Mapping[str, Any] | None) -> None:
        named = _named_modules(models)
        before = {name: dict(unwrap_parallel_model(m).named_parameters()) for name, m in named.items()}
        self.trained = {name: self.wrap(module) for name, module in named.items()}
        # fully_shard swaps each parameter for its shard: old -> new, held (not by id alone, which a freed
        # parameter's successor could take) until the optimizers are set.
        replaced = {}
        for name, module in self.modules.items():
            after = dict(module.named_parameters())
            replaced.update({id(old): (old, after[key]) for key, old in before[name].items()
                             if after.get(key) is not None and after[key] is not old})
        if optimizer is not None:
            self.set_optimizers(optimizer, kwargs or {}, replaced)
        elif kwargs:
            raise ConfigurationError("optimizer_kwargs were given without an optimizer class")
        elif self._factory is not None:
            self.optimizers = {OPTIMIZER: self._build(self._factory)}
        elif self.optimizers:
            log.warning("set_model: the optimizer instances still hold the previous models' parameters; "
                        "call set_optimizer with new ones")

    def set_optimizers(self, optimizer: Any, kwargs: Mapping[str, Any], replaced: dict | None = None) -> None:
        """An optimizer instance, a class built over the one model's trainable parameters, or a mapping of instances.

        ``replaced``: ``id(parameter) -> (parameter, its shard)`` of models just sharded.
        """
        with self._all_or_nothing():
            self._set_optimizers(optimizer, kwargs, replaced)

    @contextlib.contextmanager
    def _all_or_nothing(self):
        before = self.trained, self.optimizers, self.schedulers, self._factory
        try:
            yield
            if self.check is not None:
                self.check(self)
        except BaseException:
            self.trained, self.optimizers, self.schedulers, self._factory = before
            raise

    def _set_optimizers(self, optimizer: Any, kwargs: Mapping[str, Any], replaced: dict | None) -> None:
        if isinstance(optimizer, (Mapping, torch.optim.Optimizer)):
            for o in optimizer.values() if isinstance(optimizer, Mapping) else [optimizer]:
                _move_to_shards(o, replaced or {})
        if isinstance(optimizer, Mapping):
            if kwargs:
                raise ConfigurationError("optimizer_kwargs only apply when the optimizer is given as a class")
            named = dict(optimizer)
            bad = {name: type(o).__name__ for name, o in named.items()
                   if not isinstance(name, str) or not isinstance(o, torch.optim.Optimizer)}
            if bad or not named:
                raise ConfigurationError(f"a mapping of optimizers maps names (str) to optimizer instances, got "
                                         f"{bad or 'an empty mapping'}; e.g. {{'G': opt_g, 'D': opt_d}}")
            self._check_parameters(named)
            self._factory, self.optimizers = None, named
        elif isinstance(optimizer, torch.optim.Optimizer):
            if kwargs:
                raise ConfigurationError("optimizer_kwargs only apply when the optimizer is given as a class")
            self._check_parameters({OPTIMIZER: optimizer})
            self._factory, self.optimizers = None, {OPTIMIZER: optimizer}
        elif isinstance(optimizer, type) or (callable(optimizer) and not isinstance(optimizer, (list, tuple))):
            if len(self.trained) > 1:
                raise ConfigurationError(f"an optimizer class builds one optimizer over one model, and this handler "
                                         f"has {len(self.trained)} ({', '.join(map(repr, self.trained))}): pass "
                                         f"instances by name, e.g. {{'G': torch.optim.Adam(G.parameters())}}")
            kwargs = dict(kwargs)
            self._factory = lambda params: optimizer(params, **kwargs)
            self.optimizers = {OPTIMIZER: self._build(self._factory)}
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, an optimizer class, or a mapping name -> "
                            f"optimizer (e.g. {{'G': opt_g, 'D': opt_d}}), got {type(optimizer).__name__}")

    def set_schedulers(self, scheduler: Any, kwargs: Mapping[str, Any]) -> None:
        """A scheduler instance (of any of the optimizers), a class (over the one optimizer), a mapping by
        optimizer name, or None (no scheduler)."""
        if scheduler is None:
            self.schedulers = {}
            return
        if isinstance(scheduler, Mapping):
            if kwargs:
                raise ConfigurationError("scheduler_kwargs only apply when the scheduler is given as a class")
            named = {one_name(self.optimizers, name, "optimizer", "scheduler"): s for name, s in scheduler.items()}
            self.schedulers = {name: build_scheduler(s, {}, self.optimizers[name], self.interval)
                               for name, s in named.items()}
            return
        if isinstance(scheduler, type):
            name = one_name(self.optimizers, None, "optimizer", "a scheduler class") if self.optimizers else OPTIMIZER
        else:  # an instance: of the optimizer it was built for
            owner = getattr(scheduler, "optimizer", None)
            name = next((n for n, o in self.optimizers.items() if o is owner), next(iter(self.optimizers), None))
        self.schedulers = {name: build_scheduler(scheduler, dict(kwargs), self.optimizers.get(name), self.interval)}

    def _build(self, factory: Callable) -> torch.optim.Optimizer:
        module = next(iter(self.modules.values()))
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ConfigurationError(f"{type(module).__name__} has no trainable parameters, so there is nothing "
                                     f"to optimize")
        return factory(params)

    def _check_parameters(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        """Every optimizer steps parameters of the models, each parameter held by one optimizer."""
        owners = {id(p): name for name, module in self.modules.items() for p in module.parameters()}
        held: dict[int, str] = {}
        for name, optimizer in optimizers.items():
            params = [p for group in optimizer.param_groups for p in group["params"]]
            foreign = [p for p in params if id(p) not in owners]
            label = "the optimizer" if name == OPTIMIZER else f"optimizer {name!r}"
            if foreign and len(foreign) == len(params) and len(self.trained) == 1 and name == OPTIMIZER:
                raise ConfigurationError(
                    "the optimizer holds none of the model's parameters (was it built for another model, or did "
                    "it step before strategy='fsdp' sharded the model?); "
                    "pass the optimizer class instead, e.g. optimizer=torch.optim.SGD, optimizer_kwargs={'lr': 0.1}")
            if foreign:
                raise ConfigurationError(
                    f"{label} holds {len(foreign)} parameter(s) that belong to no model of this handler (was it "
                    f"built for another model, or did it step before strategy='fsdp' sharded the models?): a "
                    f"parameter outside the models is neither checkpointed nor averaged over DDP ranks; put it in "
                    f"one of the models")
            for p in params:
                other = held.setdefault(id(p), name)
                if other != name:
                    raise ConfigurationError(f"optimizers {other!r} and {name!r} both hold a parameter of model "
                                             f"{owners[id(p)]!r}: each parameter needs exactly one optimizer")


def _move_to_shards(optimizer: Any, replaced: dict) -> None:
    """An optimizer built over unsharded parameters steps their shards instead (as Accelerate's ``prepare`` does)."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not replaced:
        return
    groups = optimizer.param_groups
    if optimizer.state or not any(id(p) in replaced for g in groups for p in g["params"]):
        return  # a stepped optimizer's state belongs to the old tensors: refused as foreign below
    for group in groups:
        group["params"] = [replaced[id(p)][1] if id(p) in replaced else p for p in group["params"]]


def _named_modules(models: Any) -> dict[str, nn.Module]:
    """``models`` by name, checked: a module alone is ``"model"``; an ``nn.ModuleDict`` is a mapping of models."""
    if isinstance(models, nn.Module) and not isinstance(models, nn.ModuleDict):
        return {MODEL: models}
    if not isinstance(models, Mapping) and not isinstance(models, nn.ModuleDict):
        raise TypeError(f"model must be a torch.nn.Module or a mapping name -> module (e.g. {{'G': G, 'D': D}}), "
                        f"got {type(models).__name__}")
    named = dict(models.items())
    bad = {str(name): type(m).__name__ for name, m in named.items()
           if not isinstance(name, str) or not name or not isinstance(m, nn.Module)}
    if bad or not named:
        raise TypeError(f"a mapping of models maps names (non-empty str) to torch.nn.Module, got "
                        f"{bad or 'an empty mapping'}")
    owners: dict[int, str] = {}
    for name, module in named.items():
        for p in unwrap_parallel_model(module).parameters():
            other = owners.setdefault(id(p), name)
            if other != name:
                raise ConfigurationError(f"models {other!r} and {name!r} share parameters: each model is wrapped "
                                         f"on its own (one DDP per model), so put shared layers in one model")
    return named


def check_ready(parts: Parts, closed: bool) -> None:
    """What ``train()`` needs before it starts: an open handler, data, trainable parameters, an optimizer."""
    if closed and parts.distributed:
        # Without its DDP wrapper the model would train on each rank alone, silently.
        raise ConfigurationError("this handler was closed (its DDP model and process group are released); "
                                 "build a new NNHandler to train again")
    if parts.train_loader is None:
        raise ConfigurationError("no training data: call set_train_loader(dataset_or_loader) before train()")
    if not any(p.requires_grad for m in parts.modules.values() for p in m.parameters()):
        what = ", ".join(type(m).__name__ for m in parts.modules.values())
        raise ConfigurationError(f"{what} {'has' if len(parts.models) == 1 else 'have'} no trainable parameters, "
                                 f"so there is nothing to train")
    if not parts.optimizers:
        raise ConfigurationError("no optimizer: pass optimizer= (an instance, or a class with optimizer_kwargs) "
                                 "or call set_optimizer() before train()")
    check_not_empty(parts.train_loader, "training")
    if parts.val_loader is not None:
        check_not_empty(parts.val_loader, "validation")


def check_steps(config: TrainingConfig, models: Models, loss_fn: Callable | None) -> None:
    """Refuse, at once, steps that cannot run, and settings that no step would use.

    ``training_step`` computes the training loss: with it, ``loss_fn`` (and
    ``metrics``) serve the built-in validation only.
    """
    several, names = len(models.trained) > 1, ", ".join(map(repr, models.trained))
    if config.training_step is None and several:
        raise ConfigurationError(f"the built-in step trains one model and this handler has {len(models.trained)} "
                                 f"({names}): {OWN_STEP}")
    if config.training_step is None and len(models.optimizers) > 1:
        raise ConfigurationError(f"the built-in step steps one optimizer and this handler has "
                                 f"{len(models.optimizers)} ({', '.join(map(repr, models.optimizers))}): {OWN_STEP}")
    if config.training_step is not None and loss_fn is not None:
        if config.validation_step is not None:
            raise ConfigurationError("loss_fn would be used by no step: training_step and validation_step compute "
                                     "their own losses; drop loss_fn (call it inside your steps)")
        if several:
            raise ConfigurationError(f"loss_fn serves the built-in validation, which calls one model, and this "
                                     f"handler has {len(models.trained)} ({names}): pass validation_step=fn(ctx, "
                                     f"batch), or drop loss_fn")
    if config.metrics and config.training_step is not None and not builtin_validation(config, models.trained,
                                                                                       loss_fn):
        raise ConfigurationError("metrics= are computed by the built-in steps, and this handler runs neither: return "
                                 "them from your steps instead ({'loss': loss, 'acc': acc} gives train_acc and val_acc)")


def builtin_validation(config: TrainingConfig, models: Mapping[str, nn.Module], loss_fn: Callable | None) -> bool:
    """True when the built-in validation runs: no ``validation_step``, one model, and ``loss_fn`` or the built-in
    training step (the model's own loss)."""
    return config.validation_step is None and len(models) == 1 and (loss_fn is not None or config.training_step is None)


def check_frozen_at_wrap(parts: Parts) -> None:
    """Refuse a model that DDP did not wrap (it had no trainable parameter then) and an optimizer now trains."""
    if not parts.in_group or parts.strategy == "fsdp":
        return
    optimized = {id(p) for o in parts.optimizers.values() for g in o.param_groups for p in g["params"]}
    for name, model in parts.models.items():
        if not isinstance(model, DistributedDataParallel) and any(
                p.requires_grad and id(p) in optimized for p in model.parameters()):
            raise ConfigurationError(f"model {name!r} had no trainable parameter when it was wrapped, so no DDP "
                                     f"averages its gradients, and now an optimizer trains it: call set_model again "
                                     f"after unfreezing it")


def wrap_model(model: nn.Module, config: TrainingConfig, device: torch.device, precision: Precision,
               parallel: MultiGPUConfig, distributed: bool) -> nn.Module:
    """``model`` (unwrapped first) as trained: compiled when asked, then DDP-wrapped or sharded, or only moved.

    ``torch.compile`` is applied in place (``nn.Module.compile``), so the
    model keeps its class and its ``state_dict`` keys (no ``_orig_mod.``),
    and in the order torch recommends: the inner module before DDP wraps
    it; under FSDP2 each block before ``fully_shard`` shards it. A model
    without trainable parameters (a frozen teacher) has no gradients to
    average: DDP leaves it alone (it is moved).
    """
    if isinstance(getattr(model, "_orig_mod", None), nn.Module) and not config.compile:
        log.warning("the model came compiled (torch.compile); NNHandler trains the module inside it: pass "
                    "compile=True (and compile_kwargs) to compile it in the order DDP and FSDP need")
    model = unwrap_parallel_model(model)
    compile_kwargs = dict(config.compile_kwargs) if config.compile else None
    if config.strategy == "fsdp" and distributed:
        return shard_model(model, device, precision, config.fsdp_wrap, config.fsdp_kwargs, compile_kwargs)
    if compile_kwargs is not None:
        model.compile(**compile_kwargs)
    if distributed and not any(p.requires_grad for p in model.parameters()):
        return model.to(device)
    return prepare_model(model, parallel, device=device)
