"""The pointer: the small record by which a file or directory in a framework's own layout stands
for a snapshot, one format for every adapter.

A Lightning ``.ckpt`` keeps it inside the torch file (``.data/async_ckpt``, which torch ignores:
``format/native.py``); a ``checkpoint-N`` directory (Hugging Face's Trainer, Accelerate's
``save_state``, Lightning's ``ModelParallelStrategy``) keeps it as its file ``async_ckpt.json``.
It names the snapshot's step and the engine directory (relative to the pointer's own directory,
so that the two can move together) and, where the framework counts them, its global step and
epoch, which loading checks against the snapshot. Framework-free: each adapter imports its
framework.

Pointers are untrusted input: only a regular file is read, at most ``MAX_POINTER_BYTES`` of it;
every field is checked, the step is a validated integer, never a path; a damaged one raises
``PointerFileError``. Pointers written by earlier versions (``"async_ckpt.lightning"`` in a
``.ckpt``, ``{"format": 1, ...}`` in a directory) read as the same record.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

from .. import MAX_STEP, Marker
from ..errors import PointerFileError

__all__ = ["POINTER_NAME", "Pointer", "checked_fields", "read_pointer_file", "read_pointer",
           "pointer_file"]

POINTER_NAME = "async_ckpt.json"  # in a checkpoint directory: the snapshot it was made from
POINTER_FORMAT = "async_ckpt.pointer"
POINTER_VERSION = 1
MAX_POINTER_BYTES = 4096
_TORCH_FILE_PREFIX = b"PK\x03\x04"  # a zip archive: torch's file format
# What a pointer's bytes start with, as written now and by earlier versions: anything else is
# not one of ours (a .ckpt that torch.save wrote).
_PREFIXES = tuple(b'{"format": ' + json.dumps(form).encode()
                  for form in (POINTER_FORMAT, "async_ckpt.lightning", 1))


def is_count(value) -> bool:
    """Whether ``value`` is a count as a pointer keeps one: an int (not a bool), >= 0."""
    return type(value) is int and value >= 0


_FIELDS = {  # each field of a pointer, and what it may hold
    "format": lambda v: v == POINTER_FORMAT, "version": lambda v: v == POINTER_VERSION,
    "step": lambda v: is_count(v) and v < MAX_STEP,
    "directory": lambda v: type(v) is str and v != "",
    "global_step": lambda v: v is None or is_count(v),
    "epoch": lambda v: v is None or is_count(v)}


@dataclass(frozen=True)
class Pointer:
    """Snapshot ``step`` of the engine in ``directory`` (relative to the pointer's own
    directory); ``global_step`` and ``epoch``: the framework's counts saved with it, or None."""

    step: int
    directory: str
    global_step: Optional[int] = None
    epoch: Optional[int] = None

    def to_bytes(self) -> bytes:
        return (json.dumps({"format": POINTER_FORMAT, "version": POINTER_VERSION,
                            "step": self.step, "directory": self.directory,
                            "global_step": self.global_step, "epoch": self.epoch}) + "\n").encode()

    def engine_directory(self, beside: str) -> str:
        """The engine directory, for a pointer kept in directory ``beside``."""
        return os.path.normpath(os.path.join(beside, self.directory))

    @classmethod
    def parse(cls, data: bytes, where: str) -> "Pointer":
        """The pointer ``data`` holds (read from ``where``); PointerFileError if it is not a
        valid one."""
        fields = checked_fields(data, _FIELDS, where, _as_written_now)
        return cls(fields["step"], fields["directory"], fields["global_step"], fields["epoch"])


def checked_fields(data: bytes, fields: Mapping[str, Callable[[Any], bool]], where: str,
                   upgrade: Callable[[dict], dict] = lambda fields: fields) -> dict:
    """The JSON object ``data`` holds (at most ``MAX_POINTER_BYTES``), with exactly the keys of
    ``fields``, each value passing its check (after ``upgrade``, which turns an older version's
    object into today's): how every record a framework's file keeps is read (the pointer, the
    DeepSpeed adapter's). PointerFileError naming ``where`` otherwise."""
    try:
        if len(data) > MAX_POINTER_BYTES:
            raise ValueError(f"longer than {MAX_POINTER_BYTES} bytes")
        found = json.loads(data.decode("utf-8"))
        if type(found) is dict:
            found = upgrade(found)
        if type(found) is not dict or found.keys() != fields.keys():
            raise ValueError(f"not the fields {sorted(fields)}")
        wrong = [name for name, valid in fields.items() if not valid(found[name])]
        if wrong:
            raise ValueError(f"{wrong[0]} is {str(found[wrong[0]])[:40]!r}")
    except ValueError as e:  # UnicodeDecodeError and json's errors are ValueErrors
        raise PointerFileError(f"{where} holds a damaged async_ckpt pointer ({e}); it names no "
                               "snapshot that can be loaded: delete it, or load the checkpoint "
                               "with the framework's own code") from e
    return found


def _as_written_now(fields: dict) -> dict:
    """A pointer an earlier version wrote, in the fields of today's (checked by the caller)."""
    if fields.get("format") == "async_ckpt.lightning":
        return {**fields, "format": POINTER_FORMAT}
    if fields.get("format") == 1 and fields.keys() == {"format", "step", "directory"}:
        return {**fields, "format": POINTER_FORMAT, "version": POINTER_VERSION,
                "global_step": None, "epoch": None}
    return fields


def read_pointer_file(path: Union[str, os.PathLike]) -> Optional[Pointer]:
    """The pointer the file at ``path`` keeps: the whole file, or the record of a torch file.
    None where there is no regular file at ``path`` (a directory, a dangling link), or it is
    not a pointer of ours (a checkpoint another ``CheckpointIO`` or ``torch.save`` wrote)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block a plain open
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        raise PointerFileError(f"{path} cannot be opened ({e.strerror})") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_POINTER_BYTES + 1)
        if data.startswith(_TORCH_FILE_PREFIX):
            f.seek(0)
            data = Marker.record_in(f) or b""
    if not data.startswith(_PREFIXES):
        return None
    return Pointer.parse(data, str(path))


def pointer_file(engine_directory: str, checkpoint: str, step: int) -> tuple[str, bytes]:
    """The (name, bytes) of directory ``checkpoint``'s pointer to snapshot ``step`` of the
    engine in ``engine_directory``."""
    return POINTER_NAME, Pointer(step, os.path.relpath(engine_directory, checkpoint)).to_bytes()


class Target(NamedTuple):
    """What a checkpoint directory's pointer names: snapshot ``step`` of the engine in
    ``directory``."""

    directory: str
    step: int


def read_pointer(checkpoint: str) -> Optional[Target]:
    """The target that directory ``checkpoint``'s pointer names; None when it has
    none (a directory the framework's own code wrote). Its ``async_ckpt.json`` being anything
    but a pointer (not a regular file, not ours) raises PointerFileError."""
    path = os.path.join(checkpoint, POINTER_NAME)
    pointer = read_pointer_file(path)
    if pointer is None:
        if os.path.lexists(path):
            raise PointerFileError(f"{path} is not an async_ckpt pointer (not a regular file "
                                   "holding one): delete the directory, or load it with the "
                                   "framework's own code")
        return None
    return Target(pointer.engine_directory(checkpoint), pointer.step)
