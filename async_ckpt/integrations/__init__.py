"""Adapters that put async_ckpt under a training framework's own checkpointing, one module per
framework (``async_ckpt.integrations.accelerate``, ...). Each is imported on demand and is the only
place its framework is imported, so the library itself never needs any of them; the library never
imports this package."""
