"""Adapters that put async_ckpt under a training framework's own checkpointing, one module per
framework (``async_ckpt.integrations.transformers``, ...). Each is imported on demand: importing
``async_ckpt`` never imports a framework, and nothing in the library imports this package; a
framework is needed only by its own module (an optional extra, e.g. ``async_ckpt[transformers]``).
"""
