"""A committed snapshot, or one entry of it, written again in a framework's own file format, for
the files its users open without async_ckpt (docs/FORMAT.md section 9): a Lightning ``.ckpt``
given to ``load_from_checkpoint``, a ``checkpoint-N/model.safetensors`` given to
``from_pretrained``. The writer process makes such a file (a ``Derived`` of a ``Marker``) from the
shard it committed, every chunk verified on the way. It never imports torch.

- ``"torch"``: what ``torch.save`` writes and ``torch.load(path, weights_only=True)`` reads. A zip
  of stored entries: ``archive/data.pkl``, a pickle of the values in which each tensor is
  ``torch._utils._rebuild_tensor_v3(storage, offset, size, stride, False, OrderedDict(), dtype)``
  over the persistent id ``("storage", torch.storage.UntypedStorage, key, "cpu", nbytes)`` and
  every reference to torch is written as a name, as ``torch.save`` writes it; ``archive/data/KEY``,
  each storage's bytes at a file offset that is a multiple of 64 (torch's own alignment, so that
  ``torch.load(mmap=True)`` views are aligned for every dtype); ``byteorder``, ``version``,
  ``.format_version`` and ``.storage_alignment`` as torch writes them; and ``.data/async_ckpt``,
  the caller's record (torch ignores entries it does not know).
- ``"safetensors"``: a flat dict of tensors, each stored contiguous in row-major order (a view is
  gathered), a tensor that views exactly the bytes of an earlier one (tied weights) left out, as
  ``save_pretrained`` leaves it out.

The engine's own entry (the global RNG states) is never written: the file holds what was
snapshotted.
"""

from __future__ import annotations

import collections
import io
import json
import math
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Optional, Sequence

import numpy

from ..errors import InvalidArgumentError, LayoutError
from ..storage.names import DATA_FILE_SUFFIXES
from . import tree as tree_model
from .tree import RNG_KEY, Leaf
from .manifest import SnapshotRecord
from .records import ITEMSIZES, StoredTensor
from .references import References

