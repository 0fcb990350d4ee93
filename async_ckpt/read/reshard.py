"""Sharded tensors read back on any world size and mesh (docs/FORMAT.md 3.6).

A ``DTensor`` was saved as pieces: each rank's shard holds the box of the global tensor that the
rank held (replicated pieces once), recorded with its key path, global shape and global offset.
To restore, every rank computes the box it needs now (the local shard of the ``DTensor`` its
registered object holds at the same place, or the whole tensor where it holds a plain tensor or
nothing), finds the saved pieces that overlap it in whichever ranks' shards hold them, and reads
only the byte ranges of those overlaps, in slabs of at most ``SLAB_BYTES`` through one chunk
cache, each chunk verified as it is read. The pieces overlapping a box must be disjoint and
cover it exactly; anything else is damage of the snapshot.

Plain per-rank state at another world size is the engine's policy (``engine.restore``);
``differing_entries`` tells it which top-level entries the saved ranks did not hold alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch

from ..errors import CorruptSnapshotError
from ..format.manifest import SnapshotRecord
from ..format.records import DTensorPiece, StoredTensor
from ..format.references import References
from ..format import tree as tree_model
from ..format.shard import ChunkCache, ShardReader, checksum
from ..format.tree import Leaf
from ..format.layout import span_bytes
from ..tensors import DTYPES, as_stateful, dtensor_box, is_dtensor
from .memory import allocating, require_memory

SLAB_BYTES = 16 << 20
"""The most bytes of a saved piece read into memory of our own at once, besides one chunk in the
cache: what a rank holds while restoring is its own state plus these."""


@dataclass(frozen=True)
class ShardedRef:
    """A saved sharded tensor, before it is read: where the value tree held a ``$dtensor``."""

    key: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Piece:
    """A stored box of a sharded tensor: in ``rank``'s shard, the tensor record ``record``
    (its storage, offset and stride there), at ``offset`` of the global tensor."""

    rank: int
    record: StoredTensor
    offset: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.record.shape


def sharded_ref(record: DTensorPiece, path: str) -> ShardedRef:
    """The placeholder of a ``dtensors`` record, its dtype checked."""
    dtype = DTYPES.get(record.dtype)
    if dtype is None:
        raise CorruptSnapshotError(f"{path}: sharded tensor {record.key[:80]!r} has unknown "
                                   f"dtype {record.dtype!r}")
    return ShardedRef(record.key, dtype, record.global_shape)


class PieceIndex:
    """Every stored piece of every sharded tensor of one snapshot, from all its ranks' indexes,
    checked to agree: the same keys, dtypes and global shapes on every rank, each stored piece a
    tensor record of that dtype, contiguous, inside its global tensor."""

    def __init__(self, refs: References, record: SnapshotRecord,
                 open_storage: Optional[Callable[[References, SnapshotRecord, int, int],
                                                 tuple[ShardReader, int]]] = None):
        """``open_storage(refs, record, rank, storage)``: where a piece's bytes are read from
        (needed only to read them)."""
        self._refs, self._record, self._open_storage = refs, record, open_storage
        self.pieces: dict[str, list[_Piece]] = {}
        seen: dict[str, tuple] = {}
        keys_of: dict[int, set] = {}
        for shard in record.shards:
            reader = refs.open(record.dir, shard.rank)
            where = reader.path
            table, records = reader.dtensors, reader.tensors
            keys = keys_of[shard.rank] = set()
            for d in table:
                spec = (d.dtype, d.global_shape)
                if seen.setdefault(d.key, spec) != spec:
                    raise CorruptSnapshotError(
                        f"{where}: sharded tensor {d.key[:80]!r} is {spec[0]} "
                        f"{list(spec[1])[:8]} here and {seen[d.key][0]} "
                        f"{list(seen[d.key][1])[:8]} in another rank's shard")
                keys.add(d.key)
                if d.tensor is not None:
                    self.pieces.setdefault(d.key, []).append(
                        self._piece(d, records, shard.rank, where))
        for rank, keys in keys_of.items():
            if keys != seen.keys():
                missing = sorted(seen.keys() - keys)[0]
                raise CorruptSnapshotError(f"rank {rank}'s shard of {record.dir} lacks sharded "
                                           f"tensor {missing[:80]!r}: it is not in every rank's "
                                           "shard")

    def largest_chunk(self, piece: _Piece) -> int:
        """The raw bytes of the largest chunk of the storage holding ``piece`` (0 for an empty
        piece): what reading part of it decodes at once."""
        if piece.record.storage is None:
            return 0
        reader, storage = self._open_storage(self._refs, self._record, piece.rank,
                                             piece.record.storage)
        return reader.storages[storage].largest_chunk

    @staticmethod
    def _piece(d: DTensorPiece, records: tuple[StoredTensor, ...], rank: int,
               where: str) -> _Piece:
        n = d.tensor
        if n >= len(records):
            raise CorruptSnapshotError(f"{where}: sharded tensor {d.key[:80]!r} names tensor "
                                       f"{n}, which does not exist")
        t = records[n]
        offset, global_shape = d.offset, d.global_shape
        if (t.dtype != d.dtype or len(t.shape) != len(global_shape)
                or any(o + s > g for o, s, g in zip(offset, t.shape, global_shape))
                or list(t.stride) != _contiguous_strides(list(t.shape)) or t.rank is not None):
            raise CorruptSnapshotError(f"{where}: the piece of sharded tensor {d.key[:80]!r} "
                                       "does not fit its global tensor")
        return _Piece(rank, t, tuple(offset))

    def problems(self) -> list[str]:
        """What a restore on any world size would refuse in these pieces, found without reading
        a byte (``async-ckpt verify``): a dtype no reader knows, or a sharded tensor whose pieces
        overlap or leave a hole. One line (at most one)."""
        try:
            for shard in self._record.shards[:1]:  # every rank's shard has the same keys (__init__)
                reader = self._refs.open(self._record.dir, shard.rank)
                for d in reader.dtensors:
                    ref = sharded_ref(d, reader.path)
                    self.check_covered(ref, (0,) * len(ref.global_shape), ref.global_shape,
                                       reader.path)
        except CorruptSnapshotError as e:
            return [str(e)]
        return []

    def check_covered(self, ref: ShardedRef, offset: tuple, shape: tuple, where: str) -> list:
        """The pieces overlapping the box ``(offset, shape)`` of ``ref``, checked to be disjoint
        and to cover it exactly."""
        return exact_cover(offset, shape, ((piece, piece.offset, piece.shape)
                                           for piece in self.pieces.get(ref.key, ())),
                           f"{where}: the saved pieces of {ref.key[:80]!r}")

    def read_into(self, target: torch.Tensor, offset: tuple, overlapping: list,
                  cache: ChunkCache) -> None:
        """Fill ``target`` (a contiguous CPU tensor, the box at ``offset``) from the pieces
        ``check_covered`` found, reading only the bytes of each overlap."""
        itemsize = target.element_size()
        flat = target.reshape(-1).view(torch.uint8) if target.numel() else None
        target_strides = _contiguous_strides(list(target.shape))
        for piece, (lo, hi) in overlapping:
            if math.prod(h - lo_ for lo_, h in zip(lo, hi)) == 0:
                continue
            reader, storage = self._open_storage(self._refs, self._record, piece.rank,
                                                 piece.record.storage)
            strides = piece.record.stride
            local_lo = [a - o for a, o in zip(lo, piece.offset)]
            local_hi = [h - o for h, o in zip(hi, piece.offset)]
            # an overlap that is one run of bytes in both layouts (an FSDP row split) is read in
            # one go without the cache, each chunk once; others in slabs of bounded memory
            whole = _one_run([h - a for a, h in zip(lo, hi)], strides, target_strides, itemsize)
            slabs = [(local_lo, local_hi)] if whole else _slabs(local_lo, local_hi, strides,
                                                                  itemsize, SLAB_BYTES)
            for sub_lo, sub_hi in slabs:
                start = piece.record.offset + sum(a * s for a, s in zip(sub_lo, strides)) * itemsize
                shape = [h - a for a, h in zip(sub_lo, sub_hi)]
                nbytes, span = math.prod(shape) * itemsize, span_bytes(shape, strides, itemsize)
                at = [a + o - t for a, o, t in zip(sub_lo, piece.offset, offset)]
                into = sum(a * s for a, s in zip(at, target_strides)) * itemsize
                if whole or _one_run(shape, strides, target_strides, itemsize):  # into place
                    _read(reader, storage, start, start + nbytes, flat[into:into + nbytes].numpy(),
                          None if whole else cache)
                    continue
                buffer = torch.empty(span, dtype=torch.uint8)
                _read(reader, storage, start, start + span, buffer.numpy(), cache)
                region = target[tuple(slice(a, a + n) for a, n in zip(at, shape))]
                region.copy_(buffer.view(target.dtype).as_strided(shape, strides))


def _read(reader: ShardReader, storage: int, start: int, stop: int, out, cache) -> None:
    if stop > reader.storages[storage].nbytes:
        raise CorruptSnapshotError(f"{reader.path}: a piece lies outside storage {storage}")
    reader.read_range(storage, start, stop, out, cache)


def _one_run(shape: list, strides: list, target_strides: list, itemsize: int) -> bool:
    """Whether a box of ``shape`` is one run of bytes, element for element in the same order,
    under the saved piece's ``strides`` and under ``target_strides``."""
    nbytes = math.prod(shape) * itemsize
    return (span_bytes(shape, strides, itemsize) == nbytes
            and span_bytes(shape, target_strides, itemsize) == nbytes
            and all(a == b for n, a, b in zip(shape, strides, target_strides) if n > 1))


