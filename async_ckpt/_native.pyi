"""C byte-shuffle filter; use async_ckpt.format.filters, which falls back to numpy without it."""

from typing_extensions import Buffer

def shuffle(src: Buffer, itemsize: int, dst: Buffer, /) -> None:
    """Write the byte planes of src into dst: dst[p*m + i] = src[i*itemsize + p] (no overlap)."""

def unshuffle(src: Buffer, itemsize: int, dst: Buffer, /) -> None:
    """Inverse of shuffle: dst[i*itemsize + p] = src[p*m + i] (no overlap)."""
