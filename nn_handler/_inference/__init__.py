"""Inference at scale: a model over a data set too large for memory, on every device, streamed to disk, resumable.

``parallel_predict`` and ``NNHandler.predict(data_parallel=True)`` are the public faces; this package is the one
engine behind them, one job per module:

- ``batching``: forms the batches: a fixed ``batch_size``, or ``max_tokens`` budgets over length-sorted windows of
  the input (bounded memory for iterables).
- ``engine``: sends the batches to the ``ParallelExecutor``'s workers (bounded in flight), brings their outputs
  back in input order or has the workers write them to disk, splits a batch that runs out of memory, records
  failures (``on_error``), resumes what a killed run left, runs on Ray with ``backend="ray"``.
- ``layout``: the files of a predictions directory: names, the safetensors shard format, atomic writes, the index.
- ``store``: a predictions directory as a run writes it: shards written by any process, the manifest, what is
  done, refusal of a rerun whose data or settings differ.
- ``reader``: :class:`~nn_handler.Predictions`, the outputs read back lazily in input order, later, anywhere.

The padding of ragged outputs to the longest in memory is :mod:`nn_handler._padding`, shared with
``NNHandler.predict``.
"""
