"""Tensor records of a shard index (docs/FORMAT.md 3.5), checked before a tensor is built on them:
the one rule for the restore path, the sharded-tensor reader and ``inspect``."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import CorruptSnapshotError
from ..format.shard import MAX_DIMS, MAX_EXTENT
from ..tensors import DTYPES


def tensor_layout(r: Any, path: str, i: int) -> tuple[torch.dtype, list, list]:
    """The dtype, shape and stride of tensor record ``i`` (docs/FORMAT.md 3.5), checked: a known
    dtype, at most 64 dimensions, sizes and strides in [0, 2^62], at most 2^62 elements, and a
    storage reference of the right types."""
    def bad(why: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{path}: tensor {i}: {why}")

    if not isinstance(r, dict):
        raise bad("not an object")
    dtype = DTYPES.get(r["dtype"]) if type(r.get("dtype")) is str else None
    shape, stride = r.get("shape"), r.get("stride")
    if dtype is None:
        raise bad(f"unknown dtype {str(r.get('dtype'))[:40]!r}")
    if not (type(shape) is list and type(stride) is list and len(shape) == len(stride) <= MAX_DIMS
            and all(type(n) is int and 0 <= n <= MAX_EXTENT for n in shape + stride)):
        raise bad("malformed shape or stride")
    if math.prod(shape) > MAX_EXTENT:
        raise bad("more elements than any storage can hold")
    if not ((r.get("storage") is None or type(r["storage"]) is int) and type(r.get("rank", 0)) is int
            and type(r.get("offset", 0)) is int):
        raise bad("bad storage reference")
    return dtype, shape, stride


def alignments(records: Any, rank: int) -> dict[tuple[int, int], int]:
    """(rank, storage) -> the largest alignment the dtypes of the (not yet validated) tensor
    records that view it need: a mapped storage must start at a multiple of it. A dtype's
    alignment is its element size (complex128: 16). Malformed records count for nothing here;
    ``tensor_layout`` refuses them."""
    need: dict[tuple[int, int], int] = {}
    for r in records if isinstance(records, list) else ():
        dtype = DTYPES.get(r.get("dtype")) if isinstance(r, dict) and type(r.get("dtype")) is str else None
        if dtype is not None and type(r.get("storage")) is int and type(r.get("rank", rank)) is int:
            key = (r.get("rank", rank), r["storage"])
            need[key] = max(need.get(key, 1), dtype.itemsize)
    return need