def _contiguous_strides(shape: list) -> list:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def exact_cover(offset: tuple, shape: tuple, pieces: Iterable[tuple], what: str) -> list:
    """``(piece, overlap)`` for each ``(piece, offset, shape)`` of ``pieces`` that overlaps the box
    ``(offset, shape)``; CorruptSnapshotError (``what`` ... ) unless they are disjoint and cover
    the box exactly."""
    box = (tuple(offset), tuple(o + s for o, s in zip(offset, shape)))
    overlapping = []
    for piece, piece_offset, piece_shape in pieces:
        overlap = _intersect(box, (tuple(piece_offset),
                                   tuple(o + s for o, s in zip(piece_offset, piece_shape))))
        if overlap is not None:
            for _, other in overlapping:
                if _intersect(overlap, other) is not None:
                    raise CorruptSnapshotError(f"{what} overlap each other")
            overlapping.append((piece, overlap))
    covered = sum(math.prod(h - lo for lo, h in zip(*ov)) for _, ov in overlapping)
    if covered != math.prod(shape):
        raise CorruptSnapshotError(f"{what} cover {covered} of the {math.prod(shape)} elements "
                                   "needed here (a piece is missing)")
    return overlapping


def _intersect(a: tuple, b: tuple) -> Optional[tuple]:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    if any(h <= lo_ for lo_, h in zip(lo, hi)) and lo:
        return None
    return lo, hi


