"""Typed, immutable records of a shard index's tables (docs/FORMAT.md 3.4 to 3.7).

The index is JSON; ``shard._validate_index`` checks it and builds these records as it goes (the
tensor table: ``shard.tensor_table``, when first asked for), so a record that exists describes
a valid part of a file that was checked. Readers outside
format/ use the records, never the parsed dicts: the keys of the file are known here and in the
validator only. The write side builds the same records and writes their ``to_json`` (the keys
in the order they always had), so the bytes on disk are exactly what they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional

from .layout import span_bytes

ITEMSIZES = {name: size for size, names in {
    1: "bool int8 uint8 bits8 bits1x8 bits2x4 bits4x2 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
       "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2",
    2: "bfloat16 float16 int16 uint16 bits16",
    4: "float32 int32 uint32 complex32",
    8: "float64 int64 uint64 complex64",
    16: "complex128"}.items() for name in names.split()}
"""The dtypes a saved tensor may have (``tensors.DTYPES``, checked by a test) and their element
sizes, known here without torch (the writer and the keeper do not import it): a tensor record of
another dtype is damage."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk: ``stored`` bytes at ``offset`` of the shard (or of data file ``file``,
    version 6), ``raw`` bytes once decoded by ``codec``; ``planes`` the byte planes' codecs and
    lengths of a ``planes`` chunk."""
    offset: int
    stored: int
    raw: int
    codec: str
    xxh3: str
    file: Optional[int] = None
    planes: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, c: dict) -> "Chunk":
        return cls(c["offset"], c["stored"], c["raw"], c["codec"], c["xxh3"], c.get("file"),
                   tuple((codec, length) for codec, length in c.get("planes", ())))

    def to_json(self) -> dict:
        """The index's form of it, as ``of`` reads it (keys in the order shards have them)."""
        return {"offset": self.offset, "stored": self.stored, "raw": self.raw, "xxh3": self.xxh3,
                "codec": self.codec,
                **({"planes": [[codec, n] for codec, n in self.planes]} if self.planes else {}),
                **({} if self.file is None else {"file": self.file})}


@dataclass(frozen=True, slots=True)
class Reference:
    """Where a storage of an incremental snapshot keeps its bytes: storage ``storage`` of shard
    ``file`` of the earlier snapshot ``dir``, whose index and chunks had these checksums."""
    dir: str
    file: str
    storage: int
    index_xxh3: str
    chunks_xxh3: tuple[str, ...]

    @classmethod
    def of(cls, r: dict) -> "Reference":
        return cls(r["dir"], r["file"], r["storage"], r["index_xxh3"], tuple(r["chunks_xxh3"]))


@dataclass(frozen=True, slots=True)
class StorageEntry:
    """One storage: ``nbytes`` bytes of elements of ``itemsize``, held in ``chunks`` here or,
    with ``ref``, in an earlier snapshot; ``replica`` the number of a replicated storage."""
    nbytes: int
    itemsize: int
    chunks: tuple[Chunk, ...] = ()
    ref: Optional[Reference] = None
    replica: Optional[int] = None

    @classmethod
    def of(cls, s: dict) -> "StorageEntry":
        ref = s.get("ref")
        return cls(s["nbytes"], s["itemsize"], tuple(map(Chunk.of, s.get("chunks", ()))),
                   None if ref is None else Reference.of(ref), s.get("replica"))

    @property
    def chunk_digests(self) -> tuple[str, ...]:
        """The checksums of the chunks holding its bytes, here or where it refers to."""
        return self.ref.chunks_xxh3 if self.ref is not None else tuple(c.xxh3 for c in self.chunks)

    @property
    def stored_bytes(self) -> int:
        """The bytes its chunks take here (none for a reference)."""
        return sum(c.stored for c in self.chunks)

    @property
    def largest_chunk(self) -> int:
        return max((c.raw for c in self.chunks), default=0)


def raw_bytes(storages: Iterable[StorageEntry]) -> int:
    """The tensor bytes of ``storages`` before encoding: what the manifest records as a
    snapshot's ``raw_bytes``, summed here only."""
    return sum(s.nbytes for s in storages)


@dataclass(frozen=True, slots=True)
class Replica:
    """A replicated entry's digest in the index (``replicas``): its ``nbytes`` bytes, stored in
    rank ``owner``'s shard, had checksum ``xxh3`` on the rank that wrote the index; the
    committer checks that every rank's agree."""
    entry: str
    owner: int
    nbytes: int
    xxh3: str

    @classmethod
    def of(cls, r: dict) -> "Replica":
        return cls(r["entry"], r["owner"], r["nbytes"], r["xxh3"])

    def to_json(self) -> dict:
        """The index's form of it, as ``of`` reads it."""
        return {"entry": self.entry, "owner": self.owner, "nbytes": self.nbytes,
                "xxh3": self.xxh3}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A record of the tensor table (``tensors``, docs/FORMAT.md 3.5): a view of ``dtype``,
    ``shape`` and ``stride`` (in elements) at byte ``offset`` of storage ``storage`` (None: no
    elements) of this shard, or of rank ``rank``'s shard where given (a replica stored there)."""
    storage: Optional[int]
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    rank: Optional[int] = None

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        """The bytes of its elements."""
        return math.prod(self.shape) * self.itemsize

    @property
    def end(self) -> int:
        """The byte of its storage past its last element (its offset when it has none)."""
        return self.offset + span_bytes(self.shape, self.stride, self.itemsize)

    def held_in(self, rank: int) -> tuple[int, Optional[int]]:
        """(rank, storage) of the storage it views, for a record of ``rank``'s shard."""
        return (rank if self.rank is None else self.rank), self.storage


@dataclass(frozen=True, slots=True)
class DTensorPiece:
    """A record of the sharded-tensor table (``dtensors``, docs/FORMAT.md 3.6): the piece of the
    sharded tensor ``key`` (of ``dtype``, ``global_shape``) this shard holds at ``offset``, in
    tensor record ``tensor`` (None: this rank holds none of it)."""
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: Optional[int]

    @classmethod
    def of(cls, d: dict) -> "DTensorPiece":
        return cls(d["key"], d["dtype"], tuple(d["global_shape"]), tuple(d["offset"]), d["tensor"])

    def to_json(self) -> dict:
        """The index's form of it, as ``of`` reads it."""
        return {"key": self.key, "dtype": self.dtype, "global_shape": list(self.global_shape),
                "offset": list(self.offset), "tensor": self.tensor}


@dataclass(frozen=True, slots=True)
class HeldStorage:
    """A storage's bytes in a staging slot the memory tier's keeper holds: ``nbytes`` at
    ``offset``, with the xxh3-64 checksum of each ``CHUNK_BYTES`` piece (the keeper's, made when
    it sealed the snapshot)."""
    offset: int
    nbytes: int
    checksums: tuple[str, ...] = ()


class DataFile(NamedTuple):
    """A data file of a shard (``files``, version 6, docs/FORMAT.md 3.8): ``name`` beside the
    shard, of ``size`` bytes."""
    name: str
    size: int

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.size}
