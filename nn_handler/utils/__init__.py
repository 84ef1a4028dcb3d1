"""Building blocks: the distributed core (:mod:`.ddp`) and the decorators (:mod:`.ddp_decorators`)."""
