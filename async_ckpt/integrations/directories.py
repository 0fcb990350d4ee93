"""What the adapters that write a framework's checkpoint directory share (the Trainer's
``checkpoint-N/``, the directory of Accelerate's ``save_state``): the pointer file that names the
snapshot a directory was made from, and the small files a framework's own code writes, captured
as bytes for the directory's ``Marker``. Framework-free: each adapter imports its framework."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from typing import Callable, Iterable, Optional

from .. import MAX_STEP
from ..errors import CorruptSnapshotError

__all__ = ["POINTER_NAME", "files_written_by", "pointer_file", "read_pointer"]

POINTER_NAME = "async_ckpt.json"  # in a checkpoint directory: the snapshot it was made from
_POINTER_FORMAT = 1
_MAX_POINTER_BYTES = 4096
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory: a save writes no disk here


def pointer_file(engine_directory: str, checkpoint: str, step: int) -> tuple[str, bytes]:
    """The (name, bytes) of ``checkpoint``'s pointer to snapshot ``step`` of the engine in
    ``engine_directory`` (kept relative, so that the two can move together)."""
    return POINTER_NAME, json.dumps({"format": _POINTER_FORMAT, "step": step, "directory":
                                     os.path.relpath(engine_directory, checkpoint)}).encode()


def read_pointer(checkpoint: str) -> Optional[tuple[str, int]]:
    """(engine directory, step) that ``checkpoint``'s pointer names; None when it has none (a
    directory the framework's own code wrote). The file is untrusted: only a regular file is
    read, at most a few KB; CorruptSnapshotError when it is not a pointer."""
    path = os.path.join(checkpoint, POINTER_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CorruptSnapshotError(f"{path} cannot be read as a pointer: {e}") from e
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            data = f.read(_MAX_POINTER_BYTES + 1)
        if len(data) > _MAX_POINTER_BYTES:
            raise ValueError(f"longer than {_MAX_POINTER_BYTES} bytes")
        pointer = json.loads(data)
    except (OSError, ValueError) as e:
        raise CorruptSnapshotError(f"{path} cannot be read as a pointer ({e}): delete the "
                                   "directory, or load it with the framework's own code") from e
    step = pointer.get("step") if isinstance(pointer, dict) else None
    if not (isinstance(pointer, dict) and pointer.get("format") == _POINTER_FORMAT
            and type(step) is int and 0 <= step < MAX_STEP
            and isinstance(pointer.get("directory"), str)):
        raise CorruptSnapshotError(f"{path} is not an async_ckpt pointer of format "
                                   f"{_POINTER_FORMAT}: delete the directory, or load it with the "
                                   "framework's own code")
    return os.path.normpath(os.path.join(checkpoint, pointer["directory"])), step


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
