"""``async-ckpt inspect``: what a committed snapshot holds, from its shard's index alone.

The state tree is read with ``format.tree``'s walker and its value trees with ``format.values``',
which own the tags; this module only decides how they are shown (which lists are expanded, how
values are summarised)."""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .common import (EXIT_OK, UsageError, add_dir_command, add_rank_option, checkpoint_dir,
                     pick_record, size_text, step_arg, when_text)
from ..errors import CorruptSnapshotError
from ..format import tree as tree_model, values
from ..format.tree import Leaf, NodeKind
from ..format.values import Kind
from ..format.manifest import read_manifest
from ..format.records import DTensorPiece, raw_bytes
from ..format.shard import ShardReader

_PREVIEW_CHARS = 60  # longer values are summarised by type and length


HELP = "show what a snapshot holds"
DESCRIPTION = """\
Show the entries of a committed snapshot: every tensor (key path, dtype, shape, size, codec) and
every other value (summarised), with totals per top-level entry. Reads only the shard's index,
never tensor data.
"""


def add(commands) -> None:
    sub = add_dir_command(commands, "inspect", cmd_inspect, HELP, DESCRIPTION)
    sub.add_argument("--step", type=step_arg, metavar="N",
                     help="the snapshot of step N (default: the newest committed)")
    add_rank_option(sub, "show")


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = checkpoint_dir(args.dir)
    root = storage.location()
    manifest = read_manifest(storage)
    record = pick_record(manifest, args.step, root, "inspect")
    shard = next((s for s in record.shards if s.rank == args.rank), None)
    if shard is None:
        raise UsageError(f"step {record.step} has no shard of rank {args.rank}; its ranks: "
                         f"{', '.join(str(s.rank) for s in record.shards) or 'none'}")
    path = storage.location(record.dir, shard.file)
    with ShardReader(storage.open_shard(record.dir, shard.file), shard.bytes,
                     shard.index_xxh3) as reader:
        reader.check_step(record.step)
    storages = reader.storages  # parsed and checked (the tensor table too, as the walk asks for
    # it): no more reads
    walk = _TreeWalk(reader, path)
    walk.run()
    newest = " (newest)" if record is manifest.snapshots[-1] else ""
    raw = raw_bytes(storages)
    stored = sum(s.stored_bytes for s in storages)
    referred = raw_bytes(s for s in storages if s.ref is not None)
    print(f"step {record.step}{newest} in {root}, rank {shard.rank} of {record.world_size}, "
          f"committed {when_text(record.committed_at)}")
    print(f"file {os.path.join(record.dir, shard.file)}: {size_text(shard.bytes)}; tensor data "
          f"{size_text(raw)} raw, {size_text(stored)} stored"
          + (f", {size_text(referred)} referred to in earlier snapshots" if referred else ""))
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
    for name, t in [*walk.totals.items(), ("all", _Totals.sum(list(walk.totals.values())))]:
        print(f"  {name:<24} {t.kind:<7} {t.tensors:>7}  {size_text(t.bytes):>9}  "
              f"{size_text(t.stored):>9}  {t.values:>6}")
    return EXIT_OK


@dataclass
class _Totals:
    """What a top-level entry (of ``kind``) holds: tensors, their bytes, the bytes their storages
    take in the file, other values."""
    kind: str
    tensors: int = 0
    bytes: int = 0
    stored: int = 0
    values: int = 0

    @classmethod
    def sum(cls, totals: list["_Totals"]) -> "_Totals":
        """Every entry's together."""
        return cls("", sum(t.tensors for t in totals), sum(t.bytes for t in totals),
                   sum(t.stored for t in totals), sum(t.values for t in totals))


