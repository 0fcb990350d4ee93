"""``async-ckpt ls``: the committed snapshots in commit order, and the leftovers apart."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from typing import Optional

from .common import (EXIT_DAMAGE, EXIT_OK, PROG, add_dir_command, checkpoint_dir,
                     size_text, when_text)
from ..errors import CheckpointError
from ..format.manifest import SnapshotRecord, leftovers, read_manifest
from ..format.shard import ShardReader
from ..storage.names import MANIFEST_NAME, snapshot_dir_step
from ..storage.base import Storage


HELP = "list committed snapshots and leftovers"
DESCRIPTION = f"""\
List the committed snapshots of DIR in commit order (the last one is what restore() loads), and,
apart, leftovers of snapshots that never committed. Checks that every shard file is present with
its recorded size, and every data file its index names (exit 1 if not); checksums are read by
`{PROG} verify`.
"""


def add(commands) -> None:
    sub = add_dir_command(commands, "ls", cmd_ls, HELP, DESCRIPTION)
    sub.add_argument("--json", action="store_true", help="print one JSON document for machines")


def cmd_ls(args: argparse.Namespace) -> int:
    storage = checkpoint_dir(args.dir)
    root = storage.location()
    manifest = read_manifest(storage)
    has_manifest = storage.version(MANIFEST_NAME) is not None  # a link to nothing: none, as read
    snapshots = []
    for record in manifest.snapshots:
        snapshots.append({
            "step": record.step, "seq": record.seq, "dir": record.dir,
            "committed_at": record.committed_at, "committed_at_iso": _iso(record.committed_at),
            "world_size": record.world_size, "raw_bytes": record.raw_bytes,
            "stored_bytes": record.stored_bytes,
            "ratio": round(record.raw_bytes / record.stored_bytes, 4) if record.stored_bytes else None,
            "newest": record is manifest.snapshots[-1],
            "problems": _shard_problems_quick(storage, record)})
    stray = []
    for name in leftovers(storage, manifest):
        step = snapshot_dir_step(name)
        stray.append({"name": name, "kind": "manifest-tmp" if step is None else "snapshot",
                      "step": step, "bytes": storage.entry_bytes(name)})
    # Exit 1 on damage, and when nothing is committed (as inspect, verify and export do).
    failed = any(s["problems"] for s in snapshots) or not snapshots
    if args.json:
        doc = {"directory": root,
               "manifest": has_manifest,
               "newest_step": manifest.snapshots[-1].step if manifest.snapshots else None,
               "rank": manifest.rank, "snapshots": snapshots, "leftovers": stray}
        print(json.dumps(doc, indent=1))
        return EXIT_DAMAGE if failed else EXIT_OK
    _print_ls(root, has_manifest, snapshots, stray, manifest.rank)
    return EXIT_DAMAGE if failed else EXIT_OK


def _print_ls(root: str, has_manifest: bool, snapshots: list[dict], stray: list[dict],
              own_rank: Optional[int]) -> None:
    if not snapshots:
        print(f"{root}: no committed snapshot"
              + ("" if has_manifest else f" ({MANIFEST_NAME} does not exist yet)"))
    else:
        print(f"{root}: {len(snapshots)} committed snapshot{'s' * (len(snapshots) != 1)}, "
              "in commit order (oldest first)")
        header = (f"  {'step':>10}  {'committed':<33} {'ranks':>5}  {'raw':>9}  {'stored':>9}  "
                  f"{'ratio':>6}  files")
        print(header)
        for s in snapshots:
            ratio = f"{s['ratio']:.2f}x" if s["ratio"] is not None else "-"
            files = "DAMAGED" if s["problems"] else "ok"
            mark = "   <- newest" if s["newest"] else ""
            print(f"  {s['step']:>10}  {when_text(s['committed_at']):<33} {s['world_size']:>5}  "
                  f"{size_text(s['raw_bytes']):>9}  {size_text(s['stored_bytes']):>9}  {ratio:>6}  "
                  f"{files}{mark}")
        for s in snapshots:
            for problem in s["problems"]:
                print(f"  step {s['step']}: {problem}")
        if own_rank is None:
            print(f"restore() loads the newest ({snapshots[-1]['step']}) if it verifies, else the "
                  "one before it, in commit order.")
        else:
            print(f"rank {own_rank}'s own root: only its shards (the ranks shared no directory); "
                  "the job restores from its object store's manifest.")
        print(f"files 'ok': present with the recorded size; `{PROG} verify` reads the checksums.")
    if stray:
        print(f"leftovers of snapshots that never committed (never restored; `{PROG} gc {root}` "
              "removes them):")
        for s in stray:
            what = (f"step {s['step']}" if s["kind"] == "snapshot"
                    else "interrupted manifest replacement")
            print(f"  {s['name']:<36}  {what:<32}  {size_text(s['bytes']):>9}")


def _shard_problems_quick(storage: Storage, record: SnapshotRecord) -> list[str]:
    """What a listing shows wrong with a committed snapshot's files (missing, wrong size): its
    shard files, and where its stored bytes say it keeps data files (docs/FORMAT.md 3.8), the
    data files their indexes name (read for that alone)."""
    problems = []
    sizes = dict(storage.list_snapshot(record.dir))
    for shard in record.shards:
        size = sizes.get(shard.file)
        if size is None:
            problems.append(f"{os.path.join(record.dir, shard.file)} is missing")
        elif size != shard.bytes:
            problems.append(f"{os.path.join(record.dir, shard.file)} has {size} bytes, the "
                            f"manifest recorded {shard.bytes}")
    if problems or record.stored_bytes <= sum(s.bytes for s in record.shards):
        return problems
    for shard in record.shards:
        try:
            with ShardReader(storage.open_shard(record.dir, shard.file), shard.bytes,
                             shard.index_xxh3) as reader:
                problems += reader.data_file_problems(sizes, record.dir)
        except CheckpointError as e:
            problems.append(str(e))
    return problems


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat()
