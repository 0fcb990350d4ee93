"""The floors: physical limits of this machine for a byte count, measured in the same run as the
systems so that every figure can be read as a multiple of what the hardware allows.

* copy (``copy_s``): one ``copy_`` of the byte count into a preallocated, pre-faulted CPU buffer. An
  asynchronous checkpoint must copy the state at least once before training may modify it, so this
  bounds blocking time from below.
* dd (``dd_s``): ``dd if=/dev/zero bs=1M conv=fsync`` of the byte count. Nothing makes those bytes
  durable faster than the disk, so this bounds time-to-durable from below (compression off).
* read (``read_cache_s``): reading the dd file straight back, from the page cache; the floor for a
  restore of a checkpoint that was just written (also read from the page cache).
* cold read (``read_cold_s``): the dd file's pages evicted (``measure.evict``: fsync, then
  ``POSIX_FADV_DONTNEED``), then read sequentially from the disk; the floor for a cold restore,
  whose snapshot files are evicted the same way.

Both reads go 1 MiB at a time into a preallocated, pre-faulted buffer. The dd file is removed with
its directory fsynced (``measure.remove(settle=True)``), and the sweep takes its floor sample
before the cleanup of the system it runs next to, never right after a large deletion.

Informative extras, off unless asked for: a copy into a memfd-like shared-memory buffer as the
engine's staging slots are (``copy_shm_s``), and ``dd oflag=direct bs=8M`` (``dd_direct_s``), the disk
without the page cache (on this VM allocating page-cache pages can cost more than the disk).
"""

from __future__ import annotations

import mmap
import os
import subprocess
from typing import Optional

import torch

from .measure import evict, remove, spread, timed

FLOOR_KEYS = ("copy_s", "dd_s", "read_cache_s", "read_cold_s")
READ_CHUNK = 1 << 20


class Floors:
    """The floors for ``nbytes``, measured on demand (``measure()``) so they can be interleaved
    with the systems' runs; every sample is kept in ``samples``."""

    def __init__(self, directory: str, nbytes: int, shm: bool = False, direct: bool = False):
        self.directory, self.nbytes, self.direct = directory, nbytes, direct
        self.src = torch.ones(nbytes, dtype=torch.uint8)  # faulted in by the fill
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self._shm: Optional[mmap.mmap] = None
        self.shm: Optional[torch.Tensor] = None
        if shm:
            self._shm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)  # like a staging slot
            self.shm = torch.frombuffer(self._shm, dtype=torch.uint8)
            self.shm.fill_(0)
        self.buffer_bytes = (3 if shm else 2) * nbytes
        self.samples: list[dict] = []

    def measure(self) -> dict:
        sample = {"copy_s": timed(lambda: self.dst.copy_(self.src))}
        if self.shm is not None:
            sample["copy_shm_s"] = timed(lambda: self.shm.copy_(self.src))
        sample.update(self._dd_and_read())
        self.samples.append(sample)
        return sample

    def medians(self, samples: Optional[list[dict]] = None) -> dict:
        """{floor key: ``spread``} over ``samples`` (default: all taken so far)."""
        samples = self.samples if samples is None else samples
        return {k: spread([s[k] for s in samples]) for k in samples[0]}

    def _dd_and_read(self) -> dict:
        path = os.path.join(self.directory, "dd.bin")
        figures = {}
        try:
            figures["dd_s"] = timed(lambda: self._dd(path, "bs=1M"))
            figures["read_cache_s"] = timed(lambda: read_into(path, self.dst))
            evict(path)
            figures["read_cold_s"] = timed(lambda: read_into(path, self.dst))
            remove(path, settle=True)
            if self.direct:
                figures["dd_direct_s"] = timed(lambda: self._dd(path, "bs=8M", "oflag=direct"))
        finally:
            remove(path, settle=True)
        return figures

    def _dd(self, path: str, *flags: str) -> None:
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", *flags, f"count={self.nbytes}",
                        "iflag=count_bytes", "conv=fsync", "status=none"], check=True)

    def close(self) -> None:
        self.src = self.dst = None
        if self._shm is not None:
            self.shm = None
            self._shm.close()
            self._shm = None


def read_into(path: str, dst: torch.Tensor) -> None:
    """Read ``path`` sequentially, ``READ_CHUNK`` bytes a call, into ``dst`` (preallocated)."""
    view = memoryview(dst.numpy())
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + READ_CHUNK])
            if not n:
                raise EOFError(f"{path} is shorter than {len(view)} bytes")
            done += n
