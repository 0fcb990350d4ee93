"""What the training state is: the registered objects turned into a tree of safe values plus a flat
list of tensors, and the byte layout (``Plan``) those tensors occupy in a staging slot.

Registered values are objects with ``state_dict()``/``load_state_dict()``, tensors, or plain dicts
of them (a dict may also hold plain values, which restore assigns back into it). Tensors are
grouped by the storage they view, so tensors that share memory (tied weights, views) are staged
once and share memory again after restore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from ..format import tree as tree_model, values
from ..format.tree import Leaf, leaf_node, tensor_leaf
from ..errors import EncodingError, LayoutError
from ..format.records import DTensorPiece
from ..format.layout import (ALIGNMENT, Plan, Region, TensorRecord, align_up, slot_alignment,
                             span_bytes)
from ..tensors import DTYPES, as_stateful, dtensor_box, is_dtensor

_SAVEABLE_DTYPES = frozenset(DTYPES.values())
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Captured:
    """The state at one instant: ``tree`` is JSON-safe and already detached from live objects;
    ``tensors`` still are the live tensors and must be staged before training goes on."""

    tree: dict
    tensors: list[torch.Tensor]
    entry_of: list[str]  # the top-level entry each tensor belongs to
    paths: list[str]  # each tensor's key path, for messages
    # Sharded tensors (``DTensor``), one record each (docs/FORMAT.md 3.6), referenced from the
    # tree as a ``Leaf.DTENSOR`` leaf; a record's ``tensor`` indexes ``tensors`` (its local
    # piece), or is None where another rank stores the same (replicated) piece.
    dtensors: list[DTensorPiece] = field(default_factory=list)


def capture(state: Mapping[str, Any], allow_pickle: values.AllowPickle = False) -> Captured:
    """Flatten the registered state. Raises EncodingError/LayoutError naming the key path of a
    value that cannot be saved safely."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    dtensors: list[DTensorPiece] = []

    def leaf(value: Any, path: str):
        if type(value) not in _PLAIN_TENSOR_TYPES and is_dtensor(value):
            encoded = leaf_node(Leaf.DTENSOR, _capture_dtensor(value, path, tensors, dtensors))
            paths.extend([path] * (len(tensors) - len(paths)))
            return encoded
        if isinstance(value, torch.Tensor):
            tensors.append(_checked(value, path))
            paths.append(path)
            return tensor_leaf(len(tensors) - 1)
        return encode_torch_scalar(value)

    def encode(value: Any, path: str):
        return values.encode(value, allow_pickle=allow_pickle, leaf=leaf, path=path)

    entries, entry_of = {}, []
    for key, obj in state.items():
        if not isinstance(key, str):
            raise EncodingError(f"state keys must be strings, not {key!r}")
        entries[key] = _capture_entry(obj, key, encode)
        entry_of += [key] * (len(tensors) - len(entry_of))
    keys = [d.key for d in dtensors]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise LayoutError(f"two sharded tensors have the same key path {twice[0]!r}: their pieces "
                          "could not be told apart on restore; give the state dict distinct keys")
    return Captured(tree_model.dict_node(entries), tensors, entry_of, paths, dtensors)


def _capture_dtensor(t: Any, path: str, tensors: list, dtensors: list) -> int:
    """Record a DTensor: its global shape and dtype, the global offset of the piece this rank
    holds, and that piece (its local tensor) as a tensor of the shard, unless the piece is
    replicated and a rank of a lower mesh coordinate stores it (each piece is written once)."""
    if any(p.is_partial() for p in t.placements):
        raise LayoutError(f"{path}: a DTensor with a Partial placement holds unreduced values; "
                          "redistribute it to Shard or Replicate before it is saved")
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError(f"{path}: this rank is not in the DTensor's device mesh")
    local = t.to_local()
    shape, offset = dtensor_box(t)
    if tuple(local.shape) != tuple(shape):
        raise LayoutError(f"{path}: the DTensor's local tensor has shape {tuple(local.shape)}, "
                          f"its placements give {tuple(shape)}")
    stores = all(c == 0 for c, p in zip(coordinate, t.placements) if p.is_replicate())
    if stores:
        tensors.append(_checked(local, path))
    dtensors.append(DTensorPiece(path, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                 tuple(int(o) for o in offset),
                                 len(tensors) - 1 if stores else None))
    return len(dtensors) - 1