class _TreeWalk:
    """Turns a shard index's state tree (docs/FORMAT.md section 5) into display lines and totals,
    without decoding anything that could run code or loading tensor data."""

    def __init__(self, shard: ShardReader, path: str):
        self.path = path
        self.tree = shard.tree
        self.tensors = shard.tensors
        self.dtensors, self.storages = shard.dtensors, shard.storages
        self.lines: list[tuple] = []
        self.totals: dict[str, _Totals] = {}
        self._storage_owner: dict[int, str] = {}
        self._top = ""

    def run(self) -> None:
        try:
            for node in tree_model.walk(self.tree, "the state tree"):
                if len(node.keys) == 1:
                    self._top = node.top
                    self.totals[node.top] = _Totals(node.kind)
                    self.lines.append(("head", node.top, node.kind))
                if node.kind != NodeKind.DICT:  # a module's metadata (versions) is not shown
                    self._value(node.state, functools.reduce(_child_path, node.keys[1:], node.top))
        except (CorruptSnapshotError, KeyError, TypeError, IndexError, ValueError, AttributeError,
                RecursionError) as e:  # the walker's own refusals too: say where
            raise CorruptSnapshotError(
                f"{self.path}: malformed state tree near {self._top[:60]!r}: {str(e)[:200]}") from e

    def _value(self, v: Any, path: str) -> None:
        leaf, payload = tree_model.leaf_of(v) or (None, None)
        kind = values.kind_of(v)
        if leaf is Leaf.TENSOR:
            self._tensor(payload, path)
        elif leaf is Leaf.DTENSOR:
            self._dtensor(payload, path)
        elif kind in (Kind.DICT, Kind.KEYED_DICT):
            items = values.children(v)
            if not items:
                self._leaf(path, "{}")
            for key, child in items:
                self._value(child, _child_path(path, key if kind == Kind.DICT
                                               else _render(key) or _summary(key)))
        elif kind in (Kind.LIST, Kind.TUPLE) and _worth_expanding(v):
            for i, child in values.children(v):
                self._value(child, _child_path(path, i))
        else:
            self._leaf(path, _render(v) or _summary(v))

    def _leaf(self, path: str, text: str) -> None:
        self.totals[self._top].values += 1
        self.lines.append(("row", path, text))

    def _dtensor(self, k: int, path: str) -> None:
        """A sharded tensor (FORMAT.md 3.7): its global shape, and this rank's piece."""
        d = self.dtensors[tree_model.table_entry(Leaf.DTENSOR, k, len(self.dtensors), path)]
        if d.tensor is not None:
            return self._tensor(d.tensor, path, d)
        self._top_totals().tensors += 1
        self.lines.append(("row", path, d.dtype, _shape_text(d.global_shape), "-",
                           "sharded; this rank's piece is stored by another rank"))

    def _top_totals(self) -> "_Totals":
        return self.totals[self._top]

    def _tensor(self, i: int, path: str, sharded: Optional[DTensorPiece] = None) -> None:
        t = self.tensors[tree_model.table_entry(Leaf.TENSOR, i, len(self.tensors), path)]
        shape, storage = t.shape, t.storage
        total = self._top_totals()
        total.tensors += 1
        total.bytes += t.nbytes
        if storage is None:
            codec = "-"
        elif t.rank is not None:  # replicated: stored once, in the owner rank's shard
            codec = f"in rank {t.rank}'s shard"
        elif self.storages[storage].ref is not None:  # incremental: in an earlier snapshot
            codec = f"in {self.storages[storage].ref.dir}"
        else:
            chunks = self.storages[storage].chunks
            codec = "+".join(dict.fromkeys(c.codec for c in chunks)) or "-"
            owner = self._storage_owner.get(storage)
            if owner is None:
                self._storage_owner[storage] = path
                total.stored += self.storages[storage].stored_bytes
            else:
                codec += f"  (shares storage with {owner})"
        if sharded is None:
            shape_text = _shape_text(shape)
        else:  # the global shape, and which box of it this rank's piece is
            shape_text = _shape_text(sharded.global_shape)
            codec += "  (sharded; piece [" + ", ".join(
                f"{o}:{o + n}" for o, n in zip(sharded.offset, shape)) + "])"
        self.lines.append(("row", path, t.dtype, shape_text, size_text(t.nbytes), codec))

MAX_SHOWN_PATH = 240
"""Characters of a key path shown: a deep tree of long keys would otherwise build a path of
megabytes for every leaf (issue 28: 5.7 GB from a 3.5 MB shard)."""


def _child_path(path: str, key: Any) -> str:
    """``path.key``, cut at ``MAX_SHOWN_PATH`` characters with an ellipsis (and kept so below)."""
    if len(path) >= MAX_SHOWN_PATH:
        return path
    joined = f"{path}.{str(key)[:MAX_SHOWN_PATH]}"
    return joined if len(joined) <= MAX_SHOWN_PATH else joined[:MAX_SHOWN_PATH - 1] + "\u2026"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _worth_expanding(v: Any) -> bool:
    """Expand a list or tuple into one line per element when it holds tensors or mappings."""
    for _, kind, node in values.walk(v):
        leaf, _ = tree_model.leaf_of(node) or (None, None)
        if kind in (Kind.DICT, Kind.KEYED_DICT) or leaf in (Leaf.TENSOR, Leaf.DTENSOR):
            return True
    return False


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
        leaf, payload = tree_model.leaf_of(x) or (None, None)
        if kind == Kind.LIST:
            seq([child for _, child in values.children(x)], "[", "]")
        elif kind == Kind.TUPLE:
            seq([child for _, child in values.children(x)], "(", ")")
        elif kind == Kind.DICT:
            put("{")
            for i, (key, child) in enumerate(values.children(x)):
                put(", " if i else "")
                put(repr(key) + ": ")
                go(child)
            put("}")
        elif kind == Kind.VALUE:
            put(repr(x) if isinstance(x, (bool, str, float)) or x is None else str(x))
        elif kind == Kind.INT:
            put(str(values.decode(x)))
        elif kind == Kind.FLOAT:
            put(f"float({str(values.decode(x))!r})")
        elif leaf is Leaf.DTYPE:
            put(f"torch.{payload}")
        elif leaf is Leaf.SIZE:
            put(f"torch.Size({payload})")
        elif leaf is Leaf.DEVICE:
            put(f"device({payload!r})")
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
    if kind in (Kind.LIST, Kind.DICT):
        return f"{kind}[{len(v)}]"
    if kind == Kind.VALUE:
        if isinstance(v, str):
            return f"str[{len(v)}] {v[:_PREVIEW_CHARS - 12]!r}..."
        return type(v).__name__
    p = v[kind]
    if kind in (Kind.TUPLE, Kind.SET, Kind.FROZENSET, Kind.KEYED_DICT):
        return f"{kind[1:]}[{len(p)}]"
    if kind in (Kind.BYTES, Kind.BYTEARRAY):
        return f"{kind[1:]}[{values.payload_nbytes(v)}]"
    if kind == Kind.STR:
        return f"str (not valid UTF-8, {values.payload_nbytes(v)} bytes)"
    if kind == Kind.NDARRAY:
        return "ndarray {} {}".format(*values.numpy_spec(v))
    if kind == Kind.NPSCALAR:
        return f"numpy scalar {values.numpy_spec(v)[0]}"
    if kind == Kind.PICKLE:
        return f"pickled object ({size_text(values.payload_nbytes(v))}, not decoded)"
    if kind == Kind.INT:
        return f"int ({len(p)} hex digits)"
    return f"{kind} node"