ARCHIVE = "archive"
RECORD_ENTRY = ".data/async_ckpt"
MAX_RECORD_BYTES = 4096
ALIGNMENT = 64
PICKLE_PROTOCOL = 2  # torch.save's
_PADDING_FIELD = 0x4246  # the zip extra field torch pads its entries with ("FB")
_DATE = (1980, 1, 1, 0, 0, 0)  # the same bytes for the same snapshot
class _Global:
    """A name in a module of torch (or any module), pickled as a reference to it without
    importing the module."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle insists that what a reduction calls is callable
        raise TypeError(f"{self.module}.{self.name} is a stand-in, not the function")


_REBUILD_TENSOR = _Global("torch._utils", "_rebuild_tensor_v3")
_UNTYPED_STORAGE = _Global("torch.storage", "UntypedStorage")
_TORCH_SIZE = _Global("torch", "Size")
_TORCH_DEVICE = _Global("torch", "device")
_PICKLE_LOADS = _Global("pickle", "loads")


class _Storage:
    def __init__(self, key: str, nbytes: int) -> None:
        self.key, self.nbytes = key, nbytes


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, shape: tuple, stride: tuple,
                 dtype: str) -> None:
        self.storage, self.offset, self.shape, self.stride, self.dtype = (
            storage, offset, shape, stride, dtype)
        self.nbytes = math.prod(shape) * ITEMSIZES[dtype]

    def is_contiguous(self) -> bool:
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.stride)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


class _Call:
    """``function(*args)`` when unpickled."""

    def __init__(self, function: _Global, args: tuple) -> None:
        self.function, self.args = function, args


class _Pickled:
    """A value the snapshot holds pickled (``allow_pickle=True``): unpickled by ``pickle.loads``
    when the file is loaded (so ``weights_only=True`` refuses it, as it refuses the object)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table takes our stand-ins
    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.storages: dict[str, _Storage] = {}  # those the pickle refers to, by key

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if type(obj) is _Storage:
            self.storages[obj.key] = obj
            return ("storage", _UNTYPED_STORAGE, obj.key, "cpu", obj.nbytes)
        return None

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is _Tensor:
            return _REBUILD_TENSOR, (obj.storage, obj.offset, obj.shape, obj.stride, False,
                                     _Call(_Global("collections", "OrderedDict"), ()),
                                     _Global("torch", obj.dtype))
        if t is _Call:
            return obj.function, obj.args
        if t is _Pickled:
            return _PICKLE_LOADS, (obj.data,)
        return NotImplemented

    def _save_global_name(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[_Global] = _save_global_name


@dataclass(frozen=True)
class Derived:
    """A file the writer makes from the committed snapshot: entry ``entry`` of its state (a
    top-level key; None: the whole state) in ``format``, ``"torch"`` (keeping ``record`` as its
    ``.data/async_ckpt`` entry) or ``"safetensors"`` (the entry must be a dict of tensors)."""

    format: str
    entry: Optional[str] = None
    record: bytes = b""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InvalidArgumentError(f"a derived file's format is one of {FORMATS}, not "
                                       f"{self.format!r}")
        if len(self.record) > MAX_RECORD_BYTES or (self.record and self.format != "torch"):
            raise InvalidArgumentError(f"a record (at most {MAX_RECORD_BYTES} bytes) is kept in "
                                       "torch files only")


FORMATS = tuple(DATA_FILE_SUFFIXES)  # "torch", "safetensors"

Pieces = Callable[[int], Iterator[memoryview]]
"""Storage ``n``'s bytes, in order, in pieces."""


class NativeFile:
    """A ``Derived`` of a snapshot whose storages have ``sizes`` bytes, its tensor table
    ``tensors`` and state tree ``tree``, laid out: what it holds, and which storages it holds
    whole, in one piece of the file each (``whole``), so that the file can be a shard's data
    file: its bytes are those storages' chunks (docs/FORMAT.md 3.8). Raises LayoutError for a
    snapshot the format cannot hold."""

    def __init__(self, sizes: Sequence[int], tensors: Sequence[StoredTensor], tree: Any,
                 derived: Derived, where: str) -> None:
        if derived.entry is not None:
            where = f"{where} entry {derived.entry!r}"
        storages = [_Storage(str(n), nbytes) for n, nbytes in enumerate(sizes)]
        state = _state(tree, tensors, storages, derived.entry, where)
        self.derived = derived
        if derived.format == "torch":  # a shard's byte order is this machine's (its validator)
            self._layout: _TorchLayout | _SafetensorsLayout = _TorchLayout(
                state, sys.byteorder, derived.record)
        else:
            self._layout = _SafetensorsLayout(state, where)
        self.whole = self._layout.whole

    def write(self, out: BinaryIO, pieces: Pieces) -> None:
        """Write the file to ``out`` (seekable), each storage's bytes from ``pieces``: a storage
        of ``whole`` is asked for once, and its pieces written in a row where the file's
        position is when each is handed out."""
        self._layout.write(out, pieces)


def write_committed(out: BinaryIO, references: References, record: SnapshotRecord, rank: int,
                    derived: Derived) -> None:
    """Write ``derived`` of ``rank``'s shard of the committed snapshot ``record`` to ``out``,
    every byte read back from the shard (and from the earlier snapshots an incremental one
    refers to) and verified, a chunk at a time. A snapshot the format cannot hold raises
    LayoutError."""
    reader = references.open(record.dir, rank)

    def pieces(n: int) -> Iterator[memoryview]:
        entry = reader.storages[n]
        if entry.ref is not None:
            source, i = references.resolve(record, rank, entry, f"{reader.path} storage {n}")
            return source.storage_pieces(i)
        return reader.storage_pieces(n)

    NativeFile([s.nbytes for s in reader.storages], reader.tensors, reader.tree, derived,
               reader.path).write(out, pieces)


def _state(tree: Any, records: Sequence[StoredTensor], storages: list[_Storage],
           entry: Optional[str], where: str) -> Any:
    """The snapshot's state as the values a file holds (without the engine's RNG entry), or
    only its top-level ``entry``."""
    empty = _Storage(str(len(storages)), 0)
    tensors = [_tensor(record, storages, empty, where) for record in records]

    def leaf(kind: Leaf, v: Any) -> Any:
        if kind is Leaf.TENSOR:
            return tensors[tree_model.table_entry(kind, v, len(tensors), where)]
        if kind is Leaf.DTYPE:
            return _Global("torch", v)
        if kind is Leaf.SIZE:
            return _Call(_TORCH_SIZE, (tuple(v),))
        if kind is Leaf.DEVICE:
            return _Call(_TORCH_DEVICE, (v,))
        raise LayoutError(f"{where} holds sharded tensors (DTensor): a framework's file "
                          "holds whole tensors only")

    if entry is not None:  # only that entry is rebuilt: the others may hold sharded tensors
        tree = tree_model.only(tree, entry)
        if tree is None:
            raise LayoutError(f"{where}: the snapshot has no entry {entry!r}")
    root = tree_model.rebuild(tree, leaf, True, where, unpickle=_Pickled)
    root.value.pop(RNG_KEY, None)
    return root.plain() if entry is None else root.value[entry].plain()


def _tensor(record: StoredTensor, storages: list[_Storage], empty: _Storage,
            where: str) -> _Tensor:
    if record.rank is not None:
        raise LayoutError(f"{where} refers to another rank's storage: a framework's file holds "
                          "one process's state")
    storage = empty if record.storage is None else storages[record.storage]
    return _Tensor(storage, record.offset // record.itemsize, record.shape, record.stride,
                   record.dtype)


# --- torch's format ------------------------------------------------------------------------------


class _TorchLayout:
    """A zip whose entries ``data/K`` are the storages the pickled state uses, each whole."""

    def __init__(self, state: Any, byteorder: str, record: bytes) -> None:
        self.data = io.BytesIO()
        pickler = _Pickler(self.data, protocol=PICKLE_PROTOCOL)
        pickler.dump(state)
        self.storages = sorted(pickler.storages.values(), key=lambda s: int(s.key))
        self.whole = tuple(int(s.key) for s in self.storages if s.nbytes)
        self.byteorder, self.record = byteorder, record

    def write(self, out: BinaryIO, pieces: Pieces) -> None:
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            def entry(name: str, content, size: int) -> None:
                with archive.open(_aligned_entry(out.tell(), f"{ARCHIVE}/{name}", size), "w",
                                  force_zip64=size > zipfile.ZIP64_LIMIT) as f:
                    for piece in content:
                        f.write(piece)

            entry("data.pkl", [self.data.getbuffer()], len(self.data.getbuffer()))
            for name, content in ((".format_version", b"1"), (".storage_alignment", b"64"),
                                  ("byteorder", self.byteorder.encode("ascii"))):
                entry(name, [content], len(content))
            for storage in self.storages:
                entry(f"data/{storage.key}", pieces(int(storage.key)) if storage.nbytes else (),
                      storage.nbytes)
            entry("version", [b"3\n"], 2)
            entry(RECORD_ENTRY, [self.record], len(self.record))


def _aligned_entry(offset: int, name: str, size: int) -> zipfile.ZipInfo:
    """A stored entry whose local header (at ``offset``) is padded so that its data starts at a
    multiple of ``ALIGNMENT``, as torch pads its own."""
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = 20 if size * 1.05 > zipfile.ZIP64_LIMIT else 0  # zipfile adds this extra field
    header = offset + zipfile.sizeFileHeader + len(name.encode("utf-8")) + zip64
    pad = -(header + 4) % ALIGNMENT
    info.extra = struct.pack("<HH", _PADDING_FIELD, pad) + b"Z" * pad
    return info


def read_record(source: BinaryIO) -> Optional[bytes]:
    """The ``.data/async_ckpt`` record of a file in torch's format, None when it has none (a file
    ``torch.save`` wrote, or not a zip). Reads only the archive's directory and that entry, at
    most ``MAX_RECORD_BYTES``: the file is untrusted."""
    try:
        with zipfile.ZipFile(source) as archive:
            for info in archive.infolist():
                _, _, name = info.filename.partition("/")
                if name == RECORD_ENTRY and info.compress_type == zipfile.ZIP_STORED:
                    if info.file_size > MAX_RECORD_BYTES:
                        return None
                    return archive.read(info)[:MAX_RECORD_BYTES]
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError,
            NotImplementedError):
        return None
    return None


