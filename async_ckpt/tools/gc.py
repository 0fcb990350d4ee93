"""``async-ckpt gc``: remove leftovers and the committed snapshots beyond retention, under every
rank's lock (a bucket has none: ``--force``, see ``_no_engine``), with the new manifest durable
before anything is deleted."""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, Iterator

from .common import (EXIT_OK, PROG, NotDone, UsageError, add_dir_command, checkpoint_dir,
                     positive_arg, progress, size_text)
from .verify import verify_record
from ..format.manifest import Manifest, leftovers, recover_manifest, write_manifest
from ..storage.names import snapshot_dir_step
from ..storage.base import Storage


HELP = "remove leftovers and snapshots beyond retention"
DESCRIPTION = """\
Remove leftovers of snapshots that never committed and, with --keep-last N, the committed
snapshots older (in commit order) than the newest N, except those a kept incremental snapshot
refers to (it holds some of its bytes there). The newest committed snapshot is never
removed, and committed snapshots are dropped only when one of those kept verifies (its chunks
are read, newest first, as restore() does). The new manifest is durable before any directory is
deleted. Refuses (exit 1) while an engine holds the directory's lock. An s3:// URL has no lock,
and an engine's upload in progress looks like a leftover there: gc must not run while an engine
uploads to that prefix, and changes it only with --force (stop the job first).
"""


def add(commands) -> None:
    sub = add_dir_command(commands, "gc", cmd_gc, HELP, DESCRIPTION)
    sub.add_argument("--keep-last", type=positive_arg, metavar="N",
                     help="keep only the newest N committed snapshots (default: keep all of them, "
                     "remove only leftovers)")
    sub.add_argument("--dry-run", action="store_true", help="print what would be removed, change nothing")
    sub.add_argument("--force", action="store_true",
                     help="an s3:// URL only: change it although gc cannot tell whether an engine "
                     "uploads there (it must not: stop the job first)")


def cmd_gc(args: argparse.Namespace) -> int:
    storage = checkpoint_dir(args.dir)
    root = storage.location()
    with _no_engine(storage, args) as lock_all:
        manifest = recover_manifest(storage, write=not args.dry_run)
        stray = leftovers(storage, manifest)
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
            _check_something_kept_restores(storage, new_manifest, args.keep_last)
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
        sizes = {name: storage.entry_bytes(name) for name, _ in plan}
        print(f"{verb}:")
        for name, why in plan:
            print(f"  {name:<36}  {size_text(sizes[name]):>9}  {why}")
        if args.dry_run:
            print(f"dry run: nothing changed ({size_text(sum(sizes.values()))} would be freed)")
            return EXIT_OK
        lock_all()  # an engine that started since: refuse before changing anything
        if dropped:
            write_manifest(storage, new_manifest)  # durable before any snapshot directory goes
        left = remove_entries(storage, [name for name, _ in plan])
    freed = sum(size for name, size in sizes.items() if name not in left)
    print(f"removed {len(plan) - len(left)} of {len(plan)}, freed {size_text(freed)}")
    if left:
        raise NotDone(f"could not remove {', '.join(left)} under {root}; check their permissions "
                      f"and run `{PROG} gc` again")
    return EXIT_OK


@contextlib.contextmanager
def _no_engine(storage: Storage, args: argparse.Namespace) -> Iterator[Callable[[], None]]:
    """While gc runs, no engine may write to ``storage``; yields a function that checks again
    right before anything changes.

    A local directory: every rank's lock, held exclusively (``Storage.exclude_engines``;
    DirectoryInUseError while an engine or its writer holds one). A bucket has no lock, and what gc decides by cannot be made safe
    against a running upload: a snapshot being uploaded has its objects in place before the
    bucket's manifest names it, so it is a leftover to gc, which would delete the snapshot about
    to be committed; and a manifest gc replaced makes the engine's next conditional publish fail
    (RemoteConflictError). So gc changes a bucket only on the operator's word that no engine
    uploads there (``--force``); a dry run changes nothing and needs none."""
    engines_excluded = storage.exclude_engines()
    if engines_excluded is not None:
        if args.force:
            raise UsageError("--force is for an s3:// URL; a directory's locks tell gc whether an "
                             "engine writes to it, and an engine that does must be stopped first")
        with engines_excluded as lock_all:
            yield lock_all
        return
    if not (args.force or args.dry_run):
        raise UsageError(f"gc cannot tell whether an engine uploads to {storage.location()} (a "
                         "bucket has no locks), and one that does would lose the snapshot it is "
                         "uploading; stop the job, then pass --force (--dry-run shows what would "
                         "go)")
    yield lambda: None


def remove_entries(storage: Storage, names: list[str]) -> list[str]:
    """Remove ``names`` (once the manifest without them is durable); returns those still there."""
    storage.remove(names)
    return [name for name in names if storage.exists(name)]


def _check_something_kept_restores(storage: Storage, kept: Manifest, keep_last: int) -> None:
    """Refuse to drop committed snapshots unless one that is kept verifies (read newest first,
    as restore() does, with what it refers to): the dropped ones might otherwise be all that
    still restores."""
    problems = []
    with progress(sum(s.bytes for s in kept.snapshots[-1].shards), "verifying kept snapshots") as bar:
        for record in kept.newest_first():
            found = verify_record(storage, record, bar, kept)
            if not found:
                return
            problems.append(f"step {record.step}: {found[0]}")
            bar.total += sum(s.bytes for s in record.shards)
    raise NotDone(f"refusing to drop committed snapshots: none of the {len(kept.snapshots)} that --keep-last "
                  f"{keep_last} keeps verifies ({'; '.join(problems)}), so the dropped ones may be "
                  f"all that restores. Run `{PROG} verify {storage.location()} --all`, then choose "
                  "--keep-last so that an intact snapshot stays")