def _capture_entry(obj: Any, path: str, encode: Callable[[Any, str], Any],
                   objects: bool = True) -> dict:
    """The tree node of one registered value; with ``objects=False`` an object's node is left
    empty, without calling its ``state_dict()`` (a collective under FSDP, and not free)."""
    stateful = as_stateful(obj)
    if stateful is not None:
        if not objects:
            return tree_model.object_node()
        state_dict = stateful.state_dict()
        state = encode(state_dict, path)
        metadata = getattr(state_dict, "_metadata", None)
        if isinstance(obj, torch.nn.Module) and metadata is not None:  # module versions
            return tree_model.object_node(state, encode(dict(metadata),
                                                        values.child_path(path, "_metadata")))
        return tree_model.object_node(state)
    if isinstance(obj, torch.Tensor):
        return tree_model.tensor_node(encode(obj, path))
    _refuse_stock_loader(obj, path)
    if isinstance(obj, Mapping) and all(isinstance(k, str) for k in obj):
        return tree_model.dict_node({
            k: _capture_entry(v, values.child_path(path, k), encode, objects)
            for k, v in obj.items()})
    return tree_model.value_node(encode(obj, path))


def _refuse_stock_loader(obj: Any, path: str) -> None:
    if isinstance(obj, (torch.utils.data.DataLoader, torch.utils.data.Sampler)):
        raise EncodingError(
            f"{path!r} is a {type(obj).__name__}, which has no state_dict(): its data position "
            "cannot be saved, and a pickled copy would restore nothing that the running loader "
            "reads. Register an async_ckpt.data.ResumableLoader (or ResumableSampler) instead, or "
            "torchdata's StatefulDataLoader")


def check_registrable(state: Mapping[str, Any], allow_pickle: values.AllowPickle = False) -> None:
    """EncodingError now for what ``capture`` would refuse at the first snapshot, as far as it
    can be known without calling any ``state_dict()``: a stock DataLoader or sampler, a plain
    value with no safe encoding. Otherwise a job would train ``every`` steps before learning it
    cannot be checkpointed."""
    def tensor_or_scalar(value: Any, path: str):  # tensors are checked when captured
        if isinstance(value, torch.Tensor):
            return tensor_leaf(0)
        return encode_torch_scalar(value)

    def encode(value: Any, path: str):
        return values.encode(value, allow_pickle=allow_pickle, leaf=tensor_or_scalar, path=path)

    for key, obj in state.items():
        _capture_entry(obj, key, encode, objects=False)


def encode_torch_scalar(value: Any):
    """torch values that are not tensors but appear in state dicts; NotImplemented for others."""
    if isinstance(value, torch.dtype):
        return leaf_node(Leaf.DTYPE, str(value).removeprefix("torch."))
    if isinstance(value, torch.Size):
        return leaf_node(Leaf.SIZE, list(value))
    if isinstance(value, torch.device):
        return leaf_node(Leaf.DEVICE, str(value))
    return NotImplemented


def _checked(t: torch.Tensor, path: str) -> torch.Tensor:
    if type(t) not in _PLAIN_TENSOR_TYPES:
        raise LayoutError(f"{path}: tensor subclass {type(t).__name__} is not supported; "
                          "save its plain local tensor instead")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise LayoutError(f"{path}: {t.layout} tensors are not supported; convert to dense first")
    if t.dtype not in _SAVEABLE_DTYPES:
        raise LayoutError(f"{path}: {t.dtype} tensors cannot be saved (torch cannot copy them); "
                          "save them as uint8 (t.view(torch.uint8)) instead")
    if not (t.is_cpu or t.is_cuda):
        raise LayoutError(f"{path}: tensors on {t.device} cannot be staged; move them to CPU or CUDA")
    if t.is_conj() or t.is_neg():
        return t.resolve_conj().resolve_neg()  # lazy conjugate/negative views: the real values
    return t  # a Parameter as it is: the plan and the copy read its storage, never its graph


def shuffle_itemsize(t: torch.Tensor) -> int:
    """The element size the byte-shuffle filter should use: a complex number is two floats."""
    return t.element_size() // 2 if t.is_complex() else t.element_size()


