"""A committed snapshot written as a file in torch's own format: what ``torch.save`` writes and
``torch.load(path, weights_only=True)`` reads, in a process that knows nothing of async_ckpt.

For the files a framework's users open without the framework's checkpoint plugin (a Lightning
``.ckpt`` given to ``load_from_checkpoint``), the writer process makes this file from the shard
it committed (docs/FORMAT.md section 9). It never imports torch: the archive is a zip of stored
entries, its ``data.pkl`` a pickle whose references to torch (the tensor rebuild function, dtypes,
``torch.Size``, ``torch.device``) are written as names, exactly as ``torch.save`` writes them:

- ``archive/data.pkl``: the state tree as Python values, each tensor
  ``torch._utils._rebuild_tensor_v3(storage, offset, size, stride, False, OrderedDict(), dtype)``
  over the persistent id ``("storage", torch.storage.UntypedStorage, key, "cpu", nbytes)``;
- ``archive/data/KEY``: each storage's bytes, at a file offset that is a multiple of 64 (torch's
  own alignment, so that ``torch.load(mmap=True)`` views are aligned for every dtype);
- ``archive/byteorder``, ``archive/version``, ``archive/.format_version``,
  ``archive/.storage_alignment`` as torch writes them, and ``archive/.data/async_ckpt``, a
  record of the caller's (bytes; torch ignores entries it does not know).

The engine's own entry (the global RNG states) is left out: the file holds what was snapshotted.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from typing import Any, BinaryIO, Callable, Iterator, Optional

from ..errors import LayoutError
from ..storage.names import RNG_KEY
from . import tree as tree_model
from .manifest import SnapshotRecord
from .references import References

ARCHIVE = "archive"
RECORD_ENTRY = ".data/async_ckpt"
MAX_RECORD_BYTES = 4096
ALIGNMENT = 64
PICKLE_PROTOCOL = 2  # torch.save's
_PADDING_FIELD = 0x4246  # the zip extra field torch pads its entries with ("FB")
_DATE = (1980, 1, 1, 0, 0, 0)  # the same bytes for the same snapshot
ITEMSIZES = {name: size for size, names in {
    1: "bool int8 uint8 bits8 bits1x8 bits2x4 bits4x2 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
       "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2",
    2: "bfloat16 float16 int16 uint16 bits16",
    4: "float32 int32 uint32 complex32",
    8: "float64 int64 uint64 complex64",
    16: "complex128"}.items() for name in names.split()}
"""Element sizes of the dtypes a saved tensor may have (``tensors.DTYPES``, checked by a test):
torch's offsets count elements, the index's bytes."""


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
                 dtype: _Global) -> None:
        self.storage, self.offset, self.shape, self.stride, self.dtype = (
            storage, offset, shape, stride, dtype)


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

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if type(obj) is _Storage:
            return ("storage", _UNTYPED_STORAGE, obj.key, "cpu", obj.nbytes)
        return None

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is _Tensor:
            return _REBUILD_TENSOR, (obj.storage, obj.offset, obj.shape, obj.stride, False,
                                     _Call(_Global("collections", "OrderedDict"), ()), obj.dtype)
        if t is _Call:
            return obj.function, obj.args
        if t is _Pickled:
            return _PICKLE_LOADS, (obj.data,)
        return NotImplemented

    def _save_global_name(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[_Global] = _save_global_name


def snapshot_values(index: dict, path: str) -> tuple[Any, list[_Storage]]:
    """The snapshot's state (the shard ``index``'s tree without the engine's RNG entry) as the
    values ``data.pkl`` holds, and the storages its tensors view, by storage number. A snapshot
    this format cannot hold (sharded tensors, another rank's storages) raises LayoutError."""
    storages = [_Storage(str(n), s["nbytes"]) for n, s in enumerate(index["storages"])]
    empty = _Storage(str(len(storages)), 0)
    tensors = [_tensor(record, storages, empty, path) for record in index["tensors"]]

    def leaf(node: dict) -> Any:
        (tag, v), = node.items()
        if tag == "$tensor":
            return tensors[v]
        if tag == "$dtype":
            return _Global("torch", v)
        if tag == "$size":
            return _Call(_TORCH_SIZE, (tuple(v),))
        if tag == "$device":
            return _Call(_TORCH_DEVICE, (v,))
        if tag == "$dtensor":
            raise LayoutError(f"{path} holds sharded tensors (DTensor): torch's file format "
                              "holds whole tensors only")
        return NotImplemented

    state = tree_model.rebuild(index["tree"], leaf, True, path, unpickle=_Pickled).plain()
    state.pop(RNG_KEY, None)
    used = {t.storage.key: t.storage for t in tensors}
    return state, [s for s in storages + [empty] if s.key in used]


def _tensor(record: dict, storages: list[_Storage], empty: _Storage, path: str) -> _Tensor:
    if "rank" in record:
        raise LayoutError(f"{path} refers to another rank's storage: a file in torch's format "
                          "holds one process's state")
    itemsize = _itemsize(record["dtype"], path)
    storage = empty if record["storage"] is None else storages[record["storage"]]
    return _Tensor(storage, record["offset"] // itemsize, tuple(record["shape"]),
                   tuple(record["stride"]), _Global("torch", record["dtype"]))


def _itemsize(dtype: str, path: str) -> int:
    try:
        return ITEMSIZES[dtype]
    except KeyError:
        raise LayoutError(f"{path} holds a tensor of dtype {dtype}, whose element size this "
                          "release does not know: it cannot be written in torch's format") from None


def write_torch_file(out: BinaryIO, state: Any, storages: list[_Storage],
                     storage_bytes: Callable[[int], Iterator[memoryview]],
                     byteorder: str, record: bytes = b"") -> None:
    """Write the archive to ``out`` (a seekable binary file at offset 0): ``state`` and
    ``storages`` from :func:`snapshot_values`, each storage's bytes taken from
    ``storage_bytes(number)`` piece by piece, and ``record`` as the ``.data/async_ckpt`` entry."""
    if len(record) > MAX_RECORD_BYTES:
        raise ValueError(f"a torch file's record is at most {MAX_RECORD_BYTES} bytes")
    data = io.BytesIO()
    _Pickler(data, protocol=PICKLE_PROTOCOL).dump(state)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        def entry(name: str, pieces, size: int) -> None:
            with archive.open(_aligned_entry(out.tell(), f"{ARCHIVE}/{name}", size), "w",
                              force_zip64=size > zipfile.ZIP64_LIMIT) as f:
                for piece in pieces:
                    f.write(piece)

        entry("data.pkl", [data.getbuffer()], len(data.getbuffer()))
        for name, content in ((".format_version", b"1"), (".storage_alignment", b"64"),
                              ("byteorder", byteorder.encode("ascii"))):
            entry(name, [content], len(content))
        for storage in storages:
            number = int(storage.key)
            pieces = storage_bytes(number) if storage.nbytes else iter(())
            entry(f"data/{storage.key}", pieces, storage.nbytes)
        entry("version", [b"3\n"], 2)
        entry(RECORD_ENTRY, [record], len(record))


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


def write_committed(out: BinaryIO, references: References, record: SnapshotRecord, rank: int,
                    note: bytes = b"") -> None:
    """Write ``rank``'s shard of the committed snapshot ``record`` to ``out`` in torch's format,
    with ``note`` as its record: every byte read back from the shard (and the earlier snapshots
    an incremental one refers to) and verified on the way, a chunk at a time."""
    reader = references.open(record.dir, rank)
    index = reader.index
    state, storages = snapshot_values(index, reader.path)

    def storage_bytes(n: int) -> Iterator[memoryview]:
        entry = index["storages"][n]
        if "ref" in entry:
            source, i = references.resolve(record, rank, entry, f"{reader.path} storage {n}")
            return source.storage_pieces(i)
        return reader.storage_pieces(n)

    write_torch_file(out, state, storages, storage_bytes, index["byteorder"], note)
