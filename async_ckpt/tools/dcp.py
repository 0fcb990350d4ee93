"""Moving between async_ckpt and PyTorch DCP (``torch.distributed.checkpoint``) checkpoints, both
ways: ``async-ckpt export DIR --to-dcp OUT`` (``write_dcp``) and ``async-ckpt import-dcp SRC DIR
--step N`` (``read_dcp``, ``import_dcp``).

A DCP checkpoint is a directory: a pickled ``.metadata`` (every key's kind, dtype, global shape
and chunks, and the file, offset and length of each chunk's bytes) beside ``*.distcp`` files of
``torch.save``d tensors and values. DCP reads the metadata with ``pickle.load`` and the values
with ``torch.load(weights_only=False)``: both run code from the file. A DCP checkpoint is
untrusted input like any other, so ``read_dcp`` reads neither way: the metadata through an
unpickler that builds DCP's own metadata classes and nothing else, every name, size and offset
checked before it is used, tensors and values with ``torch.load(weights_only=True)`` (values that
need more, only with ``allow_pickle``).

Both directions go through whole (unsharded) tensors: an export holds a sharded snapshot's whole
tensors in memory (``load`` assembles them from every rank's pieces) and writes them as a
one-process DCP checkpoint, which DCP loads into any world size and mesh; an import writes a
one-rank snapshot of whole tensors, which ``restore()`` loads into ``DTensor``s of any layout
(each rank takes its box of each tensor).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import re
import shutil
import tempfile
import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from ..errors import (CheckpointDirError, CorruptSnapshotError, EncodingError,
                      StateMismatchError, UnsupportedFormatError)
from ..format.manifest import read_manifest
from ..format.shard import MAX_DIMS, MAX_EXTENT, MAX_KEY_CHARS
from ..read.memory import allocating, require_memory
from ..read.reshard import exact_cover
from ..read.snapshot import load
from ..storage.local import open_regular, umask
from ..storage.open import open_storage
from ..tensors import ALL_DTYPES, DTYPES
from .common import copy_bytes, dense_bytes, iter_tensors

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 256 << 20  # ~a million chunk records; a larger file is refused unread
MAX_PATH_DEPTH = 64  # nesting of a key's path in the state dict
_DATA_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # DCP writes __{rank}_{n}.distcp

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to the layout
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # the checkpoint id DCP was saved with
    "collections": {"OrderedDict"},
}
"""What ``.metadata`` may name: DCP's own classes, whose constructors and ``__setstate__`` only
store what they are given (``torch`` dtypes are allowed by value, below)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the classes of ``_METADATA_CLASSES`` and ``torch`` dtypes; refuses every other name
    (a function or class it would call with arguments from the file)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in ALL_DTYPES:
            return ALL_DTYPES[name]
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise UnsupportedFormatError(
            f"the DCP metadata names {module[:80]}.{name[:80]}, which import does not load (it "
            "would run code from the file); load this checkpoint with DCP where you trust it, "
            "then save it with async_ckpt")


# --- export ------------------------------------------------------------------------------------

def write_dcp(state: dict, target: str) -> None:
    """``state`` (CPU tensors and values, as ``load`` returns them) as a one-process DCP
    checkpoint in the new directory ``target``: written into a new directory of a name nobody can
    guess beside it, then renamed."""
    import torch.distributed.checkpoint as dcp

    # DCP writes a tensor that views only part of its storage, or expands it, as a copy
    need = sum(copy_bytes(t, "a tensor") for t in iter_tensors(state)
               if t.untyped_storage().nbytes() != dense_bytes(t))
    require_memory(need, "copying the tensors DCP writes as copies (views and expanded tensors)",
                   "free memory first. Nothing was written")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-",  # exclusive, unguessable
                           dir=os.path.dirname(os.path.abspath(target)))
    try:
        with warnings.catch_warnings():  # that no process group is set up is the point here
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        os.chmod(tmp, 0o777 & ~umask())  # as a mkdir would have made it, not mkdtemp's 0700
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- import ------------------------------------------------------------------------------------

