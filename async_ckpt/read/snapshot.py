"""Reading a committed snapshot back into CPU tensors and values (``Entry`` trees), verified.

``read_snapshot`` reads one rank's shard (and the replicated storages it refers to in other ranks'
shards): every chunk checksummed, every tensor record and tree node validated, tensors that shared
memory when saved sharing it again. ``read_committed`` picks what to read: the newest committed
snapshot that every rank can read, falling back together past damage. ``load`` is the public
engine-free reader. ``read_held`` reads a snapshot the memory tier's keeper held the same way,
from its memory instead of a file. Nothing here touches the user's objects (``restore.py`` does).
"""

from __future__ import annotations

import functools
import logging
import warnings
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable, Mapping, Optional

import torch

from ..distributed import Coordinator
from ..errors import (CheckpointDirError, CheckpointError, ChecksumMismatchError,
                      CorruptSnapshotError, NoSnapshotError)
from ..format.values import AllowPickle
from ..format import tree as tree_model
from ..format.tree import RNG_KEY, Entry, Leaf, NodeKind
from ..format.manifest import Manifest, SnapshotRecord, read_manifest
from ..format.layout import SlotCopy, align_up
from ..format.records import DTensorPiece, HeldStorage, StoredTensor, raw_bytes
from ..format.references import References
from ..format.shard import (CHUNK_BYTES, MAX_DIMS, MAX_EXTENT, ShardReader, checksum,
                            tensor_table)
from .memory import allocating, require_memory
from .records import alignments, torch_dtype
from .reshard import PieceIndex, Resolver, differing_entries, sharded_ref
from ..storage.base import Storage
from ..storage.open import open_storage
from ..tensors import ALL_DTYPES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadOptions:
    """How a snapshot is read into memory.

    ``allow_pickle``: as the engine's (``format/values.py``). ``mapped``: tensors of
    uncompressed storages view the files' private mappings (checksums checked over them, unless
    not ``verify``) instead of memory of their own; see ``Entry.borrowed``. Other storages
    (encoded ones) are decoded into ``scratch`` while it has room (memory already faulted in,
    such as a free staging slot: a restore then allocates no memory for the state), else into
    new memory. ``targets``: the registered state, for a restore: a sharded tensor is read for
    the local shard of the DTensor it holds at the same place (else whole). ``slot_copies``: by
    step, the bytes a rank's shard was written from, still in a staging slot (``SlotCopy``):
    a storage stored raw whose bytes there match its chunks' checksums is viewed there, lent as
    a mapping is, instead of read from the file (checked whatever ``verify`` says)."""

    allow_pickle: AllowPickle = False
    mapped: bool = False
    verify: bool = True
    scratch: Optional[memoryview] = None
    targets: Optional[Mapping] = None
    slot_copies: Optional[Mapping[int, SlotCopy]] = None


