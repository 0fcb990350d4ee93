"""The layout of a snapshot: which byte ranges of a staging slot hold which storages, which
tensors view them (``Plan``), and which rank writes which of those bytes (``ShardLayout``).

Plain data, no torch: the training process builds a ``Plan`` (in ``capture.py``), the writer process
turns it into file contents, and the restore path turns the tensor records back into tensors. A
plan is compared by value to decide whether the staging pool must be re-planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..storage.base import DIRECT_ALIGNMENT

# Storages start on this boundary inside a slot and inside a restored buffer, which keeps every
# tensor's byte offset a multiple of its element size (complex128 is the widest at 16 bytes).
ALIGNMENT = 64

DIRECT_BYTES = 1 << 20
"""Storages of at least this many bytes start at a multiple of ``DIRECT_ALIGNMENT`` in a slot,
so that the writer writes them from the slot straight to the disk (direct I/O); smaller ones
go through a bounce buffer, where the copy costs less than aligning them would in padding."""


def slot_alignment(nbytes: int) -> int:
    """Where in a slot a storage of ``nbytes`` starts: at a multiple of this."""
    return DIRECT_ALIGNMENT if nbytes >= DIRECT_BYTES else ALIGNMENT


@dataclass(frozen=True)
class Region:
    """The bytes of one storage that some tensor uses, staged at ``offset`` in a slot."""

    offset: int
    nbytes: int
    itemsize: int  # element size for the byte-shuffle filter; 1 when tensors of sizes differ
    is_float: bool  # floating-point data: worth byte-shuffling before compression
    replica_of: Optional[str] = None  # the replicated entry it belongs to (same bytes on every rank)


@dataclass(frozen=True)
class TensorRecord:
    """A tensor as a strided view into a region (``region`` is None for tensors with no elements)."""

    region: Optional[int]
    offset: int  # bytes from the start of the region
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def to_json(self, storage: Optional[int], rank: Optional[int] = None) -> dict:
        """The shard index's record: ``storage`` indexes the storages of this shard, or of
        ``rank``'s shard when the bytes are stored there."""
        return {"storage": storage, "offset": self.offset, "dtype": self.dtype,
                "shape": list(self.shape), "stride": list(self.stride),
                **({} if rank is None else {"rank": rank})}


@dataclass(frozen=True)
class Plan:
    """Everything about a state's tensors that stays fixed from one snapshot to the next."""

    regions: tuple[Region, ...]
    tensors: tuple[TensorRecord, ...]
    nbytes: int  # slot bytes needed

    @property
    def raw_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)


def span_bytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes from the first element of a strided tensor to past its last (no elements: 0): what
    it occupies of its storage, from its offset on."""
    if not math.prod(shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * itemsize


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class SlotCopy:
    """The bytes one rank's shard of the committed snapshot ``step`` was written from, still in
    a staging slot's ``memory``: storage ``n`` of that shard from ``regions[n]`` (offset,
    nbytes). A restore of ``step`` takes a storage from here instead of the file once its bytes
    match the shard's chunk checksums (``read/snapshot.py``): direct writes leave nothing in the
    page cache, so without this a restore right after a snapshot would read the disk."""

    step: int
    memory: memoryview
    regions: tuple[tuple[int, int], ...]


# --- which rank writes which bytes ------------------------------------------------------------
#
# State that every rank holds identically (a DDP model and its optimizer, declared with
# ``replicated=``) is written once: each replicated region gets one owner rank, which stores it in
# its shard; the other ranks' shards refer to the owner's copy. Everything else is the rank's own
# state and goes into its own shard. The layout is a pure function of the plan, the rank and the
# world size, so every rank computes the same owners and the same storage numbers without talking
# to the others; the replicas' checksums in every shard let the committer check that the ranks
# really agreed.


@dataclass(frozen=True)
class ShardLayout:
    """What one rank's shard holds: ``written`` lists plan region indices in file order (the
    replicas this rank owns, then its own regions); ``tensors`` are the index's tensor records."""

    written: tuple[int, ...]
    replica_fields: tuple[dict, ...]  # per written region: extra index fields ({"replica": k})
    replicas: tuple[tuple[int, str, int], ...]  # per replica k: (region, entry name, owner rank)
    tensors: tuple[dict, ...]

    @property
    def uses_references(self) -> bool:
        return bool(self.replicas)


def owners(sizes: list[int], world_size: int, spread: bool) -> list[int]:
    """The rank that writes each replica: rank 0 for all, or (``spread``) a greedy balance of
    bytes, largest first, ties to the lower rank and the earlier replica."""
    if not spread:
        return [0] * len(sizes)
    load = [0] * world_size
    result = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        result[k] = rank
        load[rank] += sizes[k]
    return result


def shard_layout(plan: Plan, rank: int, world_size: int, spread: bool) -> ShardLayout:
    """The layout of ``rank``'s shard. With one rank, replication changes nothing."""
    replicated = ([i for i, r in enumerate(plan.regions) if r.replica_of is not None]
                  if world_size > 1 else [])
    owner = owners([plan.regions[i].nbytes for i in replicated], world_size, spread)
    # Storage number of replica k inside its owner's shard: owned replicas come first, in order.
    position, next_position = [], [0] * world_size
    for k in range(len(replicated)):
        position.append(next_position[owner[k]])
        next_position[owner[k]] += 1
    replica_number = {region: k for k, region in enumerate(replicated)}
    owned = [region for k, region in enumerate(replicated) if owner[k] == rank]
    own = [i for i in range(len(plan.regions)) if i not in replica_number]
    written = owned + own
    storage_of = {region: n for n, region in enumerate(written)}

    def record(t) -> dict:
        if t.region is None or t.region in storage_of:
            return t.to_json(storage_of.get(t.region))
        k = replica_number[t.region]
        return t.to_json(position[k], rank=owner[k])

    return ShardLayout(
        written=tuple(written),
        replica_fields=tuple({"replica": replica_number[i]} if i in replica_number else {}
                             for i in written),
        replicas=tuple((region, plan.regions[region].replica_of, owner[k])
                       for k, region in enumerate(replicated)),
        tensors=tuple(record(t) for t in plan.tensors))
