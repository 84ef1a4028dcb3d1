"""What :class:`~nn_handler.NNHandler` orchestrates: the training loop and its parts, private.

Every function here takes the parts it works on explicitly (a
:class:`~nn_handler._training.parts.Parts` of model, optimizer, loaders and
callbacks, a :class:`~nn_handler._training.config.TrainingConfig`, a
:class:`~nn_handler._training.state.TrainingState`); nothing here imports
:mod:`nn_handler.handler`. Callbacks receive the trainer as a
:class:`~nn_handler.callbacks.TrainerView`, handed over in ``Parts.view``.

    config.py      the constructor's knobs, validated once (frozen)
    state.py       epoch, global step, stop flag, History, run identity, resume marker
    parts.py       the objects one call works on
    data.py        loaders, samplers, the mid-epoch replay
    batches.py     what a batch is (pair, lone input, mapping), how the model is called, targets and loss
    precision.py   amp: the autocast dtype, the GradScaler, FSDP's MixedPrecisionPolicy (decided once)
    context.py     StepContext (public): what a step function gets: models as trained, autocast, backward, step
    step.py        the built-in training and validation steps; a step function at each micro-batch
    loop.py        epochs, hooks, accumulation groups, finite checks, the preemption stop
    schedule.py    the LR scheduler (built, checked, stepped per epoch or per step) and the optimizer-step hooks
    report.py      the line per epoch (logged; printed off a terminal), validation every N optimizer steps
    metrics.py     the epoch's sums, one all-reduce, non-finite losses
    evaluation.py  evaluate and predict, every sample exactly once
    resume.py      what a checkpoint holds, and how a run starts and resumes
    uneven.py      ranks whose data runs out at different steps: one clear error
    preemption.py  SIGTERM (or max_time) -> a checkpoint and a clean exit
    buffers.py     the ranks' buffers are rank 0's wherever they are read (DDP's rule)
    sharding.py    strategy="fsdp": fully_shard by a wrap policy, the precision's policy
    sharded_checkpoint.py  DCP checkpoint directories, committed atomically; export_model
    progress.py    the progress of an epoch (a bar, or lines off a terminal)
    readout.py     host reads of device values: per step where free, else without waiting
    lifetime.py    trainers still holding a process group are closed at exit
"""