def read_snapshot(storage: Storage, record: SnapshotRecord, rank: int = 0,
                  how: ReadOptions = ReadOptions(), manifest: Optional[Manifest] = None,
                  compare_ranks: bool = False) -> Entry:
    """Read and verify ``rank``'s shard of a committed snapshot into CPU tensors, as ``how``
    says, with the replicated storages it refers to in other ranks' shards and, for an
    incremental snapshot, the storages it refers to in earlier snapshots of ``manifest`` (read
    when not given).

    Sharded tensors (``$dtensor``, docs/FORMAT.md 3.6) are read from every rank's pieces that
    overlap what is needed: the local shard of the DTensor that ``how.targets`` holds at the
    same place, else the whole tensor (``reshard.py``). ``compare_ranks`` sets the root entry's
    ``differing``: the top-level entries the saved ranks held unalike."""
    with References(storage, [record]) as refs:
        own = refs.open(record.dir, rank)
        path, records = own.path, own.tensors
        if manifest is None and any(s.ref is not None for s in own.storages):
            manifest = read_manifest(refs.storage)
        if manifest is not None:
            refs.add(manifest.snapshots)
        dtensors, pieces = own.dtensors, own.piece_tensors
        sources = _sources(refs, record, rank)
        aligned = alignments(records, rank)
        in_slot = _slot_views((how.slot_copies or {}).get(record.step), own, sources, aligned)
        views = {key: reader.mapped_storage(i, aligned.get(key, 1))
                 for key, (reader, i) in sources.items()
                 if how.mapped and reader.storages[i].nbytes and key not in in_slot}
        views = {key: view for key, view in views.items() if view is not None}
        held = _HeldBy(own.tree, records, rank)
        if how.verify:
            _in_parallel([_naming(check, held, key) for key in views for check in
                         sources[key][0].mapped_checks(sources[key][1])])
        views.update(in_slot)
        _check_fits_in_memory([reader.storages[i] for key, (reader, i) in sources.items()
                               if key not in views], record.step,
                              len(how.scratch) if how.scratch is not None else 0)
        buffers, lent, used, reads = {}, set(views), 0, []
        for key, (reader, i) in sources.items():
            nbytes = reader.storages[i].nbytes
            if key in views:
                buffers[key] = torch.frombuffer(views[key], dtype=torch.uint8)
                continue
            if how.scratch is not None and nbytes and used + nbytes <= len(how.scratch):
                buffers[key] = torch.frombuffer(how.scratch[used:used + nbytes],
                                                dtype=torch.uint8)
                used, lent = align_up(used + nbytes, _SCRATCH_ALIGNMENT), lent | {key}
            else:
                buffers[key] = allocating(lambda: torch.empty(nbytes, dtype=torch.uint8), nbytes,
                                          f"step {record.step}'s storages")
            reads += [_naming(read, held, key)
                      for read in reader.storage_reads(i, buffers[key].numpy())]
        _in_parallel(reads)
        tensors = [None if n in pieces else _tensor_from_record(t, buffers, rank, path, n)
                   for n, t in enumerate(records)]
        root_entry = _rebuild(own.tree, tensors, dtensors, how.allow_pickle, path)
        if dtensors or how.targets is not None:
            _read_sharded(root_entry, how.targets, Resolver(lambda: PieceIndex(
                refs, record, lambda refs, record, r, i: _storage_source(refs, record, r, i, False)),
                path))
        if compare_ranks:
            root_entry.differing = frozenset(differing_entries(refs, record))
        tensors.clear()  # _rebuild's closures form a cycle: without this the tensors (and a file's
        # mapping) would live on until the cycle collector runs, not as long as the entries do
        root_entry.borrowed = frozenset(buffers[key].untyped_storage().data_ptr() for key in lent)
        root_entry.from_slot = sum(len(view) for view in in_slot.values())
        return root_entry


def _slot_views(copy: Optional[SlotCopy], own: ShardReader,
                sources: Mapping[tuple[int, int], tuple[ShardReader, int]],
                aligned: Mapping[tuple[int, int], int]) -> dict[tuple[int, int], memoryview]:
    """(rank, storage) -> a view of ``copy`` (the slot ``own``'s shard was written from) for each
    storage of ``own`` stored raw there whose bytes match its chunks' checksums (the chunks of a
    raw storage are checksums of its bytes as they are in memory); the others are read as
    usual. A mismatch means the slot was changed since: said in the log, never damage."""
    if copy is None:
        return {}
    candidates = {}
    for key, (reader, i) in sources.items():
        storage = reader.storages[i]
        if not (reader is own and i < len(copy.regions) and storage.chunks
                and all(c.codec == "raw" for c in storage.chunks)):
            continue
        offset, nbytes = copy.regions[i]
        if nbytes == storage.nbytes and offset % aligned.get(key, 1) == 0:
            candidates[key] = copy.memory[offset:offset + nbytes], storage.chunks
    matches = {}

    def check(key, view: memoryview, start: int, chunk) -> None:
        matches[key, start] = checksum(view[start:start + chunk.raw]) == chunk.xxh3

    _in_parallel([functools.partial(check, key, view, start, chunk)
                  for key, (view, chunks) in candidates.items()
                  for start, chunk in zip(_chunk_starts(chunks), chunks)])
    views = {key: view for key, (view, chunks) in candidates.items()
             if all(matches[key, start] for start in _chunk_starts(chunks))}
    if len(views) < len(candidates):
        log.warning("%s: %d of its storages differ from the staging slot the snapshot was "
                    "written from (the slot changed since); read from the file", own.path,
                    len(candidates) - len(views))
    return views


def _chunk_starts(chunks) -> list[int]:
    """Where each chunk starts in its storage's bytes."""
    starts, at = [], 0
    for chunk in chunks:
        starts.append(at)
        at += chunk.raw
    return starts


def read_held(tree: Any, table: Any, storages: Sequence[HeldStorage],
              memory: Optional[memoryview], allow_pickle: bool, where: str) -> Entry:
    """A snapshot the memory tier's keeper held, as ``read_snapshot`` reads a shard: ``storages``
    lie in ``memory`` (the keeper's memfd, mapped privately), ``table`` the tensor table over them
    (storage ``i`` of rank 0; checked as a shard's is), ``tree`` the state tree. Every chunk is
    checked before anything is built (ChecksumMismatchError, naming the tensors it holds); the
    tensors view ``memory``, lent (``Entry.borrowed``): the restore copies them once, into
    place."""
    records = tensor_table(table, where, [s.nbytes for s in storages])
    held = _HeldBy(tree, records, 0)

    def check(i: int, at: int, end: int, expected: str) -> None:
        if checksum(memory[at:end]) != expected:
            chunk = (at - storages[i].offset) // CHUNK_BYTES
            raise ChecksumMismatchError(f"{where}: storage {i} chunk {chunk} "
                                        "fails its checksum (the memory changed after the "
                                        "keeper sealed it)")

    _in_parallel([_naming(functools.partial(check, i, at, min(at + CHUNK_BYTES,
                                                              s.offset + s.nbytes),
                                            expected), held, (0, i))
                  for i, s in enumerate(storages)
                  for at, expected in zip(range(s.offset, s.offset + s.nbytes, CHUNK_BYTES),
                                          s.checksums)])
    buffers = {(0, i): torch.frombuffer(memory[s.offset:s.offset + s.nbytes], dtype=torch.uint8)
               if s.nbytes else torch.empty(0, dtype=torch.uint8)
               for i, s in enumerate(storages)}
    tensors = [_tensor_from_record(t, buffers, 0, where, n) for n, t in enumerate(records)]
    root_entry = _rebuild(tree, tensors, [], allow_pickle, where)
    tensors.clear()  # as in read_snapshot: the tensors live as long as the entries, no longer
    root_entry.borrowed = frozenset(b.untyped_storage().data_ptr() for b in buffers.values()
                                    if b.numel())
    return root_entry


class _HeldBy:
    """For messages: (rank, storage) -> the key paths of the tensors of a shard's state tree that
    view it (``model["0.weight"]``). Walked only once a check or read fails: on every good read
    it would cost as much as a tenth of the read itself."""

    def __init__(self, tree: Any, records: tuple[StoredTensor, ...], rank: int):
        self._tree, self._records, self._rank = tree, records, rank
        self._names: Optional[dict[tuple[int, Optional[int]], str]] = None

    def get(self, key: tuple[int, Optional[int]]) -> Optional[str]:
        if self._names is None:
            self._names = self._walk()
        return self._names.get(key)

    def _walk(self) -> dict[tuple[int, Optional[int]], str]:
        """Empty where the tree is malformed: the reads that follow say what is wrong with it."""
        held: dict[tuple[int, Optional[int]], list[str]] = {}
        try:
            for node in tree_model.walk(self._tree, ""):
                for path, leaf, tensor in tree_model.leaves(node):
                    if leaf is Leaf.TENSOR:
                        number = tree_model.table_entry(leaf, tensor, len(self._records), "")
                        held.setdefault(self._records[number].held_in(self._rank),
                                        []).append(path)
        except (CorruptSnapshotError, TypeError, IndexError):
            return {}
        return {key: ", ".join(paths[:3]) + (f" and {len(paths) - 3} more"
                                             if len(paths) > 3 else "")
                for key, paths in held.items()}


def _naming(read: Callable[[], None], held: _HeldBy,
            key: tuple[int, Optional[int]]) -> Callable[[], None]:
    """``read`` (a storage's read or check), whose damage also names the tensors that view the
    storage ``key``."""
    def named() -> None:
        try:
            read()
        except CorruptSnapshotError as e:
            names = held.get(key)
            if names is None:
                raise
            raise type(e)(f"{e} (it holds {names})") from e
    return named


def _storages_viewed(records: list[StoredTensor]) -> set[int]:
    """The numbers of this shard's storages that ``records`` view."""
    return {t.storage for t in records if t.storage is not None and t.rank is None}


_SCRATCH_ALIGNMENT = 64  # storages decoded into scratch start on cache lines, as allocations do
VERIFY_THREADS = min(8, max(2, len(os.sched_getaffinity(0))))
"""Threads that checksum mapped chunks, and read, check and decode the others: a chunk's first
read through a mapping costs its page faults more than its checksum, and faults on two cores take
about 0.7x the time of one; zstd decodes on every core the process may run on (its affinity: a
container or ``taskset`` may allow fewer than the machine has)."""


class _VerifyThreads:
    """The threads of ``_in_parallel``: kept between reads while something holds them (an open
    engine: starting them costs ~5 ms here, a fifth of a 256 MB restore), else made for one read
    and joined before it returns, so that no thread of the library outlives the engine or the
    ``load`` that used it (frameworks' test suites fail on threads left behind). Per process: a
    forked child inherits the holders' count and the pool, not the threads."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._holders = 0
        self._pool: Optional[ThreadPoolExecutor] = None

    def hold(self) -> Callable[[], None]:
        """Keep the threads until the returned function is called (once; more calls do nothing)."""
        self._forget_if_forked()
        self._holders += 1
        released, pid = False, os.getpid()

        def release() -> None:
            nonlocal released
            if released or pid != os.getpid():
                return
            released = True
            self._holders -= 1
            if self._holders == 0 and self._pool is not None:
                pool, self._pool = self._pool, None
                pool.shutdown(wait=True)

        return release

    def map(self, run: Callable[[list], None], groups: list[list]) -> None:
        """``run`` each group on a thread of its own; raises the first group's failure."""
        self._forget_if_forked()
        if self._holders == 0:
            with ThreadPoolExecutor(len(groups), "async_ckpt-verify") as pool:
                for _ in pool.map(run, groups):
                    pass
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(VERIFY_THREADS, "async_ckpt-verify")
        for _ in self._pool.map(run, groups):
            pass

    def _forget_if_forked(self) -> None:
        if self._pid != os.getpid():
            self._pid, self._holders, self._pool = os.getpid(), 0, None


_verify_threads = _VerifyThreads()
hold_verify_threads = _verify_threads.hold


def _in_parallel(checks: list[Callable[[], None]]) -> None:
    """Run every task (a chunk's check, or its read): in ``VERIFY_THREADS`` contiguous runs, each
    on a thread of its own (one task per thread: a task per chunk costs more in hand-offs than it
    balances), kept between reads while an engine holds them (``hold_verify_threads``)."""

    def run(group: list[Callable[[], None]]) -> None:
        for check in group:
            check()

    size = max(1, -(-len(checks) // VERIFY_THREADS))
    groups = [checks[start:start + size] for start in range(0, len(checks), size)]
    if len(groups) < 2:
        return run(checks)
    _verify_threads.map(run, groups)


def _sources(refs: References, record: SnapshotRecord, rank: int
             ) -> dict[tuple[int, int], tuple[ShardReader, int]]:
    """The storages a restore of ``rank``'s shard reads, by (rank, storage number), and where
    each is held: the shard's own (less those only a sharded tensor's pieces view, read by the
    resharder), and the replicated storages of other ranks' shards its tensors view."""
    own = refs.open(record.dir, rank)
    pieces = own.piece_tensors
    plain = [t for n, t in enumerate(own.tensors) if n not in pieces]
    only_pieces = (_storages_viewed([t for n, t in enumerate(own.tensors) if n in pieces])
                   - _storages_viewed(plain)) if pieces else set()
    wanted = [(rank, i) for i in range(len(own.storages)) if i not in only_pieces]
    wanted += sorted({t.held_in(rank) for t in plain if t.rank not in (None, rank)
                      and t.storage is not None and any(s.rank == t.rank for s in record.shards)})
    return {(r, i): _storage_source(refs, record, r, i, r != rank) for r, i in wanted}


def check_views(refs: References, record: SnapshotRecord, rank: int,
                other_ranks: bool = True) -> None:
    """Raise what a restore would raise for the tensor records of ``rank``'s shard that the shard
    alone cannot tell (``async-ckpt verify``, once every shard reads): a view of a storage the
    restore does not read (of a rank no shard holds, or past the shard's own table), or past the
    end of another rank's storage. ``other_ranks`` False: the record lists this rank's shard only
    (its own root), so views of other ranks' storages are not checked. Each record's dtype and
    view are checked as ``read_snapshot`` checks them (``_viewed``), with no tensor made and no
    byte read: a table of millions of records costs seconds, not tens of them."""
    own = refs.open(record.dir, rank)
    sizes = {key: reader.storages[i].nbytes
             for key, (reader, i) in _sources(refs, record, rank).items()}
    for n, t in enumerate(own.tensors):
        if n not in own.piece_tensors and (other_ranks or t.rank in (None, rank)):
            torch_dtype(t, own.path, n)
            if math.prod(t.shape):
                _viewed(t, sizes.get, rank, own.path, n)


def _storage_source(refs: References, record: SnapshotRecord, rank: int, i: int,
                    must_be_replica: bool) -> tuple[ShardReader, int]:
    """The shard and storage number holding storage ``i`` of ``rank``'s shard of ``record``:
    there, or in the earlier snapshot it refers to."""
    reader = refs.open(record.dir, rank)
    storages = reader.storages
    if not 0 <= i < len(storages) or (must_be_replica and storages[i].replica is None):
        raise CorruptSnapshotError(f"{reader.path} has no replicated storage {i}, which another "
                                   "rank's shard refers to")
    if storages[i].ref is None:
        return reader, i
    return refs.resolve(record, rank, storages[i], f"{reader.path}: storage {i}")


def _check_fits_in_memory(storages, step: int, lent: int = 0) -> None:
    """Refuse, before allocating, to read more than the memory available now: the storages (less
    the ``lent`` bytes of scratch memory they may go into), plus scratch for decoding the largest
    chunk (twice its size for byte planes) on each of the ``VERIFY_THREADS``."""
    storages = list(storages)
    largest_chunk = max((s.largest_chunk for s in storages), default=0)
    need = (max(0, raw_bytes(storages) - lent)
            + 2 * largest_chunk * VERIFY_THREADS)
    require_memory(need, f"restoring step {step}", "free memory (or restore on a larger "
                   "machine). The snapshot was not checked for damage, and nothing was loaded")


def _tensor_from_record(t: StoredTensor, buffers: dict[tuple[int, int], torch.Tensor], rank: int,
                        path: str, i: int) -> torch.Tensor:
    def bad(why: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{path}: tensor {i}: {why}")

    dtype, shape, stride = torch_dtype(t, path, i), t.shape, t.stride
    if math.prod(shape) == 0:
        try:
            return torch.empty_strided(shape, stride, dtype=dtype)
        except RuntimeError as e:
            raise bad(f"shape {list(shape[:8])} and stride {list(stride[:8])} are not a valid "
                      "layout") from e
    buffer = buffers[_viewed(t, lambda key: buffers[key].numel() if key in buffers else None,
                             rank, path, i)]
    offset, end, itemsize = t.offset, t.end, t.itemsize
    if (buffer.data_ptr() + offset) % itemsize:  # never reached by read_snapshot's buffers
        # (mapped ones start aligned for every dtype viewing them), kept so that no path hands
        # torch a misaligned tensor, which its kernels may crash on: a copy of the bytes viewed
        buffer = allocating(lambda: buffer[offset:end].clone(), end - offset, f"tensor {i}")
        offset = 0
    return torch.empty(0, dtype=dtype, device=buffer.device).set_(
        buffer.untyped_storage(), offset // itemsize, shape, stride)


def _viewed(t: StoredTensor, size_of: Callable[[tuple[int, Optional[int]]], Optional[int]],
            rank: int, path: str, i: int) -> tuple[int, Optional[int]]:
    """The (rank, storage) that nonempty tensor record ``i`` of ``rank``'s shard views, refused
    where a restore does not read that storage (``size_of`` gives None) or the view runs past its
    end (another rank's storage is checked here, this shard's when its index was read)."""
    key = t.held_in(rank)
    size = size_of(key)
    if size is None:
        raise CorruptSnapshotError(f"{path}: tensor {i}: bad storage reference")
    if t.end > size:
        raise CorruptSnapshotError(f"{path}: tensor {i}: view lies outside its storage")
    return key


def _size(v: Any) -> torch.Size:
    if type(v) is not list or len(v) > MAX_DIMS or not all(type(n) is int and 0 <= n <= MAX_EXTENT
                                                             for n in v):
        raise ValueError("not a list of sizes")
    return torch.Size(v)


def _device(v: Any) -> torch.device:
    if type(v) is not str or len(v) > 64:
        raise ValueError("not a device name")
    return torch.device(v)


_TORCH_LEAVES = {Leaf.DTYPE: lambda v: ALL_DTYPES[v] if type(v) is str else None,
                 Leaf.SIZE: _size, Leaf.DEVICE: _device}


def _read_sharded(root: Entry, state: Optional[Mapping], resolver: Resolver) -> None:
    """Put the sharded tensors into the tree ``root``, read all at once (all or nothing) beside
    the registered ``state`` they will be loaded into."""
    def visit(entry: Entry, current: Any, first_pass: bool) -> None:
        if entry.kind == NodeKind.DICT:
            for key, child in entry.value.items():
                visit(child, current.get(key) if isinstance(current, Mapping) else None,
                      first_pass)
        elif first_pass:
            resolver.collect(entry.value, current)
        else:
            entry.value = resolver.fill(entry.value)

    visit(root, state, True)
    resolver.read()
    visit(root, state, False)


def tree_problems(reader: ShardReader) -> list[str]:
    """What a restore would refuse in the state tree of ``reader``'s shard, found without reading
    a tensor's bytes (``async-ckpt verify``): the tree rebuilt as ``read_snapshot`` rebuilds it,
    every value decoded, over empty stand-ins for the tensors, with pickled values passed over
    unread (never run). Each tensor and each pickled value gets a stand-in of its own: values that
    differ when restored (two pickled enum members as dict keys, a set of tensors) must not
    collide here. One line per problem found (at most one)."""
    try:
        _rebuild(reader.tree, _StandIns(len(reader.tensors), reader.piece_tensors),
                 reader.dtensors, True, reader.path, unpickle=lambda data: object())
    except CorruptSnapshotError as e:
        return [str(e)]
    return []


class _StandIns(Sequence):
    """``tree_problems``'s tensors: an empty tensor of its own for each number the tree names
    (made when first named, so a large table costs nothing), None for a sharded tensor's piece,
    as ``read_snapshot``'s list holds."""

    def __init__(self, count: int, pieces: frozenset[int]):
        self._count, self._pieces, self._made = count, pieces, {}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, n: int) -> Optional[torch.Tensor]:
        if n in self._pieces:
            return None
        if n not in self._made:
            self._made[n] = torch.empty(0, dtype=torch.uint8)
        return self._made[n]


def _rebuild(tree: Any, tensors: Sequence[Optional[torch.Tensor]],
             dtensors: tuple[DTensorPiece, ...], allow_pickle: AllowPickle, path: str,
             unpickle: Optional[Callable[[bytes], Any]] = None) -> Entry:
    def leaf(kind: Leaf, v: Any):
        try:
            if kind is Leaf.TENSOR:
                tensor = tensors[tree_model.table_entry(kind, v, len(tensors), path)]
                if tensor is None:  # a sharded tensor's piece, only ever named by its $dtensor
                    raise IndexError(v)
                return tensor
            if kind is Leaf.DTENSOR:
                return sharded_ref(dtensors[tree_model.table_entry(kind, v, len(dtensors), path)],
                                   path)
            value = _TORCH_LEAVES[kind](v)
            if value is None:
                raise KeyError(v)
            return value
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            raise CorruptSnapshotError(f"{path}: bad {kind.value} value {str(v)[:40]!r}") from e

    return tree_model.rebuild(tree, leaf, allow_pickle, path, unpickle)


def read_committed(storage: Storage, step: Optional[int] = None,
                   how: ReadOptions = ReadOptions(), *,
                   shard_of: Callable[[SnapshotRecord], int] = lambda record: 0,
                   coordinator: Optional[Coordinator] = None,
                   check: Optional[Callable[[Entry], None]] = None,
                   ) -> tuple[Optional[SnapshotRecord], Optional[Entry]]:
    """Read the newest committed snapshot that verifies (or exactly ``step``), as ``how`` says.

    ``shard_of(record)`` picks the rank whose shard to read; ``check(entry)`` validates what was
    read further, raising CorruptSnapshotError for damage. With ``how.targets`` (a restore), a
    snapshot of another world size is read with ``compare_ranks``. Damage (an error whose class
    says ``is_damage``) moves on to the previous snapshot; any other error is raised. With a
    ``coordinator`` of several ranks, rank 0's manifest is used by all, every rank reads its
    part, and they fall back together when any rank cannot read its part of a snapshot.
    Returns (record, entry), or (None, None) when nothing was ever committed.
    """
    coordinator = coordinator or Coordinator(0, 1)
    where_from = storage.location()
    manifest = coordinator.from_rank0(lambda: read_manifest(storage))
    if manifest.rank is not None:
        raise CheckpointDirError(
            f"{where_from} holds only rank {manifest.rank}'s shards of its job's snapshots (the "
            "ranks shared no directory): restore the job from its object store (the engine's "
            "remote=, or async_ckpt.load of the s3:// URL)")
    if step is None:
        candidates = manifest.newest_first()
    elif manifest.find(step) is not None:
        candidates = [manifest.find(step)]
    else:
        raise NoSnapshotError(f"step {step} is not committed in {where_from}; committed steps: "
                              f"{manifest.steps() or 'none'}")
    damaged = []
    for record in candidates:
        loaded, error = None, None
        try:
            loaded = read_snapshot(storage, record, shard_of(record), how, manifest,
                                   compare_ranks=how.targets is not None
                                   and record.world_size != coordinator.world_size)
            if check is not None:
                check(loaded)
        except CheckpointError as e:
            error = e
        problems = coordinator.gather(None if error is None else (
            error.is_damage,
            f"{type(error).__name__}: {error}"))
        if not any(problems):
            return record, loaded
        where = "; ".join(p[1] if len(problems) == 1 else f"rank {r}: {p[1]}"
                          for r, p in enumerate(problems) if p)
        if step is not None or not all(p is None or p[0] for p in problems):
            if error is not None:
                raise error
            raise CorruptSnapshotError(f"step {record.step} cannot be restored on every rank: {where}")
        message = f"snapshot of step {record.step} is unusable, falling back to the previous one: "
        log.warning("%s%s", message, where)
        warnings.warn(message + where, RuntimeWarning, stacklevel=2)  # seen without logging set up
        damaged.append(f"step {record.step}: {where}")
    if damaged:
        raise NoSnapshotError(
            f"every committed snapshot in {where_from} is damaged: " + "; ".join(damaged)
            + ". Nothing was loaded; inspect them with `async-ckpt verify`")
    return None, None


def load(directory: str | os.PathLike | Storage, step: Optional[int] = None, *, rank: int = 0,
         allow_pickle: AllowPickle = False, mmap: bool = False,
         verify: Optional[bool] = None, remote_options: Optional[dict] = None) -> tuple[int, dict]:
    """Read a committed snapshot into plain CPU tensors and values, without an engine or objects.

    Returns (step, state) where state mirrors what was registered: each object's state_dict, each
    tensor, each dict. Tensors that shared memory when saved share it again. ``allow_pickle``
    as the engine's: True unpickles any pickled value (running code stored in the file), a
    collection of classes only pickles that name nothing else.

    ``mmap=True`` (as ``torch.load(mmap=True)``): uncompressed tensors map the shard files instead
    of being read, so a snapshot larger than memory can be inspected or exported; their pages are
    read when touched and their checksums are NOT checked (``async-ckpt verify`` checks them)
    unless ``verify=True``, which reads every page once (from the page cache when it holds them)
    but still allocates no memory for them: how ``async-ckpt export`` reads a large snapshot.
    Writes to such tensors stay in this process's memory. The files must not be truncated or
    replaced in place while mapped (touching a page past a file's end kills the process with
    SIGBUS); the engine never does either: it writes new files and deletes old ones.

    ``directory`` may be an object store's URL (``s3://bucket/prefix``, settings in
    ``remote_options`` or the AWS environment, as for the engine's ``remote``): the shards are
    then read with ranged GETs into memory (``mmap`` does not apply); or a ``Storage`` already
    open (``storage.open.open_storage``, as the command line does).
    """
    storage = open_storage(directory, remote_options)
    record, loaded = read_committed(storage, step, ReadOptions(
        allow_pickle, mapped=mmap, verify=not mmap if verify is None else verify),
        shard_of=lambda record: rank)
    if loaded is None:
        raise NoSnapshotError(f"{storage.location()} holds no committed snapshot")
    loaded.value.pop(RNG_KEY, None)
    return record.step, loaded.plain()
