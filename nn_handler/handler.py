"""NNHandler: one training class for CPU, one GPU, and DDP jobs (torchrun, SLURM, mpirun).

The handler orchestrates; it owns no process code. Distributed setup comes
from :func:`~nn_handler.utils.ddp.initialize_ddp`, model wrapping and data
sharding from :func:`~nn_handler.utils.parallel.prepare_model` and
:func:`~nn_handler.utils.parallel.prepare_dataloader`, checkpoint files from
:mod:`nn_handler.checkpoint`, and :meth:`NNHandler.launch` runs on the
worker pool behind :class:`~nn_handler.ParallelExecutor`.

Collectives per epoch, beyond DDP's own gradient all-reduce: one all-reduce
of the epoch's sums (losses, metrics, sample counts, timings, memory, the
first non-finite step), one for the stop flag, and, with validation, nothing
more. Per training step the loop makes no collective and, in a distributed
run, reads no value back from the device.

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

import atexit
import contextlib
import functools
import gc
import logging
import os
import random
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

from . import _training as T
from ._checks import check_bool, check_int, check_number, invalid
from ._preemption import PREEMPTION_SIGNALS, PreemptionMonitor, SignalCatcher, TrainingPreempted, signal_name
from .callbacks import Callback
from .checkpoint import (
    FORMAT,
    atomic_save,
    capture_rng_state,
    load_payload,
    load_weights,
    prune_run_checkpoints,
    read_run_info,
    remove_stale_temp_files,
    restore_rng_state,
    run_checkpoint_name,
    run_info,
    scan_run_checkpoints,
)
from .errors import CheckpointError, CheckpointMismatchError, ConfigurationError, NonFiniteLossError, RankFailedError
from .history import History
from .utils._collectives import agree_on_failure, gather, run_on_ranks, side_group
from .utils.ddp import (
    cleanup_ddp,
    get_rank,
    get_world_size,
    initialize_ddp,
    is_distributed,
    resolve_device,
    should_use_distributed,
)
from .utils.ddp_decorators import any_rank
from .utils.parallel import MultiGPUConfig, parallel_predict, prepare_dataloader, prepare_model, unwrap_parallel_model

__all__ = ["NNHandler"]

log = logging.getLogger(__name__)

_DDP_KEYS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb", "broadcast_buffers")
_DEFAULT_BATCH_SIZE = 32
_BAR_REFRESH_S = 0.5  # how often the progress bar reads the loss back from the device
Resume = Union[Literal["auto"], str, os.PathLike, None]

# Handlers with a DDP model, closed at interpreter exit if the script did not
# close them: a gloo group still referenced by a live DDP model can abort the
# process while the interpreter tears down (measured with torch 2.13).
_live_handlers: "weakref.WeakSet[NNHandler]" = weakref.WeakSet()
_atexit_registered = False


def _close_live_handlers() -> None:
    for handler in list(_live_handlers):
        try:
            handler.close()
        except Exception as exc:  # exiting anyway: report, do not mask the exit status
            log.warning("closing %r at exit failed: %s", handler, exc)


def _track_for_exit(handler: "NNHandler") -> None:
    global _atexit_registered
    _live_handlers.add(handler)
    if not _atexit_registered:  # on first use, not at import
        atexit.register(_close_live_handlers)
        _atexit_registered = True


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


class NNHandler:
    """Train, evaluate, predict and checkpoint a model, the same way on one process or many.

    Under a launcher that started several processes (``torchrun``, ``srun``,
    ``mpirun``), or inside an existing process group, the model is wrapped in
    ``DistributedDataParallel`` and every loader gets a ``DistributedSampler``;
    losses and metrics are averaged over all ranks weighted by sample count,
    so the History is identical on every rank and equals what one process
    would report on the same data.

    Args:
        model: The model (moved to ``device``; a wrapped model is unwrapped first).
        optimizer: An optimizer instance, or an optimizer class (or any
            ``callable(params, **optimizer_kwargs)``) to build over the model's parameters.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor`` (mean over the batch).
        device: ``"auto"`` (this rank's GPU, else CPU) or anything
            :func:`~nn_handler.resolve_device` accepts.
        use_distributed: ``None`` follows the launch environment, ``False``
            forces a single process, ``True`` asks for DDP (a warning says why not).
        scheduler: An LR scheduler instance, or a class built with
            ``scheduler_kwargs``; stepped once per epoch (``ReduceLROnPlateau``
            gets ``val_loss``, else ``train_loss``).
        metrics: ``{"name": fn(outputs, targets) -> float}``; recorded as
            ``train_<name>`` and ``val_<name>``, averaged per sample.
        amp: Autocast: bf16 on CPU, fp16 with a ``GradScaler`` on CUDA.
        grad_accum_steps: Micro-batches per optimizer step (the loss is divided
            by it). Under DDP, non-final micro-steps skip the all-reduce
            (``no_sync``). The last group of an epoch may be shorter.
        clip_grad_norm: Clip the gradients' total norm to this value before each step.
        sync_batchnorm: Under DDP, convert BatchNorm layers to ``SyncBatchNorm``.
        ddp_kwargs: Passed to ``DistributedDataParallel``: ``find_unused_parameters``,
            ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``broadcast_buffers``.
        seed: Seeds ``torch``, ``random`` and NumPy now, and the
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
            second of training, whatever the step time (see :mod:`nn_handler._preemption`).

    Attributes:
        model: The model as trained (wrapped in DDP when distributed).
        module: The model itself, unwrapped (for saving and inspection).
        history: The :class:`~nn_handler.History` of completed epochs.
        epoch: Completed epochs (resumes from checkpoints).
        global_step: Optimizer steps taken.
        stop_training: Set to True (by a callback) to stop after the current epoch.
        distributed, rank, world_size, device: Where this process runs.

    Raises:
        ConfigurationError: ``grad_accum_steps`` < 1, a non-positive
            ``clip_grad_norm``, unknown ``ddp_kwargs``, metrics that are not
            callables, an optimizer that holds none of the model's parameters,
            ``resume="auto"`` without a ``checkpoint_dir``, ``overwrite``
            without a ``checkpoint_dir`` or with ``resume="auto"``.

    Example:
        >>> from torch import nn
        >>> NNHandler(nn.Linear(2, 1), grad_accum_steps=0)
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: grad_accum_steps must be an int >= 1, got 0
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        loss_fn: Callable | None = None,
        *,
        device: Any = "auto",
        use_distributed: bool | None = None,
        scheduler: Any = None,
        metrics: Mapping[str, Callable] | None = None,
        amp: bool = False,
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
    ):
        self.grad_accum_steps = check_int("grad_accum_steps", grad_accum_steps, minimum=1)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_last = check_int("keep_last", keep_last, minimum=1)
        self.preemption_check_every = check_int("preemption_check_every", preemption_check_every, minimum=1,
                                                allow_none=True)
        if resume == "auto" and self.checkpoint_dir is None:
            raise ConfigurationError("resume='auto' looks for checkpoints in checkpoint_dir; pass checkpoint_dir=...")
        if resume is not None and not isinstance(resume, (str, os.PathLike)):
            raise invalid("resume", "None, 'auto' or a checkpoint path", resume)
        check_bool("overwrite", overwrite)
        if overwrite and self.checkpoint_dir is None:
            raise ConfigurationError("overwrite=True applies to checkpoint_dir's files; pass checkpoint_dir=...")
        if overwrite and resume == "auto":
            raise ConfigurationError("overwrite=True starts a new run over the checkpoints in checkpoint_dir, and "
                                     "resume='auto' continues them: choose one")
        self.overwrite = overwrite
        self._resume: Resume = resume
        # The first train() loads what resume names and claims checkpoint_dir (_start_run).
        self._start_pending = resume is not None or self.checkpoint_dir is not None
        # Written into every checkpoint: the files of checkpoint_dir that carry
        # this id are this run's (to prune, to resume). A resumed checkpoint's
        # id replaces it, so a rerun continues the same run.
        self._run_id = uuid.uuid4().hex
        self._run_seq = 0  # checkpoint_dir's last write number (rank 0 numbers the files it writes)
        self._resume_partial: dict[str, Any] | None = None  # a mid-epoch checkpoint's state, until train uses it
        self._finished_early = False  # the loaded checkpoint was written after an early stop
        self._owns_group = False
        self._closed = False
        self.clip_grad_norm = check_number("clip_grad_norm", clip_grad_norm, allow_none=True)
        self.finite_check_every = check_int("finite_check_every", finite_check_every, minimum=1, allow_none=True)
        self.metrics = self._check_metrics(metrics)
        unknown = sorted(set(ddp_kwargs or {}) - set(_DDP_KEYS))
        if unknown:
            raise ConfigurationError(f"unknown ddp_kwargs {unknown}; allowed: {', '.join(_DDP_KEYS)}")
        self.seed = seed
        if seed is not None:
            _seed_everything(seed)

        self.distributed = should_use_distributed(use_distributed)
        if self.distributed and not is_distributed():
            initialize_ddp()
            self._owns_group = True  # so close() destroys it
        self.rank = get_rank() if self.distributed else 0
        self.world_size = get_world_size() if self.distributed else 1
        self.device = resolve_device(device)
        if sync_batchnorm and self.distributed and self.device.type != "cuda":
            raise ConfigurationError(
                f"sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm does not run on {self.device.type}); "
                f"leave it False here: each rank then normalizes with its own batch statistics"
            )
        self.amp = bool(amp)
        self._parallel = MultiGPUConfig(mode="distributed" if self.distributed else "none",
                                        sync_bn=bool(sync_batchnorm), **dict(ddp_kwargs or {}))
        # fp16 needs loss scaling; bf16 (CPU autocast) has fp32's range and does not.
        self.scaler = torch.amp.GradScaler("cuda") if self.amp and self.device.type == "cuda" else None

        self.history = History()
        self.epoch = 0
        self.global_step = 0
        self.stop_training = False
        self.callbacks: list[Callback] = []
        for cb in callbacks or []:
            self.add_callback(cb)
        self.train_loader: DataLoader | None = None
        self.val_loader: DataLoader | None = None
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.loss_fn: Callable | None = None
        self._optimizer_factory: Callable | None = None
        self.set_model(model)
        if optimizer is not None:
            self.set_optimizer(optimizer, **dict(optimizer_kwargs or {}))
        elif optimizer_kwargs:
            raise ConfigurationError("optimizer_kwargs were given without an optimizer class")
        if loss_fn is not None:
            self.set_loss_fn(loss_fn)
        if scheduler is not None:
            self.set_scheduler(scheduler, **dict(scheduler_kwargs or {}))
        if self.distributed:
            _track_for_exit(self)

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _check_metrics(metrics) -> dict[str, Callable]:
        if metrics is None:
            return {}
        if not isinstance(metrics, Mapping):
            raise ConfigurationError(f"metrics must be a dict of name -> fn(outputs, targets), got {type(metrics).__name__}")
        for name, fn in metrics.items():
            if not isinstance(name, str) or not callable(fn):
                raise ConfigurationError(f"metric {name!r} must map a str to a callable fn(outputs, targets), got {fn!r}")
        return dict(metrics)

    @property
    def module(self) -> nn.Module:
        """The model without its DDP wrapper."""
        return unwrap_parallel_model(self.model)

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (and in a single process)."""
        return self.rank == 0

    def set_model(self, model: nn.Module) -> None:
        """Use ``model`` from now on: moved to the device and, under DDP, wrapped.

        An optimizer given as a class is rebuilt over the new parameters; an
        optimizer instance must be replaced with :meth:`set_optimizer`.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = prepare_model(unwrap_parallel_model(model), self._parallel, device=self.device)
        if self._optimizer_factory is not None:
            self.optimizer = self._build_optimizer(self._optimizer_factory)
        elif self.optimizer is not None:
            log.warning("set_model: the optimizer instance still holds the previous model's parameters; "
                        "call set_optimizer with a new one")

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _build_optimizer(self, factory: Callable) -> torch.optim.Optimizer:
        params = self._trainable()
        if not params:
            raise ConfigurationError(
                f"{type(self.module).__name__} has no trainable parameters, so there is nothing to optimize"
            )
        return factory(params)

    def set_optimizer(self, optimizer: Any, **optimizer_kwargs: Any) -> None:
        """Use an optimizer instance, or build one from a class and ``optimizer_kwargs``.

        Example:
            >>> import torch
            >>> h = NNHandler(torch.nn.Linear(2, 1))
            >>> h.set_optimizer(torch.optim.Adam, lr=1e-3)
            >>> type(h.optimizer).__name__
            'Adam'
        """
        if isinstance(optimizer, torch.optim.Optimizer):
            if optimizer_kwargs:
                raise ConfigurationError("optimizer_kwargs only apply when the optimizer is given as a class")
            mine = {id(p) for p in self.module.parameters()}
            theirs = [p for group in optimizer.param_groups for p in group["params"]]
            if not any(id(p) in mine for p in theirs):
                raise ConfigurationError(
                    "the optimizer holds none of the model's parameters (was it built for another model?); "
                    "pass the optimizer class instead, e.g. optimizer=torch.optim.SGD, optimizer_kwargs={'lr': 0.1}"
                )
            self._optimizer_factory = None
            self.optimizer = optimizer
        elif callable(optimizer):
            kwargs = dict(optimizer_kwargs)
            self._optimizer_factory = lambda params: optimizer(params, **kwargs)
            self.optimizer = self._build_optimizer(self._optimizer_factory)
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a class, got {type(optimizer).__name__}")

    def set_loss_fn(self, loss_fn: Callable) -> None:
        """Use ``loss_fn(outputs, targets) -> scalar tensor``."""
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn

    def set_scheduler(self, scheduler: Any, **scheduler_kwargs: Any) -> None:
        """Use an LR scheduler instance, or build one from a class over the current optimizer; None removes it."""
        if scheduler is None:
            self.scheduler = None
            return
        if isinstance(scheduler, type):
            if self.optimizer is None:
                raise ConfigurationError("set an optimizer before building a scheduler from a class")
            scheduler = scheduler(self.optimizer, **scheduler_kwargs)
        elif scheduler_kwargs:
            raise ConfigurationError("scheduler_kwargs only apply when the scheduler is given as a class")
        if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")):
            raise TypeError(f"scheduler must be an LR scheduler, got {type(scheduler).__name__}")
        if getattr(scheduler, "optimizer", self.optimizer) is not self.optimizer:
            raise ConfigurationError("the scheduler was built for another optimizer than this handler's")
        self.scheduler = scheduler

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

    def _make_loader(self, data: Any, loader_kwargs: dict, *, shuffle: bool) -> DataLoader:
        if isinstance(data, DataLoader):
            if loader_kwargs:
                raise ConfigurationError(
                    f"loader settings {sorted(loader_kwargs)} only apply to a Dataset; "
                    f"the given DataLoader keeps its own"
                )
            loader = data
        else:
            if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
                data = TensorDataset(*data)
            if not isinstance(data, Dataset):
                raise TypeError(
                    f"data must be a DataLoader, a Dataset or a tuple of tensors, got {type(data).__name__}"
                )
            _check_not_empty(data, "given")
            kwargs = {"batch_size": _DEFAULT_BATCH_SIZE, **loader_kwargs}
            if not isinstance(data, IterableDataset):
                kwargs.setdefault("shuffle", shuffle)
            loader = DataLoader(data, **kwargs)
        # Evaluation order does not matter, and unshuffled shards keep the
        # padding DistributedSampler adds at the end, where it is cut off.
        return prepare_dataloader(loader, self._parallel, shuffle=None if shuffle else False,
                                  seed=self.seed if self.seed is not None else 0)

    def _check_ready(self) -> None:
        if self._closed and self.distributed:
            # Without its DDP wrapper the model would train on each rank alone, silently.
            raise ConfigurationError("this handler was closed (its DDP model and process group are released); "
                                     "build a new NNHandler to train again")
        if self.train_loader is None:
            raise ConfigurationError("no training data: call set_train_loader(dataset_or_loader) before train()")
        if self.loss_fn is None:
            raise ConfigurationError("no loss function: pass loss_fn= to NNHandler or call set_loss_fn() before train()")
        if not self._trainable():
            raise ConfigurationError(
                f"{type(self.module).__name__} has no trainable parameters, so there is nothing to train"
            )
        if self.optimizer is None:
            raise ConfigurationError(
                "no optimizer: pass optimizer= (an instance, or a class with optimizer_kwargs) "
                "or call set_optimizer() before train()"
            )
        _check_not_empty(self.train_loader, "training")
        if self.val_loader is not None:
            _check_not_empty(self.val_loader, "validation")

    # ------------------------------------------------------------------ training

    def train(self, epochs: int, *, validate_every: int = 1, progress: bool = True) -> History:
        """Train until ``epochs`` epochs are complete, validating every ``validate_every`` epochs.

        ``epochs`` counts from the start of training, not from this call: a
        handler resumed from a checkpoint after epoch 2 and asked for
        ``train(4)`` runs epochs 3 and 4, so rerunning an interrupted script
        finishes the job instead of starting over.

        Args:
            epochs: The epoch to train up to (>= 1).
            validate_every: Validate after every this many epochs (needs a
                validation loader; >= 1).
            progress: One tqdm bar per epoch on the main process.

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
            ConfigurationError: No training data, loss function or optimizer; a
                model without trainable parameters; an empty dataset or a
                loader that yields no batches.
            NonFiniteLossError: The loss became NaN or infinite (on every rank).
            TrainingPreempted: A preemption signal arrived (with
                ``checkpoint_dir``); its checkpoint is on disk. Uncaught, the
                process exits with :data:`~nn_handler.PREEMPTED_EXIT_CODE`.
            CheckpointError: ``resume`` names a checkpoint that a rank cannot load.
        """
        epochs = check_int("epochs", epochs, minimum=1)
        validate_every = check_int("validate_every", validate_every, minimum=1)
        self._check_ready()
        if self._start_pending:
            self._start_run()
            self._start_pending = False  # only once it succeeded: a refused directory stays refused
        if self._finished_early:
            log.warning("train(%d): the run stopped early after epoch %d (resumed from its last checkpoint); "
                        "nothing to do", epochs, self.epoch)
            return self.history
        if self.epoch >= epochs:
            log.warning("train(%d): %d epochs are already complete; nothing to do", epochs, self.epoch)
            return self.history
        self.stop_training = False
        for cb in self.callbacks:
            cb.on_train_begin(self)
        try:
            self._train_until(epochs, validate_every, progress)
        except Exception as exc:
            # Outside the SIGTERM catcher: torchrun's SIGTERM ends the wait.
            T.wait_if_peer_failed(exc)
            raise
        for cb in self.callbacks:
            cb.on_train_end(self)
        return self.history

    def _train_until(self, epochs: int, validate_every: int, progress: bool) -> None:
        catcher = SignalCatcher() if self.checkpoint_dir is not None else None
        with catcher if catcher is not None else contextlib.nullcontext():
            monitor = None
            if catcher is not None:
                monitor = PreemptionMonitor(catcher, self.distributed and is_distributed(), self.preemption_check_every)
            while self.epoch < epochs:
                try:
                    self._run_epoch(epochs, validate_every, progress, monitor)
                except _StopMidEpoch as stop:
                    path = self._save_run_checkpoint(stop.partial)
                    raise self._preempted(path, self.epoch + 1, stop.partial["batches"], catcher) from None
                # Agree, so that a callback that stopped one rank stops them all
                # after the same epoch (the next epoch's collectives would hang);
                # with a monitor, one collective says "stop" and "preempted".
                if monitor is None:
                    stop, preempt = self._any_rank(self.stop_training), False
                else:
                    stop, preempt = monitor.epoch_end(self.stop_training)
                self.stop_training = stop
                if self.checkpoint_dir is not None:
                    path = self._save_run_checkpoint()
                if preempt:
                    raise self._preempted(path, self.epoch, 0, catcher)
                if stop:
                    break

    def _preempted(self, path: Path, epoch: int, batches: int, catcher: SignalCatcher) -> TrainingPreempted:
        # Every rank raises the same exception; the one that did not receive
        # the signal itself still names it (another rank did).
        exc = TrainingPreempted(str(path), epoch, batches, signal_name(catcher.received or PREEMPTION_SIGNALS[0]))
        catcher.handled = True
        if self.is_main_process:
            log.warning("%s", exc)
        return exc

    def _any_rank(self, flag: bool) -> bool:
        if not (self.distributed and is_distributed()):
            return bool(flag)  # a handler told use_distributed=False inside a group decides alone
        return any_rank(flag)

    def _run_epoch(self, epochs: int, validate_every: int, progress: bool,
                   monitor: PreemptionMonitor | None = None) -> None:
        epoch = self.epoch + 1
        for cb in self.callbacks:
            cb.on_epoch_begin(self, epoch)
        sampler = getattr(self.train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)  # DistributedSampler: a new shuffle each epoch, the same on every rank
        lr = self.optimizer.param_groups[0]["lr"]
        T.reset_peak_memory(self.device)
        start = time.perf_counter()
        train = self._train_epoch(epoch, epochs, progress, monitor)
        train_time = time.perf_counter() - start
        validate = self.val_loader is not None and epoch % validate_every == 0
        val = self._eval_sums(self.val_loader) if validate else []
        epoch_time = time.perf_counter() - start

        mine = [train_time, epoch_time, T.peak_memory_mb(self.device), train["bad_step"], train["bad_value"]]
        totals, ranks = T.reduce_over_ranks(train["sums"] + val, mine, self.device, self.distributed)
        bad = [(r, int(v[3]), v[4]) for r, v in enumerate(ranks) if v[3] >= 0]
        if bad:
            self._raise_nonfinite(epoch, bad)

        k = len(train["sums"])
        row: dict[str, Any] = {"epoch": epoch, **self._means("train_", totals[:k])}
        if validate:
            val_logs = self._means("val_", totals[k:])
            row.update(val_logs)
            for cb in self.callbacks:
                cb.on_validation_end(self, epoch, val_logs)
        slowest_train = max(v[0] for v in ranks)
        row.update(lr=lr, epoch_time=max(v[1] for v in ranks),
                   samples_per_sec=totals[1] / slowest_train if slowest_train > 0 else float("nan"))
        row.update({f"peak_mem_mb_rank{r}": v[2] for r, v in enumerate(ranks)})
        self._step_scheduler(row)
        self.epoch = epoch
        self.history.append(row)
        if self.is_main_process:
            log.info("epoch %d/%d: %s", epoch, epochs,
                     " ".join(f"{k}={v:.4g}" for k, v in row.items() if k.startswith(("train_", "val_"))))
        for cb in self.callbacks:
            cb.on_epoch_end(self, epoch, row)

    def _means(self, prefix: str, sums: list[float]) -> dict[str, float]:
        # sums: [loss_sum, sample_count, metric_sum...]
        n = sums[1]
        out = {f"{prefix}loss": sums[0] / n}
        out.update({f"{prefix}{name}": s / n for name, s in zip(self.metrics, sums[2:])})
        return out

    def _step_scheduler(self, row: dict) -> None:
        if self.scheduler is None:
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(row.get("val_loss", row["train_loss"]))
        else:
            self.scheduler.step()

    def _train_epoch(self, epoch: int, epochs: int, progress: bool,
                     monitor: PreemptionMonitor | None = None) -> dict[str, Any]:
        model, loader, k = self.model, self.train_loader, self.grad_accum_steps
        model.train()
        try:
            n_batches = len(loader)
        except TypeError:  # an IterableDataset without __len__
            n_batches = None
        # Skipping the all-reduce needs to know which micro-step is the last
        # of an epoch; without a length every micro-step synchronizes.
        no_sync = isinstance(model, DistributedDataParallel) and k > 1 and n_batches is not None
        # Checking a loss on the host costs a CPU-GPU sync: by default only
        # where that is free (a single CPU process); elsewhere at epoch end.
        check_each_step = not self.distributed and (
            self.finite_check_every == 1 or (self.finite_check_every is None and self.device.type == "cpu"))
        check_every = None if check_each_step else self.finite_check_every
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        metric_values: list[list] = [[] for _ in self.metrics]
        resume, self._resume_partial = self._resume_partial, None
        first = 0
        if resume is not None:
            epoch_start = resume["epoch_start"]
            batches, first = self._skip_to(resume, epoch)
            losses = [t.to(self.device) for t in resume["losses"].unbind(0)]
            sizes = [int(n) for n in resume["sizes"]]
            metric_values = [list(t.unbind(0)) for t in resume["metrics"]]
        else:
            # What decides this epoch's batch order (the global generators, the
            # loader's and sampler's own), taken before the loader draws from
            # them: a mid-epoch checkpoint needs it to replay the same order.
            epoch_start = self._epoch_start_state() if monitor is not None else None
            batches = iter(loader)
        bar = self._progress_bar(epoch, epochs, n_batches) if progress and self.is_main_process else None
        if bar is not None and first:
            bar.update(first)
        bar_mark, bar_time = len(losses), time.perf_counter()
        micro = 0
        try:
            for i, batch in enumerate(batches, start=first):
                for cb in self.callbacks:
                    cb.on_batch_begin(self, i)
                inputs, targets = T.split_batch(T.to_device(batch, self.device))
                if targets is None:
                    raise ConfigurationError("training batches must be (inputs, targets) pairs; got inputs only")
                micro += 1
                boundary = micro == k or (n_batches is not None and i + 1 == n_batches)
                with model.no_sync() if no_sync and not boundary else contextlib.nullcontext():
                    with T.autocast_context(self.device, self.amp):
                        outputs = model(inputs)
                        loss = self.loss_fn(outputs, targets)
                    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                        raise ConfigurationError(
                            f"loss_fn must return a scalar tensor (mean over the batch), got "
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
                        )
                    if check_each_step and not torch.isfinite(loss):
                        raise NonFiniteLossError(epoch, i, float(loss.detach()))
                    scaled = loss / k if k > 1 else loss
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                if boundary:
                    self._optimizer_step()
                    micro = 0
                detached = loss.detach()
                losses.append(detached)
                sizes.append(T.batch_size_of(inputs, targets))
                if self.metrics:
                    with torch.no_grad():
                        out = outputs.detach()
                        for values, fn in zip(metric_values, self.metrics.values()):
                            values.append(fn(out, targets))
                for cb in self.callbacks:
                    cb.on_batch_end(self, i, detached)
                if check_every and (i + 1) % check_every == 0:
                    self._raise_if_nonfinite(losses, epoch)
                if bar is not None:
                    bar.update(1)
                    now = time.perf_counter()
                    if now - bar_time >= _BAR_REFRESH_S:
                        recent = torch.stack(losses[bar_mark:]).float().mean().item()
                        rate = sum(sizes[bar_mark:]) * self.world_size / (now - bar_time)
                        bar.set_postfix(loss=f"{recent:.4g}", samples_s=f"{rate:.0f}", refresh=False)
                        bar_mark, bar_time = len(losses), now
                # After the whole step (update, hooks): a preemption stops
                # between two optimizer steps, never inside an accumulation group.
                if monitor is not None and boundary and monitor.step_done(n_batches is not None and i + 1 == n_batches):
                    raise _StopMidEpoch({
                        "batches": i + 1, "epoch_start": epoch_start, "losses": torch.stack(losses).cpu(),
                        "sizes": list(sizes), "metrics": [_as_float64(v) for v in metric_values]})
            if micro:  # an unsized loader ended inside an accumulation group
                self._optimizer_step()
        finally:
            if bar is not None:
                bar.close()
        if not losses:
            raise ConfigurationError(
                "the training loader yielded no batches (is drop_last=True with a dataset smaller than "
                "batch_size, or fewer samples than ranks?)"
            )
        stacked = torch.stack(losses).to(torch.float64)
        weights = torch.tensor(sizes, dtype=torch.float64, device=stacked.device)
        sums = [(stacked * weights).sum(), float(sum(sizes))]
        sums += [_weighted_sum(values, weights) for values in metric_values]
        bad_step, bad_value = _first_nonfinite(stacked)
        return {"sums": sums, "bad_step": bad_step, "bad_value": bad_value}

    def _raise_if_nonfinite(self, losses: list[torch.Tensor], epoch: int) -> None:
        step, value = _first_nonfinite(torch.stack(losses))
        _, ranks = T.reduce_over_ranks([], [step, value], self.device, self.distributed)
        bad = [(r, int(v[0]), v[1]) for r, v in enumerate(ranks) if v[0] >= 0]
        if bad:
            self._raise_nonfinite(epoch, bad)

    def _raise_nonfinite(self, epoch: int, bad: list[tuple[int, int, float]]) -> None:
        """Raise for the earliest ``(rank, step, value)``; the same error on every rank."""
        step = min(s for _, s, _ in bad)
        value = next(v for _, s, v in bad if s == step)
        # Name the ranks where it started: through the gradient all-reduce a
        # NaN on one rank reaches every rank's weights one step later.
        ranks = [r for r, s, _ in bad if s == step] if self.distributed else ()
        raise NonFiniteLossError(epoch, step, value, ranks)

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            if self.clip_grad_norm is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                nn.utils.clip_grad_norm_(self._trainable(), self.clip_grad_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(self._trainable(), self.clip_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

    def _progress_bar(self, epoch: int, epochs: int, total: int | None):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"epoch {epoch}/{epochs}", unit="batch", dynamic_ncols=True, leave=True)

    # ------------------------------------------------------------------ evaluation

    def _eval_sums(self, loader: DataLoader) -> list:
        """This rank's ``[loss_sum, count, metric_sums...]`` over its real (unpadded) samples."""
        if self.loss_fn is None:
            raise ConfigurationError("no loss function: pass loss_fn= to NNHandler or call set_loss_fn()")
        module = self.module
        was_training = module.training
        module.eval()
        real = T.real_sample_count(loader)
        losses, sizes = [], []
        metric_values: list[list] = [[] for _ in self.metrics]
        seen = 0
        try:
            # The unwrapped module: DDP's forward is not needed without
            # gradients, and avoiding it keeps evaluation free of collectives.
            with torch.no_grad(), T.autocast_context(self.device, self.amp):
                for batch in loader:
                    inputs, targets = T.split_batch(T.to_device(batch, self.device))
                    if targets is None:
                        raise ConfigurationError("validation batches must be (inputs, targets) pairs; got inputs only")
                    n = T.batch_size_of(inputs, targets)
                    keep = n if real is None else min(n, real - seen)
                    seen += n
                    if keep <= 0:
                        break  # only DistributedSampler padding is left
                    outputs = module(inputs)
                    if keep < n:
                        outputs, targets = T.head(outputs, keep), T.head(targets, keep)
                    losses.append(self.loss_fn(outputs, targets).detach())
                    sizes.append(keep)
                    for values, fn in zip(metric_values, self.metrics.values()):
                        values.append(fn(outputs, targets))
        finally:
            module.train(was_training)
        if not losses:
            return [torch.zeros((), dtype=torch.float64), 0.0] + [0.0] * len(self.metrics)
        stacked = torch.stack(losses).to(torch.float64)
        weights = torch.tensor(sizes, dtype=torch.float64, device=stacked.device)
        return [(stacked * weights).sum(), float(sum(sizes))] + [_weighted_sum(v, weights) for v in metric_values]

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
        _check_not_empty(loader, "evaluation")
        totals, _ = T.reduce_over_ranks(self._eval_sums(loader), [], self.device, self.distributed)
        if totals[1] == 0:
            raise ConfigurationError("evaluate(): the data yielded no samples")
        return {k.removeprefix("val_"): v for k, v in self._means("val_", totals).items()}

    def predict(self, data: Any, batch_size: int | None = None, *, data_parallel: bool = False,
                device_ids: Sequence[int | str] | None = None) -> torch.Tensor:
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
            data_parallel: From a single process, run the model on every
                device at once through :func:`~nn_handler.parallel_predict`
                (one worker per device, batches spread dynamically).
            device_ids: Devices for ``data_parallel`` (all GPUs by default;
                ``["cpu", "cpu"]`` for CPU workers).

        Returns:
            The concatenated outputs (the model must return a tensor).

        Example:
            >>> import torch
            >>> h = NNHandler(torch.nn.Identity())
            >>> h.predict(torch.arange(5.0).reshape(5, 1)).flatten().tolist()
            [0.0, 1.0, 2.0, 3.0, 4.0]
        """
        if data_parallel:
            return self._predict_data_parallel(data, batch_size, device_ids)
        loader = self._predict_loader(data, batch_size)
        sampler = loader.sampler
        real = T.real_sample_count(loader)
        module = self.module
        was_training = module.training
        module.eval()
        outputs = []
        try:
            with torch.no_grad(), T.autocast_context(self.device, self.amp):
                for batch in loader:
                    inputs, _ = T.split_batch(T.to_device(batch, self.device))
                    out = module(inputs)
                    if not isinstance(out, torch.Tensor):
                        raise TypeError(f"predict() needs a model that returns a tensor, got {type(out).__name__}")
                    outputs.append(out.detach().cpu())
        finally:
            module.train(was_training)
        local = torch.cat(outputs) if outputs else None
        if not isinstance(sampler, DistributedSampler) or not (self.distributed and is_distributed()):
            if local is None:
                raise ConfigurationError("predict(): the data yielded no samples")
            return local
        indices = list(iter(sampler))
        count = real if real is not None else len(indices)
        part = (indices[:count], local[:count] if local is not None else None)
        parts = gather(side_group(), part)  # not all_gather_object: it needs numpy
        return _assemble(parts, len(sampler.dataset))

    def _predict_data_parallel(self, data: Any, batch_size: int | None, device_ids) -> torch.Tensor:
        if self.distributed and is_distributed():
            raise ConfigurationError(
                "predict(data_parallel=True) starts one worker per device itself; call it from a single "
                "process, not from every DDP rank (plain predict() already splits the data over the ranks)"
            )
        if batch_size is None and isinstance(data, DataLoader):
            batch_size = data.batch_size
        if isinstance(data, tuple) and all(isinstance(t, torch.Tensor) for t in data):
            data = TensorDataset(*data)
        return parallel_predict(_InputsOnly(self.module), data, batch_size=batch_size or _DEFAULT_BATCH_SIZE,
                                device_ids=device_ids, autocast=self.amp)

    def _predict_loader(self, data: Any, batch_size: int | None) -> DataLoader:
        if batch_size is not None:
            check_int("batch_size", batch_size, minimum=1)
        if isinstance(data, torch.Tensor):
            data = TensorDataset(data)
        if isinstance(data, DataLoader):
            loader = DataLoader(data.dataset, batch_size=batch_size or data.batch_size or _DEFAULT_BATCH_SIZE,
                                shuffle=False, drop_last=False, collate_fn=data.collate_fn,
                                num_workers=data.num_workers, pin_memory=data.pin_memory)
            return prepare_dataloader(loader, self._parallel, shuffle=False)
        return self._make_loader(data, {"batch_size": batch_size or _DEFAULT_BATCH_SIZE, "drop_last": False},
                                 shuffle=False)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, rng_states: list | None = None) -> dict[str, Any]:
        """Everything :meth:`load_checkpoint` needs to continue exactly, as plain tensors and values.

        Args:
            rng_states: Every rank's random state, in rank order (gathered by
                :meth:`save_checkpoint`); this rank's alone by default.
        """
        names: dict[str, int] = {}
        callbacks = {}
        for cb in self.callbacks:
            name = type(cb).__qualname__
            names[name] = names.get(name, 0) + 1
            callbacks[name if names[name] == 1 else f"{name}#{names[name]}"] = cb.state_dict()
        generator = getattr(getattr(self.train_loader, "sampler", None), "generator", None)
        return {
            "format": FORMAT,
            "run": {"id": self._run_id, "seq": None},  # seq: the write number in checkpoint_dir
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            # Another class's state loads without a word and fails at the first step.
            "optimizer_class": _class_name(self.optimizer),
            "scheduler_class": _class_name(self.scheduler),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "history": self.history.state_dict(),
            "rng": rng_states if rng_states is not None else [capture_rng_state()],
            "world_size": self.world_size,
            "sampler_generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
            "callbacks": callbacks,
            "torch_version": str(torch.__version__),  # TorchVersion is not a plain str
        }

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
        self._save(path)

    def _save(self, path, partial: dict[str, Any] | None = None, stopped: bool = False,
              seq: int | None = None) -> None:
        mine = (capture_rng_state(), partial)
        everyone = [mine]
        if self.distributed and is_distributed():
            # Each rank resumes with its own random streams, and mid-epoch with
            # its own shard's losses so far.
            everyone = gather(side_group(), mine)  # not all_gather_object: it needs numpy
        payload = self.state_dict([rng for rng, _ in everyone])
        payload["run"]["seq"] = seq
        payload["stopped"] = bool(stopped)
        if partial is not None:
            payload["partial"] = {"batches": partial["batches"],
                                  "ranks": [{k: v for k, v in p.items() if k != "batches"} for _, p in everyone]}
        for cb in self.callbacks:
            cb.on_save_checkpoint(self, payload)
        self._write_on_main(payload, path, "checkpoint")

    def _save_run_checkpoint(self, partial: dict[str, Any] | None = None) -> Path:
        """Write the next checkpoint of ``checkpoint_dir`` (mid-epoch with ``partial``) and drop old ones."""
        self._run_seq += 1
        if partial is None:
            path = self.checkpoint_dir / run_checkpoint_name(self.epoch)
            self._save(path, stopped=self.stop_training, seq=self._run_seq)
        else:
            path = self.checkpoint_dir / run_checkpoint_name(self.epoch + 1, partial["batches"])
            self._save(path, partial, seq=self._run_seq)
        if self.is_main_process:
            prune_run_checkpoints(self.checkpoint_dir, self.keep_last, run_id=self._run_id)
        return path

    def _on_main(self, fn: Callable[[], Any], what: str, peer_error: Callable[[RankFailedError], BaseException],
                 broadcast: bool = False) -> Any:
        """Run ``fn()`` on rank 0 alone; when it fails there, every rank raises (the others ``peer_error``)."""
        if not (self.distributed and is_distributed()):
            return fn() if self.is_main_process else None  # a handler told use_distributed=False decides alone
        return run_on_ranks(side_group(), fn, what=what, broadcast=broadcast, peer_error=peer_error)

    def _start_run(self) -> None:
        """Before the first epoch: load what ``resume`` names, and claim ``checkpoint_dir`` for this run.

        Rank 0 alone lists the directory and decides (ranks that listed it
        themselves could see different files while rank 0 is still writing);
        every rank then loads the file it chose, or raises its refusal.
        """
        loaded: dict[str, Any] = {}  # the payload rank 0 already read: only the plan travels

        def plan_on_main() -> dict[str, Any]:
            try:
                loaded["payload"], plan = self._plan_run()
            except ConfigurationError as exc:  # a refusal, which every rank raises alike
                return {"refused": str(exc)}
            return plan

        def unread(err: RankFailedError) -> CheckpointError:
            failure = err.failures[0]
            return CheckpointError(f"rank 0 could not read checkpoint_dir {self.checkpoint_dir}: "
                                   f"{failure.exc_type.rpartition('.')[2]}: {failure.message}")

        plan = self._on_main(plan_on_main, f"the resume plan for checkpoint_dir {self.checkpoint_dir}", unread,
                             broadcast=True)
        if "refused" in plan:
            raise ConfigurationError(plan["refused"])
        if plan["path"] is not None:
            self._resume_from(Path(plan["path"]), loaded.get("payload"), plan["why"])
        self._run_seq = max(self._run_seq, plan["seq"])
        if self.is_main_process and plan["delete"]:
            for name in plan["delete"]:
                try:
                    (self.checkpoint_dir / name).unlink()
                except FileNotFoundError:
                    pass
            log.warning("overwrite=True: deleted the checkpoints of another run from %s: %s",
                        self.checkpoint_dir, ", ".join(plan["delete"]))

    def _plan_run(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """Rank 0's part of :meth:`_start_run`: ``(payload already loaded or None, plan for every rank)``.

        Raises:
            ConfigurationError: ``checkpoint_dir`` holds checkpoints of a run
                other than the one this handler continues, and not ``overwrite``.
        """
        directory = self.checkpoint_dir
        if self._resume == "auto":
            # Nothing writes into the directory yet, so temporary files are
            # leftovers of a write that a crash interrupted.
            remove_stale_temp_files(directory)
        found = scan_run_checkpoints(directory) if directory is not None else []
        payload, path, why, run_id, damaged = None, None, "", self._run_id, set()
        if self._resume == "auto":
            # Newest by write number, not by epoch: a run resumed from an
            # earlier checkpoint writes lower epochs after higher ones.
            for entry in reversed(found):
                try:
                    if entry.error is not None:
                        raise CheckpointError(entry.error)
                    payload = _checked_payload(load_payload(entry.path), entry.path)
                except CheckpointError as exc:
                    log.warning("not resuming from %s: %s", entry.path, exc)
                    damaged.add(entry.path)
                    continue
                path, run_id = entry.path, entry.run_id
                why = f", the newest of the {len(found)} checkpoints in {directory} by write order"
                break
            else:
                log.info("no checkpoint in %s yet: training starts from the beginning", directory)
        elif self._resume is not None:
            path = Path(self._resume)
            if found:
                try:
                    run_id = read_run_info(path)[0]
                except CheckpointError:
                    run_id = None  # not loadable: the load reports why, on every rank
        # Unreadable files belong to no run: neither refused nor deleted (the
        # next write of that name replaces them).
        others = [e.path.name for e in found
                  if e.error is None and e.path not in damaged and run_id is not None and e.run_id != run_id]
        if others and not self.overwrite:
            raise ConfigurationError(self._refusal(others, path))
        return payload, {"path": None if path is None else str(path), "why": why,
                         "delete": others if self.overwrite else [],
                         "seq": max((e.seq for e in found if e.seq is not None), default=0)}

    def _refusal(self, others: list[str], resumed: Path | None) -> str:
        files = ", ".join(others[:6]) + (f", ... ({len(others) - 6} more)" if len(others) > 6 else "")
        if resumed is None:
            return (f"checkpoint_dir {self.checkpoint_dir} holds checkpoints of another run ({files}), and this "
                    f"run would write its own among them: pass resume='auto' to continue that run, overwrite=True "
                    f"to delete them and start a new run, or use another checkpoint_dir to keep both")
        remedy = ("move them away or use another checkpoint_dir" if self._resume == "auto" else
                  "pass overwrite=True to delete them, or use another checkpoint_dir")
        return (f"checkpoint_dir {self.checkpoint_dir} holds checkpoints of another run than the one resumed from "
                f"{resumed} ({files}), and this run would write its own among them: {remedy}")

    def _resume_from(self, path: Path, payload: dict[str, Any] | None, why: str = "") -> None:
        """Load ``path`` on every rank (rank 0 may have loaded it already); every rank raises if one fails."""
        error = None
        try:
            if payload is None:
                payload = _checked_payload(load_payload(path), path)
            self._restore(payload, path)
        except BaseException as exc:  # reported to every rank below, so none trains on alone
            error = exc
        if not (self.distributed and is_distributed()):
            if error is not None:
                raise error
        else:
            try:
                agree_on_failure(side_group(), f"loading {path}", error, peer_error=lambda err: CheckpointError(
                    f"another rank could not load {path} (see its error); every rank reads the checkpoint "
                    f"itself, so it must be on a file system that all nodes share"))
            finally:
                error = None  # no frame <-> traceback cycle
        self._finished_early = bool(payload.get("stopped", False))
        if self.is_main_process:
            partial = self._resume_partial
            log.info("resumed from %s%s: %d epochs complete%s", path, why, self.epoch,
                     f", {partial['batches']} batches into epoch {self.epoch + 1}" if partial else "")

    def _write_on_main(self, payload: Any, path, what: str) -> None:
        # Every rank raises when the write fails, so none waits forever.
        self._on_main(functools.partial(atomic_save, payload, path), f"the write of the {what} {path}",
                      lambda err: CheckpointError(f"rank 0 could not write the {what} {path}; see rank 0's error"))
        if self.is_main_process:
            log.info("saved %s %s", what, path)

    def load_checkpoint(self, path: str | os.PathLike, resume: bool = True) -> int:
        """Load a checkpoint written by :meth:`save_checkpoint`, on every rank.

        Args:
            path: The file.
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
        epoch = self._restore(_checked_payload(load_payload(path), path), path, resume)
        self._finished_early = False  # an explicit load means "continue from here"
        return epoch

    def _restore(self, payload: dict[str, Any], path, resume: bool = True) -> int:
        # Everything that can refuse the file does so before anything changes:
        # a refused load leaves the handler as it was.
        if resume:
            self._check_resumable(payload, path)
        load_weights(self.module, payload["model"], source=str(path))
        if not resume:
            return int(payload["epoch"])
        for name, part, target in (("optimizer", payload["optimizer"], self.optimizer),
                                   ("scheduler", payload["scheduler"], self.scheduler),
                                   ("scaler", payload["scaler"], self.scaler)):
            if part is not None and target is None:
                log.warning("%s holds %s state but this handler has no %s; it is not restored", path, name, name)
            elif part is not None:
                target.load_state_dict(part)
        self.epoch, self.global_step = int(payload["epoch"]), int(payload["global_step"])
        self._run_id = run_info(payload)[0]  # continuing that run: its files in checkpoint_dir are ours
        self.history.load_state_dict(payload["history"])
        rngs = payload["rng"]
        if len(rngs) != self.world_size:
            log.warning("%s was written by %d ranks, this run has %d; random streams will differ from an "
                        "uninterrupted run", path, len(rngs), self.world_size)
        restore_rng_state(rngs[self.rank % len(rngs)])
        generator = getattr(getattr(self.train_loader, "sampler", None), "generator", None)
        if payload.get("sampler_generator") is not None and isinstance(generator, torch.Generator):
            generator.set_state(payload["sampler_generator"])
        states = payload.get("callbacks", {})
        names: dict[str, int] = {}
        for cb in self.callbacks:
            name = type(cb).__qualname__
            names[name] = names.get(name, 0) + 1
            key = name if names[name] == 1 else f"{name}#{names[name]}"
            if key in states:
                cb.load_state_dict(states[key])
            cb.on_load_checkpoint(self, payload)
        self._resume_partial = None
        partial = payload.get("partial")
        if partial is not None and len(partial["ranks"]) != self.world_size:
            log.warning("%s was written %d batches into epoch %d by %d ranks and this run has %d, so their shards "
                        "differ: epoch %d starts over from its first batch, from the weights of the checkpoint",
                        path, partial["batches"], self.epoch + 1, len(partial["ranks"]), self.world_size,
                        self.epoch + 1)
        elif partial is not None:
            self._resume_partial = {"batches": int(partial["batches"]), "rng": rngs[self.rank],
                                    **partial["ranks"][self.rank]}
        return self.epoch

    def _check_resumable(self, payload: dict[str, Any], path) -> None:
        """Refuse optimizer or scheduler state that this handler's cannot take (torch would fail at the first step)."""
        for what, target in (("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            saved, mine = payload.get(f"{what}_class"), _class_name(target)
            if payload[what] is not None and target is not None and saved is not None and saved != mine:
                raise CheckpointMismatchError(
                    f"{path} holds the state of a {saved} {what}; this handler's is {mine}: build the handler with "
                    f"the same {what} class to resume, or load the weights alone with "
                    f"load_checkpoint(path, resume=False)"
                )
        if payload["optimizer"] is not None and self.optimizer is not None:
            saved_sizes = [len(g["params"]) for g in payload["optimizer"]["param_groups"]]
            sizes = [len(g["params"]) for g in self.optimizer.param_groups]
            if saved_sizes != sizes:
                raise CheckpointMismatchError(
                    f"{path} holds optimizer state for {len(saved_sizes)} parameter group(s) of {saved_sizes} "
                    f"parameters; this handler's optimizer has {len(sizes)} of {sizes}: build the optimizer as "
                    f"the run that wrote it did, or load the weights alone with load_checkpoint(path, resume=False)"
                )

    def _loader_generators(self) -> dict[str, torch.Generator]:
        loader = self.train_loader
        found = {"loader": getattr(loader, "generator", None),
                 "sampler": getattr(getattr(loader, "sampler", None), "generator", None)}
        return {name: g for name, g in found.items() if isinstance(g, torch.Generator)}

    def _epoch_start_state(self) -> dict[str, Any]:
        return {"rng": capture_rng_state(),
                "generators": {name: g.get_state() for name, g in self._loader_generators().items()}}

    def _skip_to(self, resume: dict[str, Any], epoch: int):
        """This epoch's batch iterator, past the ``resume["batches"]`` already trained before the checkpoint."""
        state = resume["epoch_start"]
        restore_rng_state(state["rng"])
        for name, g in self._loader_generators().items():
            if name in state["generators"]:
                g.set_state(state["generators"][name])
        batches = iter(self.train_loader)
        done = int(resume["batches"])
        # Replaying the loader (rather than skipping sampler indices) also
        # replays whatever randomness the dataset or workers draw per sample.
        for seen in range(done):
            try:
                next(batches)
            except StopIteration:
                raise CheckpointError(
                    f"the checkpoint was written after {done} batches of epoch {epoch}, but the training loader "
                    f"now yields {seen}; resume with the data and batch size it was written with"
                ) from None
        restore_rng_state(resume["rng"])  # the streams as they were at the checkpoint
        return batches, done

    def save_model(self, path: str | os.PathLike) -> None:
        """Write the unwrapped model's ``state_dict`` alone, atomically, from rank 0; call it on every rank."""
        self._write_on_main(self.module.state_dict(), path, "model")

    def load_model(self, path: str | os.PathLike) -> None:
        """Load weights saved by :meth:`save_model` (or the model part of a checkpoint).

        Raises:
            CheckpointError: A missing, corrupt or truncated file.
            CheckpointMismatchError: Weights that do not fit the model (keys named).
        """
        payload = load_payload(path)
        if isinstance(payload, dict) and payload.get("format") == FORMAT:
            payload = payload["model"]
        if not isinstance(payload, Mapping):
            raise CheckpointError(f"{path} holds a {type(payload).__name__}, not a state_dict")
        load_weights(self.module, payload, source=str(path))

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
               **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in each process of a new local DDP group; return rank 0's result.

        Starts ``nprocs`` processes (one per GPU by default, with NCCL; gloo on
        CPU, where ``nprocs`` must be given) on the worker pool of
        :class:`~nn_handler.ParallelExecutor`, joins them into one process
        group, and runs ``fn`` in each; an ``NNHandler`` built inside ``fn``
        trains distributed. ``fn`` travels with cloudpickle, so functions
        defined in a notebook work. The processes end with the call.

        Args:
            fn: The function to run on every rank.
            *args: Its positional arguments.
            nprocs: Number of processes.
            timeout: Seconds before the call is abandoned and its processes
                killed (``TimeoutError``); no limit by default.
            **kwargs: Its keyword arguments.

        Returns:
            What ``fn`` returned on rank 0.

        Raises:
            ParallelExecutionError: ``fn`` raised on a rank (the failing ranks
                tear the group down, so the others fail fast instead of waiting
                in a collective; every rank's traceback is in the message).
            WorkerDiedError: A process died.
            ValueError: ``nprocs`` missing without GPUs, or more than the GPUs.

        Example:
            >>> def body():
            ...     import torch.distributed as dist
            ...     return dist.get_world_size()
            >>> NNHandler.launch(body, nprocs=2)  # doctest: +SKIP
            2
        """
        from .utils._workers.launch import launch

        return launch(fn, args, kwargs, nprocs, timeout)

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
        _live_handlers.discard(self)
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.module
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
        return f"NNHandler({type(self.module).__name__}, {where}{self.device}, epoch={self.epoch})"


class _InputsOnly(nn.Module):
    """Feeds a model the inputs of ``(inputs, targets)`` batches, as :meth:`NNHandler.predict` does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *batch):
        inputs, _ = T.split_batch(batch if len(batch) > 1 else batch[0])
        return self.model(inputs)


class _StopMidEpoch(Exception):
    """Internal: the ranks agreed to stop for preemption; carries this rank's part of the epoch so far."""

    def __init__(self, partial: dict[str, Any]):
        super().__init__("preempted mid-epoch")
        self.partial = partial


def _as_float64(values: list) -> torch.Tensor:
    return torch.stack([torch.as_tensor(v).detach().reshape(()).to("cpu", torch.float64) for v in values]) \
        if values else torch.zeros(0, dtype=torch.float64)


def _class_name(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _checked_payload(payload: Any, path) -> dict[str, Any]:
    """``payload`` if it is a complete nn_handler checkpoint, else a CheckpointError naming ``path``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = sorted(payload)[:6] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{path} is not an nn_handler checkpoint (found {found}); for a file of weights alone use load_model()"
        )
    # What _restore reads, checked here, so that a damaged or hand-made file
    # is refused by name before anything is loaded (not a KeyError halfway).
    kinds = {"model": Mapping, "optimizer": (Mapping, type(None)), "scheduler": (Mapping, type(None)),
             "scaler": (Mapping, type(None)), "epoch": int, "global_step": int, "history": Mapping,
             "rng": (list, tuple)}
    problems = [f"no {key!r}" if key not in payload else f"{key!r} is a {type(payload[key]).__name__}"
                for key, kind in kinds.items() if key not in payload or not isinstance(payload[key], kind)]
    if not problems and not payload["rng"]:
        problems.append("'rng' is empty")
    optimizer = payload.get("optimizer")
    if not problems and optimizer is not None and not (
            isinstance(optimizer.get("state"), Mapping) and isinstance(optimizer.get("param_groups"), (list, tuple))
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
                    for g in optimizer["param_groups"])):
        problems.append("'optimizer' is not an optimizer state_dict")
    if problems:
        raise CheckpointError(f"{path} is not a complete nn_handler checkpoint ({', '.join(problems)}); "
                              f"was it changed after NNHandler.save_checkpoint wrote it?")
    return payload


def _check_not_empty(data: DataLoader | Dataset, what: str) -> None:
    dataset = data.dataset if isinstance(data, DataLoader) else data
    try:
        size = len(dataset)
    except TypeError:
        return  # an IterableDataset without a length: found out when it yields nothing
    if size == 0:
        raise ConfigurationError(f"the {what} dataset is empty (0 samples)")


def _weighted_sum(values: list, weights: torch.Tensor) -> torch.Tensor:
    t = torch.stack([torch.as_tensor(v).detach().reshape(()).to(weights.device, torch.float64) for v in values])
    return (t * weights).sum()


def _first_nonfinite(losses: torch.Tensor) -> tuple[int, float]:
    """``(index, value)`` of the first NaN/inf entry, or ``(-1, 0.0)``."""
    bad = (~torch.isfinite(losses)).nonzero()
    if bad.numel() == 0:
        return -1, 0.0
    i = int(bad[0, 0])
    return i, float(losses[i])


def _assemble(parts: list, n: int) -> torch.Tensor:
    """Put every rank's ``(indices, outputs)`` into one tensor in dataset order; each index exactly once."""
    template = next((out for _, out in parts if out is not None and len(out)), None)
    if template is None:
        raise ConfigurationError("predict(): the data yielded no samples")
    result = torch.empty((n, *template.shape[1:]), dtype=template.dtype)
    filled = torch.zeros(n, dtype=torch.bool)
    for indices, out in parts:
        if not indices:
            continue
        idx = torch.as_tensor(indices, dtype=torch.long)
        if filled[idx].any():
            raise RuntimeError("predict(): a sample came back from two ranks; the sampler is not a partition")
        result[idx] = out
        filled[idx] = True
    if not filled.all():
        raise RuntimeError(f"predict(): {int((~filled).sum())} samples came back from no rank")
    return result
