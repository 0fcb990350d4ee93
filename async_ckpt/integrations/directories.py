"""What the adapters that write a framework's checkpoint directory share (the Trainer's
``checkpoint-N/``, the directory of Accelerate's ``save_state``), besides the pointer that names
the snapshot a directory was made from (``pointer.py``): the small files a framework's own code
writes, captured as bytes for the directory's ``Marker``. Framework-free: each adapter imports
its framework."""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Iterable

__all__ = ["files_written_by"]

_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory: a save writes no disk here


def files_written_by(write: Callable[[str], object],
                     leave_out: Iterable[str] = ()) -> tuple[tuple[str, bytes], ...]:
    """The (name, bytes) of the files ``write(directory)`` writes into a fresh directory (in
    memory where there is a ``/dev/shm``), but those named in ``leave_out``: small files that a
    framework's own code writes, taken as they are into a checkpoint directory."""
    leave_out = set(leave_out)
    with tempfile.TemporaryDirectory(prefix="async_ckpt-files-", dir=_SCRATCH) as directory:
        write(directory)
        files = []
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if name not in leave_out and os.path.isfile(path):
                with open(path, "rb") as f:
                    files.append((name, f.read()))
    return tuple(files)
