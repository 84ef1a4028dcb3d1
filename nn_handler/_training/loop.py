"""The training loop: epochs, hooks, accumulation and ``no_sync``, finite checks, the preemption stop.

Collectives per epoch, beyond DDP's own gradient all-reduce: one all-reduce
of the epoch's sums (losses, metrics, sample counts, timings, memory, the
first non-finite step), one for the stop flag, and, with validation, nothing
more. Per training step the loop makes no collective and, on a GPU or in a
distributed run, reads no value back from the device and does not wait for
it (:mod:`.readout`): losses and metric values stay on the device until the
epoch's sums. The flow of :meth:`Loop.run`::

    on_train_begin
    per epoch:   on_epoch_begin -> batches (on_batch_begin, the step function through
                 MicroBatches.run: forward, backward, and at a group's end the optimizer steps with
                 their hooks and per-step schedulers; on_batch_end, the preemption check)
                 -> validation -> one all-reduce -> History row, per-epoch scheduler steps -> on_epoch_end
                 -> agree on stop / preemption -> the epoch's checkpoint (with checkpoint_dir)
    on_train_end

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .._checks import check_int, check_number
from ..checkpoint import capture_rng_state
from ..errors import ConfigurationError
from ..utils._stall import new_wait, note_step, watch_collectives
from ..utils.ddp_decorators import any_rank
from . import batches as B
from . import data as D
from . import metrics as M
from . import uneven as U
from .config import TrainingConfig
from .evaluation import eval_sums, validation_runs
from .hooks import batch_end_calls, notify_exception
from .parts import Parts, check_frozen_at_wrap
from .preemption import PREEMPTION_SIGNALS, PreemptionMonitor, SignalCatcher, TrainingPreempted, signal_name
from .progress import EpochBar
from .readout import HostReads
from .report import epoch_line, report_epoch, validate_at_step
from .resume import save_run_checkpoint
from .schedule import OptimizerSteps, epoch_learning_rates, learning_rates
from .state import TrainingState
from .step import MicroBatches, trained_models

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """When ``train()`` stops: after epoch ``epochs``, at global step ``max_steps``, after ``max_time`` seconds."""

    epochs: int | None = None
    max_steps: int | None = None
    max_time: float | None = None

    @classmethod
    def checked(cls, epochs: Any, max_steps: Any, max_time: Any) -> "Limits":
        """The limits of a ``train()`` call, each checked; at least one is needed.

        Example:
            >>> Limits.checked(None, 100, None).max_steps
            100
        """
        check_int("epochs", epochs, minimum=1, allow_none=True)
        check_int("max_steps", max_steps, minimum=1, allow_none=True)
        check_number("max_time", max_time, minimum=0, unit="seconds", allow_none=True)
        if epochs is None and max_steps is None and max_time is None:
            raise ConfigurationError("train() needs a limit: epochs, max_steps or max_time "
                                     "(e.g. train(10) or train(max_steps=1000))")
        return cls(epochs, max_steps, None if max_time is None else float(max_time))

    def reached(self, state: TrainingState) -> bool:
        """True when ``state`` is at or past the epoch or step limit (the same on every rank)."""
        return ((self.epochs is not None and state.epoch >= self.epochs)
                or (self.max_steps is not None and state.global_step >= self.max_steps))


class Loop:
    """Trains ``parts`` under ``config`` from where ``state`` stands; :meth:`run` is the whole of ``train()``."""

    def __init__(self, parts: Parts, config: TrainingConfig, state: TrainingState):
        self.parts, self.config, self.state = parts, config, state

    def run(self, limits: Limits, validate_every: int, progress: bool,
            validate_every_n_steps: int | None = None) -> None:
        """Train until ``limits``, with the train-level hooks around it (none when there is nothing to do)."""
        parts, state = self.parts, self.state
        self.validate_every, self.val_steps = validate_every, validate_every_n_steps
        # Said by rank 0 alone, as the resume line: every rank knows it, one line says it.
        if state.finished_early:
            if parts.is_main_process:
                log.warning("train(): the run stopped early after epoch %d (resumed from its last checkpoint); "
                            "nothing to do", state.epoch)
            return
        if limits.reached(state):
            if parts.is_main_process:
                log.warning("train(): already at epoch %d, global step %d: nothing to do", state.epoch,
                            state.global_step)
            return
        check_frozen_at_wrap(parts)
        self.state.stop_training = False
        self.steps = OptimizerSteps(parts, state, self.config.scheduler_interval)  # refuses a bad interval first
        self.validates = validation_runs(parts, self.config)
        try:
            for cb in parts.callbacks:
                cb.on_train_begin(parts.view)
            self._until(limits, validate_every, progress)
        except BaseException as exc:  # TrainingPreempted and Ctrl-C too: a tracker records how the run ended
            notify_exception(parts.callbacks, parts.view, exc)
            # Outside the SIGTERM catcher: torchrun's SIGTERM ends the wait.
            if isinstance(exc, Exception):
                wait_if_peer_failed(exc)
            raise
        for cb in parts.callbacks:
            cb.on_train_end(parts.view)

    def _until(self, limits: Limits, validate_every: int, progress: bool) -> None:
        parts, config, state = self.parts, self.config, self.state
        catcher = SignalCatcher() if config.checkpoint_dir is not None else None
        with catcher if catcher is not None else contextlib.nullcontext():
            monitor = None
            if catcher is not None or limits.max_time is not None:
                deadline = None if limits.max_time is None else time.monotonic() + limits.max_time
                monitor = PreemptionMonitor(catcher, parts.in_group, config.preemption_check_every, deadline)
            while not limits.reached(state):
                try:
                    partial = self._epoch(limits, validate_every, progress, monitor)
                except _StopMidEpoch as stop:
                    path = save_run_checkpoint(parts, config, state, stop.partial)
                    raise self._preempted(path, state.epoch + 1, stop.partial["batches"], catcher) from None
                if partial is not None:  # max_steps or max_time, part-way through the epoch
                    if config.checkpoint_dir is not None:
                        save_run_checkpoint(parts, config, state, partial)
                    break
                # Agree, so that a callback that stopped one rank stops them all
                # after the same epoch (the next epoch's collectives would hang);
                # with a monitor, one collective says "stop", "preempted", "time's up".
                if monitor is None:
                    stop, preempt, time_up = (any_rank(state.stop_training) if parts.in_group
                                              else bool(state.stop_training)), False, False
                else:
                    stop, preempt, time_up = monitor.epoch_end(state.stop_training)
                state.stop_training = stop
                if config.checkpoint_dir is not None:
                    path = save_run_checkpoint(parts, config, state)
                if preempt:
                    raise self._preempted(path, state.epoch, 0, catcher)
                if stop or time_up:
                    break

    def _preempted(self, path: Path, epoch: int, batches: int, catcher: SignalCatcher) -> TrainingPreempted:
        # Every rank raises the same exception; the one that did not receive
        # the signal itself still names it (another rank did).
        exc = TrainingPreempted(str(path), epoch, batches, signal_name(catcher.received or PREEMPTION_SIGNALS[0]))
        catcher.handled = True
        if self.parts.is_main_process:
            log.warning("%s", exc)
        return exc

    def _epoch(self, limits: Limits, validate_every: int, progress: bool,
               monitor: PreemptionMonitor | None) -> dict[str, Any] | None:
        """One epoch, or its first part when a step or time limit stops it: then that part's checkpoint state."""
        parts, config, state = self.parts, self.config, self.state
        epoch = state.epoch + 1
        for cb in parts.callbacks:
            cb.on_epoch_begin(parts.view, epoch)
        sampler = getattr(parts.train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(state.epoch)  # DistributedSampler: a new shuffle each epoch, the same on every rank
        lrs = epoch_learning_rates(parts.optimizers, state.resume_partial)  # at its first step, also continued
        M.reset_peak_memory(parts.device)
        start = time.perf_counter()
        train = self._train_epoch(epoch, limits, progress, monitor)
        train_time = time.perf_counter() - start
        validate = self.validates and epoch % validate_every == 0
        val, val_names = eval_sums(parts, config, parts.val_loader, epoch) if validate else ([], [])
        epoch_time = time.perf_counter() - start

        mine = [train_time, epoch_time, M.peak_memory_mb(parts.device), train["bad_step"], train["bad_value"]]
        totals, ranks = M.reduce_over_ranks(train["sums"] + val, mine, parts.device, parts.distributed)
        bad = [(r, int(v[3]), v[4]) for r, v in enumerate(ranks) if v[3] >= 0]
        if bad:
            M.raise_nonfinite(epoch, bad, parts.distributed)

        partial = train["partial"]
        if partial is not None:
            # Where this part ended, so that the next train() (or a resume from
            # a checkpoint, one a hook writes included) continues at the next
            # batch. Set before the hooks: handler.partial_epoch tells them.
            state.resume_partial = partial
        k = len(train["sums"])
        row: dict[str, Any] = {"epoch": epoch, **M.means("train_", totals[:k], train["names"])}
        if self.val_steps:
            row["step"] = state.global_step  # beside the rows of validate_every_n_steps
        if validate:
            val_logs = M.means("val_", totals[k:], val_names)
            row.update(val_logs)
            for cb in parts.callbacks:
                cb.on_validation_end(parts.view, epoch, val_logs)
        slowest_train = max(v[0] for v in ranks)
        row.update(lrs)
        row.update(epoch_time=max(v[1] for v in ranks),
                   samples_per_sec=totals[1] / slowest_train if slowest_train > 0 else float("nan"))
        row.update({f"peak_mem_mb_rank{r}": v[2] for r, v in enumerate(ranks)})
        state.drop_partial_row()  # the row of this epoch's first part, before a step or time limit stopped it
        state.partial_row = partial is not None
        if partial is None:
            # A part-way epoch leaves the epoch count and the scheduler as they
            # were: the run that continues it steps them when it completes.
            self.steps.epoch_done(row)
            state.epoch = epoch
        state.history.append(row)
        if parts.is_main_process:
            report_epoch(epoch_line(row, limits.epochs, None if partial is None else partial["batches"]), progress)
        for cb in parts.callbacks:
            cb.on_epoch_end(parts.view, epoch, row)
        return partial

    def _train_epoch(self, epoch: int, limits: Limits, progress: bool,
                     monitor: PreemptionMonitor | None) -> dict[str, Any]:
        parts, config, state = self.parts, self.config, self.state
        loader, device, view = parts.train_loader, parts.device, parts.view
        callbacks, k = parts.callbacks, config.grad_accum_steps
        for model in trained_models(parts):
            model.train()
        try:
            n_batches = len(loader)
        except TypeError:  # an IterableDataset without __len__
            n_batches = None
        uneven = U.check_mode(loader, n_batches) if parts.in_group else None
        if uneven == "length":
            U.check_lengths(n_batches, epoch)
        # Skipping the all-reduce needs to know which micro-step is the last
        # of an epoch; without a length every micro-step synchronizes.
        pause_sync = k > 1 and n_batches is not None
        # Checking a loss on the host costs a CPU-GPU sync: by default only
        # where that is free (a single CPU process); elsewhere at epoch end.
        reads = HostReads.for_device(device)
        # A finite_check_every adds its check to the free per-step one, never replaces it.
        check_each_step = not parts.distributed and (config.finite_check_every == 1 or reads.free)
        check_every = None if check_each_step else config.finite_check_every
        steps = MicroBatches.for_training(parts, config, state, self.steps, epoch, check_each_step)
        batch_ends = batch_end_calls(callbacks)
        max_steps = limits.max_steps
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        columns = M.Columns()  # the values the step returns besides its loss (metrics), by key
        resume, state.resume_partial = state.resume_partial, None
        first = 0
        if resume is not None:
            epoch_start = resume["epoch_start"]
            batches, first = D.skip_to(loader, resume, epoch)
            losses = [t.to(device) for t in resume["losses"].unbind(0)]
            sizes = [int(n) for n in resume["sizes"]]
            columns = M.Columns.restored(resume, sizes)
        else:
            # What decides this epoch's batch order (the global generators, the
            # loader's and sampler's own), taken before the loader draws from
            # them: a mid-epoch checkpoint (or a stop at max_steps or max_time)
            # needs it to replay the same order.
            stoppable = monitor is not None or max_steps is not None
            epoch_start = D.epoch_start_state(loader, learning_rates(parts.optimizers)) if stoppable else None
            batches = D.epoch_batches(loader)
        if uneven == "step":
            batches = U.agreed(batches, first, epoch)
        rows = D.RealRows(loader, sum(sizes))
        bar = (EpochBar(epoch, limits.epochs, n_batches, first, parts.world_size)
               if progress and parts.is_main_process else None)
        micro = 0
        stop = None
        non_blocking = reads.non_blocking
        on_device = D.gathered_on(loader, device)  # in-memory tensors there already: no move per batch
        padded = rows.real is not None  # DistributedSampler padding at the shard's end: some rows not counted
        try:
            # The user's own collectives in a step (loss_fn, callbacks) are watched for stalls.
            with watch_collectives(), steps.refusing_steps_by_hand():
                for i, batch in enumerate(batches, start=first):
                    new_wait()  # a collective the user's code calls at every step waits anew at each
                    for cb in callbacks:
                        cb.on_batch_begin(view, i)
                    if not on_device:
                        batch = B.move(batch, device, non_blocking)
                    micro += 1
                    boundary = micro == k or (n_batches is not None and i + 1 == n_batches)
                    n = B.sample_count(batch)
                    keep = rows.take(n) if padded else n  # padding: trained on, as DDP must; weighed 0 in the sums
                    loss, counted, returned = steps.run(batch, i, boundary, pause_sync, None if keep == n else keep)
                    if boundary:
                        note_step(state.global_step)
                        micro = 0
                    losses.append(counted)
                    sizes.append(keep)
                    if returned:
                        columns.add(returned, keep)
                    for batch_end in batch_ends:
                        batch_end(view, i, loss, steps.returned)
                    if check_every and (i + 1) % check_every == 0:
                        M.raise_if_nonfinite(losses, epoch, device, parts.distributed)
                    if bar is not None:
                        bar.advance(losses, sizes)
                    if not boundary:
                        continue
                    # After the whole step (update, hooks): a stop comes between
                    # two optimizer steps, never inside an accumulation group.
                    last = n_batches is not None and i + 1 == n_batches
                    if (self.val_steps and state.global_step % self.val_steps == 0 and self.validates
                            and not (last and epoch % self.validate_every == 0)):  # not twice at the epoch's end
                        validate_at_step(parts, config, state, epoch)
                    if monitor is not None:
                        stop = monitor.step_done(last)
                    if stop is None and max_steps is not None and state.global_step >= max_steps and not last:
                        stop = "steps"
                    if stop is not None:
                        break
                if micro:  # an unsized loader ended inside an accumulation group
                    steps.end_group(step_asked=True)
        finally:
            if bar is not None:
                bar.close()
        if not losses:
            raise ConfigurationError(
                "the training loader yielded no batches (is drop_last=True with a dataset smaller than "
                "batch_size, or fewer samples than ranks?)"
            )
        partial = None
        if stop is not None:
            # "rng": the streams at the stop, before validation draws from them.
            partial = {"batches": i + 1, "epoch_start": epoch_start, "losses": torch.stack(losses).cpu(),
                       "sizes": list(sizes), **columns.state(), "rng": capture_rng_state()}
            if stop == "preempt":
                raise _StopMidEpoch(partial)
        stacked = torch.stack(losses).to(torch.float64)
        mine = steps.values.names if steps.values.fixed else list(columns.values)  # in the order first returned
        names = M.agree_on_names(mine, steps.values.fixed, parts.in_group)
        sums = M.batch_sums(stacked, sizes, columns, names)
        bad_step, bad_value = M.first_nonfinite(stacked)
        return {"sums": sums, "names": names, "bad_step": bad_step, "bad_value": bad_value, "partial": partial}


class _StopMidEpoch(Exception):
    """Internal: the ranks agreed to stop for preemption; carries this rank's part of the epoch so far."""

    def __init__(self, partial: dict[str, Any]):
        super().__init__("preempted mid-epoch")
        self.partial = partial


# Under torchrun, when one rank fails its peers fail a moment later, in the
# collective that waited for it ("Connection closed by peer"). torchrun names
# as root cause the failure with the earliest timestamp, in whole seconds, and
# the lowest rank on a tie, so a peer's secondary error could be reported
# instead of the rank that really failed. A peer that waits a little lets the
# agent see the real failure first; the agent then stops it with SIGTERM, so
# the wait rarely runs to its end.
PEER_FAILURE_GRACE_S = 2.0
_PEER_FAILURE_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_peer_failure(exc: BaseException) -> bool:
    """True for the errors a rank gets when another rank of its group went away.

    Example:
        >>> is_peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4242"))
        True
        >>> is_peer_failure(ValueError("bad batch"))
        False
    """
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_FAILURE_TEXT)


def wait_if_peer_failed(exc: BaseException, environ: Mapping[str, str] | None = None) -> bool:
    """Under torchrun, pause :data:`PEER_FAILURE_GRACE_S` before a peer failure propagates; True if it paused."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ or not is_peer_failure(exc):
        return False
    time.sleep(PEER_FAILURE_GRACE_S)
    return True
