"""The worker pool: one spawned process per device, its transport, the executor and the local launcher.

Private; the public names live in :mod:`nn_handler.utils.ddp_decorators`. Imports point one way: nothing here
imports the trainer, the callbacks or :mod:`nn_handler.utils._models`.
"""
