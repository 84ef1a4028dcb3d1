"""Model helpers folded in from neighbouring systems: wrapping, DataParallel, placement, prediction, reports.

Private; the public names live in :mod:`nn_handler.utils.parallel` and :mod:`nn_handler.utils.ddp_decorators`.
"""