def read_dcp(path: str | os.PathLike, allow_pickle: bool = False) -> dict:
    """The state a DCP checkpoint holds, as nested dicts and lists of whole CPU tensors and values
    (the nesting DCP recorded when it flattened the state it saved; optimizer state keyed by
    parameter number as torch's optimizers keep it). Raises CorruptSnapshotError for a damaged
    checkpoint, UnsupportedFormatError for one this reader does not read, EncodingError for a
    value that needs code to load (without ``allow_pickle``), InsufficientMemoryError."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointDirError(f"{path} is not a directory; pass a DCP checkpoint directory")
    metadata = _read_metadata(path)
    items = _items(metadata, path)
    files = {info[0] for _, _, chunks in items.values() for _, _, info in chunks}
    need = sum(math.prod(shape) * dtype.itemsize for dtype, shape, _ in items.values()
               if dtype is not None)
    need += max((info[2] for _, _, chunks in items.values() for _, _, info in chunks), default=0)
    require_memory(need, f"importing {path}", "free memory first. Nothing was written")
    opened = {name: _open_data_file(path, name) for name in sorted(files)}
    try:
        values = {fqn: _read_item(fqn, dtype, shape, chunks, opened, allow_pickle, path)
                  for fqn, (dtype, shape, chunks) in items.items()}
    finally:
        for fd, _ in opened.values():
            os.close(fd)
    return _nest(values, _paths(metadata, values, path), path)


def _read_metadata(path: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    fd, size = _open_regular(os.path.join(path, METADATA_NAME), f"{path}: no {METADATA_NAME} "
                             "(not a DCP checkpoint, or one whose save did not finish)")
    try:
        if size > MAX_METADATA_BYTES:
            raise CorruptSnapshotError(f"{path}: {METADATA_NAME} is {size} bytes, more than "
                                       f"{MAX_METADATA_BYTES} (not DCP metadata)")
        with os.fdopen(os.dup(fd), "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except UnsupportedFormatError:
                raise
            except Exception as e:  # damaged pickles fail in every way; none runs our code
                raise CorruptSnapshotError(f"{path}: {METADATA_NAME} is damaged "
                                           f"({type(e).__name__}: {str(e)[:100]})") from e
    finally:
        os.close(fd)
    if not _whole(metadata, Metadata):
        raise CorruptSnapshotError(f"{path}: {METADATA_NAME} does not hold DCP metadata")
    return metadata


def _whole(obj: Any, kind: type) -> bool:
    """Whether ``obj`` is a ``kind`` (one of DCP's metadata dataclasses) with every field set: an
    unpickled object is built from whatever state the file gives it, which may lack fields."""
    return isinstance(obj, kind) and all(hasattr(obj, f.name) for f in dataclasses.fields(kind))


def _items(metadata: Any, path: str) -> dict:
    """fqn -> (dtype, global shape, [(offset, shape, (file, start, length)), ...]) for tensors,
    (None, None, [(None, None, (file, start, length))]) for values; every field checked."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       TensorProperties, TensorStorageMetadata)

    def bad(what: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{path}: {METADATA_NAME} is damaged: {what}")

    where = _locations(metadata, bad)
    keys, items = metadata.state_dict_metadata, {}
    if not isinstance(keys, dict):
        raise bad("no key table")
    for fqn, meta in keys.items():
        if not isinstance(fqn, str) or len(fqn) > MAX_KEY_CHARS:
            raise bad(f"a key is not a string of at most {MAX_KEY_CHARS} characters")
        if isinstance(meta, BytesStorageMetadata):
            items[fqn] = (None, None, [(None, None, _located(where, fqn, None, bad))])
            continue
        if not (_whole(meta, TensorStorageMetadata) and _whole(meta.properties, TensorProperties)
                and isinstance(meta.properties.dtype, torch.dtype)
                and meta.properties.dtype in DTYPES.values() and isinstance(meta.chunks, list)):
            raise bad(f"{fqn[:80]!r} is neither a tensor nor a value")
        shape = _box(meta.size, None, bad, fqn)
        if math.prod(shape) * meta.properties.dtype.itemsize > MAX_EXTENT:
            raise bad(f"{fqn[:80]!r} is larger than any tensor")
        chunks = []
        for chunk in meta.chunks:
            if not _whole(chunk, ChunkStorageMetadata):
                raise bad(f"a chunk of {fqn[:80]!r} is not a chunk")
            offset, size = _box(chunk.offsets, len(shape), bad, fqn), _box(chunk.sizes, len(shape),
                                                                           bad, fqn)
            if any(o + s > n for o, s, n in zip(offset, size, shape)):
                raise bad(f"a chunk of {fqn[:80]!r} lies outside the tensor")
            chunks.append((offset, size, _located(where, fqn, offset, bad)))
        exact_cover((0,) * len(shape), shape, ((c, c[0], c[1]) for c in chunks),
                    f"{path}: the chunks of {fqn[:80]!r}")
        items[fqn] = (meta.properties.dtype, shape, chunks)
    return items


def _locations(metadata: Any, bad: Callable[[str], Exception]) -> dict:
    """(fqn, chunk offset or None) -> (file name, start, length), from ``storage_data``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not isinstance(metadata.storage_data, dict):
        raise bad("no storage table (not written by DCP's file system writer)")
    where = {}
    for index, info in metadata.storage_data.items():
        if not (_whole(index, MetadataIndex) and isinstance(index.fqn, str)
                and _whole(info, _StorageInfo)):
            raise bad("a storage record is malformed")
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedFormatError(
                f"{index.fqn[:80]!r} was written through a DCP extension "
                f"({str(info.transform_descriptors)[:80]}), which import does not read; load it "
                "with DCP, then save it with async_ckpt")
        name, start, length = info.relative_path, info.offset, info.length
        if not (isinstance(name, str) and _DATA_FILE.fullmatch(name) and type(start) is int
                and type(length) is int and 0 <= start <= MAX_EXTENT and 0 <= length <= MAX_EXTENT):
            raise bad(f"the storage record of {index.fqn[:80]!r} names {str(name)[:80]!r} at "
                      f"{str(start)[:20]}+{str(length)[:20]}")
        offset = None if index.offset is None else _box(index.offset, None, bad, index.fqn)
        where[(index.fqn, offset)] = (name, start, length)
    return where


def _located(where: dict, fqn: str, offset: Optional[tuple], bad) -> tuple:
    found = where.get((fqn, offset))
    if found is None:
        raise bad(f"no storage record for {fqn[:80]!r}"
                  + ("" if offset is None else f" at {offset}"))
    return found


def _box(size: Any, dims: Optional[int], bad, fqn: str) -> tuple:
    if not (isinstance(size, (torch.Size, tuple, list)) and len(size) <= MAX_DIMS
            and (dims is None or len(size) == dims)
            and all(type(n) is int and 0 <= n <= MAX_EXTENT for n in size)):
        raise bad(f"{fqn[:80]!r} has a malformed shape")
    return tuple(size)


def _open_regular(path: str, missing: str) -> tuple[int, int]:
    """A descriptor of the regular file ``path`` (by the rules every checkpoint file is opened
    by, ``storage.local.open_regular``), and its size."""
    try:
        fd = open_regular(path, CorruptSnapshotError)
    except FileNotFoundError:
        raise CorruptSnapshotError(missing) from None
    return fd, os.fstat(fd).st_size


def _open_data_file(path: str, name: str) -> tuple[int, int]:
    return _open_regular(os.path.join(path, name), f"{path}: {name} is missing (the checkpoint "
                         "is incomplete)")


def _read_item(fqn: str, dtype: Optional[torch.dtype], shape: Optional[tuple], chunks: list,
               opened: dict, allow_pickle: bool, path: str) -> Any:
    if dtype is None:
        return _load_blob(fqn, opened, chunks[0][2], allow_pickle, path)
    whole = allocating(lambda: torch.empty(shape, dtype=dtype), math.prod(shape) * dtype.itemsize,
                       f"{fqn[:80]!r}")
    for offset, size, location in chunks:
        piece = _load_blob(fqn, opened, location, False, path)
        if (type(piece) is not torch.Tensor or piece.dtype != dtype
                or tuple(piece.shape) != size):
            raise CorruptSnapshotError(f"{path}: a chunk of {fqn[:80]!r} does not hold the "
                                       f"{dtype} {size} tensor its metadata names")
        whole[tuple(slice(o, o + s) for o, s in zip(offset, size))].copy_(piece)
    return whole


def _load_blob(fqn: str, opened: dict, location: tuple, allow_pickle: bool, path: str) -> Any:
    name, start, length = location
    fd, size = opened[name]
    if start + length > size:
        raise CorruptSnapshotError(f"{path}: {name} ends at byte {size}, before the "
                                   f"{length} bytes of {fqn[:80]!r} at {start} (truncated)")
    data = os.pread(fd, length, start)
    if len(data) != length:
        raise CorruptSnapshotError(f"{path}: {name} was truncated while read")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) and not allow_pickle:
            raise EncodingError(f"{path}: the value of {fqn[:80]!r} needs code from the file to "
                                "load (a pickled object); refused by default") from e
        raise CorruptSnapshotError(f"{path}: the bytes of {fqn[:80]!r} are damaged") from e
    except Exception as e:  # torch.load of damaged bytes fails in many ways: all are damage
        raise CorruptSnapshotError(f"{path}: the bytes of {fqn[:80]!r} are damaged "
                                   f"({type(e).__name__})") from e


def _paths(metadata: Any, values: dict, path: str) -> dict:
    """fqn -> its key path in the state DCP flattened (``planner_data``), else the fqn alone."""
    recorded = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths = {}
    for fqn in values:
        keys = recorded.get(fqn, (fqn,))
        if not (isinstance(keys, tuple) and 0 < len(keys) <= MAX_PATH_DEPTH
                and all(type(k) is int and 0 <= k < MAX_EXTENT
                        or type(k) is str and len(k) <= MAX_KEY_CHARS for k in keys)
                and isinstance(keys[0], str)):
            raise CorruptSnapshotError(f"{path}: {METADATA_NAME} records a malformed key path "
                                       f"for {fqn[:80]!r}")
        paths[fqn] = keys
    return paths


class _Listed(dict):
    """A container built for integer path elements: a list once every index is in."""


def _nest(values: dict, paths: dict, path: str) -> dict:
    root: dict = {}
    for fqn, value in values.items():
        node, keys = root, paths[fqn]
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = _Listed() if type(keys[depth + 1]) is int else {}
            if not isinstance(child, dict) or isinstance(child, _Listed) != (
                    type(keys[depth + 1]) is int):
                raise CorruptSnapshotError(f"{path}: the key paths of {METADATA_NAME} collide "
                                           f"at {fqn[:80]!r}")
            node = child
        if keys[-1] in node:
            raise CorruptSnapshotError(f"{path}: two keys of {METADATA_NAME} have the path of "
                                       f"{fqn[:80]!r}")
        node[keys[-1]] = value
    return _settled(root, path)


def _settled(node: Any, path: str) -> Any:
    """Lists for ``_Listed`` containers; optimizer state keyed by parameter number again."""
    if not isinstance(node, dict):
        return node
    items = {k: _settled(v, path) for k, v in node.items()}
    if isinstance(node, _Listed):
        if sorted(items) != list(range(len(items))):
            raise CorruptSnapshotError(f"{path}: {METADATA_NAME} records a list with gaps")
        return [items[i] for i in range(len(items))]
    _renumber_optimizer_state(items)
    return items


def _renumber_optimizer_state(node: dict) -> None:
    """DCP turns every dict key into a string: an optimizer's ``state`` saved by parameter number
    comes back keyed "0", "1", ..., which ``load_state_dict`` would silently not match with the
    numbers in ``param_groups``. Keys that are those numbers, written out, become them again."""
    state, groups = node.get("state"), node.get("param_groups")
    if not (isinstance(state, dict) and isinstance(groups, list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        return
    numbers = {str(i): i for g in groups for i in g["params"] if type(i) is int}
    if state and set(state) <= numbers.keys():
        node["state"] = {numbers[k]: v for k, v in state.items()}


class ObjectState:
    """A dict saved as an object's ``state_dict`` (an imported state's top-level dict): what the
    registered object (a module, an optimizer, an ``AppState``) is given back on restore."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def import_dcp(source: str | os.PathLike, directory: str | os.PathLike, step: int,
               allow_pickle: bool = False, as_dicts: Iterable[str] = ()) -> dict:
    """Write the DCP checkpoint ``source`` as the one snapshot (step ``step``, one rank) of the
    new checkpoint directory ``directory``; returns the state written. Each top-level dict is
    saved as a registered object's state (restore gives it to the object registered under that
    name: a module, an optimizer, an ``AppState``), except those named in ``as_dicts``, saved as
    plain dicts (restored into a dict registered under that name); top-level tensors and values
    as themselves; no RNG state (DCP saves none)."""
    _check_new_directory(directory)
    state = read_dcp(source, allow_pickle)
    as_dicts = set(as_dicts)
    if as_dicts - state.keys():
        raise StateMismatchError(f"{os.fspath(source)} has no top-level "
                                 f"{', '.join(sorted(as_dicts - state.keys()))}; its entries: "
                                 f"{', '.join(state) or 'none'}")
    write_snapshot({key: ObjectState(value) if isinstance(value, dict) and key not in as_dicts
                    else value for key, value in state.items()}, directory, step, allow_pickle)
    return state


