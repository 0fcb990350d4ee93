"""The root manifest: the single source of truth for which snapshots are committed.

A snapshot is restorable if and only if the manifest names it. The manifest is replaced atomically
(temporary file, fsync, ``os.replace``, fsync of the directory), so a crash at any instant leaves
either the old or the new list. Snapshot directories are deleted only after a manifest that no longer
names them is durable; directories that no manifest names are leftovers of interrupted writes.

Order is commit order (``seq``), not step order: after a user rewinds to an older step and trains on,
the snapshot committed last is the one to resume from, and retention must never drop it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .errors import CheckpointError, ManifestError, UnsupportedFormatError
from .fsutil import atomic_write

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "async_ckpt.manifest"
MANIFEST_VERSION = 1
_SNAPSHOT_DIR = re.compile(r"^step-(\d{20})\.([0-9a-f]{8})$")
_MANIFEST_TMP = re.compile(re.escape(MANIFEST_NAME) + r"\.tmp-\d+$")


@dataclass(frozen=True)
class ShardRecord:
    """One rank's file of a snapshot, with what is needed to spot truncation before reading it."""

    rank: int
    file: str
    bytes: int
    index_xxh3: str


@dataclass(frozen=True)
class SnapshotRecord:
    """A committed snapshot as the manifest lists it."""

    step: int
    seq: int
    dir: str
    committed_at: float
    world_size: int
    shards: tuple[ShardRecord, ...]
    raw_bytes: int
    stored_bytes: int

    def to_json(self) -> dict:
        d = self.__dict__.copy()
        d["shards"] = [s.__dict__ for s in self.shards]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SnapshotRecord":
        d = dict(d)
        d["shards"] = tuple(ShardRecord(**s) for s in d["shards"])
        return cls(**d)


@dataclass(frozen=True)
class Manifest:
    """Committed snapshots in commit order, oldest first."""

    snapshots: tuple[SnapshotRecord, ...] = ()
    next_seq: int = 0
    extra: dict = field(default_factory=dict)

    def steps(self) -> list[int]:
        return [s.step for s in self.snapshots]

    def find(self, step: int) -> Optional[SnapshotRecord]:
        for s in self.snapshots:
            if s.step == step:
                return s
        return None

    def newest_first(self) -> list[SnapshotRecord]:
        return list(reversed(self.snapshots))

    def commit(self, record: SnapshotRecord, keep_last: int,
               keep_every: Optional[int] = None) -> tuple["Manifest", list[SnapshotRecord]]:
        """The manifest with ``record`` appended (replacing an older snapshot of the same step) and
        retention applied; also returns the records it dropped, whose directories may be deleted
        once the new manifest is durable."""
        record = SnapshotRecord(**{**record.__dict__, "seq": self.next_seq})
        replaced = [s for s in self.snapshots if s.step == record.step]
        ordered = [s for s in self.snapshots if s.step != record.step] + [record]
        newest = {s.seq for s in ordered[-keep_last:]}
        kept = [s for s in ordered
                if s.seq in newest or (keep_every and s.step % keep_every == 0)]
        dropped = replaced + [s for s in ordered if s not in kept]
        return Manifest(tuple(kept), self.next_seq + 1, self.extra), dropped

    def without(self, steps: Iterable[int]) -> tuple["Manifest", list[SnapshotRecord]]:
        """The manifest without the given steps, and the dropped records."""
        steps = set(steps)
        kept = tuple(s for s in self.snapshots if s.step not in steps)
        dropped = [s for s in self.snapshots if s.step in steps]
        return Manifest(kept, self.next_seq, self.extra), dropped

    def to_bytes(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "next_seq": self.next_seq,
            "snapshots": [s.to_json() for s in self.snapshots],
            **({"extra": self.extra} if self.extra else {}),
        }
        return json.dumps(doc, indent=1, allow_nan=False).encode()


def manifest_path(root: str) -> str:
    return os.path.join(root, MANIFEST_NAME)


def read_manifest(root: str) -> Manifest:
    """The committed snapshots under ``root``; an empty manifest when none was ever committed."""
    path = manifest_path(root)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return Manifest()
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {e.strerror}; check permissions") from e
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ManifestError(
            f"{path} is not valid JSON (damaged?). Committed snapshot directories are still on disk: "
            "run `async-ckpt verify` on the directory, or restore a step explicitly") from e
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path} is not an async_ckpt manifest; point the engine at its own directory")
    if doc.get("version") != MANIFEST_VERSION:
        raise UnsupportedFormatError(
            f"{path} has manifest version {doc.get('version')!r}; this async_ckpt reads version "
            f"{MANIFEST_VERSION}. Upgrade async_ckpt to read it")
    try:
        _check_types(doc, _MANIFEST_FIELDS, "manifest")
        for i, snapshot in enumerate(doc["snapshots"]):
            _check_types(snapshot, _SNAPSHOT_FIELDS, f"snapshot {i}")
            for shard in snapshot["shards"]:
                _check_types(shard, _SHARD_FIELDS, f"snapshot {i} shard")
        snapshots = tuple(SnapshotRecord.from_json(s) for s in doc["snapshots"])
        return Manifest(snapshots, doc["next_seq"], doc.get("extra", {}))
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path} is structurally invalid ({e}); it was damaged or hand-edited") from e


