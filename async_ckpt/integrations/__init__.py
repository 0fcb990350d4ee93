"""Adapters that put async_ckpt under a training framework's own checkpointing, one module per
framework (``lightning``, ``transformers``, ``accelerate``, ``deepspeed``). Each is imported on
demand and is the only place its framework is imported: importing ``async_ckpt`` never imports a
framework, nothing in the library imports this package, and a framework is needed only by its
own module (an optional extra, e.g. ``pip install 'async_ckpt[transformers]'``). ``directories`` holds what the
adapters that write a framework's checkpoint directory share, and imports no framework."""