def _check_new_directory(directory: str | os.PathLike) -> None:
    directory = os.fspath(directory)
    if os.path.lexists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise CheckpointDirError(f"{directory} exists and is not an empty directory; import into "
                                 "a new checkpoint directory")


def write_snapshot(state: dict, directory: str | os.PathLike, step: int,
                   allow_pickle: bool = False) -> None:
    """``state`` (what an engine may register) as the one snapshot, step ``step`` of one rank,
    of the new checkpoint directory ``directory``, committed when this returns; no RNG state."""
    from ..engine import CheckpointEngine

    _check_new_directory(directory)
    with CheckpointEngine(directory, state, rng=False, mode="sync", rank=0, world_size=1,
                          allow_pickle=allow_pickle, heartbeat_interval=None) as engine:
        engine.snapshot(step, force=True)


def read_all_ranks(directory: str | os.PathLike, step: Optional[int] = None,
                   allow_pickle: bool = False) -> tuple[int, dict]:
    """(step, state) of a committed snapshot as one DCP checkpoint of every saved rank holds it:
    rank 0's view (sharded tensors whole, ``load``), with each top-level dict that the ranks held
    differently (a per-rank data position keyed by rank) merged, key by key, as DCP merges the
    keys the ranks save. A key that two ranks hold with different values has no single value in
    DCP: UnsupportedFormatError. Reads every saved rank's view in turn (verified, uncompressed
    tensors mapped), one at a time."""
    storage = open_storage(directory)
    step, state = load(storage, step, allow_pickle=allow_pickle, mmap=True, verify=True)
    record = read_manifest(storage).find(step)
    for rank in range(1, 1 if record is None else record.world_size):
        _, other = load(storage, step, rank=rank, allow_pickle=allow_pickle, mmap=True,
                        verify=True)
        for key, value in other.items():
            if key in state and not _same(state[key], value):
                state[key] = _merged(key, state[key], value, rank)
    return step, state


def _merged(key: str, ours: Any, theirs: Any, rank: int) -> dict:
    if not (isinstance(ours, dict) and isinstance(theirs, dict)):
        raise UnsupportedFormatError(
            f"entry {key[:80]!r} differs between saved ranks 0 and {rank} and is not a dict of "
            "keys to merge: DCP keeps one value per key. Export one rank's view instead "
            "(async-ckpt export --rank R --to-dcp)")
    merged = dict(ours)
    for name, value in theirs.items():
        if name in merged and not _same(merged[name], value):
            raise UnsupportedFormatError(
                f"{key[:80]}.{str(name)[:80]} differs between saved rank {rank} and a rank "
                "before it: DCP keeps one value per key. Export one rank's view instead "
                "(async-ckpt export --rank R --to-dcp)")
        merged[name] = value
    return merged


def _same(a: Any, b: Any) -> bool:
    """Whether two loaded values are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bytes_of(a), _bytes_of(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements (so that NaNs compare by their bits)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)
