"""``async-ckpt verify``: read every chunk, check every checksum, and say what restore() would
pick; also what ``gc`` runs before it drops committed snapshots."""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from .common import (EXIT_DAMAGE, EXIT_OK, add_dir_command, checkpoint_dir, fail,
                     pick_record, progress, step_arg)
from ..errors import CheckpointError, CorruptSnapshotError, ManifestError
from ..format.manifest import Manifest, SnapshotRecord, read_manifest, snapshot_dirs
from ..storage.names import MANIFEST_NAME, SHARD_FILE, snapshot_dir_step
from ..format.references import References
from ..format.shard import ShardReader
from ..read.memory import require_memory
from ..storage.base import Storage


HELP = "read every chunk and check every checksum"
DESCRIPTION = """\
Read every chunk of the named snapshots and check every checksum; report each damaged file and
chunk, and say which step restore() would pick (the newest committed snapshot whose shards all
verify). Exit 0 only when every named snapshot is intact.
"""


def add(commands) -> None:
    sub = add_dir_command(commands, "verify", cmd_verify, HELP, DESCRIPTION)
    which = sub.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_arg, metavar="N",
                       help="verify the snapshot of step N (default: the newest committed)")
    which.add_argument("--all", action="store_true", help="verify every committed snapshot")


def cmd_verify(args: argparse.Namespace) -> int:
    storage = checkpoint_dir(args.dir)
    root = storage.location()
    try:
        manifest = read_manifest(storage)
    except ManifestError as e:
        fail(str(e), EXIT_DAMAGE)
        _verify_unreferenced(storage)
        return EXIT_DAMAGE
    if args.all:
        if not manifest.snapshots:
            pick_record(manifest, None, root, "verify")  # raises NoSnapshotError
        named = list(manifest.snapshots)
    else:
        named = [pick_record(manifest, args.step, root, "verify")]
    named_seqs = {r.seq for r in named}
    results: list[tuple[SnapshotRecord, list[str], bool]] = []
    pick: Optional[SnapshotRecord] = None
    with progress(sum(s.bytes for r in named for s in r.shards), "verifying") as bar:
        for record in manifest.newest_first():
            asked = record.seq in named_seqs
            if not asked and pick is not None:
                continue
            if not asked:  # checked only to find what restore() would pick
                bar.total += sum(s.bytes for s in record.shards)
                bar.refresh()
            problems = verify_record(storage, record, bar, manifest)
            results.append((record, problems, asked))
            if pick is None and not problems:
                pick = record
            if pick is not None and named_seqs <= {r.seq for r, _, _ in results}:
                break
    damaged = [r for r, problems, asked in results if asked and problems]
    print(f"{root}: read every chunk of {len(results)} snapshot{'s' * (len(results) != 1)}, "
          "newest first")
    for record, problems, asked in results:
        note = "" if asked else "   (not asked for; checked to find what restore() would pick)"
        print(f"  step {record.step:<10} {'DAMAGED' if problems else 'ok'}{note}")
        for problem in problems:
            print(f"    {problem}")
    if manifest.rank is not None:
        print(f"rank {manifest.rank}'s own root (the ranks shared no directory): the job restores "
              "from its object store's manifest, not from here")
    elif pick is None:
        print("restore() would find no intact snapshot and raise NoSnapshotError (nothing loads)")
    elif pick is manifest.snapshots[-1]:
        print(f"restore() would pick step {pick.step}: the newest committed snapshot, intact")
    else:
        skipped = ", ".join(str(r.step) for r, p, _ in results if p and r.seq > pick.seq)
        print(f"restore() would pick step {pick.step}: the newest committed snapshot that "
              f"verifies (newer damaged: {skipped})")
    if damaged:
        print(f"result: DAMAGED: {len(damaged)} of {len(named)} snapshot"
              f"{'s' * (len(named) != 1)} asked for; restore(step=N) of a damaged step fails")
        return EXIT_DAMAGE
    print(f"result: intact: {len(named)} of {len(named)} snapshot{'s' * (len(named) != 1)} asked for")
    return EXIT_OK


