"""The root manifest: the single source of truth for which snapshots are committed.

A snapshot is restorable if and only if the manifest names it. The manifest is replaced atomically
(``Storage.publish``; locally: temporary file, fsync, ``os.replace``, fsync of the directory), so a
crash at any instant leaves either the old or the new list. Snapshot directories are deleted only
after a manifest that no longer names them is durable; directories that no manifest names are
leftovers of interrupted writes.

Order is commit order (``seq``), not step order: after a user rewinds to an older step and trains on,
the snapshot committed last is the one to resume from, and retention must never drop it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from ..errors import CheckpointError, ManifestError, SnapshotWriteError, UnsupportedFormatError
from ..storage.base import Storage
from . import values
from .shard import is_checksum
from ..checks import is_int, short_repr
from ..storage.names import (MANIFEST_NAME, MANIFEST_TMP, MAX_STEP, MAX_WORLD_SIZE, SHARD_FILE,
                             SNAPSHOT_DIR, checked_name, shard_file_name, snapshot_dir_step)

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "async_ckpt.manifest"
READABLE_MANIFEST_VERSIONS = (1, 2, 3)  # which one a manifest is written as: Manifest.version
MANIFEST_COST_PER_ENTRY = 4096
"""What parsing the manifest may cost (``values.json_cost``) beyond ``values.READ_ALLOWANCE`` for
each snapshot directory and each shard file the checkpoint directory holds (``manifest_budget``):
a shard record costs at most 1.2 KiB, a snapshot record with one shard (two entries) about 4.5
KiB, so a manifest stays readable even when half of what it lists is gone."""
_MAX_INT = 2**62  # bound of sizes, steps and counts: arithmetic on them never overflows int64
_LATEST_TIME = 253402300799  # 9999-12-31T23:59:59Z: any later Unix time cannot be shown as a date


def _fields(record) -> dict:
    """A record's fields by name, in their declared order: the manifest's keys for it."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """One rank's file of a snapshot, with what is needed to spot truncation before reading it."""

    rank: int
    file: str
    bytes: int
    index_xxh3: str


@dataclass(frozen=True, slots=True)
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
    refers: tuple[str, ...] = ()  # earlier snapshots holding some of its bytes (incremental)

    def shard_of(self, rank: int) -> Optional[ShardRecord]:
        """Rank ``rank``'s shard, or None when the record does not list it (a rank's own
        manifest lists only that rank's)."""
        return next((s for s in self.shards if s.rank == rank), None)

    def to_json(self) -> dict:
        d = _fields(self)
        d["shards"] = [_fields(s) for s in self.shards]
        if self.refers:
            d["refers"] = list(self.refers)
        else:
            del d["refers"]
        return d


@dataclass(frozen=True, slots=True)
class DroppedRecord:
    """A snapshot that was committed and later dropped by retention. The other ranks' writers
    read these to tell "committed, then dropped" from "given up" when a directory is gone."""

    dir: str
    step: int
    raw_bytes: int
    stored_bytes: int


_DROPPED_KEPT = 64  # dropped snapshots remembered in the manifest


