"""What the loggers share: the values they log and their names, the run of a tracker, the sender of its records.

- :mod:`.values`: per-step values (:class:`~.values.StepSeries`), epoch rows,
  learning rates, hyperparameters and the handler's settings, each under the
  name every logger gives it.
- :mod:`.csv_files`: the History's and the per-step CSV files of :class:`~nn_handler.callbacks.CSVLogger`.
- :mod:`.run`: :class:`~.run.TrackerLogger`, a tracker's run from rank 0: opened,
  continued across a resume (its id in the checkpoint), ended as finished,
  failed or preempted.
- :mod:`.sender`: a thread that sends a tracker's records, so that training
  never waits on the network, and keeps or writes down what it could not send.
- :mod:`.child`: a tracker's client in a process of its own, fed by a :mod:`.sender`
  thread, so that the client's Python never runs under training's GIL.
- :mod:`.mlflow_logger`, :mod:`.wandb_logger`: the two trackers' callbacks;
  :mod:`.mlflow_client`, :mod:`.wandb_client`: their clients' side, run in that process.

Private: :mod:`nn_handler.loggers` is the public face. This package's
``__init__`` imports nothing (``callbacks`` imports :mod:`.values` and
:mod:`.csv_files`, which import nothing of the callbacks).
"""
