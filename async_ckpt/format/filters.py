"""Byte-shuffle filter applied to tensor bytes before zstd.

A float's bytes differ in how well they compress: the plane holding the sign and exponent of
fp32 or bf16 weights compresses ~2.7x, while the mantissa planes are noise (ratio 1.00). Storing
byte p of every item together (plane p) lets the compressor find the redundancy, and lets the
writer store incompressible planes raw.

``shuffle(src, itemsize, dst)`` writes ``dst[p*m + i] = src[i*itemsize + p]`` for ``m`` items;
``unshuffle`` is its inverse. Both take any contiguous buffers (bytes, bytearray, memoryview,
mmap, numpy arrays) of equal length, a multiple of ``itemsize`` (1..16); ``dst`` must be writable
and must not overlap ``src``.

The C extension ``async_ckpt._native`` does the work with the GIL released, near memory bandwidth
(~10 GB/s for itemsize 2 and 4, 3-25x the numpy reference; see ``bench/bench_filters.py``). It is
optional (``setup.py``): where it did not build, the numpy reference runs instead and writes the
same bytes. This module is the one place that decides which runs, and the only module of the
library that imports the extension. Setting ``ASYNC_CKPT_PURE_PYTHON=1`` forces the numpy
reference so the whole suite can run against both; ``BACKEND`` says which one is in use.
"""

from __future__ import annotations

import operator
import os
import sys
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "BACKEND",
    "MAX_ITEMSIZE",
    "shuffle",
    "shuffle_reference",
    "unshuffle",
    "unshuffle_reference",
]

MAX_ITEMSIZE = 16


def _byte_arrays(src: Buffer, itemsize: int, dst: Buffer) -> tuple[np.ndarray, np.ndarray]:
    """Flat uint8 views of ``src`` and ``dst``, validated exactly as the C extension does.

    Both ask the exporter for a simple (contiguous) buffer, so a non-contiguous ``src`` fails with
    the exporter's own error in either backend; an unusable ``dst`` is a TypeError in both.
    """
    s = np.frombuffer(src, np.uint8)
    itemsize = operator.index(itemsize)
    if not -sys.maxsize - 1 <= itemsize <= sys.maxsize:
        raise OverflowError("Python int too large to convert to C ssize_t")
    try:
        d = np.frombuffer(dst, np.uint8)
    except (BufferError, TypeError, ValueError) as e:
        raise TypeError("dst must be a writable contiguous buffer") from e
    if not d.flags.writeable:
        raise TypeError("dst must be a writable contiguous buffer")
    if not 1 <= itemsize <= MAX_ITEMSIZE:
        raise ValueError(f"itemsize must be in 1..{MAX_ITEMSIZE}, got {itemsize}")
    if s.size % itemsize:
        raise ValueError(f"src length {s.size} is not a multiple of itemsize {itemsize}")
    if d.size != s.size:
        raise ValueError(f"dst length {d.size} differs from src length {s.size}")
    return s, d


def shuffle_reference(src: Buffer, itemsize: int, dst: Buffer, /) -> None:
    """numpy version of :func:`shuffle`: the specification the C code is tested against."""
    s, d = _byte_arrays(src, itemsize, dst)
    d.reshape(itemsize, -1)[...] = s.reshape(-1, itemsize).T


def unshuffle_reference(src: Buffer, itemsize: int, dst: Buffer, /) -> None:
    """numpy version of :func:`unshuffle`: the specification the C code is tested against."""
    s, d = _byte_arrays(src, itemsize, dst)
    d.reshape(-1, itemsize)[...] = s.reshape(itemsize, -1).T


def _select_backend() -> tuple[str, Callable[..., None], Callable[..., None]]:
    """The C functions unless the extension did not build (it is optional) or
    ``ASYNC_CKPT_PURE_PYTHON`` is set (not "" or "0")."""
    if os.environ.get("ASYNC_CKPT_PURE_PYTHON", "") in ("", "0"):
        try:
            from async_ckpt import _native
        except ImportError:
            pass
        else:
            return "native", _native.shuffle, _native.unshuffle
    return "python", shuffle_reference, unshuffle_reference


BACKEND, _shuffle, _unshuffle = _select_backend()


def shuffle(src: Buffer, itemsize: int, dst: Buffer, /) -> None:
    """Write the byte planes of ``src`` into ``dst``: ``dst[p*m + i] = src[i*itemsize + p]``."""
    _shuffle(src, itemsize, dst)


def unshuffle(src: Buffer, itemsize: int, dst: Buffer, /) -> None:
    """Inverse of :func:`shuffle`: ``dst[i*itemsize + p] = src[p*m + i]``."""
    _unshuffle(src, itemsize, dst)
