"""``async-ckpt ls``: the committed snapshots in commit order, and the leftovers apart."""

from __future__ import annotations

import argparse
import datetime
import json
import os

from .common import (EXIT_DAMAGE, EXIT_OK, PROG, add_dir_command, checkpoint_dir,
                     size_text, when_text)
from ..format.manifest import SnapshotRecord, leftovers, manifest_path, read_manifest
from ..format.names import MANIFEST_NAME, snapshot_dir_step
from ..storage.local import tree_bytes


HELP = "list committed snapshots and leftovers"
DESCRIPTION = f"""\
List the committed snapshots of DIR in commit order (the last one is what restore() loads), and,
apart, leftovers of snapshots that never committed. Checks that every shard file is present with
its recorded size (exit 1 if not); checksums are read by `{PROG} verify`.
"""


def add(commands) -> None:
    sub = add_dir_command(commands, "ls", cmd_ls, HELP, DESCRIPTION)
    sub.add_argument("--json", action="store_true", help="print one JSON document for machines")


def cmd_ls(args: argparse.Namespace) -> int:
    root = checkpoint_dir(args.dir)
    manifest = read_manifest(root)
    has_manifest = os.path.exists(manifest_path(root))
    snapshots = []
    for record in manifest.snapshots:
        snapshots.append({
            "step": record.step, "seq": record.seq, "dir": record.dir,
            "committed_at": record.committed_at, "committed_at_iso": _iso(record.committed_at),
            "world_size": record.world_size, "raw_bytes": record.raw_bytes,
            "stored_bytes": record.stored_bytes,
            "ratio": round(record.raw_bytes / record.stored_bytes, 4) if record.stored_bytes else None,
            "newest": record is manifest.snapshots[-1],
            "problems": _shard_problems_quick(root, record)})
    stray = []
    for name in leftovers(root, manifest):
        is_dir = os.path.isdir(os.path.join(root, name))
        stray.append({"name": name, "kind": "snapshot" if is_dir else "manifest-tmp",
                      "step": snapshot_dir_step(name) if is_dir else None,
                      "bytes": tree_bytes(os.path.join(root, name))})
    # Exit 1 on damage, and when nothing is committed (as inspect, verify and export do).
    failed = any(s["problems"] for s in snapshots) or not snapshots
    if args.json:
        doc = {"directory": os.path.abspath(root), "manifest": has_manifest,
               "newest_step": manifest.snapshots[-1].step if manifest.snapshots else None,
               "snapshots": snapshots, "leftovers": stray}
        print(json.dumps(doc, indent=1))
        return EXIT_DAMAGE if failed else EXIT_OK
    _print_ls(root, has_manifest, snapshots, stray)
    return EXIT_DAMAGE if failed else EXIT_OK


def _print_ls(root: str, has_manifest: bool, snapshots: list[dict], stray: list[dict]) -> None:
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
        print(f"restore() loads the newest ({snapshots[-1]['step']}) if it verifies, else the one "
              "before it, in commit order.")
        print(f"files 'ok': present with the recorded size; `{PROG} verify` reads the checksums.")
    if stray:
        print(f"leftovers of snapshots that never committed (never restored; `{PROG} gc {root}` "
              "removes them):")
        for s in stray:
            what = (f"step {s['step']}" if s["kind"] == "snapshot"
                    else "interrupted manifest replacement")
            print(f"  {s['name']:<36}  {what:<32}  {size_text(s['bytes']):>9}")


def _shard_problems_quick(root: str, record: SnapshotRecord) -> list[str]:
    """What a stat() shows wrong with a committed snapshot's files (missing, wrong size)."""
    problems = []
    if len(record.shards) != record.world_size:
        problems.append(f"{len(record.shards)} of {record.world_size} shards recorded")
    for shard in record.shards:
        path = os.path.join(root, record.dir, shard.file)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{os.path.join(record.dir, shard.file)} is missing")
            continue
        if size != shard.bytes:
            problems.append(f"{os.path.join(record.dir, shard.file)} has {size} bytes, the "
                            f"manifest recorded {shard.bytes}")
    return problems


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat()