_MANIFEST_FIELDS = {"next_seq": int, "snapshots": list, "extra": dict}
_SNAPSHOT_FIELDS = {"step": int, "seq": int, "dir": str, "committed_at": (int, float),
                    "world_size": int, "shards": list, "raw_bytes": int, "stored_bytes": int}
_SHARD_FIELDS = {"rank": int, "file": str, "bytes": int, "index_xxh3": str}


def _check_types(doc, fields: dict, what: str) -> None:
    """Raise TypeError unless ``doc`` is an object whose fields have the listed JSON types
    (``extra`` may be absent; bools are not ints)."""
    if not isinstance(doc, dict):
        raise TypeError(f"{what} is not an object")
    for name, kind in fields.items():
        if name == "extra" and name not in doc:
            continue
        value = doc[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"{what}: field {name!r} has the wrong type")


def write_manifest(root: str, manifest: Manifest) -> None:
    """Durably replace the manifest: after this returns, the new list survives a power cut."""
    atomic_write(manifest_path(root), manifest.to_bytes())


def recover_manifest(root: str, write: bool = True) -> Manifest:
    """The manifest, or, when ``manifest.json`` is missing although complete snapshots exist (it
    was deleted or lost), one rebuilt from them (and written durably if ``write``).

    Without this, the snapshots of a directory that lost its manifest would all look like
    leftovers and be deleted. A snapshot is complete when every rank's shard has a valid trailer
    and index (chunk checksums are checked when it is restored). Call only while holding the
    directory's writer locks.
    """
    if os.path.exists(manifest_path(root)):
        return read_manifest(root)
    found: dict[int, SnapshotRecord] = {}
    for name in os.listdir(root):
        record = _complete_snapshot(root, name) if _SNAPSHOT_DIR.match(name) else None
        if record is not None and (record.step not in found
                                   or found[record.step].committed_at < record.committed_at):
            found[record.step] = record
    if not found:
        return Manifest()
    ordered = sorted(found.values(), key=lambda r: r.committed_at)
    manifest = Manifest(tuple(SnapshotRecord(**{**r.__dict__, "seq": i}) for i, r in enumerate(ordered)),
                        next_seq=len(ordered))
    if write:
        write_manifest(root, manifest)
    log.warning("%s was missing; rebuilt it from %d complete snapshot(s): steps %s",
                manifest_path(root), len(ordered), manifest.steps())
    return manifest


def _complete_snapshot(root: str, name: str) -> Optional[SnapshotRecord]:
    from .format import SHARD_FILE, ShardReader  # the shard format is needed only for this repair

    shards, indexes = [], []
    for file in sorted(os.listdir(os.path.join(root, name))):
        if not SHARD_FILE.match(file):  # e.g. a shard still being written (*.partial)
            continue
        try:
            with ShardReader(os.path.join(root, name, file)) as reader:
                indexes.append(reader.index)
                shards.append(ShardRecord(reader.index.get("rank"), file, reader.size, reader.index_xxh3))
        except (CheckpointError, OSError):
            continue
    if not indexes:
        return None
    first = indexes[0]
    world_size, step = first.get("world_size"), first.get("step")
    if (not isinstance(step, int) or not isinstance(world_size, int)
            or sorted(s.rank for s in shards) != list(range(world_size))
            or any(i.get("step") != step for i in indexes)):
        return None
    raw = sum(s["nbytes"] for i in indexes for s in i["storages"])
    return SnapshotRecord(step=step, seq=0, dir=name, committed_at=float(first.get("created", 0)),
                          world_size=world_size, shards=tuple(sorted(shards, key=lambda s: s.rank)),
                          raw_bytes=raw, stored_bytes=sum(s.bytes for s in shards))


def snapshot_dir_name(step: int, session: str, attempt: int) -> str:
    """The directory of the ``attempt``-th snapshot of ``step`` in a session: the same on every rank
    (they agree on the session), fresh for every attempt, so re-snapshotting a committed step
    never touches it."""
    tag = hashlib.blake2b(f"{session}/{step}/{attempt}".encode(), digest_size=4).hexdigest()
    return f"step-{step:020d}.{tag}"


def leftovers(root: str, manifest: Manifest) -> list[str]:
    """Names under ``root`` written by interrupted snapshots or commits: never restorable, safe to
    delete while no writer is active on ``root``."""
    referenced = {s.dir for s in manifest.snapshots}
    names = []
    for name in sorted(os.listdir(root)):
        if _SNAPSHOT_DIR.match(name) and name not in referenced:
            names.append(name)
        elif _MANIFEST_TMP.match(name):
            names.append(name)
    return names


def remove_paths(root: str, names: Iterable[str]) -> None:
    """Delete snapshot directories or stray files under ``root``; missing ones are fine."""
    for name in names:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