class Source(NamedTuple):
    """Where a region's bytes are: ``nbytes`` from byte ``start`` of ``storage``, the storage
    that its tensors viewed when the snapshot was taken (a later ``p.data = x`` leaves it be)."""

    storage: torch.UntypedStorage
    start: int
    nbytes: int

    def view(self) -> torch.Tensor:
        """The bytes as a uint8 tensor; made where they are copied, off the training thread for
        a lazy snapshot (a view costs over a microsecond, a state has hundreds of regions).
        LayoutError if the storage was resized in place since (``set_`` would grow it back)."""
        if self.storage.nbytes() < self.start + self.nbytes:
            raise LayoutError(f"a storage of the state shrank to {self.storage.nbytes()} bytes "
                              f"while its {self.start + self.nbytes} were being staged")
        return torch.empty(0, dtype=torch.uint8, device=self.storage.device).set_(
            self.storage, self.start, (self.nbytes,), (1,))


class Planner:
    """Lays a state's tensors out in a slot: groups them by storage and places the used byte
    range of each storage. It keeps its last plan while the tensors keep their layout (which of
    them share a storage, their offsets, dtypes, shapes and strides, as between two snapshots of
    a training state; an RNG state is a new tensor each time, which changes nothing): laying out
    hundreds of tensors anew is much of what ``snapshot()`` costs training. It keeps no tensor,
    only what the plan was made from."""

    def __init__(self) -> None:
        self._last: Optional[tuple[list, Plan, list[tuple[int, int, int]]]] = None

    def plan(self, tensors: list[torch.Tensor], replica_of: Optional[list[Optional[str]]] = None,
             ) -> tuple[Plan, list[Source]]:
        """The plan of ``tensors`` and, per region, the ``Source`` of the bytes to copy into the
        slot. ``replica_of`` names, per tensor, the replicated entry it belongs to (None: this
        rank's own state); a storage is replicated only when every tensor viewing it is."""
        storages = [t.untyped_storage() for t in tensors]
        numbers: dict[tuple, int] = {}  # the storages, numbered in order of first use
        key: list = [(numbers.setdefault((t.device, s.data_ptr()), len(numbers)),
                      t.storage_offset(), t.dtype, t.shape, t.stride())
                     for t, s in zip(tensors, storages)]
        key.append(replica_of)
        if self._last is None or self._last[0] != key:
            self._last = (key, *_lay_out(tensors, storages, replica_of))
        _, plan, spans = self._last
        return plan, [Source(storages[n], start, nbytes) for n, start, nbytes in spans]


def _lay_out(tensors: list[torch.Tensor], storages: list[torch.UntypedStorage],
             replica_of: Optional[list[Optional[str]]]) -> tuple[Plan, list[tuple[int, int, int]]]:
    """A new plan of ``tensors`` (``storages``: their storages), and per region where its bytes
    are: (the index of a tensor viewing the storage, the region's first byte in it, its bytes)."""
    groups: dict[tuple, dict] = {}
    placed = []
    for n, (t, storage) in enumerate(zip(tensors, storages)):
        if t.numel() == 0:
            placed.append(None)
            continue
        key = (t.device, storage.data_ptr())
        start = t.storage_offset() * t.element_size()
        end = start + span_bytes(t.shape, t.stride(), t.element_size())
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"tensor": n, "start": start, "end": end, "itemsizes": set(),
                               "float": True, "index": len(groups), "replicas": set()}
        g["start"], g["end"] = min(g["start"], start), max(g["end"], end)
        g["itemsizes"].add(shuffle_itemsize(t))
        g["float"] &= t.is_floating_point() or t.is_complex()
        g["replicas"].add(replica_of[n] if replica_of is not None else None)
        placed.append((g, start))

    regions, spans, offset = [], [], 0
    for g in groups.values():
        g["start"] -= g["start"] % ALIGNMENT
        nbytes = g["end"] - g["start"]
        itemsize = g["itemsizes"].pop() if len(g["itemsizes"]) == 1 else 1
        replica = "+".join(sorted(g["replicas"])) if None not in g["replicas"] else None
        offset = align_up(offset, slot_alignment(nbytes))
        regions.append(Region(offset, nbytes, itemsize, g["float"] and itemsize > 1, replica))
        spans.append((g["tensor"], g["start"], nbytes))
        offset += align_up(nbytes)

    records = tuple(
        TensorRecord(None if p is None else p[0]["index"], 0 if p is None else p[1] - p[0]["start"],
                     str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))
        for t, p in zip(tensors, placed))
    return Plan(tuple(regions), records, offset), spans
