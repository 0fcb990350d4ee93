"""Names inside a checkpoint directory: the one owner of every file-name pattern (docs/FORMAT.md
section 1).

A checkpoint directory is untrusted input (docs/SECURITY.md). So a name read from a file becomes a
path only after it matches one of the exact patterns below (one path component, no separator, no
``.``/``..``, no NUL, bounded length), through ``checked_name``; and only names of ours are ever
deleted (``is_ours``). It lives at the bottom of the layers, in storage/, because the storages
need it (what they may delete, the names they write under) as much as format/ and everything
above; it imports nothing of the library but the errors and checks.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Optional, Type

from ..checks import is_int, short_repr
from ..errors import CheckpointError, InvalidArgumentError


MANIFEST_NAME = "manifest.json"
_REPLACEMENT = ".tmp-"  # a file's replacement being written: NAME.tmp-PID, renamed over NAME
MANIFEST_TMP = re.compile(re.escape(MANIFEST_NAME + _REPLACEMENT) + r"[0-9]{1,10}")
REPLACEMENT_FILE = re.compile(r".+" + re.escape(_REPLACEMENT) + r"[0-9]{1,10}")  # of any file
SNAPSHOT_DIR = re.compile(r"step-([0-9]{20})\.([0-9a-f]{8})")
SHARD_FILE = re.compile(r"rank-([0-9]{5})\.ackpt")
DATA_FILE_SUFFIXES = {"torch": "pt", "safetensors": "safetensors"}
"""The suffix of a shard's data file in each framework format that ``format.native`` writes."""
DATA_FILE = re.compile(r"rank-([0-9]{5})\.(0|[1-9][0-9]?)\.("
                       + "|".join(map(re.escape, DATA_FILE_SUFFIXES.values())) + ")")
"""A file of a shard's chunks in a framework's format (format version 6): rank, number (one
spelling each: no leading zero), suffix."""
MAX_DATA_FILES = 100  # what DATA_FILE's number can count
PARTIAL_SUFFIX = ".partial"  # a shard being written; renamed to its final name once durable
PARTIAL_SHARD_FILE = re.compile(SHARD_FILE.pattern + re.escape(PARTIAL_SUFFIX))
PARTIAL_DATA_FILE = re.compile(DATA_FILE.pattern + re.escape(PARTIAL_SUFFIX))  # being downloaded
LOCK_PREFIX = ".lock-rank"
LOCK_FILE = re.compile(re.escape(LOCK_PREFIX) + r"[0-9]{5}")
SESSION_NAME = "session.json"  # the current run's session token, with several ranks
HEARTBEAT_FILE = re.compile(r"heartbeat\.rank[0-9]{5}\.json")  # liveness, not part of any snapshot
MEMORY_SESSION_FILE = re.compile(r"memory\.rank[0-9]{5}\.json")  # the memory tier's session
RANK_ROOT = re.compile(r"rank-([0-9]{5})")  # a rank's own root when the ranks share no directory
MAX_STEP = 10**20  # steps have 20 digits in directory names
MAX_WORLD_SIZE = 10**5  # ranks have 5 digits in shard, lock and heartbeat file names
_DELETABLE = (SNAPSHOT_DIR, MANIFEST_TMP, SHARD_FILE, PARTIAL_SHARD_FILE, DATA_FILE,
              PARTIAL_DATA_FILE)


def is_ours(name) -> bool:
    """Whether ``name`` is an entry the library writes and may delete (snapshot directories,
    shard and data files finished or not, interrupted manifest replacements)."""
    return type(name) is str and any(p.fullmatch(name) for p in _DELETABLE)


def replacement_name(name: str, pid: int) -> str:
    """The temporary name under which process ``pid`` writes the next version of file ``name``
    (for the manifest, what ``MANIFEST_TMP`` matches)."""
    return f"{name}{_REPLACEMENT}{pid}"


def check_step(step) -> None:
    """InvalidArgumentError unless ``step`` can tag a snapshot: an int from 0 to ``MAX_STEP - 1``."""
    if not is_int(step, 0, MAX_STEP - 1):
        raise InvalidArgumentError(f"step must be an int from 0 to {MAX_STEP - 1}, not "
                                   f"{short_repr(step)}")


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


def is_lock_file(name) -> bool:
    """Whether ``name`` is a rank's lock file (an engine has used the directory)."""
    return type(name) is str and LOCK_FILE.fullmatch(name) is not None


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.ackpt"


def data_files_of(rank: int, names: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """The data files of ``rank``'s shard among a snapshot directory's (name, size) listing."""
    return [(name, size) for name, size in names
            if (m := DATA_FILE.fullmatch(name)) and int(m.group(1)) == rank]


def data_file_name(rank: int, number: int, format: str) -> str:
    """The name of data file ``number`` of ``rank``'s shard, a file in framework format
    ``format`` (a key of ``DATA_FILE_SUFFIXES``, whose suffix says which): what ``DATA_FILE``
    matches."""
    return f"rank-{rank:05d}.{number}.{DATA_FILE_SUFFIXES[format]}"


def rank_root_name(rank: int) -> str:
    """The directory inside ``DIR`` that is rank ``rank``'s own checkpoint root when the ranks of
    a job do not share ``DIR`` (node-local disks; docs/FORMAT.md section 8)."""
    return f"rank-{rank:05d}"


def lock_file_name(rank: int) -> str:
    return f"{LOCK_PREFIX}{rank:05d}"


def heartbeat_file_name(rank: int) -> str:
    return f"heartbeat.rank{rank:05d}.json"


def memory_session_file_name(rank: int) -> str:
    """The file naming the memory tier's session of ``rank`` (docs/memory_tier.md): what a
    trainer greets the rank's keeper with; what ``MEMORY_SESSION_FILE`` matches."""
    return f"memory.rank{rank:05d}.json"


def checked_name(name, pattern: re.Pattern, what: str, error: Type[CheckpointError]) -> str:
    """``name`` if it is a string matching ``pattern`` exactly, else ``error``: the one gate between a
    name read from a file and a path."""
    if type(name) is not str or not pattern.fullmatch(name):
        raise error(f"{what} {short_repr(name, 80)} is not a valid name (docs/FORMAT.md section "
                    "1); the file was damaged or crafted, and nothing it names is used")
    return name
