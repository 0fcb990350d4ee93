"""async_ckpt: asynchronous checkpoints for PyTorch training that restore bit for bit.

The public names are imported lazily so that the writer process, which imports
``async_ckpt.write.writer``, never imports torch.
"""

import importlib
import sys

if sys.platform != "linux":  # refused here, not by a missing os function at the first snapshot
    from .errors import UnsupportedPlatformError

    raise UnsupportedPlatformError(
        f"async_ckpt needs Linux (memfd staging buffers, flock, preadv, sync_file_range); this is "
        f"{sys.platform}. Run it on Linux, or in a Linux container")

__all__ = ["CheckpointEngine", "Marker", "Derived", "load", "errors", "MAX_STEP", "deterministic"]
__version__ = "0.1.0"

_LAZY = {"CheckpointEngine": "async_ckpt.engine", "Marker": "async_ckpt.write.protocol",
         "Derived": "async_ckpt.write.protocol",
         "load": "async_ckpt.read.snapshot", "errors": "async_ckpt.errors",
         "MAX_STEP": "async_ckpt.storage.names",  # steps are ints from 0 to MAX_STEP - 1
         "deterministic": "async_ckpt.determinism"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'async_ckpt' has no attribute {name!r}")
    value = importlib.import_module(module)
    return value if name == "errors" else getattr(value, name)


def __dir__():
    return sorted(__all__)