def _slabs(lo: list, hi: list, strides: list, itemsize: int, limit: int) -> Iterator[tuple]:
    """Sub-boxes of ``[lo, hi)`` whose bytes span at most ``limit`` (or a single element's row),
    split along the dimensions of largest stride first, in storage order."""
    shape = [h - a for a, h in zip(lo, hi)]
    if span_bytes(shape, strides, itemsize) <= limit or all(n <= 1 for n in shape):
        yield list(lo), list(hi)
        return
    d = max((i for i, n in enumerate(shape) if n > 1), key=lambda i: strides[i])
    one = span_bytes([1 if i == d else n for i, n in enumerate(shape)], strides, itemsize)
    per = max(1, (limit - one) // (strides[d] * itemsize) + 1) if one <= limit else 1
    for start in range(lo[d], hi[d], per):
        sub_lo, sub_hi = list(lo), list(hi)
        sub_lo[d], sub_hi[d] = start, min(start + per, hi[d])
        if per == 1 and one > limit:
            yield from _slabs(sub_lo, sub_hi, strides, itemsize, limit)
        else:
            yield sub_lo, sub_hi


# --- which box each rank needs ------------------------------------------------------------------

@dataclass
class _Target:
    ref: ShardedRef
    template: Any  # the registered DTensor whose local shard to fill, or None: the whole tensor
    offset: tuple
    shape: tuple
    overlapping: list = field(default_factory=list)
    tensor: Optional[torch.Tensor] = None
    whole: Optional[torch.Tensor] = None  # a plain saved tensor to cut the box from, not pieces


class Resolver:
    """Replaces the ``ShardedRef``s of decoded trees by tensors, in three steps that read and
    check every piece before a restore loads anything: ``collect`` (per tree, beside what the
    registered objects hold at the same places) finds the box each needs, ``read`` checks every
    box is covered, that memory suffices, and reads and verifies them all, and ``fill`` (per
    tree, in the same order) puts them in: a DTensor laid out like the registered one, else the
    whole tensor."""

    def __init__(self, pieces: Callable[[], PieceIndex], where: str):
        self._pieces, self._index, self.where = pieces, None, where
        self._targets: list[_Target] = []
        self._next = 0

    @property
    def pieces(self) -> PieceIndex:
        """Every rank's pieces, gathered when a sharded tensor is first needed."""
        if self._index is None:
            self._index = self._pieces()
        return self._index

    def collect(self, value: Any, current: Any) -> None:
        if isinstance(value, ShardedRef):
            self._targets.append(_target(value, current))
        elif (isinstance(value, torch.Tensor) and is_dtensor(current)
              and tuple(value.shape) == tuple(current.shape)):
            # a plain saved tensor is the whole of a tensor registered sharded now (a snapshot
            # of an unsharded run, an imported checkpoint): this rank takes its box of it
            target = _target(ShardedRef("", value.dtype, tuple(value.shape)), current)
            target.whole = value
            self._targets.append(target)
        elif isinstance(value, dict):
            current = _current_state(current, value)
            for key, item in value.items():
                self.collect(item, current.get(key) if isinstance(current, Mapping) else None)
        elif isinstance(value, (list, tuple)):
            at = list(current) if isinstance(current, (list, tuple)) else []
            for i, item in enumerate(value):
                self.collect(item, at[i] if i < len(at) else None)

    def read(self) -> None:
        if not self._targets:
            return
        for t in self._targets:
            if t.whole is None:
                t.overlapping = self.pieces.check_covered(t.ref, t.offset, t.shape, self.where)
        need = sum(math.prod(t.shape) * t.ref.dtype.itemsize for t in self._targets)
        need += SLAB_BYTES + max((self.pieces.largest_chunk(piece) for t in self._targets
                                  for piece, _ in t.overlapping), default=0) if any(
            t.overlapping for t in self._targets) else 0
        require_memory(need, "restoring the sharded tensors", "free memory, or restore on more "
                       "ranks. The snapshot was not checked for damage, and nothing was loaded")
        cache = ChunkCache()
        for t in self._targets:
            nbytes = math.prod(t.shape) * t.ref.dtype.itemsize
            if t.whole is not None:
                box = t.whole[tuple(slice(o, o + n) for o, n in zip(t.offset, t.shape))]
                t.tensor = allocating(lambda: box.clone(memory_format=torch.contiguous_format),
                                      nbytes, "a sharded tensor")
                continue
            t.tensor = allocating(lambda: torch.empty(t.shape, dtype=t.ref.dtype), nbytes,
                                  "a sharded tensor")
            self.pieces.read_into(t.tensor, t.offset, t.overlapping, cache)

    def fill(self, value: Any) -> Any:
        upcoming = self._targets[self._next] if self._next < len(self._targets) else None
        if isinstance(value, ShardedRef) or (isinstance(value, torch.Tensor) and upcoming
                                             is not None and upcoming.whole is value):
            t = self._targets[self._next]
            self._next += 1
            local, t.tensor, t.whole = t.tensor, None, None
            if t.template is None:
                return local
            return type(t.template).from_local(  # the registered DTensor's own class
                local.to(t.template.device), t.template.device_mesh, t.template.placements,
                run_check=False, shape=t.template.shape, stride=t.template.stride())
        if isinstance(value, dict):
            for key, item in value.items():
                value[key] = self.fill(item)
        elif isinstance(value, list):
            value[:] = [self.fill(item) for item in value]
        elif isinstance(value, tuple):
            return type(value)(self.fill(item) for item in value)
        return value


def _current_state(current: Any, saved: dict) -> Any:
    """What a saved dict is laid out like: a registered object's state dict, and for an
    optimizer, its parameters standing in for the per-parameter state it has not created yet
    (torch's optimizers create it shaped and placed like the parameter)."""
    if current is None or isinstance(current, Mapping) and not hasattr(current, "state_dict"):
        return current
    stateful = as_stateful(current)
    if stateful is None:
        return current
    state = stateful.state_dict()
    if isinstance(current, torch.optim.Optimizer) and isinstance(saved.get("state"), dict):
        params = [p for group in current.param_groups for p in group["params"]]
        own = state.setdefault("state", {})
        for i, entries in saved["state"].items():
            if type(i) is int and 0 <= i < len(params) and isinstance(entries, dict):
                mine = own.setdefault(i, {})
                for name in entries:
                    mine.setdefault(name, params[i])
    return state


def _target(ref: ShardedRef, current: Any) -> _Target:
    if is_dtensor(current) and tuple(current.shape) == ref.global_shape:
        shape, offset = dtensor_box(current)
        return _Target(ref, current, offset, shape)
    return _Target(ref, None, (0,) * len(ref.global_shape), ref.global_shape)


# --- plain state at another world size -----------------------------------------------------------

def differing_entries(refs: References, record: SnapshotRecord) -> set[str]:
    """The top-level entries whose saved content is not the same on every rank of ``record``
    (compared through the indexes: the tree, each tensor's layout and its storage's chunk
    checksums; a sharded tensor by its key and global shape, since its pieces differ by
    design). An entry that differs holds per-rank state."""
    digests: dict[str, list] = {}
    for shard in record.shards:
        for name, digest in _digests(refs.open(record.dir, shard.rank), refs, record).items():
            digests.setdefault(name, []).append(digest)
    return {name for name, seen in digests.items()
            if len(seen) != len(record.shards) or len(set(seen)) > 1}


def _digests(reader: ShardReader, refs: References, record: SnapshotRecord) -> dict[str, str]:
    """Top-level entry -> a digest of what a shard holds in it; none where the shard's tree is
    malformed (its entries then count as differing)."""
    tensors, storages, dtensors = reader.tensors, reader.storages, reader.dtensors

    def leaf_digest(leaf: Leaf, payload: Any) -> list:
        if leaf is Leaf.TENSOR:
            return [leaf.name, _tensor_digest(payload)]
        if leaf is Leaf.DTENSOR:
            d = dtensors[tree_model.table_entry(leaf, payload, len(dtensors), reader.path)]
            return [leaf.name, [d.key, d.dtype, list(d.global_shape)]]
        return [leaf.name, payload]

    def _tensor_digest(i: Any) -> Any:
        t = tensors[tree_model.table_entry(Leaf.TENSOR, i, len(tensors), reader.path)]
        holder, n = storages, t.storage
        if t.rank is not None:  # a replica stored in its owner's shard
            if any(s.rank == t.rank for s in record.shards):
                holder = refs.open(record.dir, t.rank).storages
        s = holder[n] if n is not None and n < len(holder) else None
        return [t.offset, t.dtype, list(t.shape), list(t.stride),
                None if s is None else list(s.chunk_digests)]

    nodes: dict[str, list] = {}
    try:
        for node in tree_model.walk(reader.tree, reader.path):
            nodes.setdefault(node.top, []).append(
                [node.keys, node.kind, tree_model.canonical(node.state, leaf_digest, reader.path),
                 tree_model.canonical(node.metadata, leaf_digest, reader.path)])
    except CorruptSnapshotError:
        return {}
    return {name: checksum(json.dumps(held, sort_keys=True, separators=(",", ":")).encode())
            for name, held in nodes.items()}
