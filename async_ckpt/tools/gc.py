"""``async-ckpt gc``: remove leftovers and the committed snapshots beyond retention, under every
rank's lock, with the new manifest durable before anything is deleted."""

from __future__ import annotations

import argparse
import os

from .common import (EXIT_OK, PROG, NotDone, add_dir_command, checkpoint_dir,
                     positive_arg, progress, size_text)
from .verify import verify_record
from ..format.manifest import Manifest, leftovers, recover_manifest, write_manifest
from ..format.names import snapshot_dir_step
from ..storage.local import remove_entries, tree_bytes
from ..storage.locks import every_rank_exclusively


HELP = "remove leftovers and snapshots beyond retention"
DESCRIPTION = """\
Remove leftovers of snapshots that never committed and, with --keep-last N, the committed
snapshots older (in commit order) than the newest N, except those a kept incremental snapshot
refers to (it holds some of its bytes there). The newest committed snapshot is never
removed, and committed snapshots are dropped only when one of those kept verifies (its chunks
are read, newest first, as restore() does). The new manifest is durable before any directory is
deleted. Refuses (exit 1) while an engine holds the directory's lock.
"""


def add(commands) -> None:
    sub = add_dir_command(commands, "gc", cmd_gc, HELP, DESCRIPTION)
    sub.add_argument("--keep-last", type=positive_arg, metavar="N",
                     help="keep only the newest N committed snapshots (default: keep all of them, "
                     "remove only leftovers)")
    sub.add_argument("--dry-run", action="store_true", help="print what would be removed, change nothing")


def cmd_gc(args: argparse.Namespace) -> int:
    root = checkpoint_dir(args.dir)
    with every_rank_exclusively(root) as lock_all:
        manifest = recover_manifest(root, write=not args.dry_run)
        stray = leftovers(root, manifest)
        if args.keep_last is not None and len(manifest.snapshots) > args.keep_last:
            # Those the newest N refer to (incremental snapshots) are kept too.
            new_manifest, dropped = manifest.without(
                [r.step for r in manifest.snapshots[:-args.keep_last]])
        else:
            new_manifest, dropped = manifest, []
        kept = new_manifest.snapshots
        kept_dirs = {r.dir for r in kept}
        assert not manifest.snapshots or manifest.snapshots[-1].dir in kept_dirs
        if dropped:
            _check_something_kept_restores(root, new_manifest, args.keep_last)
        plan = [(r.dir, f"committed step {r.step}, beyond --keep-last {args.keep_last}")
                for r in dropped if r.dir not in kept_dirs]
        plan += [(name, f"leftover of uncommitted step {snapshot_dir_step(name)}"
                  if snapshot_dir_step(name) is not None else "leftover manifest replacement")
                 for name in stray]
        verb = "would remove" if args.dry_run else "removing"
        print(f"{root}: keeping {len(kept)} committed snapshot{'s' * (len(kept) != 1)}"
              + (f" (step{'s' * (len(kept) != 1)} {', '.join(str(r.step) for r in kept)})"
                 if kept else ""))
        if not plan:
            print("nothing to remove")
            return EXIT_OK
        sizes = {name: tree_bytes(os.path.join(root, name)) for name, _ in plan}
        print(f"{verb}:")
        for name, why in plan:
            print(f"  {name:<36}  {size_text(sizes[name]):>9}  {why}")
        if args.dry_run:
            print(f"dry run: nothing changed ({size_text(sum(sizes.values()))} would be freed)")
            return EXIT_OK
        lock_all()  # an engine that started since: refuse before changing anything
        if dropped:
            write_manifest(root, new_manifest)  # durable before any snapshot directory goes
        remove_entries(root, [name for name, _ in plan])
        left = [name for name, _ in plan if os.path.lexists(os.path.join(root, name))]
    freed = sum(size for name, size in sizes.items() if name not in left)
    print(f"removed {len(plan) - len(left)} of {len(plan)}, freed {size_text(freed)}")
    if left:
        raise NotDone(f"could not remove {', '.join(left)} under {root}; check their permissions "
                      f"and run `{PROG} gc` again")
    return EXIT_OK


def _check_something_kept_restores(root: str, kept: Manifest, keep_last: int) -> None:
    """Refuse to drop committed snapshots unless one that is kept verifies (read newest first,
    as restore() does, with what it refers to): the dropped ones might otherwise be all that
    still restores."""
    problems = []
    with progress(sum(s.bytes for s in kept.snapshots[-1].shards), "verifying kept snapshots") as bar:
        for record in kept.newest_first():
            found = verify_record(root, record, bar, kept)
            if not found:
                return
            problems.append(f"step {record.step}: {found[0]}")
            bar.total += sum(s.bytes for s in record.shards)
    raise NotDone(f"refusing to drop committed snapshots: none of the {len(kept.snapshots)} that --keep-last "
                  f"{keep_last} keeps verifies ({'; '.join(problems)}), so the dropped ones may be "
                  f"all that restores. Run `{PROG} verify {root} --all`, then choose --keep-last "
                  "so that an intact snapshot stays")
