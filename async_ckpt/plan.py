"""The layout of a staged snapshot: which byte ranges of a staging slot hold which storages, and
which tensors view them.

Plain data, no torch: the training process builds a ``Plan`` (in ``capture.py``), the writer process
turns it into file contents, and the restore path turns the tensor records back into tensors. A
plan is compared by value to decide whether the staging pool must be re-planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Storages start on this boundary inside a slot and inside a restored buffer, which keeps every
# tensor's byte offset a multiple of its element size (complex128 is the widest at 16 bytes).
ALIGNMENT = 64


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


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment
