"""The shard file: one rank's part of a snapshot. Specified in docs/FORMAT.md; keep the two in step.

Layout: a 16-byte header, the chunks of every storage back to back (from version 5 each storage's
first chunk at a multiple of ``STORAGE_ALIGNMENT``, from version 7 there or at a multiple of
``DIRECT_ALIGNMENT``, zero bytes before it), a UTF-8 JSON index,
and a 32-byte trailer that locates and checksums the index. The index is written last so the writer
can stream chunks without knowing their compressed sizes; a file cut short loses its trailer and is
refused before anything is read.

Reading is validation first: every offset, length and codec is checked against the file before a
byte of chunk data is trusted, and every chunk's xxh3-64 checksum is checked before it is decoded.
This module never imports torch: the writer process uses it, and so does the restore path.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import mmap
import os
import posixpath
import re
import struct
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import xxhash
import zstandard

from . import filters, values
from .layout import DIRECT_BYTES, span_bytes
from .records import (ITEMSIZES, Chunk, DataFile, DTensorPiece, Replica, StorageEntry,
                      StoredTensor, raw_bytes)
from ..checks import is_int, short_repr
from ..storage.names import (DATA_FILE, MAX_DATA_FILES, SHARD_FILE, SNAPSHOT_DIR, checked_name,
                             data_files_of)
from ..errors import (ChecksumMismatchError, CorruptSnapshotError, EncodingError,
                      UnsupportedFormatError)
from ..storage.base import DIRECT_ALIGNMENT, ShardSink, ShardSource
from ..storage.local import new_shard_file, open_shard_file

log = logging.getLogger(__name__)

READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
MAGIC = b"ACKPT\x00\r\n"
TRAILER_MAGIC = b"ACKPTEND"
_HEADER = struct.Struct("<8sII")  # magic, format version, reserved (0)
_TRAILER = struct.Struct("<QQQ8s")  # index offset, index length, xxh3-64 of the index, magic
HEADER_SIZE = _HEADER.size
TRAILER_SIZE = _TRAILER.size
CHUNK_BYTES = 8 << 20  # raw bytes per chunk: the unit of checksumming and compression
MAX_CHUNK_BYTES = 1 << 30
MAX_INDEX_BYTES = 1 << 30
DECODE_PIECE = 1 << 20  # scratch for decoding and checking: what a chunk is decoded through
CODECS = ("raw", "zstd", "planes")
STORAGE_ALIGNMENT = 64
"""From version 5, the file offset of each storage's first chunk is a multiple of this: more than
any dtype's alignment (16, complex128), so a tensor over a mapped storage is as aligned as torch's
kernels assume (docs/FORMAT.md 3.4). The one place the file's alignment is decided."""


def version_needed(uses_references: bool, refers_to_snapshots: bool = False,
                   sharded: bool = False, stores_bytes: bool = False,
                   data_files: bool = False, direct: bool = False) -> int:
    """The format version to write a shard in: the oldest that can express it. Version 2 adds
    references to storages in other ranks' shards (state replicated across ranks is stored once),
    version 3 storages that are stored in an earlier committed snapshot (incremental snapshots),
    version 4 sharded tensors (``dtensors``, pieces of one tensor in several ranks' shards),
    version 5 aligned storages (``STORAGE_ALIGNMENT``; any shard that stores a chunk), version 6
    chunks kept in data files beside the shard (a framework's own files), version 7 storages
    aligned for direct I/O (``DIRECT_ALIGNMENT``; a shard that stores a chunk, written
    ``direct``), so a shard without them stays readable by older readers."""
    return (7 if direct and stores_bytes else 6 if data_files else 5 if stores_bytes
            else 4 if sharded else 3 if refers_to_snapshots else 2 if uses_references else 1)


def data_files(index: dict) -> list[DataFile]:
    """A (validated) index's data files (version 6): the files beside its shard that a snapshot
    holds, which only the index names (never a listing)."""
    return [DataFile(f["name"], f["bytes"]) for f in index.get("files", ())]


def data_file_problems(index: dict, listing: dict[str, int], where: str) -> list[str]:
    """What the listing of its snapshot directory ``where`` (name -> size) shows wrong with the
    data files a (validated) index names: one line for each that is missing or of another size,
    as for a shard file (the snapshot is damaged, or incomplete)."""
    problems = []
    for name, size in data_files(index):
        found = listing.get(name)
        if found is None:
            problems.append(f"{where}/{name} is missing")
        elif found != size:
            problems.append(f"{where}/{name} has {found} bytes, its shard recorded {size}")
    return problems


def data_file_bytes(index: dict) -> int:
    """The bytes of a (validated) index's data files (version 6), which a snapshot stores
    besides its shard files."""
    return sum(size for _, size in data_files(index))


def referenced_dirs(storages: tuple[StorageEntry, ...]) -> list[str]:
    """The earlier snapshot directories whose shards ``storages`` (a shard's) refer to."""
    return sorted({s.ref.dir for s in storages if s.ref is not None})


def reference_to(target: "ShardReader", directory: str, file: str, i: int) -> dict:
    """The ``ref`` field of a storage stored as storage ``i`` of shard ``file`` of the earlier
    snapshot ``directory`` (read through ``target``): enough to find it and to tell that the
    target was replaced since."""
    return {"dir": directory, "file": file, "storage": i, "index_xxh3": target.index_xxh3,
            "chunks_xxh3": list(target.storages[i].chunk_digests)}


def check_reference(entry: StorageEntry, target: "ShardReader", where: str) -> int:
    """The storage number in ``target`` that reference ``entry`` (a storage with a ``ref``)
    names, after checking that it is the very storage referred to when written: same index, a
    storage that holds chunks (never another reference), same size, same chunk checksums."""
    ref = entry.ref
    assert ref is not None
    if target.index_xxh3 != ref.index_xxh3:
        raise CorruptSnapshotError(f"{where} refers to {target.path}, which was replaced since "
                                   "(its index checksum differs)")
    held = target.held_storage(ref.storage)
    if held is None:
        raise CorruptSnapshotError(f"{where} refers to storage {ref.storage} of {target.path}, "
                                   "which does not hold its bytes")
    if held.nbytes != entry.nbytes or held.chunk_digests != ref.chunks_xxh3:
        raise CorruptSnapshotError(f"{where} refers to storage {ref.storage} of {target.path}, "
                                   "which holds other bytes")
    return ref.storage


def index_budget(data_bytes: int) -> int:
    """The memory parsing the index of a shard may take (``values.json_cost``): the fixed
    allowance, and as much as the data a read of it checks, ``data_bytes``: its data area (which
    ends where the index starts) and its data files (format version 6). The writer refuses to
    write an index the reader would refuse."""
    return values.READ_ALLOWANCE + data_bytes


def checksum(*buffers) -> str:
    h = checksummer()
    for b in buffers:
        h.update(b)
    return h.hexdigest()


def checksummer() -> "xxhash.xxh3_64":
    """A running ``checksum``: ``update`` it with pieces in order, and its ``hexdigest()`` is
    ``checksum`` of them all (for a copy that checksums each piece as it goes)."""
    return xxhash.xxh3_64()


_CHECKSUM = re.compile(r"[0-9a-f]{16}")


def is_checksum(value) -> bool:
    """Whether ``value`` (read from a file) is a checksum as ``checksum`` writes it."""
    return type(value) is str and _CHECKSUM.fullmatch(value) is not None


COMPRESSIONS = (None, "zstd")
ZSTD_LEVELS = range(-(1 << 17), zstandard.MAX_COMPRESSION_LEVEL + 1)  # zstd's fastest to smallest


class ChunkEncoder:
    """Turns a chunk of raw bytes into what is stored, spending CPU only where it pays.

    Float data is byte-shuffled and only the most significant plane (sign and exponent) is
    compressed: the mantissa planes of trained weights are noise, and compressing them costs 3-4x
    the CPU for no gain. Other data is compressed whole. A chunk that
    does not shrink is stored raw, so decoding it is a plain read.
    """

    def __init__(self, compression: Optional[str], level: int = 1):
        """``compression`` and ``level`` as ``EngineOptions`` checked them: one of
        ``COMPRESSIONS``, a level in ``ZSTD_LEVELS``."""
        self.compression, self.level = compression, level
        self._zstd = zstandard.ZstdCompressor(level=level) if compression else None
        self._scratch = bytearray()

    def twin(self) -> "ChunkEncoder":
        """An encoder with the same settings and its own scratch memory (one per thread)."""
        return ChunkEncoder(self.compression, self.level)

    def encode(self, raw: memoryview, itemsize: int, is_float: bool) -> tuple[dict, list]:
        """Returns the chunk's codec fields and the buffers to write, in order."""
        if self._zstd is None or len(raw) == 0:
            return {"codec": "raw"}, [raw]
        if is_float and itemsize > 1:
            return self._encode_planes(raw, itemsize)
        packed = self._zstd.compress(raw)
        if len(packed) < len(raw):
            return {"codec": "zstd"}, [packed]
        return {"codec": "raw"}, [raw]

    def _encode_planes(self, raw: memoryview, itemsize: int) -> tuple[dict, list]:
        if len(self._scratch) < len(raw):
            self._scratch = bytearray(len(raw))
        shuffled = memoryview(self._scratch)[:len(raw)]
        filters.shuffle(raw, itemsize, shuffled)
        plane = len(raw) // itemsize
        low, top = shuffled[:plane * (itemsize - 1)], shuffled[plane * (itemsize - 1):]
        packed_top = self._zstd.compress(top)
        if len(packed_top) >= plane:
            return {"codec": "raw"}, [raw]
        planes = [["raw", plane]] * (itemsize - 1) + [["zstd", len(packed_top)]]
        return {"codec": "planes", "planes": planes}, [low, packed_top]


def _encoded(encoder: ChunkEncoder, raw: memoryview, itemsize: int,
             is_float: bool) -> tuple[dict, list, str, float]:
    """The chunk encoded and checksummed, and the CPU seconds that took this thread."""
    started = time.thread_time()
    fields, buffers = encoder.encode(raw, itemsize, is_float)
    digest = checksum(*buffers)
    return fields, buffers, digest, time.thread_time() - started


class ShardWriter:
    """Writes one shard file: ``add_storage`` for each region in order, ``flush`` once the source
    memory may change, then ``finish`` (or ``abort``). It writes into a ``ShardSink`` (from
    ``Storage.create_shard``), which it owns; a path makes a plain local file there (tests, tools).

    With ``workers``, chunks are encoded and checksummed on that many threads while the caller
    writes the ones before them, in order (zstd, the byte shuffle and the write release the GIL):
    at most ``workers`` chunks are in flight, each encoded by a ``ChunkEncoder`` of its own whose
    scratch memory holds it until written. ``add_storage`` then returns before every chunk of the
    storage is read: the memory it was given must stay unchanged until ``flush``, ``finish`` or
    ``abort`` returns."""

    def __init__(self, sink: Union[ShardSink, str, os.PathLike], encoder: ChunkEncoder,
                 chunk_bytes: int = CHUNK_BYTES, version: int = 1, workers: int = 0):
        if version not in READABLE_VERSIONS:
            raise ValueError(f"cannot write shard format version {version}")
        self.version = version
        self._encoders = [encoder] + [encoder.twin() for _ in range(workers - 1)]
        self._pool = ThreadPoolExecutor(workers, "shard-encode") if workers else None
        self._pending: collections.deque = collections.deque()  # (future, chunk list, raw size),
        # or (None, None, alignment): pad there (version 5)
        self._encoding = 0  # futures in _pending: chunks being encoded, each with its encoder
        self._submitted = 0
        self._chunk_bytes = chunk_bytes
        self._sink = sink if isinstance(sink, ShardSink) else new_shard_file(os.fspath(sink))
        self._storages: list[dict] = []
        self._offset = 0
        self.encode_cpu_s = 0.0  # CPU seconds of the chunks' checksums and compression
        try:
            self._write([_HEADER.pack(MAGIC, version, 0)])
        except BaseException:
            self.abort()
            raise

    def _write(self, buffers: list) -> None:
        self._sink.write(buffers)
        self._offset += sum(len(b) for b in buffers)

    def add_reference(self, nbytes: int, itemsize: int, is_float: bool, ref: dict) -> None:
        """Append a storage whose bytes are in an earlier committed snapshot (``reference_to``);
        nothing is written for it. Version 3 only."""
        if self.version < 3:
            raise ValueError(f"shard format version {self.version} cannot refer to snapshots")
        self._storages.append({"nbytes": nbytes, "itemsize": itemsize, "float": is_float,
                               "ref": ref})

    def add_stored(self, nbytes: int, itemsize: int, is_float: bool, chunks: Sequence[Chunk],
                   **extra) -> None:
        """Append a storage whose raw chunks were written into a data file (``chunks``, each with
        its ``file``); nothing is written here. Version 6 only."""
        if self.version < 6:
            raise ValueError(f"shard format version {self.version} keeps no data files")
        self._storages.append({"nbytes": nbytes, "itemsize": itemsize, "float": is_float,
                               **extra, "chunks": [c.to_json() for c in chunks]})

    def add_storage(self, data: memoryview, itemsize: int, is_float: bool,
                    checksums: Optional[Sequence[str]] = None, **extra) -> None:
        """Append one storage; ``extra`` fields go into its index entry (e.g. ``replica``). From
        version 5 its first chunk is aligned (``STORAGE_ALIGNMENT``); from version 7 at a
        multiple of ``DIRECT_ALIGNMENT`` where the sink then writes it from ``data``'s memory
        straight to the disk, for a storage large enough (``DIRECT_BYTES``) to be worth the
        padding. ``checksums``: those of its ``CHUNK_BYTES`` chunks, made as ``data`` was staged
        (``StagingPool.start``): where its chunks are stored raw, they are taken instead of
        reading ``data`` again to make them."""
        step = self._chunk_bytes - self._chunk_bytes % itemsize
        known = checksums if (checksums is not None and step == CHUNK_BYTES
                              and self._encoders[0].compression is None
                              and len(checksums) == -(-len(data) // step)) else None
        chunks: list[dict] = []
        self._storages.append({"nbytes": len(data), "itemsize": itemsize, "float": is_float,
                               **extra, "chunks": chunks})
        if self.version >= 5 and len(data):
            alignment = (DIRECT_ALIGNMENT if self.version >= 7 and len(data) >= DIRECT_BYTES
                         and self._sink.writes_directly(data) else STORAGE_ALIGNMENT)
            if self._pool is None:
                self._pad(alignment)
            else:  # where the previous storage ends is known once its chunks are written
                self._pending.append((None, None, alignment))
        for n, start in enumerate(range(0, len(data), step)):
            raw = data[start:start + step]
            if known is not None:
                self._add_known(chunks, raw, known[n])
                continue
            if self._pool is None:
                self._append(chunks, len(raw), *_encoded(self._encoders[0], raw, itemsize, is_float))
                continue
            while self._encoding >= len(self._encoders):
                self._write_oldest()
            encoder = self._encoders[self._submitted % len(self._encoders)]  # free: its last
            self._submitted += 1  # chunk was written by the loop above
            self._encoding += 1
            self._pending.append((self._pool.submit(_encoded, encoder, raw, itemsize, is_float),
                                  chunks, len(raw)))

    def _add_known(self, chunks: list, raw: memoryview, digest: str) -> None:
        """A raw chunk whose checksum is known: written now, or after the chunks being encoded
        before it (in order), its future done already (no encoder taken)."""
        encoded = ({"codec": "raw"}, [raw], digest, 0.0)
        if self._pool is None:
            self._append(chunks, len(raw), *encoded)
            return
        while self._encoding >= len(self._encoders):
            self._write_oldest()
        done: Future = Future()
        done.set_result(encoded)
        self._encoding += 1  # in flight, as far as _write_oldest counts (never an encoder's)
        self._pending.append((done, chunks, len(raw)))

    def _write_oldest(self) -> None:
        future, chunks, raw = self._pending.popleft()
        if future is None:
            self._pad(raw)
        else:
            self._encoding -= 1
            self._append(chunks, raw, *future.result())

    def _pad(self, alignment: int) -> None:
        """Zero bytes up to the next multiple of ``alignment``."""
        if self._offset % alignment:
            self._write([bytes(alignment - self._offset % alignment)])

    def _append(self, chunks: list, raw: int, fields: dict, buffers: list, digest: str,
                cpu_s: float) -> None:
        self.encode_cpu_s += cpu_s
        chunks.append(Chunk(self._offset, sum(len(b) for b in buffers), raw, fields["codec"],
                            digest, planes=tuple(map(tuple, fields.get("planes", ())))).to_json())
        self._write(buffers)

    def flush(self) -> None:
        """Write every chunk still being encoded, and wait for the writes still reading memory
        given to ``add_storage`` (direct I/O): afterwards none of it is read again."""
        while self._pending:
            self._write_oldest()
        self._sink.settle()

    def finish(self, meta: dict) -> tuple[int, str]:
        """Write the index (``meta`` plus the storage table) and trailer; on return the file is
        durable under its final name (``ShardSink.finish``).

        Returns the file size and the index checksum, which the manifest records.
        """
        self.flush()
        index = {"format_version": self.version, "byteorder": sys.byteorder, **meta,
                 "storages": self._storages}
        blob = json.dumps(index, separators=(",", ":"), allow_nan=False).encode()
        if values.json_cost(blob) > index_budget(self._offset + data_file_bytes(meta)):
            raise EncodingError(f"the non-tensor state is too large to read back: its index would "
                                f"take about {values.json_cost(blob) >> 20} MiB to parse, more "
                                "than a reader allows for a shard of this size. Store long lists "
                                "and large values as tensors or numpy arrays")
        digest = xxhash.xxh3_64_intdigest(blob)
        self._write([blob, _TRAILER.pack(self._offset, len(blob), digest, TRAILER_MAGIC)])
        self._sink.finish()
        self._stop_workers()
        return self._offset, f"{digest:016x}"

    def abort(self) -> None:
        """Discard the file (nothing of it stays); harmless after ``finish``. Returns once no
        worker reads the memory given to ``add_storage`` any more."""
        self._stop_workers()
        self._sink.abort()

    def _stop_workers(self) -> None:
        if self._pool is not None:
            for future, _, _ in self._pending:
                if future is not None:
                    future.cancel()
            self._pool.shutdown(wait=True)  # a chunk being encoded still reads its memory
            self._pending.clear()
            self._encoding = 0


class ShardReader:
    """Reads and verifies one shard file. Construction validates the header, trailer and index.

    It reads from a ``ShardSource`` (from ``Storage.open_shard``), which it owns and closes; a path
    opens that local file (the CLI, tests)."""

    def __init__(self, source: Union[ShardSource, str, os.PathLike],
                 expected_bytes: Optional[int] = None, expected_index_xxh3: Optional[str] = None):
        self._source = (source if isinstance(source, ShardSource)
                        else open_shard_file(os.fspath(source)))
        self.path = self._source.name
        # by data file number (None: this file): its mapping, False when it cannot map
        self._mappings: dict[Optional[int], Union[mmap.mmap, bool]] = {}
        self._prefetched: set[Optional[int]] = set()
        self._data_files: dict[int, ShardSource] = {}  # opened when first read
        self._beside: Optional[int] = None  # the bytes of its data files, once listed
        self._opening = threading.Lock()
        try:
            self.size = self._source.size
            if expected_bytes is not None and self.size != expected_bytes:
                raise CorruptSnapshotError(
                    f"{self.path} has {self.size} bytes, the manifest recorded {expected_bytes}: "
                    "the file was truncated or replaced")
            self.index, self.storages = self._read_index(expected_index_xxh3)
            self.replicas = tuple(map(Replica.of, self.index.get("replicas", ())))  # validated
            self.dtensors = tuple(map(DTensorPiece.of, self.index.get("dtensors", ())))
        except BaseException:
            self.close()
            raise

    @functools.cached_property
    def tensors(self) -> tuple[StoredTensor, ...]:
        """Its tensor table as records (``tensor_table``), checked when first asked for: a
        reader that only copies storages (the committer's, the uploader's) never pays for it."""
        return tensor_table(self.index.get("tensors"), self.path,
                            [s.nbytes for s in self.storages])

    @functools.cached_property
    def piece_tensors(self) -> frozenset[int]:
        """The numbers of the tensor records that hold a sharded tensor's local piece: read only
        through their ``$dtensor``, never named by a ``$tensor`` leaf."""
        return frozenset(d.tensor for d in self.dtensors if d.tensor is not None)

    @property
    def raw_bytes(self) -> int:
        """The tensor bytes of its storages (those it refers to included), before encoding."""
        return raw_bytes(self.storages)

    @property
    def tree(self) -> Any:
        """Its state tree as written (docs/FORMAT.md section 5), for ``format/tree.py``'s walker
        and rebuilder, which check it as they go."""
        return self.index.get("tree")

    def is_shard_of(self, step: int, rank: int, world_size: int) -> bool:
        """Whether its index says it is ``rank``'s shard of ``step`` written by ``world_size``
        ranks."""
        return (self.index.get("step"), self.index.get("rank"),
                self.index.get("world_size")) == (step, rank, world_size)

    @functools.cached_property
    def data_files(self) -> tuple[DataFile, ...]:
        """Its data files (version 6), which only its index names."""
        return tuple(data_files(self.index))

    @property
    def data_file_bytes(self) -> int:
        return data_file_bytes(self.index)

    def data_file_problems(self, listing: dict[str, int], where: str) -> list[str]:
        """``data_file_problems`` of its index against the listing of its directory."""
        return data_file_problems(self.index, listing, where)

    def held_storage(self, i: int, nbytes: Optional[int] = None,
                     itemsize: Optional[int] = None) -> Optional[StorageEntry]:
        """Storage ``i`` if it holds its bytes here (it is no reference), of ``nbytes`` bytes of
        elements of ``itemsize`` where given, else None: the one check of what a reference, read
        (``check_reference``) or about to be written (the writer's), may name."""
        s = self.storages[i] if 0 <= i < len(self.storages) else None
        if s is None or s.ref is not None or nbytes not in (None, s.nbytes) or itemsize not in (
                None, s.itemsize):
            return None
        return s

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._source.close()
        for source in self._data_files.values():
            source.close()

    def _source_of(self, number: Optional[int]) -> ShardSource:
        """The file that holds a chunk of data file ``number``: this one (None), or one of its
        data files (version 6), opened the first time and checked to have the size the index
        records."""
        if number is None:
            return self._source
        with self._opening:
            if number not in self._data_files:
                entry = self.index["files"][number]
                source = self._source.sibling(entry["name"])
                if source.size != entry["bytes"]:
                    source.close()
                    raise CorruptSnapshotError(
                        f"{source.name} has {source.size} bytes, its shard {self.path} recorded "
                        f"{entry['bytes']}: the file was truncated or replaced")
                self._data_files[number] = source
            return self._data_files[number]

    def _pread(self, n: int, offset: int) -> bytearray:
        data = bytearray(n)
        try:
            got = self._source.read_into(data, offset)
        except OSError as e:  # EIO from a failing device
            raise CorruptSnapshotError(f"{self.path}: cannot read at offset {offset}: {e.strerror}") from e
        if got != n:
            raise CorruptSnapshotError(f"{self.path}: short read at offset {offset} (truncated?)")
        return data

    def check_step(self, step: int) -> None:
        """CorruptSnapshotError unless this shard holds ``step``, the step of the snapshot it was
        found in (by the manifest, or by its directory's name): a shard moved between
        snapshots."""
        if self.index.get("step") != step:
            raise CorruptSnapshotError(f"{self.path} holds step "
                                       f"{short_repr(self.index.get('step'), 40)}, not the step "
                                       f"{step} of the snapshot it is in")

    def _read_index(self, expected_xxh3: Optional[str]) -> tuple[dict, tuple[StorageEntry, ...]]:
        if self.size < HEADER_SIZE + TRAILER_SIZE:
            raise CorruptSnapshotError(f"{self.path} is too short ({self.size} bytes) to be a shard")
        magic, version, reserved = _HEADER.unpack(self._pread(HEADER_SIZE, 0))
        if magic != MAGIC:
            raise CorruptSnapshotError(f"{self.path} is not an async_ckpt shard (bad magic)")
        if reserved != 0:
            raise CorruptSnapshotError(f"{self.path}: the header's reserved field is not zero")
        if version not in READABLE_VERSIONS:
            raise UnsupportedFormatError(
                f"{self.path} is format version {version}; this async_ckpt reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}. Install the async_ckpt release that "
                "wrote it")
        self.version = version
        offset, length, digest, tmagic = _TRAILER.unpack(
            self._pread(TRAILER_SIZE, self.size - TRAILER_SIZE))
        if tmagic != TRAILER_MAGIC:
            raise CorruptSnapshotError(f"{self.path} has no trailer: it was cut short while written")
        if length > MAX_INDEX_BYTES or offset < HEADER_SIZE or offset + length + TRAILER_SIZE != self.size:
            raise CorruptSnapshotError(f"{self.path}: the trailer points outside the file")
        if values.JSON_BYTES_PER_BYTE * length > self._index_budget(  # what json_cost counts
                offset, values.JSON_BYTES_PER_BYTE * length):  # at least
            raise CorruptSnapshotError(f"{self.path}: its index of {length} bytes is larger "
                                       f"than a shard of {self.size} bytes (and its data files) "
                                       "has (crafted?)")
        blob = self._pread(length, offset)
        self.index_xxh3 = f"{digest:016x}"
        if xxhash.xxh3_64_intdigest(blob) != digest or (
                expected_xxh3 is not None and f"{digest:016x}" != expected_xxh3):
            raise ChecksumMismatchError(f"{self.path}: the index checksum does not match")
        try:
            index = values.parse_json(blob, self._index_budget(offset, values.json_cost(blob)))
        except values.JSONTooCostly as e:
            raise CorruptSnapshotError(f"{self.path}: the index is refused: {e}") from e
        except (ValueError, RecursionError) as e:
            raise CorruptSnapshotError(f"{self.path}: the index is not valid JSON") from e
        return index, _validate_index(index, self.path, data_end=offset, version=self.version)

    def _index_budget(self, data_end: int, cost: int) -> int:
        """The budget of the index (``index_budget``), whose parse costs ``cost``: its data area
        ``[16, data_end)``, and where that is not enough, from version 6, its rank's data files
        as the directory lists them (the index that names them is not read yet): a bound of
        sizes, listed once and only for an index that needs it."""
        budget = index_budget(data_end)
        rank = SHARD_FILE.fullmatch(posixpath.basename(self.path))
        if cost <= budget or self.version < 6 or rank is None:
            return budget
        if self._beside is None:
            self._beside = sum(size for _, size in data_files_of(int(rank.group(1)),
                                                                 self._source.siblings()))
        return index_budget(data_end + self._beside)

    def read_storage(self, i: int, out) -> None:
        """Fill ``out`` (a writable buffer of the storage's size) with storage ``i``, verified."""
        for read in self.storage_reads(i, out):
            read()

    def storage_reads(self, i: int, out) -> list[Callable[[], None]]:
        """One read per chunk of storage ``i`` into its part of ``out`` (a writable buffer of the
        storage's size), each verified and decoded, each raising for its chunk's damage;
        independent, so callers may run them on several threads (reading, checksums and zstd
        all release the GIL: a compressed storage decodes on every core)."""
        storage = self.storages[i]
        if storage.ref is not None:  # the caller follows it (format/references.py)
            raise CorruptSnapshotError(f"{self.path}: storage {i} is a reference, not bytes")
        view = memoryview(out).cast("B")
        if len(view) != storage.nbytes:
            raise ValueError(f"buffer has {len(view)} bytes, storage {i} has {storage.nbytes}")
        reads, position = [], 0
        for chunk_no, chunk in enumerate(storage.chunks):
            reads.append(functools.partial(
                self._read_chunk, chunk, storage.itemsize,
                view[position:position + chunk.raw], f"storage {i} chunk {chunk_no}"))
            position += chunk.raw
        return reads

    def storage_pieces(self, i: int) -> Iterator[memoryview]:
        """Storage ``i``'s bytes chunk by chunk, each verified and decoded into one reused buffer
        (valid until the next piece): to copy a storage elsewhere in memory of one chunk."""
        storage = self.storages[i]
        if storage.ref is not None:  # the caller follows it (format/references.py)
            raise CorruptSnapshotError(f"{self.path}: storage {i} is a reference, not bytes")
        buffer = memoryview(bytearray(storage.largest_chunk))
        for chunk_no, chunk in enumerate(storage.chunks):
            piece = buffer[:chunk.raw]
            self._read_chunk(chunk, storage.itemsize, piece, f"storage {i} chunk {chunk_no}")
            yield piece

    def read_range(self, i: int, start: int, stop: int, out,
                   cache: Optional["ChunkCache"] = None) -> None:
        """Fill ``out`` (``stop - start`` writable bytes) with bytes ``[start, stop)`` of storage
        ``i``, reading only the chunks that hold some of them, each verified whole (a checksum
        covers a chunk). A chunk needed only in part is decoded into ``cache``, where the next
        call finds it: reads of consecutive ranges decode each chunk once. Without a cache, the
        needed part of a raw chunk is read straight into ``out`` (the rest only to be checked)."""
        storage = self.storages[i]
        if storage.ref is not None:  # the caller follows it (format/references.py)
            raise CorruptSnapshotError(f"{self.path}: storage {i} is a reference, not bytes")
        view = memoryview(out).cast("B")
        if not (0 <= start <= stop <= storage.nbytes and len(view) == stop - start):
            raise ValueError(f"bytes [{start}, {stop}) of storage {i} do not fit a buffer of "
                             f"{len(view)} bytes")
        position = 0
        for chunk_no, chunk in enumerate(storage.chunks):
            lo, hi = position, position + chunk.raw
            position = hi
            if hi <= start:
                continue
            if lo >= stop:
                break
            where = f"storage {i} chunk {chunk_no}"
            if start <= lo and hi <= stop:
                self._read_chunk(chunk, storage.itemsize, view[lo - start:hi - start], where)
                continue
            a, b = max(lo, start), min(hi, stop)
            if cache is None and chunk.codec == "raw" and chunk.stored == chunk.raw:
                self._read_chunk_part(chunk, view[a - start:b - start], a - lo, where)
                continue
            key = (id(self), i, chunk_no)
            data = cache.get(key) if cache is not None else None
            if data is None:
                data = memoryview(bytearray(chunk.raw))
                self._read_chunk(chunk, storage.itemsize, data, where)
                if cache is not None:
                    cache.put(key, data)
            view[a - start:b - start] = data[a - lo:b - lo]

    def mapped_storage(self, i: int, alignment: int) -> Optional[memoryview]:
        """Storage ``i`` as a view of the file's private mapping, not yet verified (see
        ``mapped_checks``), or None when it cannot be mapped: the source does not map, a chunk is
        encoded, or the storage does not start at a multiple of ``alignment`` (the largest
        alignment of the dtypes that view it: tensors over it would be misaligned, which torch's
        kernels do not expect; an older or crafted file).

        A page-cache hit costs no copy here: the checksums read the cached pages in place, and
        the caller copies them once, into the tensors that hold the state."""
        storage = self.storages[i]
        chunks = storage.chunks
        if (not chunks or any(c.codec != "raw" for c in chunks)
                or chunks[0].offset % alignment):
            return None
        mapping = self._map(chunks[0].file)  # a storage's chunks are in one file, in a row
        if mapping is None:
            return None
        start = chunks[0].offset
        return memoryview(mapping)[start:start + storage.nbytes]

    def mapped_checks(self, i: int) -> list[Callable[[], None]]:
        """One check per chunk of mapped storage ``i`` (``mapped_storage``), each raising
        ChecksumMismatchError for a damaged chunk; independent, so callers may run them on
        several threads (the first touch of mapped pages is what costs, and it parallelises).
        The whole file is asked to be read ahead first, for a cold cache."""
        chunks = self.storages[i].chunks
        number = chunks[0].file if chunks else None
        mapping = self._map(number)
        if number not in self._prefetched:  # once, for a file's whole data area: one call costs
            self._prefetched.add(number)  # as much as many
            if number is None:
                _prefetch(mapping, HEADER_SIZE, self.size - TRAILER_SIZE - HEADER_SIZE)
            else:
                _prefetch(mapping, 0, self.index["files"][number]["bytes"])
        view = memoryview(mapping)

        def check(chunk_no: int, chunk: Chunk) -> None:
            if checksum(view[chunk.offset:chunk.offset + chunk.stored]) != chunk.xxh3:
                raise ChecksumMismatchError(f"{self._source_of(chunk.file).name}: storage {i} chunk "
                                            f"{chunk_no} fails its checksum (bytes damaged on "
                                            "disk)")

        return [functools.partial(check, n, c) for n, c in enumerate(chunks)]

    def _map(self, number: Optional[int]) -> Optional[mmap.mmap]:
        """The mapping of this file (``number`` None) or of data file ``number``; None when it
        cannot be mapped, or is a data file with other links: a framework's file, which a
        program may truncate while it is read, and a mapping would then kill the process
        (SIGBUS) where a read into memory raises for the short read."""
        if number not in self._mappings:
            source = self._source_of(number)
            if number is not None and source.linked:
                self._mappings[number] = False
                return None
            try:
                self._mappings[number] = source.map() or False
            except (OSError, ValueError) as e:  # a file system that cannot map: read instead
                log.debug("cannot map %s (%s); reading it", source.name, e)
                self._mappings[number] = False
        return self._mappings[number] or None

    def _read_chunk(self, chunk: Chunk, itemsize: int, target: Optional[memoryview],
                    where: str) -> None:
        """Chunk ``chunk``, verified and decoded into ``target`` (``chunk.raw`` bytes), or with
        ``target`` None only verified and decoded into scratch of at most ``DECODE_PIECE`` bytes
        (``verify``): no buffer the size of the chunk."""
        if chunk.codec == "raw" and target is None:
            self._check_raw(chunk, where)
            return
        source = self._source_of(chunk.file)
        if chunk.codec == "raw":
            stored = target
            try:
                got = source.read_into(stored, chunk.offset)
            except OSError as e:
                raise CorruptSnapshotError(f"{source.name}: cannot read {where}: {e.strerror}") from e
            if got != chunk.stored:
                raise CorruptSnapshotError(f"{source.name}: short read of {where}")
        else:
            stored = self._pread(chunk.stored, chunk.offset)
        if checksum(stored) != chunk.xxh3:
            raise ChecksumMismatchError(
                f"{source.name}: {where} fails its checksum (bytes damaged on disk)")
        if chunk.codec == "zstd":
            _unzstd_into(stored, chunk.raw, target, self.path, where)
        elif chunk.codec == "planes":
            self._decode_planes(chunk, itemsize, stored, target, where)

    def _check_raw(self, chunk: Chunk, where: str) -> None:
        """The checksum of a raw chunk, read in pieces of at most ``DECODE_PIECE`` bytes."""
        source = self._source_of(chunk.file)
        h, scratch = xxhash.xxh3_64(), memoryview(bytearray(min(chunk.raw, DECODE_PIECE)))
        for at in range(0, chunk.raw, len(scratch)):
            piece = scratch[:min(len(scratch), chunk.raw - at)]
            try:
                got = source.read_into(piece, chunk.offset + at)
            except OSError as e:
                raise CorruptSnapshotError(f"{source.name}: cannot read {where}: {e.strerror}") from e
            if got != len(piece):
                raise CorruptSnapshotError(f"{source.name}: short read of {where}")
            h.update(piece)
        if h.hexdigest() != chunk.xxh3:
            raise ChecksumMismatchError(
                f"{source.name}: {where} fails its checksum (bytes damaged on disk)")

    def _read_chunk_part(self, chunk: Chunk, part: memoryview, skip: int, where: str) -> None:
        """Bytes ``[skip, skip + len(part))`` of a raw chunk into ``part``, the chunk verified
        whole: the bytes around them are read into scratch for the checksum."""
        source = self._source_of(chunk.file)
        head, tail = bytearray(skip), bytearray(chunk.raw - skip - len(part))
        for buffer, at in ((head, 0), (part, skip), (tail, skip + len(part))):
            try:
                got = source.read_into(buffer, chunk.offset + at) if len(buffer) else 0
            except OSError as e:
                raise CorruptSnapshotError(f"{source.name}: cannot read {where}: {e.strerror}") from e
            if got != len(buffer):
                raise CorruptSnapshotError(f"{source.name}: short read of {where}")
        if checksum(head, part, tail) != chunk.xxh3:
            raise ChecksumMismatchError(
                f"{source.name}: {where} fails its checksum (bytes damaged on disk)")

    def _decode_planes(self, chunk: Chunk, itemsize: int, stored: bytes,
                       target: Optional[memoryview], where: str) -> None:
        """Un-shuffle a planes chunk into ``target`` (None: check it decodes) a block of elements
        at a time: each plane is read (or zstd-decoded) block by block into scratch of at most
        ``DECODE_PIECE`` bytes, never whole."""
        plane = chunk.raw // itemsize
        src, sources = memoryview(stored), []
        for codec, length in chunk.planes:
            part, src = src[:length], src[length:]
            sources.append(part if codec == "raw" else _ZstdFrame(part, plane, self.path, where))
        block = max(1, DECODE_PIECE // itemsize)
        scratch = memoryview(bytearray(min(plane, block) * itemsize))
        out = memoryview(bytearray(len(scratch))) if target is None else None
        for first in range(0, plane, block):
            n = min(block, plane - first)
            for p, source in enumerate(sources):
                piece = scratch[p * n:(p + 1) * n]
                if isinstance(source, _ZstdFrame):
                    source.fill(piece)
                else:
                    piece[:] = source[first:first + n]
            dst = out[:n * itemsize] if target is None else target[first * itemsize:(first + n) * itemsize]
            filters.unshuffle(scratch[:n * itemsize], itemsize, dst)
        for source in sources:
            if isinstance(source, _ZstdFrame):
                source.finish()

    def verify(self) -> list[str]:
        """Read every chunk stored here and return one line per damaged chunk, or padding that
        is not zero (empty when intact). References to earlier snapshots are not followed (see
        format/references.py)."""
        return ([p for i in range(len(self.storages)) for p in self.verify_storage(i)]
                + self._padding_problems())

    def _padding_problems(self) -> list[str]:
        """One line per storage whose alignment padding (version 5) is not zero bytes: no
        checksum covers it, so this is the one check that it holds nothing."""
        position, problems = HEADER_SIZE, []
        for i, storage in enumerate(self.storages):
            chunks = storage.chunks
            if not chunks or chunks[0].file is not None:  # a data file's other bytes are its format's
                continue
            gap = chunks[0].offset - position
            if gap and any(self._pread(gap, position)):
                problems.append(f"{self.path}: the {gap} bytes of padding before storage {i} are "
                                "not zero (damaged on disk, or written by something else)")
            position = chunks[-1].offset + chunks[-1].stored
        return problems

    def verify_storage(self, i: int) -> list[str]:
        """One line per damaged chunk of storage ``i`` (none for a reference)."""
        storage, problems = self.storages[i], []
        for j, chunk in enumerate(storage.chunks):
            try:
                self._read_chunk(chunk, storage.itemsize, None, f"storage {i} chunk {j}")
            except CorruptSnapshotError as e:
                problems.append(str(e))
        return problems


class ChunkCache:
    """The last chunk decoded for a partial read (``ShardReader.read_range``): one chunk, so its
    memory stays bounded by the largest chunk."""

    def __init__(self):
        self._key, self._data = None, None

    def get(self, key) -> Optional[memoryview]:
        return self._data if key == self._key else None

    def put(self, key, data: memoryview) -> None:
        self._key, self._data = key, data


def _prefetch(mapping: mmap.mmap, start: int, length: int) -> None:
    """Ask the kernel to read a mapped range ahead, all of it, as the checksums will: from a cold
    cache the faults then find pages already read, in large sequential requests."""
    aligned = start - start % mmap.PAGESIZE
    try:
        mapping.madvise(mmap.MADV_WILLNEED, aligned, length + start - aligned)
    except (OSError, ValueError, AttributeError):  # advice only: where refused, faults read
        pass


class _ZstdFrame:
    """The one zstd frame ``data`` that must hold exactly ``size`` bytes, decoded piece by piece
    into buffers the caller gives (``fill``), so that no buffer of the decoded size is made.

    The frame must declare its content size (our writer always does) and declare ``size``: a
    frame may claim any size, and a decoder trusting the claim allocates it. Nothing may follow
    the frame (another frame, skippable or empty, included). ``finish`` checks that every byte was
    taken and the frame ended there; a frame that is cut short or decodes to more is damage."""

    def __init__(self, data, size: int, path: str, where: str):
        self.path, self.where, self.size, self.done = path, where, size, 0
        try:
            declared = zstandard.frame_content_size(data)
            if declared != size:
                raise CorruptSnapshotError(
                    f"{path}: {where} is a zstd frame declaring {declared} bytes, the index {size}")
            if _frame_length(data) != len(data):
                raise self._not_one_frame()
            self._reader = zstandard.ZstdDecompressor().stream_reader(
                data, read_size=DECODE_PIECE, read_across_frames=False)
        except zstandard.ZstdError as e:
            raise CorruptSnapshotError(f"{path}: {where} does not decompress: {e}") from e

    def _not_one_frame(self) -> CorruptSnapshotError:
        return CorruptSnapshotError(
            f"{self.path}: {self.where} is not one zstd frame of exactly {self.size} bytes")

    def fill(self, out: memoryview) -> None:
        """Decode the next ``len(out)`` bytes straight into ``out``."""
        got = 0
        try:
            while got < len(out):
                n = self._reader.readinto(out[got:])
                if not n:
                    raise self._not_one_frame()
                got += n
        except zstandard.ZstdError as e:
            raise CorruptSnapshotError(f"{self.path}: {self.where} does not decompress: {e}") from e
        self.done += got

    def finish(self) -> None:
        try:
            more = self._reader.readinto(bytearray(1))
        except zstandard.ZstdError as e:
            raise CorruptSnapshotError(f"{self.path}: {self.where} does not decompress: {e}") from e
        if more or self.done != self.size:
            raise self._not_one_frame()


def _frame_length(data) -> int:
    """The length of the zstd frame at the start of ``data`` by its block headers (RFC 8878
    3.1.1), -1 when they run past the end: the frame must be all of ``data``, and a decoder
    stops at its end without saying how much it read."""
    view = memoryview(data)
    position, has_checksum = zstandard.frame_header_size(data), view[4] & 4
    while position + 3 <= len(view):
        header = int.from_bytes(view[position:position + 3], "little")
        position += 3 + (1 if (header >> 1) & 3 == 1 else header >> 3)  # an RLE block holds 1
        if header & 1:  # the last block
            return position + (4 if has_checksum else 0)
    return -1


def _unzstd_into(data, size: int, target: Optional[memoryview], path: str, where: str) -> None:
    """Decode one zstd frame that must hold exactly ``size`` bytes straight into ``target``, or
    (None) into scratch of at most ``DECODE_PIECE`` bytes, to check that it decodes."""
    frame = _ZstdFrame(data, size, path, where)
    if target is not None:
        frame.fill(target)
    else:
        scratch = memoryview(bytearray(min(size, DECODE_PIECE)))
        for at in range(0, size, len(scratch)):
            frame.fill(scratch[:min(len(scratch), size - at)])
    frame.finish()


def _validate_index(index, path: str, data_end: int,
                    version: int) -> tuple[StorageEntry, ...]:
    """Check the index's structure and that its chunks tile the data area exactly; return its
    storage table as records, built here only, so that a record describes a valid storage."""

    def bad(why: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{path}: invalid index: {why}")

    if not isinstance(index, dict):
        raise bad("not an object")
    if type(index.get("format_version")) is not int or index["format_version"] != version:
        raise UnsupportedFormatError(
            f"{path}: index format version {index.get('format_version')!r}, the header says {version}")
    if index.get("byteorder") != sys.byteorder:
        raise UnsupportedFormatError(
            f"{path} was written on a {index.get('byteorder')}-endian machine; this one is "
            f"{sys.byteorder}-endian")
    replicas = index.get("replicas", [])
    if not (isinstance(replicas, list) and all(
            isinstance(r, dict) and isinstance(r.get("entry"), str) and is_int(r.get("owner"))
            and is_int(r.get("nbytes")) and isinstance(r.get("xxh3"), str) for r in replicas)):
        raise bad("'replicas' is malformed")
    if "dtensors" in index:
        if version < 4:
            raise bad("'dtensors' needs format version 4")
        _validate_dtensors(index["dtensors"], bad)
    files = _validated_data_files(index, version, bad)
    in_files: list[list[tuple[int, int, int]]] = [[] for _ in files]  # (start, end, storage)
    storages = index.get("storages")
    if not isinstance(storages, list):
        raise bad("'storages' is not a list")
    position = HEADER_SIZE
    for i, s in enumerate(storages):
        if not (isinstance(s, dict) and is_int(s.get("nbytes")) and is_int(s.get("itemsize"), 1, 16)
                and ("replica" not in s or (version >= 2 and is_int(s["replica"])))):
            raise bad(f"storage {i} is malformed")
        if "ref" in s:
            if version < 3 or "chunks" in s:
                raise bad(f"storage {i}: a reference needs format version 3 and holds no chunks")
            _validate_reference(s["ref"], bad, f"storage {i}")
            continue
        if not isinstance(s.get("chunks"), list):
            raise bad(f"storage {i} is malformed")
        if s["chunks"] and isinstance(s["chunks"][0], dict) and "file" in s["chunks"][0]:
            _check_stored_elsewhere(s, i, files, in_files, bad)
            continue
        total = 0
        for j, c in enumerate(s["chunks"]):
            if not _is_chunk(c) or "file" in c:
                raise bad(f"storage {i} chunk {j} is malformed")
            if j == 0 and version >= 5:  # the one place padding may be
                position = _first_chunk_position(position, c["offset"], version)
            if c["offset"] != position or c["offset"] + c["stored"] > data_end:
                raise bad(f"storage {i} chunk {j} is not where the previous chunk ended"
                          + (" (or at the next aligned offset, for a storage's first chunk)"
                             if version >= 5 and j == 0 else ""))
            if c["codec"] == "raw" and c["stored"] != c["raw"]:
                raise bad(f"storage {i} chunk {j}: raw chunk with stored != raw")
            if c["codec"] == "zstd" and c["stored"] == 0:
                raise bad(f"storage {i} chunk {j}: an empty zstd frame")
            if c["codec"] == "planes":
                _validate_planes(c, s["itemsize"], bad, f"storage {i} chunk {j}")
            position += c["stored"]
            total += c["raw"]
        if total != s["nbytes"]:
            raise bad(f"storage {i}: chunks hold {total} bytes, the storage {s['nbytes']}")
    if position != data_end:
        raise bad(f"{data_end - position} bytes between the last chunk and the index")
    for number, ranges in enumerate(in_files):
        ranges.sort()
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
            if start < end:
                raise bad(f"storages {first} and {second} overlap in data file {number}")
    return tuple(map(StorageEntry.of, storages))


def _first_chunk_position(end: int, offset: int, version: int) -> int:
    """Where a storage's first chunk must be when the storage before it ended at ``end``: the
    next multiple of ``STORAGE_ALIGNMENT`` (version 5), or from version 7 the next multiple of
    ``DIRECT_ALIGNMENT`` where the writer chose that (``offset``, the chunk's, says which)."""
    if version >= 7 and offset == end + -end % DIRECT_ALIGNMENT:
        return offset
    return end + -end % STORAGE_ALIGNMENT


def _is_chunk(c) -> bool:
    return (isinstance(c, dict) and is_int(c.get("offset")) and is_int(c.get("stored"))
            and is_int(c.get("raw"), 1, MAX_CHUNK_BYTES) and c.get("codec") in CODECS
            and isinstance(c.get("xxh3"), str))


def _validated_data_files(index: dict, version: int, bad) -> list[dict]:
    """The index's data files (version 6): each named as ``DATA_FILE`` for this shard's rank and
    its place in the list, before the name becomes a path."""
    if "files" not in index:
        return []
    files, rank = index["files"], index.get("rank")
    if version < 6:
        raise bad("'files' needs format version 6")
    if not (isinstance(files, list) and 0 < len(files) <= MAX_DATA_FILES and is_int(rank)
            and all(isinstance(f, dict) and f.keys() == {"name", "bytes"} and is_int(f["bytes"])
                    and type(f["name"]) is str for f in files)):
        raise bad("'files' is malformed")
    for number, f in enumerate(files):
        match = DATA_FILE.fullmatch(f["name"])
        if match is None or (int(match.group(1)), int(match.group(2))) != (rank, number):
            raise bad(f"data file {number} is not named as rank {rank}'s data file {number}: "
                      f"{short_repr(f['name'], 60)}")
    return files


def _check_stored_elsewhere(s: dict, i: int, files: list[dict], in_files: list, bad) -> None:
    """A storage kept in a data file (version 6): raw chunks, all in that file, one after the
    other, inside it; its byte range noted in ``in_files`` for the overlap check."""
    number, total, start = s["chunks"][0]["file"], 0, s["chunks"][0].get("offset")
    if not (type(number) is int and 0 <= number < len(files)):
        raise bad(f"storage {i} names no data file of the shard")
    position = start
    for j, c in enumerate(s["chunks"]):
        if not (_is_chunk(c) and c.get("file") == number and c["codec"] == "raw"
                and c["stored"] == c["raw"] and c["offset"] == position):
            raise bad(f"storage {i} chunk {j} is malformed, or not where the previous one ended "
                      "in the same data file")
        position += c["stored"]
        total += c["raw"]
    if position > files[number]["bytes"]:
        raise bad(f"storage {i} ends past the end of data file {number}")
    if total != s["nbytes"]:
        raise bad(f"storage {i}: chunks hold {total} bytes, the storage {s['nbytes']}")
    in_files[number].append((start, position, i))


_DTENSOR_FIELDS = {"key", "dtype", "global_shape", "offset", "tensor"}
MAX_KEY_CHARS = 1 << 16
MAX_DIMS = 64  # torch's limit on tensor dimensions
MAX_EXTENT = 2**62  # sizes, strides and element counts stay clear of int64 overflow


def _validate_dtensors(dtensors, bad) -> None:
    """The sharded-tensor table (docs/FORMAT.md 3.6): each record's fields and ranges, keys and
    tensor numbers distinct. Whether the pieces tile their tensors is the reader's to check, with
    every rank's table in hand."""
    if not isinstance(dtensors, list):
        raise bad("'dtensors' is not a list")
    keys, tensors = set(), set()
    for k, d in enumerate(dtensors):
        if not (isinstance(d, dict) and d.keys() == _DTENSOR_FIELDS
                and type(d["key"]) is str and 0 < len(d["key"]) <= MAX_KEY_CHARS
                and type(d["dtype"]) is str and len(d["dtype"]) <= 40
                and type(d["global_shape"]) is list and type(d["offset"]) is list
                and len(d["global_shape"]) == len(d["offset"]) <= MAX_DIMS
                and all(type(n) is int and 0 <= n <= MAX_EXTENT for n in d["global_shape"])
                and all(type(o) is int and 0 <= o <= n for o, n in zip(d["offset"],
                                                                      d["global_shape"]))
                and (d["tensor"] is None or (type(d["tensor"]) is int and d["tensor"] >= 0))):
            raise bad(f"sharded tensor {k} is malformed")
        if d["key"] in keys or (d["tensor"] is not None and d["tensor"] in tensors):
            raise bad(f"sharded tensor {k} repeats a key or a tensor of another")
        keys.add(d["key"])
        if d["tensor"] is not None:
            tensors.add(d["tensor"])


def tensor_table(records: Any, where: str, sizes: Sequence[int]) -> tuple[StoredTensor, ...]:
    """The tensor table ``records`` (docs/FORMAT.md 3.5) as records, each checked: a dtype a
    saved tensor may have, at most 64 dimensions, sizes and strides in [0, 2^62], at most 2^62
    elements, an offset at a multiple of the element size, a storage where it has elements, and
    the view inside that storage when it is one of this table's (``sizes``: their bytes; another
    rank's is checked where it is read). The one check of a tensor record, for a shard's table
    (``ShardReader.tensors``) and a keeper's hold (``read_held``) alike."""
    if not isinstance(records, list):
        raise CorruptSnapshotError(f"{where}: the index has no tensor table")
    return tuple(_stored_tensor(r, where, i, sizes) for i, r in enumerate(records))


def _stored_tensor(r: Any, where: str, i: int, sizes: Sequence[int]) -> StoredTensor:
    def bad(why: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{where}: tensor {i}: {why}")

    if not isinstance(r, dict):
        raise bad("not an object")
    dtype, shape, stride = r.get("dtype"), r.get("shape"), r.get("stride")
    itemsize = ITEMSIZES.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise bad(f"unknown dtype {str(dtype)[:40]!r}")
    if not (type(shape) is list and type(stride) is list and len(shape) == len(stride) <= MAX_DIMS
            and all(type(n) is int and 0 <= n <= MAX_EXTENT for n in shape + stride)):
        raise bad("malformed shape or stride")
    elements = math.prod(shape)
    if elements > MAX_EXTENT:
        raise bad("more elements than any storage can hold")
    storage, offset, rank = r.get("storage"), r.get("offset"), r.get("rank")
    if not ((storage is None or is_int(storage)) and is_int(offset)
            and ("rank" not in r or is_int(rank)) and (storage is not None or not elements)):
        raise bad("bad storage reference")
    if offset % itemsize:
        raise bad(f"its offset {offset} is not a multiple of its element size")
    if rank is None and storage is not None:
        if storage >= len(sizes):
            raise bad(f"refers to storage {storage}, which does not exist")
        if offset + span_bytes(shape, stride, itemsize) > sizes[storage]:
            raise bad("view lies outside its storage")
    return StoredTensor(storage, offset, dtype, tuple(shape), tuple(stride), rank)


_REF_FIELDS = {"dir", "file", "storage", "index_xxh3", "chunks_xxh3"}


def _validate_reference(ref, bad, where: str) -> None:
    """A reference's fields: names that match docs/FORMAT.md section 1 before anything uses them
    as paths, a storage number, checksums."""
    if not (isinstance(ref, dict) and ref.keys() == _REF_FIELDS and type(ref["storage"]) is int
            and ref["storage"] >= 0 and is_checksum(ref["index_xxh3"])
            and type(ref["chunks_xxh3"]) is list and all(map(is_checksum, ref["chunks_xxh3"]))):
        raise bad(f"{where}: malformed reference")
    checked_name(ref["dir"], SNAPSHOT_DIR, f"{where}: referenced directory", CorruptSnapshotError)
    checked_name(ref["file"], SHARD_FILE, f"{where}: referenced shard", CorruptSnapshotError)


def _validate_planes(chunk: dict, itemsize: int, bad, where: str) -> None:
    planes = chunk.get("planes")
    if chunk["raw"] % itemsize or not isinstance(planes, list) or len(planes) != itemsize:
        raise bad(f"{where}: plane table does not match the element size")
    plane = chunk["raw"] // itemsize
    total = 0
    for p in planes:
        if not (isinstance(p, list) and len(p) == 2 and p[0] in ("raw", "zstd")
                and type(p[1]) is int and p[1] >= 0) or (p[0] == "raw" and p[1] != plane):
            raise bad(f"{where}: malformed plane {p!r}")
        total += p[1]
    if total != chunk["stored"]:
        raise bad(f"{where}: planes hold {total} bytes, the chunk {chunk['stored']}")