def verify_record(storage: Storage, record: SnapshotRecord, bar, manifest: Manifest) -> list[str]:
    """One line per problem of a committed snapshot (of ``manifest``): missing or truncated
    files, damaged chunks, here or in the earlier snapshots it refers to, views of storages a
    restore would not read, and sharded tensors whose pieces in the ranks' shards a restore
    would refuse."""
    problems = []
    with References(storage, manifest.snapshots) as refs:
        for shard in record.shards:
            found = _verify_shard(storage, record.dir, shard.file, record.step, shard.bytes,
                                  shard.index_xxh3)
            problems += found or _verify_references(refs, record, shard.rank)
            bar.update(shard.bytes)
        if problems:
            return problems
        # every shard reads: does each view what a restore reads, do the pieces make tensors?
        from ..read.reshard import PieceIndex  # imports torch: not at the CLI's start-up
        from ..read.snapshot import check_views

        for shard in record.shards:
            problems += _problems(lambda: check_views(refs, record, shard.rank,
                                                      manifest.rank is None) or [],
                                  storage.location(record.dir, shard.file))
        return problems or _problems(lambda: PieceIndex(refs, record).problems(),
                                     storage.location(record.dir))


def _problems(check: Callable[[], list[str]], where: str) -> list[str]:
    """``check()``'s lines, or the one line of the damage it raised (a file that cannot be read
    is damage too); any other error is raised."""
    try:
        return check()
    except CheckpointError as e:
        if not e.is_damage:
            raise
        return [str(e)]
    except OSError as e:
        return [f"{where}: {e.strerror or e}"]


def _verify_references(refs: References, record: SnapshotRecord, rank: int) -> list[str]:
    """One line per reference of ``rank``'s (intact) shard whose target is missing, replaced or
    damaged: damage of this snapshot, which restore() would skip."""
    problems = []
    reader = refs.open(record.dir, rank)
    for i, entry in enumerate(reader.storages):
        if entry.ref is not None:
            where = f"{reader.path}: storage {i}"

            def check() -> list[str]:  # run at once: entry and where are this storage's
                target, number = refs.resolve(record, rank, entry, where)
                return target.verify_storage(number)

            problems += _problems(check, where)
    return problems


def _verify_shard(storage: Storage, dir: str, file: str, step: Optional[int],
                  expected_bytes: Optional[int] = None,
                  expected_xxh3: Optional[str] = None) -> list[str]:
    from ..read.snapshot import tree_problems  # imports torch: not at the CLI's start-up

    path = storage.location(dir, file)

    def check() -> list[str]:
        with ShardReader(storage.open_shard(dir, file), expected_bytes, expected_xxh3) as reader:
            problems = []
            if step is not None:
                try:
                    reader.check_step(step)
                except CorruptSnapshotError as e:
                    problems.append(str(e))
            largest = max((s.largest_chunk for s in reader.storages), default=0)  # decoded one at a time, byte planes into scratch of their own
            require_memory(2 * largest, f"verifying {path}", "free memory, or verify on a larger "
                           "machine")
            return problems + tree_problems(reader) + reader.verify()

    return _problems(check, path)


def _verify_unreferenced(storage: Storage) -> None:
    """With the manifest unreadable, check the snapshot directories there, so the operator knows
    what survived (their commit status is unknown)."""
    names = snapshot_dirs(storage)
    print(f"{storage.location()}: {MANIFEST_NAME} is unreadable, so no snapshot counts as "
          "committed and restore() loads nothing.")
    if not names:
        print("no snapshot directories on disk")
        return
    print("snapshot directories on disk (commit status unknown), checked file by file:")
    shards = {name: [(file, size) for file, size in storage.list_snapshot(name)
                     if SHARD_FILE.fullmatch(file)] for name in names}
    with progress(sum(size for found in shards.values() for _, size in found), "verifying") as bar:
        for name in sorted(names, key=lambda n: (snapshot_dir_step(n) or 0, n), reverse=True):
            problems = [] if shards[name] else ["no shard file"]
            for file, size in shards[name]:
                problems += _verify_shard(storage, name, file, snapshot_dir_step(name))
                bar.update(size)
            count = len(shards[name])
            state = "DAMAGED" if problems else f"intact ({count} shard file{'s' * (count != 1)})"
            print(f"  step {snapshot_dir_step(name)!s:<10} {name}  {state}")
            for problem in problems:
                print(f"    {problem}")