# --- safetensors ---------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64", "uint64": "U64", "uint32": "U32",
    "uint16": "U16"}
"""The dtypes safetensors stores, by torch's name (``safetensors.torch``'s table)."""


class _SafetensorsLayout:
    """The tensors of a flat dict, each contiguous (``write_safetensors``): a storage is held
    whole where one tensor covers exactly its bytes and no other tensor of the file views it."""

    def __init__(self, state: Any, where: str) -> None:
        if not (isinstance(state, dict) and all(type(t) is _Tensor for t in state.values())
                and all(type(name) is str for name in state)):
            raise LayoutError(f"{where} is not a dict of tensors by name: safetensors holds "
                              "nothing else")
        seen, self.kept = set(), []
        for name, tensor in state.items():
            if tensor.dtype not in SAFETENSORS_DTYPES:
                raise LayoutError(f"{where}: {name} is of dtype {tensor.dtype}, which "
                                  "safetensors cannot hold")
            view = (tensor.storage.key, tensor.offset, tensor.shape, tensor.stride, tensor.dtype)
            if view in seen and tensor.nbytes:
                continue  # the same bytes under another name: tied weights
            seen.add(view)
            self.kept.append((name, tensor))
        users = collections.Counter(t.storage.key for _, t in self.kept if t.nbytes)
        self.whole = tuple(int(t.storage.key) for _, t in self.kept
                           if t.nbytes and users[t.storage.key] == 1 and t.offset == 0
                           and t.nbytes == t.storage.nbytes and t.is_contiguous())

    def write(self, out: BinaryIO, pieces: Pieces) -> None:
        write_safetensors(out, [
            SafetensorsEntry(name, t.dtype, t.shape, t.nbytes,
                             lambda t=t: _tensor_bytes(t, pieces)) for name, t in self.kept],
            {"format": "pt"})


