"""Tensor records of a shard index (``format.records.StoredTensor``, checked by the format's
validator) in torch's terms: the one rule for the restore path and the sharded-tensor reader."""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import CorruptSnapshotError
from ..format.records import StoredTensor
from ..tensors import DTYPES


def torch_dtype(t: StoredTensor, where: str, i: int) -> torch.dtype:
    """The dtype of tensor record ``i``: one the format knows may be unknown to this torch (an
    older release than the writer's)."""
    dtype = DTYPES.get(t.dtype)
    if dtype is None:
        raise CorruptSnapshotError(f"{where}: tensor {i}: unknown dtype {t.dtype!r} (not in this "
                                   "release of torch)")
    return dtype


def alignments(records: Iterable[StoredTensor], rank: int) -> dict[tuple[int, int], int]:
    """(rank, storage) -> the largest alignment the dtypes of the tensor records of ``rank``'s
    shard that view it need: a mapped storage must start at a multiple of it. A dtype's alignment
    is its element size (complex128: 16)."""
    need: dict[tuple[int, int], int] = {}
    for t in records:
        if t.storage is not None:
            key = t.held_in(rank)
            need[key] = max(need.get(key, 1), t.itemsize)
    return need
