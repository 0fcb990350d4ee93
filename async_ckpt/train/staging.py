"""The staging pool: CPU buffers in shared memory, allocated once, pre-faulted, reused.

Each slot is an anonymous shared-memory file (memfd) mapped into the training process and handed to
the writer process as a file descriptor, so the writer reads the staged bytes without another copy
and no named file can leak in /dev/shm when a process dies. The first touch of fresh shared memory
runs at ~0.7 GB/s against ~5 GB/s warm (measured), so slots are faulted in when allocated and kept
for the engine's lifetime; they grow only when the state grows. With CUDA the slots are page-locked
(``cudaHostRegister``) so device-to-host copies run at full speed and asynchronously; where the
runtime refuses that (a sandbox), the slot stays pageable and its copies synchronous: said once,
counted (``StagingPool.pin_failures``, the engine's ``stats()``), never retried for that memory.

A copy into a slot (``Copy``) is started by ``start`` and runs in the background: CPU regions on
the pool's copy thread, in pieces of ``PIECE_BYTES`` (torch's ``copy_`` releases the GIL), CUDA
regions as non-blocking copies on a side stream ordered after the work already queued, with an
event recorded after them. ``stage`` starts one and waits for it (eager staging); lazy staging
lets training run on until a fence waits for it (``engine.py``).

With ``checksums``, a copy also checksums each region's chunks (``CHUNK_BYTES`` from its start,
as a shard and the memory tier's keeper cut them) while copying them: a piece of
``HASH_PIECE_BYTES`` is checksummed right after it is copied, while it is still in the CPU's
cache, which costs a fraction of reading the slot again afterwards (the keeper's seal did that,
and it was the largest cost of a memory snapshot on a busy machine).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Collection, Optional

import torch

from ..errors import StagingMemoryError
from ..format.layout import Plan, align_up
from ..format.shard import CHUNK_BYTES, checksummer
from .capture import Source

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device, not only one
_GROWTH_ALIGNMENT = 2 << 20
PIECE_BYTES = 64 << 20
"""The copy thread copies a CPU region this many bytes at a time."""
HASH_PIECE_BYTES = 1 << 20
"""With checksums, a CPU region is copied this many bytes at a time, each piece checksummed
while in cache (about an L2 cache's size: smaller pieces cost more calls than they save)."""


class Copy:
    """A copy into a slot in progress: CPU regions on the copy thread (``future``), CUDA regions
    on side streams (``events``). ``wait`` returns once every byte is in the slot."""

    def __init__(self, future: Optional[Future], events: list,
                 digests: Optional[list[Optional[tuple[str, ...]]]] = None):
        self._future, self._events = future, events
        self.started = time.perf_counter()
        self.finished = self.started  # when the CPU part ended (set by whoever copied it)
        self.seconds: Optional[float] = None  # how long the copy ran, once waited for
        self._digests = digests  # by region, filled in as the copy goes

    @property
    def checksums(self) -> Optional[tuple[Optional[tuple[str, ...]], ...]]:
        """Each region's chunk checksums once ``wait`` returned, where the copy was asked for
        them: None for a region it made none of (a CUDA region, one not copied)."""
        if self.seconds is None or self._digests is None:
            return None
        return tuple(self._digests)

    def wait(self) -> float:
        """Wait for the whole copy; the seconds from its start to its end (re-raises an error
        of the copy thread)."""
        if self.seconds is None:
            if self._future is not None:
                self.finished = max(self.finished, self._future.result())
            for event in self._events:
                event.synchronize()
            if self._events:
                self.finished = max(self.finished, time.perf_counter())
            self.seconds = self.finished - self.started
        return self.seconds


@dataclass(eq=False)
class Slot:
    """One staging buffer. ``buffer_id`` changes whenever the memory behind the slot is replaced.
    ``busy``: the writer reads it; ``held``: the memory tier's keeper holds it, or will
    (``train/memory_tier.py``). Either keeps it from being staged into, or read into.
    ``written``: (step, plan) of the snapshot the writer wrote from it, while its bytes are still
    here (until the slot is staged or read into again): a restore of that step reads them."""

    index: int
    buffer_id: int = -1
    nbytes: int = 0
    fd: int = -1
    busy: bool = False
    held: bool = False
    pinned: bool = False
    written: Optional[tuple[int, Plan]] = None
    written_order: int = 0  # when, counted in writes (the newest is the last one replaced)
    _map: Optional[mmap.mmap] = field(default=None, repr=False)
    tensor: Optional[torch.Tensor] = field(default=None, repr=False)

    def free_memory(self) -> None:
        self.written = None
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view of it still lives (see StagingPool.scratch): unmapped
                pass  # when that view goes
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.nbytes = 0


class StagingPool:
    """A fixed number of slots, whose flags only the pool sets: a free one is acquired per
    snapshot, and freed by the writer's "released" message and the keeper's letting go."""

    def __init__(self, slots: int, copy_nice: int = 0):
        self.slots = [Slot(i) for i in range(slots)]
        self.copy_nice = copy_nice  # added to the copy thread's (Linux threads have their own)
        self.pin_failures = 0  # slot memories cudaHostRegister refused
        self._refused: set[int] = set()  # their buffer ids: not asked again
        self._next_buffer_id = 0
        self._writes = itertools.count(1)  # Slot.written_order
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}
        self._copier: Optional[tuple[int, ThreadPoolExecutor]] = None  # (pid that made it, pool)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def free_slot(self, empty: bool = False) -> Optional[Slot]:
        """A slot neither the writer nor the keeper uses (``empty``: nor holding what a snapshot
        was written from). Of those, one with memory first (none is allocated that need not
        be), and of those the one that holds no written snapshot, else the oldest: a restore
        reads the newest one from its slot."""
        free = [s for s in self.slots if not (s.busy or s.held or (empty and s.written))]
        return min(free, key=lambda s: (s.tensor is None, s.written is not None, s.written_order),
                   default=None)

    def acquire(self, slot: Slot, writer: bool, keeper: bool) -> None:
        """``slot``, staged into, is the ``writer``'s to read and the ``keeper``'s to hold until
        each releases it."""
        slot.busy, slot.held = writer, keeper

    def release(self, slot: Slot) -> None:
        """``slot`` never reached the writer or the keeper: free again."""
        slot.busy = slot.held = False

    def release_written(self, buffer_id: int) -> None:
        """The writer's "released" message: it no longer reads ``buffer_id``."""
        for slot in self.slots:
            if slot.buffer_id == buffer_id:
                slot.busy = False

    def release_held(self, buffer_id: Optional[int] = None) -> None:
        """The keeper no longer holds ``buffer_id`` (None: any, the keeper is gone)."""
        for slot in self.slots:
            if buffer_id is None or slot.buffer_id == buffer_id:
                slot.held = False

    def scratch(self, slot: Optional[Slot] = None) -> Optional[memoryview]:
        """The memory of ``slot``, or of the largest free slot that holds no written snapshot's
        bytes (``written``: a restore may read those), for a restore to read into
        (``read_snapshot``'s ``scratch``): faulted in already, and the next snapshot's to
        overwrite. None before any slot is allocated."""
        free = [slot] if slot is not None else [
            s for s in self.slots
            if not (s.busy or s.held) and s.written is None and s._map is not None]
        if not free:
            return None
        chosen = max(free, key=lambda s: s.nbytes)
        chosen.written = None
        return memoryview(chosen._map)

    def wrote(self, slot: Slot, step: int, plan: Plan) -> None:
        """The writer writes the snapshot of ``step`` from ``slot`` (``Slot.written``); no other
        slot holds that step's bytes any more."""
        for other in self.slots:
            if other.written is not None and other.written[0] == step:
                other.written = None
        slot.written, slot.written_order = (step, plan), next(self._writes)

    def written_copies(self) -> list[tuple[int, Plan, memoryview]]:
        """(step, plan, memory) of each slot that holds what a snapshot was written from."""
        return [(s.written[0], s.written[1], memoryview(s._map)) for s in self.slots
                if s.written is not None and s._map is not None]

    def fit(self, slot: Slot, plan: Plan, pin: bool) -> bool:
        """Make ``slot`` large enough for ``plan``; True when its memory was replaced.

        ``pin`` asks for page-locked memory; it is asked only when the state has CUDA tensors, so a
        CPU job on a GPU machine never creates a CUDA context."""
        replaced = slot.tensor is None or slot.nbytes < plan.nbytes
        if replaced:
            slot.free_memory()
            size = max(align_up(plan.nbytes, _GROWTH_ALIGNMENT), _GROWTH_ALIGNMENT)
            try:
                slot.fd = os.memfd_create(f"async_ckpt-slot{slot.index}",
                                          os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(slot.fd, size)
                # never resized: whoever maps it (the writer, the keeper, a restore from the
                # keeper) can rely on that, as no read of a mapping can then fault
                fcntl.fcntl(slot.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                slot._map = mmap.mmap(slot.fd, size)
                slot.tensor = torch.frombuffer(slot._map, dtype=torch.uint8)
                slot.tensor.fill_(0)  # fault every page in now, not during a snapshot
            except (OSError, RuntimeError) as e:
                slot.free_memory()
                raise StagingMemoryError(
                    f"could not allocate a {size / 1e6:.0f} MB staging buffer: {e}. Free host "
                    "memory or use fewer slots") from e
            slot.nbytes = size
            slot.buffer_id = self._next_buffer_id
            self._next_buffer_id += 1
            log.info("staging slot %d: %.1f MB", slot.index, size / 1e6)
        if pin and not slot.pinned and slot.buffer_id not in self._refused:
            self._pin(slot)
        return replaced

    def _pin(self, slot: Slot) -> None:
        """Page-lock the slot so CUDA copies into it are asynchronous and run at full bandwidth;
        where that is refused, the slot stays pageable (copies into it synchronous)."""
        err = torch.cuda.cudart().cudaHostRegister(slot.tensor.data_ptr(), slot.nbytes,
                                                   _HOST_REGISTER_PORTABLE)
        if int(err) == 0:
            slot.pinned = True
            return
        self._refused.add(slot.buffer_id)
        self.pin_failures += 1
        if self.pin_failures == 1:
            log.warning("could not page-lock staging slot %d (cudaHostRegister error %s); "
                        "device-to-host copies into slots that cannot be pinned run "
                        "synchronously, more slowly (counted in stats()['pin_failures'])",
                        slot.index, err)

    def stage(self, plan: Plan, sources: list[Source], slot: Slot,
              skip: Collection[int] = ()) -> float:
        """Copy and wait for the copy (the CPU part on the calling thread): once this returns,
        the caller may change its tensors. Returns the seconds the copy took."""
        return self.start(plan, sources, slot, skip, background=False).wait()

    def start(self, plan: Plan, sources: list[Source], slot: Slot,
              skip: Collection[int] = (), background: bool = True,
              now: Collection[int] = (), checksums: bool = False) -> Copy:
        """Start copying each region's bytes into the slot, except regions ``skip`` (an
        incremental snapshot refers to them where they are stored already); returns at once
        (unless not ``background``: then the CPU regions are copied before it returns), but
        for regions ``now``, which nothing may change after the call returns (module buffers,
        updated in the forward pass): CPU ones are copied before it returns, and the current
        CUDA stream waits for the copy of CUDA ones before its next work. ``checksums``: CPU
        regions are checksummed as they are copied (``Copy.checksums``).

        The copy reads the tensors as they are while it runs: until ``Copy.wait`` returns, the
        caller must not change them (lazy staging fences every write path it knows of). CUDA
        regions are copied on a side stream that first waits for the work already queued on the
        current stream (the values the caller sees)."""
        slot.written = None
        cpu, inline, events, used_streams = [], [], [], []
        digests = [None] * len(plan.regions) if checksums else None
        for k, (region, src) in enumerate(zip(plan.regions, sources)):
            if k in skip:
                continue
            device = src.storage.device
            if device == _CPU:  # (capture refuses other devices than the CPU and CUDA ones)
                (inline if k in now or not background else cpu).append((k, region.offset, src))
                continue
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            if stream not in used_streams:
                stream.wait_stream(torch.cuda.current_stream(device))
                used_streams.append(stream)
            with torch.cuda.stream(stream):
                view = src.view()
                slot.tensor[region.offset:region.offset + src.nbytes].copy_(
                    view, non_blocking=slot.pinned)
                view.record_stream(stream)  # freed before the copy ran: not reused until then
            if k in now:  # the compute stream's next work (a forward) may write it
                torch.cuda.current_stream(device).wait_event(stream.record_event())
        for stream in used_streams:
            events.append(stream.record_event())
        copy = Copy(self._copy_thread().submit(_copy_pieces, slot.tensor, cpu, digests)
                    if cpu else None, events, digests)
        if inline:
            copy.finished = _copy_pieces(slot.tensor, inline, digests)
        return copy

    def _copy_thread(self) -> ThreadPoolExecutor:
        """The pool's one copy thread, made on first use (and anew in a forked child, which
        inherits the executor but not its thread)."""
        if self._copier is None or self._copier[0] != os.getpid():
            self._copier = (os.getpid(), ThreadPoolExecutor(
                1, "async_ckpt-stage", initializer=_lower_thread_priority,
                initargs=(self.copy_nice,)))
        return self._copier[1]

    def close(self) -> None:
        if self._copier is not None and self._copier[0] == os.getpid():
            self._copier[1].shutdown(wait=True)
        self._copier = None
        for slot in self.slots:
            slot.free_memory()


def _copy_pieces(slot: torch.Tensor, regions: list[tuple[int, int, Source]],
                 digests: Optional[list]) -> float:
    """Copy each (region number, offset in the slot, source), ``PIECE_BYTES`` at a time, or
    with ``digests`` ``HASH_PIECE_BYTES`` at a time, each region's chunk checksums put in
    ``digests`` by its number; returns when it finished (``time.perf_counter``)."""
    memory = None if digests is None else memoryview(slot.numpy())
    for k, offset, source in regions:
        src = source.view()
        if memory is None:
            for start in range(0, source.nbytes, PIECE_BYTES):
                end = min(start + PIECE_BYTES, source.nbytes)
                slot[offset + start:offset + end].copy_(src[start:end])
            continue
        chunks = []
        for chunk in range(0, source.nbytes, CHUNK_BYTES):
            digest = checksummer()
            for start in range(chunk, min(chunk + CHUNK_BYTES, source.nbytes), HASH_PIECE_BYTES):
                end = min(start + HASH_PIECE_BYTES, chunk + CHUNK_BYTES, source.nbytes)
                slot[offset + start:offset + end].copy_(src[start:end])
                digest.update(memory[offset + start:offset + end])
            chunks.append(digest.hexdigest())
        digests[k] = tuple(chunks)
    return time.perf_counter()


def _lower_thread_priority(nice: int) -> None:
    if nice:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