@dataclass(frozen=True)
class SafetensorsEntry:
    """A tensor of a safetensors file: ``data()`` yields its ``nbytes`` bytes in row-major
    order, in pieces."""

    name: str
    dtype: str  # torch's name: a key of SAFETENSORS_DTYPES
    shape: tuple
    nbytes: int
    data: Callable[[], Iterable]


def write_safetensors(out: BinaryIO, entries: list[SafetensorsEntry], metadata: dict) -> None:
    """A safetensors file of ``entries``, their bytes streamed into ``out``: the header (padded to
    8 bytes), then the tensors with the largest elements first, so that each one's data is
    aligned for its dtype, as safetensors orders them."""
    entries = sorted(entries, key=lambda e: (-ITEMSIZES[e.dtype], e.name))
    header, end = {}, 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [end, end + e.nbytes]}
        end += e.nbytes
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out.write(struct.pack("<Q", len(text)) + text)
    for e in entries:
        for piece in e.data():
            out.write(piece)


GATHER_BYTES = 4 << 20
"""The most of a view's elements ``row_major`` copies at a time."""


def row_major(view: numpy.ndarray) -> Iterator[memoryview]:
    """The elements of ``view``, of any strides, in row-major order, in contiguous pieces of at
    most ``GATHER_BYTES`` (or one element): a view is never copied whole, since one with a
    stride of 0 (an expanded tensor) may stand for far more bytes than it holds."""
    if view.ndim == 0 or view.nbytes <= GATHER_BYTES:
        yield memoryview(numpy.ascontiguousarray(view)).cast("B")
    elif view[0].nbytes <= GATHER_BYTES:  # whole rows at a time
        rows = GATHER_BYTES // view[0].nbytes
        for i in range(0, len(view), rows):
            yield memoryview(numpy.ascontiguousarray(view[i:i + rows])).cast("B")
    else:
        for row in view:
            yield from row_major(row)


def _tensor_bytes(tensor: _Tensor, pieces: Pieces) -> Iterator[memoryview]:
    """The tensor's elements in row-major order: a contiguous tensor's byte range streamed from
    its storage's pieces, any other view gathered from the whole storage."""
    if not tensor.nbytes:
        return
    size = ITEMSIZES[tensor.dtype]
    start, stop = tensor.offset * size, tensor.offset * size + tensor.nbytes
    if tensor.is_contiguous():
        position = 0
        for piece in pieces(int(tensor.storage.key)):
            lo, hi = max(start, position), min(stop, position + len(piece))
            if lo < hi:
                yield piece[lo - position:hi - position]
            position += len(piece)
            if position >= stop:
                return
        return
    whole = bytearray()
    for piece in pieces(int(tensor.storage.key)):
        whole += piece
    elements = numpy.frombuffer(whole, dtype=f"V{size}")
    yield from row_major(numpy.lib.stride_tricks.as_strided(
        elements[tensor.offset:], tensor.shape, [s * size for s in tensor.stride], writeable=False))
