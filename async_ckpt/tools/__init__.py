"""Operators' tools: the ``async-ckpt`` command line (one module per command), ``supervise`` and
``advise``. They read checkpoints only through the library's format, storage and read modules."""
