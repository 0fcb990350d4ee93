"""The operator's command line: ``async-ckpt COMMAND ...`` (also ``python -m async_ckpt``).

Answers, without writing Python, which snapshots exist, which are intact, what is in them, and moves
weights out: ``ls``, ``inspect``, ``verify``, ``export``, ``gc``, plus ``compare-loss`` for
training logs. Everything is read through the library (``manifest``, ``format.ShardReader``,
``read.snapshot.load``), so the command line and ``restore()`` never disagree about what a snapshot is.

Each command is one ``_add_<command>`` function that declares its arguments and one
``cmd_<command>`` function that runs it and returns the exit code; a new command is one more pair
and one more entry in ``_COMMANDS``. Expected failures are exceptions caught once, in
:func:`main`, and printed as one line on stderr:

- exit 0: fine (everything named is intact, the logs are identical, gc finished);
- exit 1: damage found or the job is not done: a damaged or missing snapshot file, an unreadable
  manifest, a format version this release cannot read, no committed snapshot, logs that differ,
  gc refused because an engine holds the directory;
- exit 2: usage error: bad arguments, a missing path, a directory that is not a checkpoint
  directory, a step that is not committed, an entry that does not exist.

Torch is imported only by the commands that need it (``inspect``, ``export``), so ``ls``,
``verify``, ``gc`` and ``compare-loss`` start fast.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import errno
import json
import math
import os
import struct
import sys
import textwrap
import time
from typing import Any, Callable, Optional, Sequence

from .. import __version__
from ..errors import (CheckpointDirError, CheckpointError, CorruptSnapshotError, DirectoryInUseError,
                      EncodingError,
                     NoSnapshotError, ManifestError, UnsupportedFormatError)
from .argtypes import int_arg, is_number
from ..format import values
from ..format.shard import ShardReader
from ..format.manifest import (Manifest, SnapshotRecord, leftovers, manifest_path, read_manifest,
                               recover_manifest, snapshot_dirs, write_manifest)
from ..format.names import MANIFEST_NAME, SHARD_FILE, is_lock_file, snapshot_dir_step
from ..storage.local import remove_entries
from ..storage.locks import every_rank_exclusively

__all__ = ["main", "build_parser"]

PROG = "async-ckpt"
EXIT_OK, EXIT_DAMAGE, EXIT_USAGE = 0, 1, 2
_PREVIEW_CHARS = 60  # longer values are summarised by type and length

EXIT_CODES_HELP = """\
exit codes:
  0  fine: everything named is intact, the logs are identical, gc finished
  1  damage found, or not done: a damaged, truncated or missing snapshot
     file, a damaged manifest, a format version this release cannot read,
     no committed snapshot, loss logs that differ, gc refused (an engine is
     writing to the directory, or a kept snapshot is damaged)
  2  usage error: bad arguments, a missing directory or file, a directory
     that is not a checkpoint directory, a step that is not committed, an
     unknown entry

Errors are one line on stderr: "async-ckpt: error: <cause>; <what to do>".
"""


class UsageError(Exception):
    """The command line asked for something that does not exist or makes no sense: exit 2."""


class NotDone(Exception):
    """An expected outcome that is not damage but is not fine either (gc refused): exit 1."""


# --- entry point -------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (the console script passes it to sys.exit)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    try:
        return args.run(args)
    except UsageError as e:
        return _fail(str(e), EXIT_USAGE)
    except (NotDone, DirectoryInUseError) as e:
        return _fail(str(e), EXIT_DAMAGE)
    except CheckpointDirError as e:
        return _fail(str(e), EXIT_USAGE)
    except CorruptSnapshotError as e:
        return _fail(f"{e}; run `{PROG} verify` on the directory to list every damaged snapshot",
                     EXIT_DAMAGE)
    except CheckpointError as e:  # ManifestError, UnsupportedFormatError, NoSnapshotError, ...
        return _fail(str(e), EXIT_DAMAGE)
    except BrokenPipeError:  # `async-ckpt ls DIR | head`: the reader left; not an error worth a line
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_DAMAGE
    except OSError as e:
        return _fail(_os_error_message(e), EXIT_USAGE if e.errno in _USAGE_ERRNOS else EXIT_DAMAGE)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect, verify, export and clean up async_ckpt checkpoint directories.",
        epilog=EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(commands)
    return parser


def _command(commands, name: str, run: Callable[[argparse.Namespace], int], help: str,
             description: str) -> argparse.ArgumentParser:
    sub = commands.add_parser(name, help=help, description=textwrap.fill(description, 79),
                              epilog=EXIT_CODES_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.set_defaults(run=run)
    return sub


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


_USAGE_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST}


def _os_error_message(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e)
    if e.errno in (errno.EACCES, errno.EPERM):
        todo = "run as a user that may access it, or fix its permissions"
    elif e.errno in (errno.ENOENT, errno.ENOTDIR):
        todo = "check the path"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = "free space or write somewhere else"
    elif e.errno == errno.EIO:
        todo = f"the device reported an I/O error; check the disk, then run `{PROG} verify`"
    else:
        todo = "check the file system, then run the command again"
    return f"{where}{what}; {todo}"


# --- shared helpers ----------------------------------------------------------------------------


def _checkpoint_dir(path: str) -> str:
    """``path`` if it looks like a checkpoint directory, else a UsageError saying what to pass.

    A checkpoint directory holds a manifest, snapshot directories, or an engine's lock files (an
    engine that has not committed yet)."""
    hint = "pass the directory given to CheckpointEngine (the one that holds manifest.json)"
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist; {hint}")
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory; {hint}")
    names = os.listdir(path)
    if MANIFEST_NAME in names or snapshot_dirs(path) or any(map(is_lock_file, names)):
        return path
    raise UsageError(f"{path} is not an async_ckpt checkpoint directory (no {MANIFEST_NAME}, no "
                     f"step-* snapshot directories); {hint}")


def _disk_bytes(path: str) -> int:
    """Bytes of the files at or under ``path`` (0 when it vanished)."""
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
    except FileNotFoundError:
        return 0
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def _size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(ts: float) -> str:
    stamp = datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    age = time.time() - ts
    if age < -60:
        return f"{stamp} (in the future: clock skew?)"
    age = max(age, 0.0)
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if age >= scale:
            return f"{stamp} ({age / scale:.0f} {unit} ago)"
    return f"{stamp} ({age:.0f} s ago)"


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat()


def _steps_text(steps: Sequence[int], limit: int = 12) -> str:
    """``1-4, 7, 9-10``: sorted steps with runs collapsed, cut after ``limit`` runs."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) > limit:
        parts = parts[:limit] + [f"... ({len(steps)} steps)"]
    return ", ".join(parts) if parts else "none"


