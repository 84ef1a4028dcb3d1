"""NNHandler: one training class for CPU, one GPU, and DDP jobs (torchrun, SLURM, mpirun).

The handler orchestrates; it owns no process code. Distributed setup comes
from :func:`~nn_handler.utils.ddp.initialize_ddp`, model wrapping and data
sharding from :func:`~nn_handler.utils.parallel.prepare_model` and
:func:`~nn_handler.utils.parallel.prepare_dataloader`, checkpoint files from
:mod:`nn_handler.checkpoint`, and :meth:`NNHandler.launch` runs on the
worker pool behind :class:`~nn_handler.ParallelExecutor`.

The training itself lives in the private package :mod:`nn_handler._training`
(config, state, data, step, loop, evaluation, resume, preemption); this class
builds its parts, keeps them, and delegates each call in a few lines. Its
collectives per epoch are listed in :mod:`nn_handler._training.loop`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from nn_handler import NNHandler
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> X, y = torch.randn(64, 4), torch.randn(64, 1)
    >>> handler = NNHandler(nn.Linear(4, 1), torch.optim.SGD, nn.MSELoss(), optimizer_kwargs={"lr": 0.1})
    >>> handler.set_train_loader((X, y), batch_size=16)
    >>> history = handler.train(3, progress=False)
    >>> len(history["train_loss"]), history["train_loss"][-1] < history["train_loss"][0]
    (3, True)
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ._checks import check_int
from ._training import data as D
from ._training import evaluation, lifetime
from ._training import resume as R
from ._training.config import Resume, TrainingConfig, check_for_device, config_property
from ._training.loop import Limits, Loop
from ._training.context import StepContext
from ._training.parts import Models, Parts, check_ready, check_steps, wrap_model
from ._training.precision import Precision
from ._training.schedule import optimizer_steps_per_epoch
from ._training.sharded_checkpoint import check_every_rank_runs
from ._training.state import TrainingState, state_property
from .callbacks import Callback
from .checkpoint import load_payload
from .errors import ConfigurationError
from .history import History
from .seeding import seed_everything
from .utils._stall import current as stall_watchdog
from .utils._stall import resolve_stall_timeout, set_timeout as set_stall_timeout
from .utils.ddp import (cleanup_ddp, get_rank, get_world_size, initialize_ddp, is_distributed, resolve_device,
                        should_use_distributed)
from .utils.parallel import MultiGPUConfig, unwrap_parallel_model

__all__ = ["NNHandler"]

log = logging.getLogger(__name__)

class NNHandler:
    """Train, evaluate, predict and checkpoint a model, the same way on one process or many.

    Under a launcher that started several processes (``torchrun``, ``srun``,
    ``mpirun``), or inside an existing process group, the model is wrapped in
    ``DistributedDataParallel`` and every loader gets a ``DistributedSampler``;
    losses and metrics are averaged over all ranks weighted by sample count,
    so the History is identical on every rank and equals what one process
    would report on the same data.

    Args:
        model: The model (moved to ``device``; a wrapped model is unwrapped first), or a mapping name -> model (a
            dict or ``nn.ModuleDict``), each wrapped on its own (one DDP, or ``fully_shard``, per model).
        optimizer: An optimizer instance, or an optimizer class (or any ``callable(params,
            **optimizer_kwargs)``) to build over the model's parameters, or a mapping name -> optimizer instance.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor`` (mean over the batch); None: the output's own
            ``loss`` (a Hugging Face model given ``"labels"``). A mapping batch is called as ``model(**batch)``.
            With ``training_step``, it serves the built-in validation only.
        training_step: ``fn(ctx, batch)``, your own step in place of the built-in one, called once per
            micro-batch with a :class:`~nn_handler.StepContext` (``ctx.backward``, ``ctx.step(name)``, ...); it
            returns the loss or a mapping ``{"loss": ..., "k": ...}`` (History ``train_loss``, ``train_k``).
            Needed with several models or optimizers (docs/training.md, "Your own training step").
        validation_step: ``fn(ctx, batch)`` under ``torch.no_grad()``, returning as ``training_step`` does
            (``val_loss``, ``val_k``). Without it, validation uses ``loss_fn`` on the one model (or, with
            the built-in step, the model's own loss), or is skipped with a log line.
        device: ``"auto"`` (this rank's GPU, else CPU) or anything
            :func:`~nn_handler.resolve_device` accepts.
        use_distributed: ``None`` follows the launch environment, ``False``
            forces a single process, ``True`` asks for DDP (a warning says why not).
        scheduler: An LR scheduler instance, or a class built with ``scheduler_kwargs``, or a mapping by optimizer
            name; stepped as ``scheduler_interval`` says (``ReduceLROnPlateau`` per epoch, on ``val_loss``, else
            ``train_loss``).
        scheduler_interval: ``"epoch"`` (after each epoch), ``"step"`` (after each optimizer step, a step the fp16
            scaler skipped included) or None: ``"step"`` for ``OneCycleLR`` and ``CyclicLR``, else ``"epoch"``.
        metrics: ``{"name": fn(outputs, targets) -> float}``; recorded as
            ``train_<name>`` and ``val_<name>``, averaged per sample.
        amp: Mixed precision: ``"bf16"``, ``"fp16"`` (with a ``GradScaler``), ``True`` (bf16 where
            the device has it: the CPU, a CUDA GPU reporting bf16 support; else fp16) or ``False``.
        grad_accum_steps: Micro-batches per optimizer step (the loss is divided
            by it). Under DDP, non-final micro-steps skip the all-reduce
            (``no_sync``). The last group of an epoch may be shorter.
        clip_grad_norm: Clip the gradients' total norm to this value before each step.
        sync_batchnorm: Under DDP, convert BatchNorm layers to ``SyncBatchNorm``.
        ddp_kwargs: Passed to ``DistributedDataParallel``: ``find_unused_parameters``,
            ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``broadcast_buffers``.
        seed: :func:`~nn_handler.seed_everything` now (``random``, NumPy, torch), and the
            ``DistributedSampler``'s shuffling (0 when not given).
        optimizer_kwargs: Keyword arguments when ``optimizer`` is a class.
        scheduler_kwargs: Keyword arguments when ``scheduler`` is a class.
        callbacks: :class:`~nn_handler.callbacks.Callback` objects.
        finite_check_every: Check the loss for NaN/inf every this many
            batches. By default every batch in a single CPU process (before
            the backward pass, so no bad step is taken), and once per epoch on
            a GPU (a per-batch check would wait for the GPU every step) and in
            a distributed run (folded into the epoch's all-reduce, so no extra
            collective); a value here adds a check (distributed: one small
            collective) every that many batches.
        checkpoint_dir: Write a full checkpoint into this directory after
            every epoch (``epoch-NNNN.ckpt``, atomically, from rank 0; on a
            shared file system for multi-node jobs), keep this run's newest
            ``keep_last``, and, while :meth:`train` runs, turn SIGTERM into a
            checkpoint and a clean exit (:class:`~nn_handler.TrainingPreempted`,
            exit code :data:`~nn_handler.PREEMPTED_EXIT_CODE`). Every file
            names its run; a directory that holds another run's checkpoints
            is refused when :meth:`train` starts (see ``overwrite``).
        resume: ``"auto"``: at the start of :meth:`train`, load the newest
            complete checkpoint of ``checkpoint_dir`` by write order if there
            is one (rank 0 picks it and logs which, every rank loads that
            file) and continue its run, so rerunning a stopped, crashed or
            preempted job, or torchrun restarting it, continues where it
            stopped. A path: load that checkpoint and continue its run.
            ``None``: start a new run.
        keep_last: How many of this run's checkpoints in ``checkpoint_dir`` to keep (>= 1).
        overwrite: Start this run (``resume=None``, or a ``resume`` path) in
            a ``checkpoint_dir`` that holds another run's checkpoints by
            deleting those first; without it, :meth:`train` refuses such a
            directory with a :class:`~nn_handler.ConfigurationError`.
        preemption_check_every: Agree on "a rank got SIGTERM" every this many
            optimizer steps (a one-int collective); by default about once a
            second of training, whatever the step time (see :mod:`nn_handler._training.preemption`).
        strategy: ``"auto"`` or ``"ddp"``: every rank holds the whole model (DDP). ``"fsdp"``: FSDP2 (``fully_shard``)
            shards parameters, gradients and optimizer state over the ranks; ``amp`` also sets its
            ``MixedPrecisionPolicy`` (parameters in that dtype, fp32 gradient reduction); checkpoints are directories
            written by every rank with ``torch.distributed.checkpoint`` that resume on any number of ranks (see
            :meth:`export_model` for one file of weights). One process (no group) trains the plain model.
        fsdp_wrap: Module classes (e.g. ``{Block}``) whose instances are sharded each on their own, then the
            root; by default every child of the model that holds parameters.
        fsdp_kwargs: ``reshard_after_forward`` (True: free the gathered parameters after forward) and
            ``cpu_offload`` (keep shards in CPU memory on a GPU run; False by default).
        compile: ``torch.compile`` the model in place, in torch's order: before DDP wraps it; under FSDP each
            sharded block before ``fully_shard``. Keys stay plain. ``compile_kwargs``: ``torch.compile``'s own.
        stall_timeout: Seconds a rank may wait in a collective for a missing rank before every rank raises
            :class:`~nn_handler.CollectiveStallError` with a report (``None``: no watchdog; ``"env"``:
            ``NN_HANDLER_STALL_TIMEOUT``, else 300 s); also retunes the watchdog of your own ``initialize_ddp()``.

    Attributes:
        model: The model as trained (DDP-wrapped when distributed; under FSDP the module itself, sharded).
        module: The model itself, unwrapped (for saving and inspection).
        models, optimizers, schedulers: By name (the models unwrapped); ``model``, ``module``, ``optimizer``
            and ``scheduler`` are the one there is.
        history: The :class:`~nn_handler.History` of completed epochs.
        epoch: Completed epochs (resumes from checkpoints).
        global_step: Training steps taken (optimizer steps: one per accumulation group, however many optimizers).
        steps_per_epoch: Training steps an epoch takes on this rank (``ceil(batches / grad_accum_steps)``).
        stop_training: Set to True (by a callback) to stop after the current epoch.
        distributed, rank, world_size, device: Where this process runs.
        config: The training knobs given to the constructor, validated (read-only; also readable as
            attributes: ``grad_accum_steps``, ``amp``, ``checkpoint_dir``, ...).

    Raises:
        ConfigurationError: ``grad_accum_steps`` < 1, a non-positive
            ``clip_grad_norm``, unknown ``ddp_kwargs``, metrics that are not
            callables, an optimizer that holds none of the model's parameters,
            ``resume="auto"`` without a ``checkpoint_dir``, ``overwrite``
            without a ``checkpoint_dir`` or with ``resume="auto"``, an unknown ``strategy``, ``fsdp_wrap`` that
            is not module classes, ``fsdp_*`` settings without ``strategy="fsdp"`` (or ``ddp_kwargs`` with it),
            several models or optimizers without ``training_step``, ``loss_fn`` or ``metrics`` no step uses.

    Example:
        >>> from torch import nn
        >>> NNHandler(nn.Linear(2, 1), grad_accum_steps=0)
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: grad_accum_steps must be an int >= 1, got 0
    """

    def __init__(
        self,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: Any = None,
        loss_fn: Callable | None = None,
        *,
        training_step: Callable[[StepContext, Any], Any] | None = None,
        validation_step: Callable[[StepContext, Any], Any] | None = None,
        device: Any = "auto",
        use_distributed: bool | None = None,
        scheduler: Any = None,
        metrics: Mapping[str, Callable] | None = None,
        amp: bool | str = False,
        grad_accum_steps: int = 1,
        clip_grad_norm: float | None = None,
        sync_batchnorm: bool = False,
        ddp_kwargs: Mapping[str, Any] | None = None,
        seed: int | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        scheduler_kwargs: Mapping[str, Any] | None = None,
        callbacks: list[Callback] | None = None,
        finite_check_every: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        resume: Resume = None,
        keep_last: int = 2,
        preemption_check_every: int | None = None,
        overwrite: bool = False,
        stall_timeout: float | None | str = "env",
        strategy: str = "auto",
        fsdp_wrap: Any = None,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        compile: bool = False,
        compile_kwargs: Mapping[str, Any] | None = None,
        scheduler_interval: str | None = None,
    ):
        self.config = TrainingConfig.from_arguments(
            grad_accum_steps=grad_accum_steps, clip_grad_norm=clip_grad_norm, finite_check_every=finite_check_every,
            metrics=metrics, amp=amp, seed=seed, sync_batchnorm=sync_batchnorm, ddp_kwargs=ddp_kwargs,
            checkpoint_dir=checkpoint_dir, resume=resume, keep_last=keep_last, overwrite=overwrite,
            preemption_check_every=preemption_check_every, strategy=strategy, fsdp_wrap=fsdp_wrap,
            fsdp_kwargs=fsdp_kwargs, compile=compile, compile_kwargs=compile_kwargs,
            scheduler_interval=scheduler_interval, training_step=training_step, validation_step=validation_step)
        # The first train() loads what resume names and claims checkpoint_dir (resume.start_run).
        self._state = TrainingState(start_pending=resume is not None or checkpoint_dir is not None)
        self._owns_group, self._closed = False, False  # _owns_group: close() destroys the process group
        if seed is not None:
            seed_everything(seed)

        stall_seconds = resolve_stall_timeout(stall_timeout)  # a bad value fails before any group starts
        self.distributed = should_use_distributed(use_distributed)
        if self.distributed and not is_distributed():
            initialize_ddp(stall_timeout=stall_seconds)
            self._owns_group = True
        elif stall_timeout != "env" and stall_watchdog() is not None:
            set_stall_timeout(stall_seconds)  # the group is the caller's; its watchdog takes this handler's setting
        if checkpoint_dir is not None and stall_watchdog() is not None:
            stall_watchdog().report_next_to(checkpoint_dir)  # stall reports beside the checkpoints
        self.rank = get_rank() if self.distributed else 0
        self.world_size = get_world_size() if self.distributed else 1
        self.device = resolve_device(device)
        check_for_device(self.config, self.device, self.distributed)
        self._parallel = MultiGPUConfig(mode="distributed" if self.distributed else "none",
                                        sync_bn=self.config.sync_batchnorm, **self.config.ddp_kwargs)
        self.precision = Precision.resolve(self.config.amp, self.device)  # the one decision of dtype and scaler
        self.scaler = self.precision.make_scaler()

        self.callbacks: list[Callback] = []
        for cb in callbacks or []:
            self.add_callback(cb)
        self.train_loader: DataLoader | None = None
        self.val_loader: DataLoader | None = None
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn: Callable | None = loss_fn
        self._models = Models(lambda m: wrap_model(m, self.config, self.device, self.precision, self._parallel,
                                                   self.distributed), self.config.scheduler_interval,
                              check=lambda models: check_steps(self.config, models, self.loss_fn))
        self._models.set_models(model, optimizer, optimizer_kwargs)
        self._models.set_schedulers(scheduler, dict(scheduler_kwargs or {}))
        if self.distributed:
            lifetime.track_for_exit(self)

    # The run's state (updated by the loop and by resume) and the constructor's knobs.
    epoch = state_property("epoch", "Completed epochs (resumes from checkpoints).")
    global_step = state_property("global_step", "Training steps taken (one per accumulation group).")
    stop_training = state_property("stop_training", "Set to True (by a callback) to stop after the current epoch.")
    history = state_property("history", "The History of completed epochs.")
    partial_epoch = property(lambda self: self._state.resume_partial is not None, doc="True from where max_steps "
                             "or max_time stopped an epoch part-way (its hooks included) until it is continued.")
    steps_per_epoch = property(lambda self: optimizer_steps_per_epoch(self.train_loader, self.grad_accum_steps),
                               doc="Training steps an epoch takes on this rank (after accumulation).")
    grad_accum_steps = config_property("grad_accum_steps")
    clip_grad_norm = config_property("clip_grad_norm")
    finite_check_every = config_property("finite_check_every")
    metrics = config_property("metrics")
    amp = config_property("amp")
    seed = config_property("seed")
    checkpoint_dir = config_property("checkpoint_dir")
    keep_last = config_property("keep_last")
    overwrite = config_property("overwrite")
    preemption_check_every = config_property("preemption_check_every")
    strategy = config_property("strategy")
    scheduler_interval = config_property("scheduler_interval")

    @property
    def model(self) -> nn.Module:
        """The model as trained (DDP-wrapped, sharded); with several, an ``AttributeError`` naming them."""
        return self._models.one("model")

    @property
    def module(self) -> nn.Module:
        """The model without its DDP wrapper."""
        return unwrap_parallel_model(self.model)

    @property
    def models(self) -> dict[str, nn.Module]:
        """The models by name, unwrapped."""
        return self._models.modules

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer (None before one is set)."""
        return self._models.one("optimizer")

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimizers by name."""
        return dict(self._models.optimizers)

    @property
    def scheduler(self) -> Any:
        """The LR scheduler, or None."""
        return self._models.one("scheduler")

    @property
    def schedulers(self) -> dict[str, Any]:
        """The schedulers by the name of their optimizer."""
        return dict(self._models.schedulers)

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (and in a single process)."""
        return self.rank == 0

    def set_model(self, model: nn.Module | Mapping[str, nn.Module]) -> None:
        """Use ``model`` (or a mapping name -> model) from now on: moved to the device and, under DDP, wrapped.

        An optimizer given as a class is rebuilt over the new parameters; an
        optimizer instance must be replaced with :meth:`set_optimizer`.
        """
        self._models.set_models(model)

    def set_optimizer(self, optimizer: Any, **optimizer_kwargs: Any) -> None:
        """Use an optimizer instance, a mapping name -> instance, or one built from a class and ``optimizer_kwargs``.

        Example:
            >>> import torch
            >>> h = NNHandler(torch.nn.Linear(2, 1))
            >>> h.set_optimizer(torch.optim.Adam, lr=1e-3)
            >>> type(h.optimizer).__name__
            'Adam'
        """
        self._models.set_optimizers(optimizer, optimizer_kwargs)

    def set_loss_fn(self, loss_fn: Callable) -> None:
        """Use ``loss_fn(outputs, targets) -> scalar tensor``."""
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        check_steps(self.config, self._models, loss_fn)
        self.loss_fn = loss_fn

    def set_scheduler(self, scheduler: Any, **scheduler_kwargs: Any) -> None:
        """Use an LR scheduler instance, a mapping by optimizer name, or a class built over the optimizer; None: none."""
        self._models.set_schedulers(scheduler, scheduler_kwargs)

    def add_callback(self, callback: Callback) -> None:
        """Attach a :class:`~nn_handler.callbacks.Callback`."""
        if not isinstance(callback, Callback):
            raise TypeError(f"callbacks must be nn_handler.Callback instances, got {type(callback).__name__}")
        self.callbacks.append(callback)

    def set_train_loader(self, data: Any, **loader_kwargs: Any) -> None:
        """Training data: a ``DataLoader``, a ``Dataset`` or a tuple of tensors.

        A ``Dataset`` is wrapped in ``DataLoader(data, batch_size=32,
        shuffle=True, **loader_kwargs)``. Under DDP the loader is rebuilt with
        a ``DistributedSampler`` (same batch size, collate function, workers,
        pin memory, drop_last) and ``set_epoch`` is called every epoch.
        """
        self.train_loader = self._make_loader(data, loader_kwargs, shuffle=True)

    def set_val_loader(self, data: Any, **loader_kwargs: Any) -> None:
        """Validation data, as :meth:`set_train_loader` (not shuffled); every sample counts exactly once."""
        self.val_loader = self._make_loader(data, loader_kwargs, shuffle=False)

    # ------------------------------------------------------------------ training

    def train(self, epochs: int | None = None, *, max_steps: int | None = None, max_time: float | None = None,
              validate_every: int = 1, validate_every_n_steps: int | None = None, progress: bool = True) -> History:
        """Train until ``epochs`` epochs are complete, ``max_steps`` optimizer steps or ``max_time`` seconds.

        ``epochs`` and ``max_steps`` count from the start of training (a run
        resumed after epoch 2 and asked for ``train(4)`` runs epochs 3 and 4),
        ``max_time`` from this call; every rank stops at the same step. A limit
        inside an epoch ends it there, with a History row, ``on_epoch_end`` and
        (``checkpoint_dir``) a mid-epoch checkpoint; the next ``train()`` or a
        resume continues at the next batch as if never stopped (docs/training.md).

        Args:
            epochs: The epoch to train up to (>= 1), or None for no epoch limit.
            max_steps: The global optimizer step to stop at (>= 1), or None.
            max_time: Seconds to train for in this call (> 0), or None.
            validate_every: Validate after every this many epochs (needs a
                validation loader; >= 1).
            validate_every_n_steps: Also validate every this many optimizer steps (global), each a History row
                ``{epoch, step, val_*, lr}`` and an ``on_validation_end``; not twice at an epoch's end.
            progress: One tqdm bar per epoch on the main process (off a terminal, also a line per epoch).

        With ``checkpoint_dir``, a checkpoint is written after every epoch,
        and a SIGTERM (SLURM, Kubernetes, torchrun forwarding its own) makes
        every rank finish its current optimizer step, rank 0 write a
        checkpoint of exactly that point (mid-epoch included), and every rank
        raise :class:`~nn_handler.TrainingPreempted`. The previous SIGTERM
        handler is back when ``train`` returns or raises. With ``resume``, the
        checkpoint is loaded first; a run resumed mid-epoch skips the batches
        already trained (``on_epoch_begin`` runs again, the batch hooks of
        those batches do not) and ends with the same weights and History as
        an uninterrupted run.

        Returns:
            The History (all epochs, including those before a resume).

        Raises:
            ConfigurationError: No limit or a bad one; no training data or optimizer; no loss_fn and no loss
                in the model's output (at the first batch); no trainable parameters; no batches;
                ranks given different numbers of batches.
            NonFiniteLossError: The loss became NaN or infinite (on every rank).
            TrainingPreempted: A preemption signal arrived (with
                ``checkpoint_dir``); its checkpoint is on disk. Uncaught, the
                process exits with :data:`~nn_handler.PREEMPTED_EXIT_CODE`.
            CheckpointError: ``resume`` names a checkpoint that a rank cannot load.
        """
        limits = Limits.checked(epochs, max_steps, max_time)
        validate_every = check_int("validate_every", validate_every, minimum=1)
        check_int("validate_every_n_steps", validate_every_n_steps, minimum=1, allow_none=True)
        parts, state = self._parts(), self._state
        check_ready(parts, closed=self._closed)
        check_every_rank_runs(parts, "NNHandler.train")  # refused at once inside on_rank
        if state.start_pending:
            R.start_run(parts, self.config, state)
            state.start_pending = False  # only once it succeeded: a refused directory stays refused
        Loop(parts, self.config, state).run(limits, validate_every, progress, validate_every_n_steps)
        return self.history

    def evaluate(self, data: Any = None) -> dict[str, float]:
        """Loss and metrics over ``data`` (or the validation loader), every sample counted once over all ranks.

        Returns:
            ``{"loss": ..., "<metric>": ...}``, identical on every rank.

        Raises:
            ConfigurationError: No data given and no validation loader set, no
                loss function, or no samples.
        """
        if data is None:
            if self.val_loader is None:
                raise ConfigurationError("evaluate() needs data, or a validation loader set with set_val_loader()")
            loader = self.val_loader
        else:
            loader = self._make_loader(data, {}, shuffle=False)
        return evaluation.evaluate(self._parts(), self.config, loader)

    def predict(self, data: Any, batch_size: int | None = None, *, model: str | None = None,
                data_parallel: bool = False, device_ids: Sequence[int | str] | None = None,
                padding_value: float = -100) -> Any:
        """Model outputs for every sample of ``data``, in input order, on CPU.

        Under DDP each rank predicts its shard; the shards are gathered with
        their sample indices, so every rank returns the full result with each
        sample exactly once, also when the dataset size does not divide by
        the number of ranks.

        Args:
            data: A tensor of inputs, a tuple of tensors (the first is the
                input), a ``Dataset`` or a ``DataLoader`` (its order and
                batching settings are kept; shuffling is turned off).
            batch_size: Batch size (default: the loader's, else 32).
            model: The name of the model to run, with several (``predict(x, model="G")``).
            data_parallel: From a single process, run the model on every
                device at once through :func:`~nn_handler.parallel_predict`
                (one worker per device, batches spread dynamically).
            device_ids: Devices for ``data_parallel`` (all GPUs by default;
                ``["cpu", "cpu"]`` for CPU workers).
            padding_value: Where batches' outputs differ in length (a collate that pads each batch to its
                longest row), the shorter are padded to the longest with this.

        Returns:
            The concatenated outputs: a tensor, a tuple (of tuples) of them, or for a mapping output (``ModelOutput``)
            that mapping; a scalar (a loss) is left out of a mapping, None in a tuple.

        Example:
            >>> import torch
            >>> h = NNHandler(torch.nn.Identity())
            >>> h.predict(torch.arange(5.0).reshape(5, 1)).flatten().tolist()
            [0.0, 1.0, 2.0, 3.0, 4.0]
        """
        parts = self._parts()
        module = parts.module(model, "predict()")
        if data_parallel:
            return evaluation.predict_data_parallel(parts, module, data, batch_size, device_ids, padding_value)
        loader = D.predict_loader(data, batch_size, self._parallel, self.config.seed)
        return evaluation.predict(parts, module, loader, padding_value)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, rng_states: list | None = None) -> dict[str, Any]:
        """Everything :meth:`load_checkpoint` needs to continue exactly, as plain tensors and values.

        Args:
            rng_states: Every rank's random state, in rank order (gathered by
                :meth:`save_checkpoint`); this rank's alone by default.
        """
        return R.state_dict(self._parts(), self._state, rng_states)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write a full training checkpoint from rank 0, atomically; call it on every rank.

        Holds the unwrapped model, optimizer, scheduler, grad scaler, epoch,
        step, History, every rank's RNG states and the callbacks' state, as
        tensors and plain values (loadable with ``torch.load(weights_only=True)``).
        A crash during the write leaves the previous file at ``path`` intact.

        Raises:
            OSError: On rank 0, the write failed (``path`` is unchanged).
            CheckpointError: On the other ranks, when rank 0's write failed.
        """
        R.save(self._parts(), self._state, path, self._state.resume_partial)  # after a max_steps stop: mid-epoch

    def load_checkpoint(self, path: str | os.PathLike, resume: bool = True) -> int:
        """Load a checkpoint written by :meth:`save_checkpoint`, on every rank.

        Args:
            path: The file (or, from a ``strategy="fsdp"`` run, the directory).
            resume: Restore the full training state (optimizer, scheduler,
                scaler, epoch, step, History, RNG states, callbacks) so that
                :meth:`train` continues exactly where the run stopped;
                ``False`` loads the model weights only.

        Returns:
            The number of epochs the checkpoint had completed.

        Raises:
            CheckpointError: The file is missing, corrupt or truncated, or not
                an nn_handler checkpoint.
            CheckpointMismatchError: Its weights do not fit the model (the
                message names the keys).
        """
        payload = R.checked_payload(load_payload(path), path)
        epoch = R.restore(self._parts(), self._state, payload, path, resume)
        self._state.finished_early = False  # an explicit load means "continue from here"
        return epoch

    def save_model(self, path: str | os.PathLike) -> None:
        """Write the model's ``state_dict`` alone, atomically, from rank 0 (as :meth:`export_model`); call it on every rank."""
        self.export_model(path)

    def export_model(self, path: str | os.PathLike) -> None:
        """Write the whole model's ``state_dict`` as one file, from rank 0; call it on every rank.

        Under ``strategy="fsdp"`` the shards are gathered to rank 0 (on CPU) first. The file loads with
        ``torch.load(path, weights_only=True)`` into the plain model, on any machine, without nn_handler.
        With several models it holds ``{name: state_dict}``: ``G.load_state_dict(torch.load(path)["G"])``.
        """
        R.export_model(self._parts(), path)

    def load_model(self, path: str | os.PathLike) -> None:
        """Load weights saved by :meth:`save_model` (by name, with several models), or a checkpoint's.

        Raises:
            CheckpointError: A missing, corrupt or truncated file.
            CheckpointMismatchError: Weights that do not fit the model (keys named).
        """
        R.load_model(self._parts(), path)

    def plot_history(self, path: str | os.PathLike) -> None:
        """Save a PNG of the loss and metric curves (main process only; others return at once).

        Raises:
            MissingExtraError: matplotlib is missing (``pip install 'nn_handler[plot]'``).
            ValueError: No epoch has been trained yet.
        """
        if self.is_main_process:
            self.history.plot(path)

    @staticmethod
    def launch(fn: Callable[..., Any], *args: Any, nprocs: int | None = None, timeout: float | None = None,
               stall_timeout: float | None | str = "env", **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in each process of a new local DDP group; return rank 0's result.

        Starts ``nprocs`` processes (one per GPU by default, with NCCL; gloo on
        CPU, where ``nprocs`` must be given) on the worker pool of
        :class:`~nn_handler.ParallelExecutor`, joins them into one group and runs
        ``fn`` in each (it travels with cloudpickle: notebook functions work).
        Under torchrun, srun, mpirun or a group of several ranks already up,
        nothing starts: ``fn`` runs once here, as this rank, so one script runs anywhere.

        Args:
            fn: The function to run on every rank.
            *args: Its positional arguments.
            nprocs: Number of processes (an existing launch's world size).
            timeout: Seconds before the call is abandoned and its processes
                killed (``TimeoutError``); no limit by default (nor under an existing launch).
            stall_timeout: The ranks' stall watchdog, as on ``NNHandler``; a number wins over the variable.
            **kwargs: Its keyword arguments.

        Returns:
            What ``fn`` returned on rank 0; under an existing launch, on this rank.

        Raises:
            ParallelExecutionError: ``fn`` raised on a rank (the failing ranks
                tear the group down, so the others fail fast instead of waiting
                in a collective; every rank's traceback is in the message).
            WorkerDiedError: A process died.
            ValueError: ``nprocs`` missing without GPUs, more than the GPUs, or not the launch's world size.

        Example:
            >>> def body():
            ...     import torch.distributed as dist
            ...     return dist.get_world_size()
            >>> NNHandler.launch(body, nprocs=2)  # doctest: +SKIP
            2
        """
        from .utils._workers.launch import launch

        return launch(fn, args, kwargs, nprocs, timeout, stall_timeout)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Release the DDP model, then the process group if this handler created it.

        In that order: a gloo group still referenced by a live DDP model can
        abort the process when it is destroyed, or at interpreter exit
        (measured with torch 2.13: about one run in three). Afterwards
        :attr:`model` is the plain module, still usable in this process. A
        group created before the handler (by your own ``initialize_ddp()``)
        is left for you to destroy. Calling it again does nothing; handlers
        not closed by the script are closed at interpreter exit.

        Example:
            >>> import torch
            >>> with NNHandler(torch.nn.Linear(2, 1)) as handler:
            ...     pass
            >>> handler.close()  # again: harmless
        """
        if self._closed:
            return
        self._closed = True
        lifetime.forget(self)
        if any(isinstance(m, DistributedDataParallel) for m in self._models.trained.values()):
            self._models.trained = {n: unwrap_parallel_model(m) for n, m in self._models.trained.items()}
            # DDP's reducer holds the group; cycles through its hooks can keep
            # it alive past the last reference, so collect them now.
            gc.collect()
        if self._owns_group and is_distributed():
            cleanup_ddp()

    def __enter__(self) -> "NNHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"rank {self.rank}/{self.world_size}, " if self.distributed else ""
        models = ", ".join(type(m).__name__ if n == "model" else f"{n}={type(m).__name__}"
                           for n, m in self.models.items())
        return f"NNHandler({models}, {where}{self.device}, epoch={self.epoch})"

    def _parts(self) -> Parts:
        """What a call works on, handed to :mod:`nn_handler._training` explicitly."""
        return Parts(view=self, models=dict(self._models.trained), optimizers=dict(self._models.optimizers),
                     schedulers=dict(self._models.schedulers), scaler=self.scaler, loss_fn=self.loss_fn,
                     train_loader=self.train_loader, val_loader=self.val_loader, callbacks=self.callbacks,
                     device=self.device, distributed=self.distributed, rank=self.rank, world_size=self.world_size,
                     precision=self.precision, strategy=self.config.strategy)

    def _make_loader(self, data: Any, loader_kwargs: dict, *, shuffle: bool) -> DataLoader:
        return D.make_loader(data, loader_kwargs, self._parallel, shuffle=shuffle, seed=self.config.seed)
