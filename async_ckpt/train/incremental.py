"""Which storages changed since a committed snapshot stored them, so that an incremental snapshot
(``incremental=True``) neither stages nor writes the others: its shard refers to the bytes where
they already are.

A storage counts as unchanged when it is the same storage (the same storage object, held through
a weak reference so that a freed one is never taken for a new one at the same address; the same
data pointer, size and used byte range) viewed by tensors with the same layout (the plan is equal)
whose version counters did not move. The version counter sees every write made through torch:
in-place ops, optimizer steps, ``copy_`` under ``no_grad``, ``load_state_dict``; ``.data = x``
replaces the storage. It cannot see writes that bypass it: through a NumPy array or a DLPack
capsule sharing the memory, in place through ``.data`` (a tensor with a counter of its own), through
a raw ``data_ptr`` or a C extension. Parameters that require grad are therefore never referred to
(``trainable_storages``): they change every step anyway, and optimizers and EMA code of the older
style write them through ``.data``. For the rest, every ``full_every``-th snapshot is written whole,
which bounds how many snapshots such a change can miss.

A reference goes only to the snapshot that physically stored the bytes, and only once that one is
committed: an in-flight snapshot may still fail, and then its bytes are written again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..format.layout import Plan
from ..tensors import registered_objects
from .capture import Source


def trainable_storages(state: Any) -> set[int]:
    """Storage addresses of the parameters that require grad of the modules in ``state``
    (``tensors.registered_objects``: directly, in dicts, or attributes of an ``AppState``)."""
    return {p.untyped_storage().data_ptr()
            for module in registered_objects(state, (torch.nn.Module,))
            for p in module.parameters() if p.requires_grad}


@dataclass
class _Holder:
    """The snapshot that stored a region's bytes, and what the region looked like then."""

    fingerprint: tuple
    storage: StorageWeakRef  # expires when the storage is freed: then the region changed
    dir: str
    step: int
    job: int
    committed: bool = False


class ChangeTracker:
    """Per region of the current plan, the snapshot holding its bytes (see the module doc)."""

    def __init__(self, full_every: int):
        self.full_every = full_every
        self._plan: Optional[Plan] = None
        self._holders: dict[int, _Holder] = {}
        self._incremental_in_a_row = 0

    def reset(self) -> None:
        """Forget everything: the next snapshot is full. After a restore (the restored bytes came
        from a snapshot and must be compared afresh) and after a snapshot failed."""
        self._plan, self._incremental_in_a_row = None, 0
        self._holders.clear()

    def unchanged(self, plan: Plan, sources: list[Source], tensors: list[torch.Tensor],
                  job: int, step: int, directory: str,
                  trainable: frozenset = frozenset()) -> dict[int, str]:
        """The regions of snapshot ``job`` (of ``step``, into ``directory``) to refer to instead
        of writing, each with the directory holding its bytes; this snapshot becomes the holder
        of the regions it writes. ``sources`` and ``tensors`` are ``Planner.plan``'s and
        ``capture``'s; regions over ``trainable`` storages (``trainable_storages``) are always
        written."""
        if plan != self._plan:  # another layout: region numbers mean other storages
            self._plan = plan
            self._holders.clear()
        full = self._incremental_in_a_row + 1 >= self.full_every
        versions: list[list[int]] = [[] for _ in plan.regions]
        for record, t in zip(plan.tensors, tensors):
            if record.region is not None:
                versions[record.region].append(t._version)
        refer = {}
        for k, source in enumerate(sources):
            storage = source.storage
            weak = StorageWeakRef(storage)
            fingerprint = (weak.cdata, storage.data_ptr(), storage.nbytes(), source.start,
                           tuple(versions[k]))
            holder = self._holders.get(k)
            same = (holder is not None and holder.fingerprint == fingerprint
                    and not holder.storage.expired() and holder.step != step
                    and storage.data_ptr() not in trainable)
            if same and holder.committed and not full:
                refer[k] = holder.dir
            elif full or not same:
                self._holders[k] = _Holder(fingerprint, weak, directory, step, job)
            # else: unchanged, but its holder is still in flight: written again, holder kept
        self._incremental_in_a_row = self._incremental_in_a_row + 1 if refer else 0
        return refer

    def committed(self, job: int) -> None:
        """Snapshot ``job`` is committed: the regions it holds may be referred to."""
        for holder in self._holders.values():
            if holder.job == job:
                holder.committed = True