def _committed_steps(manifest: Manifest) -> str:
    return ", ".join(map(str, manifest.steps())) or "none"


def _pick_record(manifest: Manifest, step: Optional[int], root: str, what: str) -> SnapshotRecord:
    """The record for ``step``, or the newest committed one (commit order) when ``step`` is None."""
    if not manifest.snapshots:
        raise NoSnapshotError(f"{root} holds no committed snapshot, nothing to {what}; `{PROG} ls "
                              f"{root}` lists leftovers of snapshots that never committed")
    if step is None:
        return manifest.snapshots[-1]
    record = manifest.find(step)
    if record is None:
        raise UsageError(f"step {step} is not committed in {root}; committed steps: "
                         f"{_committed_steps(manifest)}")
    return record


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


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _progress(total: int, desc: str):
    """A byte progress bar on stderr; silent when stderr is not a terminal."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                file=sys.stderr, leave=False, disable=not _is_tty(sys.stderr))


_step_arg = int_arg(0)
_positive_arg = int_arg(1)


# --- ls ----------------------------------------------------------------------------------------


def _add_ls(commands) -> None:
    sub = _command(commands, "ls", cmd_ls, help="list committed snapshots and leftovers",
                   description="List the committed snapshots of DIR in commit order (the last one "
                   "is what restore() loads), and, apart, leftovers of snapshots that never "
                   "committed. Checks that every shard file is present with its recorded size "
                   f"(exit 1 if not); checksums are read by `{PROG} verify`.")
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory")
    sub.add_argument("--json", action="store_true", help="print one JSON document for machines")


def cmd_ls(args: argparse.Namespace) -> int:
    root = _checkpoint_dir(args.dir)
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
                      "bytes": _disk_bytes(os.path.join(root, name))})
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
            print(f"  {s['step']:>10}  {_when(s['committed_at']):<33} {s['world_size']:>5}  "
                  f"{_size(s['raw_bytes']):>9}  {_size(s['stored_bytes']):>9}  {ratio:>6}  "
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
            print(f"  {s['name']:<36}  {what:<32}  {_size(s['bytes']):>9}")


# --- inspect -----------------------------------------------------------------------------------


def _add_inspect(commands) -> None:
    sub = _command(commands, "inspect", cmd_inspect, help="show what a snapshot holds",
                   description="Show the entries of a committed snapshot: every tensor (key path, "
                   "dtype, shape, size, codec) and every other value (summarised), with totals per "
                   "top-level entry. Reads only the shard's index, never tensor data.")
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory")
    sub.add_argument("--step", type=_step_arg, metavar="N",
                     help="the snapshot of step N (default: the newest committed)")
    sub.add_argument("--rank", type=_step_arg, default=0, metavar="R",
                     help="which rank's shard to show (default 0)")


def cmd_inspect(args: argparse.Namespace) -> int:
    root = _checkpoint_dir(args.dir)
    manifest = read_manifest(root)
    record = _pick_record(manifest, args.step, root, "inspect")
    shard = next((s for s in record.shards if s.rank == args.rank), None)
    if shard is None:
        raise UsageError(f"step {record.step} has no shard of rank {args.rank}; its ranks: "
                         f"{', '.join(str(s.rank) for s in record.shards) or 'none'}")
    path = os.path.join(root, record.dir, shard.file)
    with ShardReader(path, shard.bytes, shard.index_xxh3) as reader:
        index = reader.index
    if index.get("step") != record.step:
        raise CorruptSnapshotError(
            f"{path} holds step {str(index.get('step'))[:40]!r}, the manifest says {record.step}")
    _check_tensor_table(index, path)
    walk = _TreeWalk(index, path)
    walk.run()
    newest = " (newest)" if record is manifest.snapshots[-1] else ""
    raw = sum(s["nbytes"] for s in index["storages"])
    stored = sum(c["stored"] for s in index["storages"] for c in s["chunks"])
    print(f"step {record.step}{newest} in {root}, rank {shard.rank} of {record.world_size}, "
          f"committed {_when(record.committed_at)}")
    print(f"file {os.path.join(record.dir, shard.file)}: {_size(shard.bytes)}; tensor data "
          f"{_size(raw)} raw, {_size(stored)} stored")
    width = min(max((len(line[1]) for line in walk.lines if line[0] == "row"), default=10), 56)
    for kind, *fields in walk.lines:
        if kind == "head":
            name, entry_kind = fields
            print(f"\n{name} ({entry_kind})")
        elif len(fields) == 2:
            print(f"  {fields[0]:<{width}}  {fields[1]}")
        else:
            key, dtype, shape, nbytes, codec = fields
            print(f"  {key:<{width}}  {dtype:<10} {shape:<16} {nbytes:>9}  {codec}")
    print("\ntotals per entry (bytes: tensor sizes; stored: their storages in the file)")
    print(f"  {'entry':<24} {'kind':<7} {'tensors':>7}  {'bytes':>9}  {'stored':>9}  {'values':>6}")
    all_totals = collections.Counter()
    for name, t in walk.totals.items():
        print(f"  {name:<24} {t['kind']:<7} {t['tensors']:>7}  {_size(t['bytes']):>9}  "
              f"{_size(t['stored']):>9}  {t['values']:>6}")
        all_totals.update({k: v for k, v in t.items() if k != "kind"})
    print(f"  {'all':<24} {'':<7} {all_totals['tensors']:>7}  {_size(all_totals['bytes']):>9}  "
          f"{_size(all_totals['stored']):>9}  {all_totals['values']:>6}")
    return EXIT_OK


def _check_tensor_table(index: dict, path: str) -> None:
    """Every tensor record is well-formed (as restore checks it), so the display can trust it."""
    from ..read.snapshot import tensor_layout

    tensors = index.get("tensors")
    if not isinstance(tensors, list):
        raise CorruptSnapshotError(f"{path}: the index has no tensor table")
    storages = len(index["storages"])
    for i, t in enumerate(tensors):
        tensor_layout(t, path, i)
        if t.get("rank") is None and t.get("storage") is not None and not 0 <= t["storage"] < storages:
            raise CorruptSnapshotError(f"{path}: tensor {i} refers to storage {t['storage']}, which "
                                       "does not exist")


class _TreeWalk:
    """Turns a shard index's state tree (docs/FORMAT.md section 5) into display lines and totals,
    without decoding anything that could run code or loading tensor data."""

    def __init__(self, index: dict, path: str):
        self.path = path
        self.tree = index.get("tree")
        self.tensors = index.get("tensors")
        self.storages = index["storages"]
        self.lines: list[tuple] = []
        self.totals: dict[str, dict] = {}
        self._storage_owner: dict[int, str] = {}
        self._top = ""

    def run(self) -> None:
        try:
            if not isinstance(self.tree, dict) or self.tree.get("kind") != "dict":
                raise TypeError("the root is not a dict node")
            for name, node in self.tree["entries"].items():
                self._top = name
                self.totals[name] = {"kind": node["kind"], "tensors": 0, "bytes": 0, "stored": 0,
                                     "values": 0}
                self.lines.append(("head", name, node["kind"]))
                self._node(node, name)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError, RecursionError) as e:
            raise CorruptSnapshotError(
                f"{self.path}: malformed state tree near {self._top[:60]!r}: {str(e)[:200]}") from e

    def _node(self, node: dict, path: str) -> None:
        kind = node["kind"]
        if kind == "dict":
            for key, child in node["entries"].items():
                self._node(child, f"{path}.{key}")
        elif kind in ("object", "tensor", "value"):
            self._value(node["state"], path)  # a module's "metadata" (versions) is not shown
        else:
            raise ValueError(f"unknown node kind {kind!r}")

    def _value(self, v: Any, path: str) -> None:
        kind = values.kind_of(v)
        if kind == "$tensor":
            self._tensor(v["$tensor"], path)
        elif kind in ("dict", "$dict"):
            items = values.children(v)
            if not items:
                self._leaf(path, "{}")
            for key, child in items:
                self._value(child, f"{path}.{key if kind == 'dict' else _render(key) or _summary(key)}")
        elif kind in ("list", "$tuple") and _worth_expanding(v):
            for i, child in values.children(v):
                self._value(child, f"{path}.{i}")
        else:
            self._leaf(path, _render(v) or _summary(v))

    def _leaf(self, path: str, text: str) -> None:
        self.totals[self._top]["values"] += 1
        self.lines.append(("row", path, text))

    def _tensor(self, i: int, path: str) -> None:
        if type(i) is not int or not 0 <= i < len(self.tensors):
            raise IndexError(f"tensor {i!r} is not in the tensor table")
        t = self.tensors[i]
        dtype, shape, storage = t["dtype"], t["shape"], t["storage"]
        itemsize = _itemsize(dtype)
        nbytes = None if itemsize is None else math.prod(shape) * itemsize
        total = self.totals[self._top]
        total["tensors"] += 1
        total["bytes"] += nbytes or 0
        if storage is None:
            codec = "-"
        elif t.get("rank") is not None:  # replicated: stored once, in the owner rank's shard
            codec = f"in rank {t['rank']}'s shard"
        else:
            chunks = self.storages[storage]["chunks"]
            codec = "+".join(dict.fromkeys(c["codec"] for c in chunks)) or "-"
            owner = self._storage_owner.get(storage)
            if owner is None:
                self._storage_owner[storage] = path
                total["stored"] += sum(c["stored"] for c in chunks)
            else:
                codec += f"  (shares storage with {owner})"
        shape_text = "[" + ", ".join(map(str, shape)) + "]"
        self.lines.append(("row", path, dtype, shape_text, _size(nbytes), codec))


_EXPANDED = ("$tensor", "$dict", "dict")


def _worth_expanding(v: Any) -> bool:
    """Expand a list or tuple into one line per element when it holds tensors or mappings."""
    return any(kind in _EXPANDED for _, kind, _ in values.walk(v))


class _TooLong(Exception):
    pass


def _render(v: Any, limit: int = _PREVIEW_CHARS) -> Optional[str]:
    """A Python-like text of an encoded value, or None if it is longer than ``limit``."""
    parts: list[str] = []
    budget = [limit]

    def put(s: str) -> None:
        budget[0] -= len(s)
        if budget[0] < 0:
            raise _TooLong
        parts.append(s)

    def seq(items, open_: str, close: str) -> None:
        put(open_)
        for i, x in enumerate(items):
            if i:
                put(", ")
            go(x)
        if open_ == "(" and len(items) == 1:
            put(",")
        put(close)

    def go(x: Any) -> None:
        kind = values.kind_of(x)
        if kind == "list":
            seq([child for _, child in values.children(x)], "[", "]")
        elif kind == "$tuple":
            seq([child for _, child in values.children(x)], "(", ")")
        elif kind == "dict":
            put("{")
            for i, (key, child) in enumerate(values.children(x)):
                put(", " if i else "")
                put(repr(key) + ": ")
                go(child)
            put("}")
        elif kind == "value":
            put(repr(x) if isinstance(x, (bool, str, float)) or x is None else str(x))
        elif kind == "$int":
            put(str(values.decode(x)))
        elif kind == "$float":
            put(f"float({str(values.decode(x))!r})")
        elif kind == "$dtype":
            put(f"torch.{x[kind]}")
        elif kind == "$size":
            put(f"torch.Size({x[kind]})")
        elif kind == "$device":
            put(f"device({x[kind]!r})")
        else:
            put(_summary(x))

    try:
        go(v)
    except _TooLong:
        return None
    return "".join(parts)


def _summary(v: Any) -> str:
    """A short description of an encoded value by type and length."""
    kind = values.kind_of(v)
    if kind in ("list", "dict"):
        return f"{kind}[{len(v)}]"
    if kind == "value":
        if isinstance(v, str):
            return f"str[{len(v)}] {v[:_PREVIEW_CHARS - 12]!r}..."
        return type(v).__name__
    p = v[kind]
    if kind in ("$tuple", "$set", "$frozenset", "$dict"):
        return f"{kind[1:]}[{len(p)}]"
    if kind in ("$bytes", "$bytearray"):
        return f"{kind[1:]}[{values.payload_nbytes(v)}]"
    if kind == "$str":
        return f"str (not valid UTF-8, {values.payload_nbytes(v)} bytes)"
    if kind == "$ndarray":
        return f"ndarray {p.get('dtype')} {p.get('shape')}"
    if kind == "$npscalar":
        return f"numpy scalar {p.get('dtype')}"
    if kind == "$pickle":
        return f"pickled object ({_size(values.payload_nbytes(v))}, not decoded)"
    if kind == "$int":
        return f"int ({len(p)} hex digits)"
    return f"{kind} node"


def _itemsize(dtype: str) -> Optional[int]:
    import torch
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    return value.itemsize if isinstance(value, torch.dtype) else None


# --- verify ------------------------------------------------------------------------------------


def _add_verify(commands) -> None:
    sub = _command(commands, "verify", cmd_verify, help="read every chunk and check every checksum",
                   description="Read every chunk of the named snapshots and check every checksum; "
                   "report each damaged file and chunk, and say which step restore() would pick "
                   "(the newest committed snapshot whose shards all verify). Exit 0 only when "
                   "every named snapshot is intact.")
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory")
    which = sub.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step_arg, metavar="N",
                       help="verify the snapshot of step N (default: the newest committed)")
    which.add_argument("--all", action="store_true", help="verify every committed snapshot")


def cmd_verify(args: argparse.Namespace) -> int:
    root = _checkpoint_dir(args.dir)
    try:
        manifest = read_manifest(root)
    except ManifestError as e:
        _fail(str(e), EXIT_DAMAGE)
        _verify_unreferenced(root)
        return EXIT_DAMAGE
    if args.all:
        if not manifest.snapshots:
            _pick_record(manifest, None, root, "verify")  # raises NoSnapshotError
        named = list(manifest.snapshots)
    else:
        named = [_pick_record(manifest, args.step, root, "verify")]
    named_seqs = {r.seq for r in named}
    results: list[tuple[SnapshotRecord, list[str], bool]] = []
    pick: Optional[SnapshotRecord] = None
    with _progress(sum(s.bytes for r in named for s in r.shards), "verifying") as bar:
        for record in manifest.newest_first():
            asked = record.seq in named_seqs
            if not asked and pick is not None:
                continue
            if not asked:  # checked only to find what restore() would pick
                bar.total += sum(s.bytes for s in record.shards)
                bar.refresh()
            problems = _verify_record(root, record, bar)
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
    if pick is None:
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


def _verify_record(root: str, record: SnapshotRecord, bar) -> list[str]:
    """One line per problem of a committed snapshot: missing or truncated files, damaged chunks."""
    problems = []
    if len(record.shards) != record.world_size:
        problems.append(f"the manifest records {len(record.shards)} of {record.world_size} shards")
    for shard in record.shards:
        problems += _verify_shard(os.path.join(root, record.dir, shard.file), record.step,
                                  shard.bytes, shard.index_xxh3)
        bar.update(shard.bytes)
    return problems


def _verify_shard(path: str, step: Optional[int], expected_bytes: Optional[int] = None,
                  expected_xxh3: Optional[str] = None) -> list[str]:
    try:
        with ShardReader(path, expected_bytes, expected_xxh3) as reader:
            problems = []
            if step is not None and reader.index.get("step") != step:
                problems.append(f"{path} holds step {reader.index.get('step')!r}, the manifest "
                                f"says {step}")
            return problems + reader.verify()
    except (CorruptSnapshotError, UnsupportedFormatError) as e:
        return [str(e)]
    except OSError as e:
        return [f"{path}: {e.strerror or e}"]


def _verify_unreferenced(root: str) -> None:
    """With the manifest unreadable, check the snapshot directories on disk, so the operator
    knows what survived (their commit status is unknown)."""
    names = snapshot_dirs(root)
    print(f"{root}: {MANIFEST_NAME} is unreadable, so no snapshot counts as committed and "
          "restore() loads nothing.")
    if not names:
        print("no snapshot directories on disk")
        return
    print("snapshot directories on disk (commit status unknown), checked file by file:")
    with _progress(sum(_disk_bytes(os.path.join(root, n)) for n in names), "verifying") as bar:
        for name in sorted(names, key=lambda n: (snapshot_dir_step(n) or 0, n), reverse=True):
            directory = os.path.join(root, name)
            shards = sorted(n for n in os.listdir(directory) if SHARD_FILE.fullmatch(n))
            problems = [] if shards else ["no shard file"]
            for shard in shards:
                problems += _verify_shard(os.path.join(directory, shard), snapshot_dir_step(name))
                bar.update(_disk_bytes(os.path.join(directory, shard)))
            state = "DAMAGED" if problems else f"intact ({len(shards)} shard file{'s' * (len(shards) != 1)})"
            print(f"  step {snapshot_dir_step(name)!s:<10} {name}  {state}")
            for problem in problems:
                print(f"    {problem}")


# --- export ------------------------------------------------------------------------------------


def _add_export(commands) -> None:
    sub = _command(commands, "export", cmd_export, help="write a snapshot as .pt or .safetensors",
                   description="Write a committed snapshot (verified while read) to a plain "
                   "torch.save file (FILE.pt: everything, as nested dicts of tensors and values) "
                   "or a safetensors file (FILE.safetensors: the tensors only, keyed by their "
                   "dotted key paths, e.g. model.0.weight; with --only model the keys are the "
                   "model's state_dict keys).")
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory")
    sub.add_argument("--step", type=_step_arg, metavar="N",
                     help="the committed step to export (default: the newest)")
    sub.add_argument("--to", required=True, metavar="FILE",
                     help="output file, ending in .pt (or .pth) or .safetensors")
    sub.add_argument("--only", metavar="ENTRY",
                     help="export one top-level entry (model, optimizer, ...) instead of all")
    sub.add_argument("--rank", type=_step_arg, default=0, metavar="R",
                     help="which rank's shard to export (default 0)")
    sub.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    sub.add_argument("--allow-pickle", action="store_true",
                     help="decode pickled values (runs code from the file: only for files you trust)")


def cmd_export(args: argparse.Namespace) -> int:
    root = _checkpoint_dir(args.dir)
    target = args.to
    suffix = os.path.splitext(target)[1].lower()
    if suffix not in (".pt", ".pth", ".safetensors"):
        raise UsageError(f"{target}: the file name must end in .pt or .safetensors (it picks the format)")
    if os.path.isdir(target):
        raise UsageError(f"{target} is a directory; pass a file name")
    if os.path.exists(target) and not args.force:
        raise UsageError(f"{target} exists; pass --force to overwrite it, or choose another name")
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        raise UsageError(f"{parent} does not exist; create it first")
    manifest = read_manifest(root)
    wanted = _pick_record(manifest, args.step, root, "export").step

    from ..read.snapshot import load
    try:
        step, state = load(root, wanted, rank=args.rank, allow_pickle=args.allow_pickle)
    except EncodingError as e:  # load() raises it only for a refused pickle
        raise UsageError(f"step {wanted}: {str(e).split(';')[0]}, refused by default; pass "
                         "--allow-pickle only if you trust where this checkpoint came from") from e
    what = "all entries"
    if args.only is not None:
        if args.only not in state:
            raise UsageError(f"step {step} has no entry {args.only!r}; its entries: "
                             f"{', '.join(state) or 'none'}")
        state, what = state[args.only], f"entry {args.only!r}"

    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        if suffix == ".safetensors":
            tensors, skipped = _flat_tensors(state)
            if not tensors:
                raise UsageError(f"{what} of step {step} holds no tensors; export it to a .pt file")
            _save_safetensors(tensors, tmp, {"format": "pt", "async_ckpt.step": str(step),
                                             "async_ckpt.entry": args.only or ""})
            count, nbytes = len(tensors), sum(t.nbytes for t in tensors.values())
        else:
            import torch
            torch.save(state, tmp)
            (count, nbytes), skipped = _count_tensors(state), []
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    print(f"exported step {step} ({what}) to {target}: {count} tensors, {_size(nbytes)} of tensor data")
    if suffix == ".safetensors" and skipped:
        shown = ", ".join(skipped[:8]) + (f", ... ({len(skipped)} in all)" if len(skipped) > 8 else "")
        print(f"not in the safetensors file (not tensors): {shown}; export to .pt to keep them")
    return EXIT_OK


def _flat_tensors(state: Any) -> tuple[dict, list[str]]:
    """Tensors of ``state`` by dotted key path, and the paths of the other values."""
    import torch
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []

    def walk(v: Any, path: str) -> None:
        if isinstance(v, torch.Tensor):
            if path in tensors:
                raise UsageError(f"two tensors map to the safetensors key {path!r} (a key holds a "
                                 "dot); export to a .pt file instead")
            tensors[path] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, (list, tuple)) and any(_holds_tensor(x) for x in v):
            for i, x in enumerate(v):
                walk(x, f"{path}.{i}" if path else str(i))
        else:
            skipped.append(path or "<value>")

    walk(state, "")
    return tensors, skipped


def _holds_tensor(v: Any) -> bool:
    import torch
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def _save_safetensors(tensors: dict, path: str, metadata: dict) -> None:
    """safetensors wants contiguous tensors that share no memory: copy only those that must be."""
    import torch
    from safetensors.torch import save_file
    users = collections.Counter(t.untyped_storage().data_ptr() for t in tensors.values() if t.numel())
    ready = {}
    for key, t in tensors.items():
        if t.numel() and (users[t.untyped_storage().data_ptr()] > 1 or not t.is_contiguous()):
            t = t.clone(memory_format=torch.contiguous_format)
        ready[key] = t
    try:
        save_file(ready, path, metadata=metadata)
    except (ValueError, RuntimeError, KeyError, TypeError) as e:  # e.g. a dtype safetensors lacks
        raise UsageError(f"safetensors cannot hold this state ({' '.join(str(e).split())[:200]}); "
                         "export to a .pt file instead") from e


def _count_tensors(state: Any) -> tuple[int, int]:
    import torch
    count = nbytes = 0
    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            count, nbytes = count + 1, nbytes + v.nbytes
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return count, nbytes


# --- gc ----------------------------------------------------------------------------------------


def _add_gc(commands) -> None:
    sub = _command(commands, "gc", cmd_gc, help="remove leftovers and snapshots beyond retention",
                   description="Remove leftovers of snapshots that never committed and, with "
                   "--keep-last N, the committed snapshots older (in commit order) than the newest "
                   "N. The newest committed snapshot is never removed, and committed snapshots are "
                   "dropped only when one of those kept verifies (its chunks are read, newest "
                   "first, as restore() does). The new manifest is durable before any directory is "
                   "deleted. Refuses (exit 1) while an engine holds the directory's lock.")
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory")
    sub.add_argument("--keep-last", type=_positive_arg, metavar="N",
                     help="keep only the newest N committed snapshots (default: keep all of them, "
                     "remove only leftovers)")
    sub.add_argument("--dry-run", action="store_true", help="print what would be removed, change nothing")


def cmd_gc(args: argparse.Namespace) -> int:
    root = _checkpoint_dir(args.dir)
    with every_rank_exclusively(root) as lock_all:
        manifest = recover_manifest(root, write=not args.dry_run)
        stray = leftovers(root, manifest)
        if args.keep_last is not None and len(manifest.snapshots) > args.keep_last:
            kept = manifest.snapshots[-args.keep_last:]
            new_manifest, dropped = manifest.without(
                [r.step for r in manifest.snapshots[:-args.keep_last]])
        else:
            kept, new_manifest, dropped = manifest.snapshots, manifest, []
        kept_dirs = {r.dir for r in new_manifest.snapshots}
        assert not manifest.snapshots or manifest.snapshots[-1].dir in kept_dirs
        if dropped:
            _check_something_kept_restores(root, kept, args.keep_last)
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
        sizes = {name: _disk_bytes(os.path.join(root, name)) for name, _ in plan}
        print(f"{verb}:")
        for name, why in plan:
            print(f"  {name:<36}  {_size(sizes[name]):>9}  {why}")
        if args.dry_run:
            print(f"dry run: nothing changed ({_size(sum(sizes.values()))} would be freed)")
            return EXIT_OK
        lock_all()  # an engine that started since: refuse before changing anything
        if dropped:
            write_manifest(root, new_manifest)  # durable before any snapshot directory goes
        remove_entries(root, [name for name, _ in plan])
        left = [name for name, _ in plan if os.path.lexists(os.path.join(root, name))]
    freed = sum(size for name, size in sizes.items() if name not in left)
    print(f"removed {len(plan) - len(left)} of {len(plan)}, freed {_size(freed)}")
    if left:
        raise NotDone(f"could not remove {', '.join(left)} under {root}; check their permissions "
                      f"and run `{PROG} gc` again")
    return EXIT_OK


def _check_something_kept_restores(root: str, kept: Sequence[SnapshotRecord], keep_last: int) -> None:
    """Refuse to drop committed snapshots unless one that is kept verifies (read newest first,
    as restore() does): the dropped ones might otherwise be all that still restores."""
    problems = []
    with _progress(sum(s.bytes for s in kept[-1].shards), "verifying kept snapshots") as bar:
        for record in reversed(kept):
            found = _verify_record(root, record, bar)
            if not found:
                return
            problems.append(f"step {record.step}: {found[0]}")
            bar.total += sum(s.bytes for s in record.shards)
    raise NotDone(f"refusing to drop committed snapshots: none of the {len(kept)} that --keep-last "
                  f"{keep_last} keeps verifies ({'; '.join(problems)}), so the dropped ones may be "
                  f"all that restores. Run `{PROG} verify {root} --all`, then choose --keep-last "
                  "so that an intact snapshot stays")


# --- compare-loss ------------------------------------------------------------------------------


def _add_compare_loss(commands) -> None:
    sub = _command(commands, "compare-loss", cmd_compare_loss,
                   help="compare two JSON-lines loss logs bit for bit",
                   description="Compare two training logs with one JSON object per line holding "
                   "at least \"step\" and \"loss\" (\"lr\" too, optionally). When a step appears "
                   "more than once in a log (a resumed run replays steps), its last occurrence "
                   "counts. Prints the first step whose losses differ, the largest absolute "
                   "difference over the common steps, and the steps present in only one log. "
                   "Exit 0 only when both logs have the same steps with bit-identical losses.")
    sub.add_argument("a", metavar="A.jsonl", help="first log")
    sub.add_argument("b", metavar="B.jsonl", help="second log")


def cmd_compare_loss(args: argparse.Namespace) -> int:
    a, a_lines = _read_loss_log(args.a)
    b, b_lines = _read_loss_log(args.b)
    common = sorted(a.keys() & b.keys())
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    for label, path, log, lines in (("A", args.a, a, a_lines), ("B", args.b, b, b_lines)):
        replays = (f", {lines - len(log)} replayed lines (the last of each step counts)"
                   if lines > len(log) else "")
        print(f"{label}: {path}: {len(log)} steps ({_steps_text(sorted(log), 3)}){replays}")
    print(f"common steps: {len(common)}")
    first = None
    largest: Optional[tuple[float, int]] = None
    for step in common:
        x, y = a[step]["loss"], b[step]["loss"]
        if _same_number(x, y):
            continue
        first = step if first is None else first
        diff = _abs_difference(x, y)
        if largest is None or _rank_difference(diff) > _rank_difference(largest[0]):
            largest = (diff, step)
    if first is None:
        print("losses: bit-identical on every common step")
    else:
        x, y = a[first]["loss"], b[first]["loss"]
        print(f"first difference: step {first}: A loss {x!r}, B loss {y!r}")
        print(f"largest absolute difference: {largest[0]!r} at step {largest[1]}")
    lr_differs = [s for s in common if "lr" in a[s] and "lr" in b[s]
                  and not _same_number(a[s]["lr"], b[s]["lr"])]
    if lr_differs:
        print(f"note: lr differs first at step {lr_differs[0]}: A {a[lr_differs[0]]['lr']!r}, "
              f"B {b[lr_differs[0]]['lr']!r}")
    print(f"only in A: {_steps_text(only_a)}")
    print(f"only in B: {_steps_text(only_b)}")
    same = first is None and not only_a and not only_b
    print("result: IDENTICAL" if same else "result: DIFFERENT")
    return EXIT_OK if same else EXIT_DAMAGE


def _read_loss_log(path: str) -> tuple[dict[int, dict], int]:
    """``{step: record}`` (the last record of each step) and the number of records read."""
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory; pass a JSON-lines loss log")
    log: dict[int, dict] = {}
    count = 0
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist; pass two JSON-lines loss logs") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = _loss_record(line, path, lineno)
                log[record["step"]] = record
                count += 1
        except UnicodeDecodeError:
            raise UsageError(f"{path} line {lineno + 1}: not UTF-8 text; pass a JSON-lines loss "
                             "log") from None
    if not log:
        raise UsageError(f"{path} holds no loss records; pass a JSON-lines log with one "
                         '{"step": ..., "loss": ...} object per line')
    return log, count


def _loss_record(line: str, path: str, lineno: int) -> dict:
    where = f"{path} line {lineno}"
    fix = 'each line must be one JSON object like {"step": 3, "loss": 2.5}'
    try:
        record = json.loads(line)
    except ValueError as e:
        raise UsageError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}); {fix}") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: not a JSON object; {fix}")
    step, loss = record.get("step"), record.get("loss")
    if type(step) is not int or step < 0:
        raise UsageError(f"{where}: \"step\" must be a non-negative integer, got {step!r}; {fix}")
    if not is_number(loss):
        raise UsageError(f"{where}: \"loss\" must be a number, got {loss!r}; {fix}")
    if "lr" in record and not is_number(record["lr"]):
        raise UsageError(f"{where}: \"lr\" must be a number, got {record['lr']!r}; {fix}")
    return record


def _same_number(x, y) -> bool:
    """Bit-identical as float64 (so -0.0 differs from 0.0 and a NaN equals the same NaN)."""
    try:
        return struct.pack("<d", x) == struct.pack("<d", y)
    except OverflowError:  # an int beyond float64
        return x == y


def _abs_difference(x, y) -> float:
    try:
        return abs(float(x) - float(y))
    except OverflowError:
        return math.inf


def _rank_difference(d: float) -> float:
    return math.inf if math.isnan(d) else d


# --- advise ------------------------------------------------------------------------------------


def _add_advise(commands) -> None:
    from . import advise

    sub = _command(commands, "advise", cmd_advise, help=advise.CLI_HELP,
                   description=advise.CLI_DESCRIPTION)
    advise.add_arguments(sub)


def cmd_advise(args: argparse.Namespace) -> int:
    from . import advise

    try:
        result = advise.advise_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from e
    print(advise.render(args, result))
    return EXIT_OK


# --- supervise ---------------------------------------------------------------------------------


def _add_supervise(commands) -> None:
    from . import supervisor

    sub = _command(commands, "supervise", supervisor.run_from_args,
                   help="run a training command, restarting it when it crashes or hangs",
                   description=supervisor.DESCRIPTION)
    sub.epilog = supervisor.EXIT_CODES_HELP  # its exit codes are the job's, not 0/1/2
    supervisor.add_arguments(sub)


_COMMANDS = (_add_ls, _add_inspect, _add_verify, _add_export, _add_gc, _add_compare_loss,
             _add_advise, _add_supervise)