@dataclass(frozen=True)
class Manifest:
    """Committed snapshots in commit order, oldest first, and the latest ones dropped since.

    ``rank``: None for the manifest of a job's snapshots (every rank's shard in each record); a
    rank number for a rank's own manifest, in the root it keeps when the ranks share no
    directory (docs/FORMAT.md section 8): each record then lists only that rank's shard of its
    ``world_size``, and what restores the job is the object store's manifest."""

    snapshots: tuple[SnapshotRecord, ...] = ()
    next_seq: int = 0
    extra: dict = field(default_factory=dict)
    dropped: tuple[DroppedRecord, ...] = ()
    rank: Optional[int] = None

    def steps(self) -> list[int]:
        return [s.step for s in self.snapshots]

    def find(self, step: int) -> Optional[SnapshotRecord]:
        for s in self.snapshots:
            if s.step == step:
                return s
        return None

    def newest_first(self) -> list[SnapshotRecord]:
        return list(reversed(self.snapshots))

    def commit(self, record: SnapshotRecord, keep_last: int, keep_every: Optional[int] = None,
               keep: Iterable[str] = ()) -> tuple["Manifest", list[SnapshotRecord]]:
        """The manifest with ``record`` appended (replacing an older snapshot of the same step) and
        retention applied; also returns the records it dropped, whose directories may be deleted
        once the new manifest is durable. ``keep``: directories to keep whatever retention says
        (the snapshot being uploaded)."""
        keep = set(keep)
        record = dataclasses.replace(record, seq=self.next_seq)
        replaced = [s for s in self.snapshots if s.step == record.step]
        ordered = [s for s in self.snapshots if s.step != record.step] + [record]
        newest = {s.seq for s in ordered[-keep_last:]}
        kept = _restorable(_with_referenced(ordered, [
            s for s in ordered if s.seq in newest or s.dir in keep
            or (keep_every and s.step % keep_every == 0)]))
        if record not in kept:
            raise SnapshotWriteError(
                f"step {record.step} refers to {sorted(record.refers)}, which the manifest does "
                "not all name (any more); it was not committed")
        kept_dirs = {s.dir for s in kept}
        dropped = replaced + [s for s in ordered if s.dir not in kept_dirs]
        remembered = self.dropped + tuple(DroppedRecord(s.dir, s.step, s.raw_bytes, s.stored_bytes)
                                          for s in dropped)
        return Manifest(tuple(kept), self.next_seq + 1, self.extra,
                        remembered[-_DROPPED_KEPT:], self.rank), dropped

    def without(self, steps: Iterable[int]) -> tuple["Manifest", list[SnapshotRecord]]:
        """The manifest without the given steps, except those a kept snapshot refers to, and the
        dropped records."""
        steps = set(steps)
        kept = tuple(_with_referenced(self.snapshots,
                                      [s for s in self.snapshots if s.step not in steps]))
        kept_dirs = {s.dir for s in kept}
        dropped = [s for s in self.snapshots if s.dir not in kept_dirs]
        return Manifest(kept, self.next_seq, self.extra, self.dropped, self.rank), dropped

    def to_bytes(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": self.version(),
            **({} if self.rank is None else {"rank": self.rank}),
            "next_seq": self.next_seq,
            "snapshots": [s.to_json() for s in self.snapshots],
            **({"extra": self.extra} if self.extra else {}),
            **({"dropped": [_fields(d) for d in self.dropped]} if self.dropped else {}),
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()  # on one line,
        # as json's C encoder writes it: an indented manifest of 60,000 shard records takes
        # seconds to write and half again as much to parse

    def version(self) -> int:
        """The oldest version that expresses this manifest: a reader that knows no references
        would let retention delete a snapshot that a kept one refers to (so it must refuse 2),
        and one that knows no rank's own manifest would take its records for damage (3)."""
        if self.rank is not None:
            return 3
        return 2 if any(s.refers for s in self.snapshots) else 1


def _with_referenced(ordered, kept: list) -> list:
    """``kept`` and every snapshot of ``ordered`` that one of them refers to (and so on: a
    referenced snapshot may refer to older ones), in the order of ``ordered``."""
    by_dir = {s.dir: s for s in ordered}
    dirs = {s.dir for s in kept}
    todo = [d for s in kept for d in s.refers]
    while todo:
        d = todo.pop()
        if d not in dirs and d in by_dir:
            dirs.add(d)
            todo += by_dir[d].refers
    return [s for s in ordered if s.dir in dirs]


def _restorable(kept: list) -> list:
    """``kept`` without the snapshots that refer to one not kept, or (in turn) not restorable:
    only a new snapshot of the same step (after a rewind) replaces a referenced one, and what
    referred to it cannot restore. One pass in commit order, since a snapshot refers only to ones
    committed before it (a reference forward is not restorable either): linear in the chain."""
    restorable: set[str] = set()
    for s in kept:
        if restorable.issuperset(s.refers):
            restorable.add(s.dir)
    return [s for s in kept if s.dir in restorable]


def committed_steps(storage: Storage) -> list[int]:
    """The steps committed in ``storage``, in commit order (oldest first); empty when none is."""
    return read_manifest(storage).steps()


def read_manifest(storage: Storage) -> Manifest:
    """The committed snapshots in ``storage``; an empty manifest when none was ever committed.

    The file is untrusted: every field is checked (types, ranges, names against docs/FORMAT.md
    section 1) before a record is built, so nothing later turns a damaged manifest into a path
    outside ``storage`` or an untyped exception."""
    try:
        raw = _read_bounded(storage)
    except FileNotFoundError:
        return Manifest()
    return parse_manifest(raw, storage.location(MANIFEST_NAME), lambda: manifest_budget(storage))


class _OverTheAllowance(ManifestError):
    """The manifest is larger than ``values.READ_ALLOWANCE`` lets it be in any directory."""


def _read_bounded(storage: Storage) -> bytes:
    """The manifest's bytes, refused unread when parsing them could cost more than
    ``manifest_budget``; the directory is listed only for a manifest that large."""
    try:
        return storage.read_file(MANIFEST_NAME, values.READ_ALLOWANCE // values.JSON_BYTES_PER_BYTE,
                                 _OverTheAllowance)
    except _OverTheAllowance:  # (or not a regular file: refused again below)
        pass
    return storage.read_file(MANIFEST_NAME,
                             manifest_budget(storage) // values.JSON_BYTES_PER_BYTE, ManifestError)


def manifest_budget(storage: Storage) -> int:
    """What parsing the manifest of ``storage`` may cost (``values.json_cost``): the allowance,
    and ``MANIFEST_COST_PER_ENTRY`` for each snapshot directory and shard file there. A manifest
    lists only what the directory holds, so one as large as its job is readable at any world
    size and retention, while one claiming ranks or snapshots that are not there is refused
    unparsed (docs/SECURITY.md)."""
    entries = 0
    for name in storage.list_root():
        if SNAPSHOT_DIR.fullmatch(name):
            try:
                files = storage.list_snapshot(name)
            except OSError:  # unreadable: it holds nothing the manifest may list
                files = ()
            entries += 1 + sum(1 for file, _ in files if SHARD_FILE.fullmatch(file))
    return values.READ_ALLOWANCE + MANIFEST_COST_PER_ENTRY * entries


def parse_manifest(raw: bytes, path: str,
                   budget: Callable[[], int] = lambda: values.READ_ALLOWANCE) -> Manifest:
    """The manifest ``raw`` holds, every field checked (``path`` names it in errors): what the
    reader accepts, and so, through ``write_manifest``, all that the writer may write.
    ``budget()``: what parsing it may cost when that is more than ``values.READ_ALLOWANCE``
    (``manifest_budget``; asked only then)."""
    try:
        try:
            doc = values.parse_json(raw)
        except values.JSONTooCostly:
            doc = values.parse_json(raw, budget())
    except values.JSONTooCostly as e:
        raise ManifestError(f"{path} is refused: {e}. Committed snapshot directories are "
                            "still on disk: run `async-ckpt verify` on the directory") from e
    except (ValueError, RecursionError) as e:
        raise ManifestError(
            f"{path} is not valid JSON (damaged?). Committed snapshot directories are still on disk: "
            "run `async-ckpt verify` on the directory, or restore a step explicitly") from e
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path} is not an async_ckpt manifest; point the engine at its own directory")
    if type(doc.get("version")) is not int or doc["version"] not in READABLE_MANIFEST_VERSIONS:
        raise UnsupportedFormatError(
            f"{path} has manifest version {short_repr(doc.get('version'), 40)}; this async_ckpt "
            f"reads versions {', '.join(map(str, READABLE_MANIFEST_VERSIONS))}. Upgrade "
            "async_ckpt to read it")
    try:
        _check_fields(doc, _MANIFEST_FIELDS, "manifest", closed=False,
                      optional=("extra", "dropped", "rank"))
        if ("rank" in doc) != (doc["version"] == 3):
            raise ManifestError("a rank's own manifest has a 'rank' and version 3, and only it")
        rank = doc.get("rank")
        snapshots = tuple(_snapshot_record(s, f"snapshot {i}", doc["version"], rank)
                          for i, s in enumerate(doc["snapshots"]))
        _check_order(snapshots, doc["next_seq"])
        dropped = tuple(_dropped_record(d, f"dropped {i}") for i, d in enumerate(doc.get("dropped", [])))
        return Manifest(snapshots, doc["next_seq"], doc.get("extra", {}), dropped, rank)
    except ManifestError as e:
        raise ManifestError(f"{path} is invalid: {e}; it was damaged or hand-edited. Committed "
                            "snapshot directories are untouched") from None


def _int(lo: int, hi: int = _MAX_INT):
    return lambda v: is_int(v, lo, hi)


def _of_type(kind):
    return lambda v: type(v) is kind


# Each field and the check its value must pass (bools are not ints).
_MANIFEST_FIELDS = {"next_seq": _int(0), "snapshots": _of_type(list), "extra": _of_type(dict),
                    "dropped": lambda v: type(v) is list and len(v) <= _DROPPED_KEPT,
                    "rank": _int(0, MAX_WORLD_SIZE - 1)}
_SNAPSHOT_FIELDS = {"step": _int(0, MAX_STEP - 1), "seq": _int(0), "dir": _of_type(str),
                    "committed_at": lambda v: type(v) in (int, float) and 0 <= v <= _LATEST_TIME,
                    "world_size": _int(1, MAX_WORLD_SIZE), "shards": _of_type(list),
                    "raw_bytes": _int(0), "stored_bytes": _int(0),
                    "refers": lambda v: type(v) is list and 0 < len(v) == len(set(map(str, v)))}
_SHARD_FIELDS = {"rank": _int(0, MAX_WORLD_SIZE - 1), "file": _of_type(str), "bytes": _int(0),
                 "index_xxh3": is_checksum}


def _check_fields(doc, fields: dict, what: str, closed: bool = True,
                  optional: tuple[str, ...] = ()) -> None:
    """Raise ManifestError unless ``doc`` is an object whose fields pass their checks (those of
    ``optional`` may be absent) and, if ``closed``, has no other fields."""
    if type(doc) is not dict:
        raise ManifestError(f"{what} is not an object")
    if closed and doc.keys() - fields.keys():
        raise ManifestError(f"{what} has unknown fields {sorted(doc.keys() - fields.keys())[:5]}")
    for name, ok in fields.items():
        if name in optional and name not in doc:
            continue
        if name not in doc:
            raise ManifestError(f"{what} has no field {name!r}")
        if not ok(doc[name]):
            raise ManifestError(f"{what}: field {name!r} has a wrong type or is out of range")


def _snapshot_record(doc, what: str, version: int, only_rank: Optional[int]) -> SnapshotRecord:
    _check_fields(doc, _SNAPSHOT_FIELDS, what, optional=("refers",))
    checked_name(doc["dir"], SNAPSHOT_DIR, f"{what}: directory", ManifestError)
    if snapshot_dir_step(doc["dir"]) != doc["step"]:
        raise ManifestError(f"{what}: directory {doc['dir']} does not belong to step {doc['step']}")
    refers = doc.get("refers", [])
    if refers and version < 2:
        raise ManifestError(f"{what}: 'refers' needs manifest version 2")
    for name in refers:
        checked_name(name, SNAPSHOT_DIR, f"{what}: referenced directory", ManifestError)
    if doc["dir"] in refers:
        raise ManifestError(f"{what} refers to itself")
    ranks = range(doc["world_size"]) if only_rank is None else [only_rank]
    if len(doc["shards"]) != len(ranks) or only_rank is not None and only_rank >= doc["world_size"]:
        raise ManifestError(f"{what} lists {len(doc['shards'])} shards for {doc['world_size']} ranks"
                            + ("" if only_rank is None else f" in rank {only_rank}'s own manifest"))
    shards = []
    for rank, shard in zip(ranks, doc["shards"]):
        _check_fields(shard, _SHARD_FIELDS, f"{what} shard {rank}")
        if shard["rank"] != rank or shard["file"] != shard_file_name(rank):
            raise ManifestError(f"{what} shard {rank} is not rank {rank}'s file "
                                f"{shard_file_name(rank)}")
        shards.append(ShardRecord(rank, shard["file"], shard["bytes"], shard["index_xxh3"]))
    return SnapshotRecord(step=doc["step"], seq=doc["seq"], dir=doc["dir"],
                          committed_at=float(doc["committed_at"]), world_size=doc["world_size"],
                          shards=tuple(shards), raw_bytes=doc["raw_bytes"],
                          stored_bytes=doc["stored_bytes"], refers=tuple(refers))


_DROPPED_FIELDS = {"dir": _of_type(str), "step": _SNAPSHOT_FIELDS["step"],
                   "raw_bytes": _int(0), "stored_bytes": _int(0)}


def _dropped_record(doc, what: str) -> DroppedRecord:
    _check_fields(doc, _DROPPED_FIELDS, what)
    checked_name(doc["dir"], SNAPSHOT_DIR, f"{what}: directory", ManifestError)
    if snapshot_dir_step(doc["dir"]) != doc["step"]:
        raise ManifestError(f"{what}: directory {doc['dir']} does not belong to step {doc['step']}")
    return DroppedRecord(doc["dir"], doc["step"], doc["raw_bytes"], doc["stored_bytes"])


def _check_order(snapshots: tuple, next_seq: int) -> None:
    """Steps and directories are unique, and ``seq`` strictly increases below ``next_seq``."""
    if len({s.step for s in snapshots}) != len(snapshots) or len({s.dir for s in snapshots}) != len(snapshots):
        raise ManifestError("a step or directory is listed twice")
    seqs = [s.seq for s in snapshots] + [next_seq]
    if any(a >= b for a, b in zip(seqs, seqs[1:])):
        raise ManifestError("commit sequence numbers do not increase")


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Durably replace the manifest: after this returns, the new list survives a power cut.

    What is written is first read back by ``parse_manifest``: a manifest the reader would refuse
    (a ``next_seq`` past its range, a snapshot referring to itself, both reachable from a crafted
    directory) would make every committed snapshot unreachable, so it is never written
    (SnapshotWriteError; the manifest on disk stays as it was)."""
    data = manifest.to_bytes()
    try:
        parse_manifest(data, storage.location(MANIFEST_NAME), lambda: manifest_budget(storage))
    except CheckpointError as e:
        raise SnapshotWriteError(f"the new manifest would not read back ({e}); it was not "
                                 "written, and the one on disk is unchanged") from e
    storage.publish(MANIFEST_NAME, data)


def recover_manifest(storage: Storage, write: bool = True,
                     rank: Optional[int] = None) -> Manifest:
    """The manifest, or, when ``manifest.json`` is missing although complete snapshots exist (it
    was deleted or lost), one rebuilt from them (and written durably if ``write``).

    Without this, the snapshots of a directory that lost its manifest would all look like
    leftovers and be deleted. A snapshot is complete when every rank's shard has a valid trailer
    and index (chunk checksums are checked when it is restored); in rank ``rank``'s own root
    (``Manifest.rank``), when that rank's shard has. Call only while holding the directory's
    writer locks.
    """
    if storage.exists(MANIFEST_NAME):
        try:
            version = storage.version(MANIFEST_NAME)
        except OSError:  # a link loop, a name too long, no permission: unreadable all the same
            version = None
        if version is None:  # there, yet unreadable: a dangling link (or one of the above)
            raise ManifestError(f"{storage.location(MANIFEST_NAME)} is a link to nothing; replace "
                                "it with the real manifest (committed snapshot directories are "
                                "untouched)")
        return read_manifest(storage)
    found: dict[int, SnapshotRecord] = {}
    for name in storage.list_root():
        record = _complete_snapshot(storage, name, rank) if SNAPSHOT_DIR.fullmatch(name) else None
        if record is not None and (record.step not in found
                                   or found[record.step].committed_at < record.committed_at):
            found[record.step] = record
    if not found:
        return Manifest(rank=rank)
    ordered = _restorable(sorted(found.values(), key=lambda r: r.committed_at))
    manifest = Manifest(tuple(dataclasses.replace(r, seq=i) for i, r in enumerate(ordered)),
                        next_seq=len(ordered), rank=rank)
    if write:
        write_manifest(storage, manifest)
    log.warning("%s was missing; rebuilt it from %d complete snapshot(s): steps %s",
                storage.location(MANIFEST_NAME), len(ordered), manifest.steps())
    return manifest


def _complete_snapshot(storage: Storage, name: str,
                       only_rank: Optional[int]) -> Optional[SnapshotRecord]:
    """The record of snapshot directory ``name`` if every rank's shard in it (or ``only_rank``'s,
    in that rank's own root) is whole, else None (also when ``name`` is not a directory, or a
    link to one)."""
    from .shard import (ShardReader, data_file_bytes, data_file_problems,  # only for this
                        referenced_dirs)  # repair

    shards, indexes, raw, refers_to = {}, [], 0, set()
    listing = dict(storage.list_snapshot(name))
    for file in listing:
        if not SHARD_FILE.fullmatch(file) or (  # e.g. a shard still being written (*.partial)
                only_rank is not None and file != shard_file_name(only_rank)):
            continue
        try:
            with ShardReader(storage.open_shard(name, file)) as reader:
                index = reader.index
                raw += reader.raw_bytes
                refers_to.update(referenced_dirs(reader.storages))
                record = ShardRecord(int(SHARD_FILE.fullmatch(file).group(1)), file, reader.size,
                                     reader.index_xxh3)
        except CheckpointError:
            continue
        if index.get("rank") != record.rank or data_file_problems(index, listing, name):
            return None
        indexes.append(index)
        shards[record.rank] = record
    world_size = indexes[0].get("world_size") if indexes else None
    created = indexes[0].get("created") if indexes else None
    if type(world_size) is not int or not 0 < world_size <= MAX_WORLD_SIZE:
        return None
    needed = list(range(world_size)) if only_rank is None else [only_rank]
    if (sorted(shards) != needed or needed[-1] >= world_size
            or type(created) not in (int, float) or not 0 <= created <= _LATEST_TIME
            or any(i.get("step") != snapshot_dir_step(name) or i.get("world_size") != world_size
                   for i in indexes)):
        return None
    refers = tuple(sorted(refers_to))
    if name in refers:  # a shard that refers to its own snapshot cannot be restored
        return None
    return SnapshotRecord(step=snapshot_dir_step(name), seq=0, dir=name, committed_at=float(created),
                          world_size=world_size, shards=tuple(shards[r] for r in needed),
                          raw_bytes=raw, stored_bytes=sum(s.bytes for s in shards.values())
                          + sum(map(data_file_bytes, indexes)),
                          refers=refers)


def snapshot_dirs(storage: Storage) -> list[str]:
    """Every snapshot directory name in ``storage``, committed or not, sorted."""
    return [name for name in storage.list_root() if SNAPSHOT_DIR.fullmatch(name)]


def leftovers(storage: Storage, manifest: Manifest) -> list[str]:
    """Names in ``storage`` written by interrupted snapshots or commits: never restorable, safe
    to delete (``Storage.remove``, ``storage.local.remove_entries``) while no writer is active
    there."""
    referenced = {s.dir for s in manifest.snapshots}
    return [name for name in storage.list_root()
            if (SNAPSHOT_DIR.fullmatch(name) and name not in referenced) or MANIFEST_TMP.fullmatch(name)]
