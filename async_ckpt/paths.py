"""Names inside a checkpoint directory, and the only ways the library opens or deletes them.

A checkpoint directory is untrusted input (docs/SECURITY.md). So, as docs/FORMAT.md section 1
requires of readers: a name read from a file becomes a path only after it matches one of the exact
patterns below (one path component, no separator, no ``.``/``..``, no NUL, bounded length); files
are opened only when they are regular files, checked without blocking (a FIFO would hang the
reader, a device could act); and deletion removes only entries whose names match a pattern of
ours, directly inside the given directory, without following symlinks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
from typing import Iterable, Optional, Type

from .errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_TMP = re.compile(re.escape(MANIFEST_NAME) + r"\.tmp-\d{1,10}")
SNAPSHOT_DIR = re.compile(r"step-(\d{20})\.([0-9a-f]{8})")
SHARD_FILE = re.compile(r"rank-(\d{5})\.ackpt")
PARTIAL_SUFFIX = ".partial"  # a shard being written; renamed to its final name once durable
PARTIAL_SHARD_FILE = re.compile(SHARD_FILE.pattern + re.escape(PARTIAL_SUFFIX))
LOCK_PREFIX = ".lock-rank"
LOCK_FILE = re.compile(re.escape(LOCK_PREFIX) + r"\d{5}")
MAX_STEP = 10**20  # steps have 20 digits in directory names
_DELETABLE = (SNAPSHOT_DIR, MANIFEST_TMP, SHARD_FILE, PARTIAL_SHARD_FILE)


def snapshot_dir_name(step: int, session: str, attempt: int) -> str:
    """The directory of the ``attempt``-th snapshot of ``step`` in a session: the same on every rank
    (they agree on the session), fresh for every attempt, so re-snapshotting a committed step
    never touches it."""
    tag = hashlib.blake2b(f"{session}/{step}/{attempt}".encode(), digest_size=4).hexdigest()
    return f"step-{step:020d}.{tag}"


def snapshot_dir_step(name: str) -> Optional[int]:
    """The step a snapshot directory name carries, or None when ``name`` is not one."""
    match = SNAPSHOT_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.ackpt"


def lock_file_name(rank: int) -> str:
    return f"{LOCK_PREFIX}{rank:05d}"


def lock_files(root: str) -> list[str]:
    """The engine lock files in ``root`` (one per rank that ever wrote there)."""
    return sorted(n for n in os.listdir(root) if LOCK_FILE.fullmatch(n))


def checked_name(name, pattern: re.Pattern, what: str, error: Type[CheckpointError]) -> str:
    """``name`` if it is a string matching ``pattern`` exactly, else ``error``: the one gate between a
    name read from a file and a path."""
    if type(name) is not str or not pattern.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise error(f"{what} {shown} is not a valid name (docs/FORMAT.md section 1); the file was "
                    "damaged or crafted, and nothing it names is used")
    return name


def open_regular(path: str, error: Type[CheckpointError], flags: int = os.O_RDONLY) -> int:
    """A file descriptor of ``path``, which must be a regular file (a symlink to one is followed).

    Opened with O_NONBLOCK so that a FIFO planted in the directory cannot hang the caller, and
    checked with fstat on the open descriptor. FileNotFoundError propagates (callers say what a
    missing file means); anything else that is not a readable regular file raises ``error``.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise error(f"{path} is not a regular file; the checkpoint directory was tampered with")
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL
        raise error(f"cannot open {path!r}: {getattr(e, 'strerror', None) or e}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path} is not a regular file; the checkpoint directory was tampered with")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int, error: Type[CheckpointError]) -> bytes:
    """The whole content of the regular file ``path``, refusing one larger than ``limit`` bytes
    before reading it."""
    fd = open_regular(path, error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{path} has {size} bytes, more than the {limit} a valid one can have")
        data = os.pread(fd, size + 1, 0)
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror}") from e
    finally:
        os.close(fd)
    if len(data) > limit:
        raise error(f"{path} grew past {limit} bytes while read")
    return data


def remove_entries(root: str, names: Iterable[str]) -> None:
    """Delete the named entries directly inside ``root``; missing ones are fine.

    Only names of ours are deleted (snapshot directories, shard files, interrupted manifest
    replacements); anything else is logged and left alone. A symlink is removed as a link, never
    followed, and a directory's tree is removed without following the symlinks inside it.
    """
    for name in names:
        if type(name) is not str or not any(p.fullmatch(name) for p in _DELETABLE):
            log.error("refusing to delete %r under %s: not a name async_ckpt writes", name, root)
            continue
        path = os.path.join(root, name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not delete %s: %s", path, e.strerror)
