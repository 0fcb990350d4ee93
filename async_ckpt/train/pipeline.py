"""The snapshot pipeline: capture -> plan -> fit the slot -> attach -> copy -> job.

``CheckpointEngine.snapshot()`` decides when a snapshot is taken, into which slot, and what an
error means; it calls ``prepare`` (capture the state, lay it out, make the slot fit, telling the
writer of new memory), then ``start`` (the copy into the slot, and the writer's job), and, once
the copy has ended (``Staged.wait``, at the engine's fence), ``hand_over`` (to the writer and the
memory tier's keeper) or ``abandon``. The pipeline keeps what one snapshot passes to the next:
the planner's layout and the plan the writer holds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Collection, MutableMapping, Optional

import torch

from ..errors import LayoutError
from ..format.layout import Plan, SlotCopy, shard_layout
from ..rng import GlobalRNG
from ..format.tree import RNG_KEY
from ..tensors import registered_objects
from ..write.client import WriterClient
from ..write.protocol import Marker, SnapshotJob
from .capture import Captured, Planner, Source, capture
from .incremental import ChangeTracker, trainable_storages
from .memory_tier import SHARDED_REFUSED, MemoryTier
from .staging import Copy, Slot, StagingPool


@dataclasses.dataclass
class Prepared:
    """A captured state laid out in its slot (the slot fits it): what ``start`` copies."""

    captured: Captured
    plan: Plan
    sources: list[Source]


@dataclasses.dataclass
class Staged:
    """A snapshot of ``step`` being copied into its slot: handed to the writer (``job``) and the
    memory tier's keeper (``memory``: its plan and state tree) once the copy is done and none of
    the ``watched`` (key path, tensor, version) tensors changed meanwhile. ``staged_bytes``: what
    the copy moves (an incremental snapshot refers to the rest)."""

    copy: Copy
    slot: Slot
    plan: Plan
    watched: list
    step: int
    job: Optional[SnapshotJob]
    memory: Optional[tuple]
    staged_bytes: int

    def changed(self) -> list[str]:
        """The key paths of the watched tensors written since the copy started (lazy staging)."""
        return [path for path, t, version in self.watched if t._version != version]


class SnapshotPipeline:
    """The staging of snapshots into ``pool``'s slots for ``writer`` (and ``memory``, the memory
    tier, if any). ``allow_pickle``, ``rng`` (the global RNG states, captured with the state) and
    ``replicated`` are the engine's settings; ``require_memory(nbytes)`` is asked before a slot
    of the memory tier grows (shared memory that is not there kills the process that touches it,
    rather than failing its allocation). ``raw``: shards store the slot's bytes as they are
    (no compression), so a restore may read a written snapshot's bytes from its slot."""

    def __init__(self, pool: StagingPool, writer: WriterClient, memory: Optional[MemoryTier],
                 allow_pickle: Any, rng: Optional[GlobalRNG], replicated: frozenset[str],
                 require_memory: Callable[[int], None], raw: bool):
        self.pool, self._writer, self._memory = pool, writer, memory
        self._allow_pickle, self._rng, self._replicated = allow_pickle, rng, replicated
        self._require_memory, self._raw = require_memory, raw
        self._planner = Planner()
        self._writer_plan: Optional[Plan] = None  # the plan the writer holds

    def capture(self, state: MutableMapping[str, Any]) -> Captured:
        """``capture`` of ``state`` and, with ``rng``, the global RNG states."""
        return capture(state if self._rng is None else {**state, RNG_KEY: self._rng},
                       self._allow_pickle)

    def prepare(self, state: MutableMapping[str, Any], slot: Slot, to_memory: bool) -> Prepared:
        """Capture ``state``, lay it out, and make ``slot`` fit it. LayoutError for what the
        snapshot cannot hold: a sharded DTensor in a replicated entry, or in a memory
        snapshot."""
        captured = self.capture(state)
        replica_of = [key if key in self._replicated else None for key in captured.entry_of]
        sharded = [d for d in captured.dtensors if d.tensor is not None
                   and replica_of[d.tensor] is not None]
        if sharded:
            raise LayoutError(f"{sharded[0].key} is a sharded DTensor in an entry declared "
                              "replicated; its pieces differ between ranks: leave the entry out "
                              "of replicated= (sharded tensors are written once per piece anyway)")
        if to_memory and captured.dtensors:
            raise LayoutError(f"{captured.dtensors[0].key} is a sharded tensor: "
                              f"{SHARDED_REFUSED}")
        plan, sources = self._planner.plan(captured.tensors, replica_of)
        self.fit(slot, plan, pin=any(t.is_cuda for t in captured.tensors))
        return Prepared(captured, plan, sources)

    def fit(self, slot: Slot, plan: Plan, pin: bool) -> None:
        """Make ``slot`` fit ``plan`` (page-locked if ``pin``), telling the writer of new memory.
        With the memory tier, new memory is asked for only when it is there: a keeper may hold
        an earlier run's slot meanwhile."""
        old_buffer = slot.buffer_id
        if self._memory is not None and slot.nbytes < plan.nbytes:
            self._require_memory(plan.nbytes)
        if self.pool.fit(slot, plan, pin):
            if old_buffer >= 0:
                self._writer.detach(old_buffer)
            self._writer.attach(slot.buffer_id, slot.fd, slot.nbytes)

    def start(self, prepared: Prepared, slot: Slot, state: MutableMapping[str, Any], step: int,
              job: Optional[int], directory: Optional[str], to_memory: bool, lazy: bool,
              tracker: Optional[ChangeTracker], markers: Collection[Marker]) -> Staged:
        """Start the copy of ``prepared`` into ``slot``, acquired for the writer when ``job`` (its
        number; it writes into ``directory``) and for the keeper when ``to_memory``.
        ``lazy``: the copy runs on while training goes on, but for module buffers (the next
        forward pass changes them before any fence); the tensors it copies are watched.
        ``tracker``: incremental snapshots, which refer to the regions it finds unchanged."""
        captured, plan, sources = prepared.captured, prepared.plan, prepared.sources
        refer = {} if job is None or tracker is None else tracker.unchanged(
            plan, sources, captured.tensors, job, step, directory, trainable_storages(state))
        now = _buffer_regions(sources, state) if lazy else set()
        watched = [] if not lazy else [  # what must not change until the copy has ended
            (path, t, t._version) for path, t, record in zip(captured.paths, captured.tensors,
                                                              plan.tensors)
            if record.region is not None and record.region not in refer
            and record.region not in now and not t.is_inference()]
        # checksums made by the copy: the keeper's seal then reads nothing, nor does the writer
        # for a chunk stored raw; a copy that blocks training (eager) makes them only for the
        # keeper, whose seal would otherwise compete with training every step
        copy = self.pool.start(plan, sources, slot, skip=refer, background=lazy, now=now,
                               checksums=to_memory or (lazy and self._raw))
        prepared.sources = captured.tensors = []  # the live tensors: not kept past the copy
        self.pool.acquire(slot, writer=job is not None, keeper=to_memory)
        snapshot_job = None
        if job is not None:
            snapshot_job = SnapshotJob(
                job=job, step=step, buffer_id=slot.buffer_id, dir=directory, tree=captured.tree,
                plan=plan if plan != self._writer_plan else None, submitted=time.monotonic(),
                refer=tuple(sorted(refer.items())), dtensors=tuple(captured.dtensors),
                markers=tuple(markers))
            self._writer_plan = plan
        return Staged(copy, slot, plan, watched, step, snapshot_job,
                      (plan, captured.tree) if to_memory else None,
                      plan.raw_bytes - sum(plan.regions[k].nbytes for k in refer))

    def hand_over(self, staged: Staged) -> None:
        """A copy that ended untouched: to the keeper, then the writer."""
        if staged.memory is not None:  # first: a writer gone must not keep the slot held
            self._memory.hold(staged.slot, *staged.memory, staged.step, staged.copy.checksums)
        if staged.job is not None:
            self._writer.submit(dataclasses.replace(staged.job, checksums=staged.copy.checksums))
            if self._raw:
                self.pool.wrote(staged.slot, staged.step, staged.plan)

    def abandon(self, staged: Staged) -> None:
        """A snapshot that never reached the writer: its slot is free again, and the next job
        carries its plan (the writer never got this one)."""
        self.pool.release(staged.slot)
        if staged.job is not None:
            self._writer_plan = None

    def read_memory(self, state: MutableMapping[str, Any]) -> tuple[bool, Optional[memoryview]]:
        """(``mapped``, ``scratch``) of a restore's read. With CUDA tensors registered, every
        storage is read into a page-locked staging slot, fitted to the state as its first
        snapshot would fit it (the same memory, so nothing extra is held), so that the copies
        onto the device run from pinned memory at full bandwidth and need no bounce through
        CUDA's own staging, as copies from the files' pageable mappings do. Otherwise (or where
        CUDA refuses to pin the slot) the files are mapped, and a free slot, if any, is
        scratch for what must be decoded."""
        slot = self.pool.free_slot(empty=True)
        if slot is not None and slot.tensor is None and self.pool.nbytes:
            slot = None  # memory of its own beside the slot a written snapshot holds: not taken
        if slot is not None and torch.cuda.is_available():  # (no state is on CUDA without it)
            tensors = self.capture(state).tensors
            if any(t.is_cuda for t in tensors):
                self.fit(slot, self._planner.plan(tensors)[0], pin=True)
                if slot.pinned:
                    return False, self.pool.scratch(slot)
        return True, self.pool.scratch()


    def slot_copies(self, rank: int, world_size: int, spread: bool) -> dict[int, SlotCopy]:
        """By step, the bytes each of this rank's committed shards was written from that a
        slot still holds (``SlotCopy``), in the shard's storage order (``shard_layout``)."""
        copies = {}
        for step, plan, memory in self.pool.written_copies():
            written = shard_layout(plan, rank, world_size, spread).written
            copies[step] = SlotCopy(step, memory, tuple(
                (plan.regions[i].offset, plan.regions[i].nbytes) for i in written))
        return copies


def _buffer_regions(sources: list, state: Any) -> set[int]:
    """The regions holding buffers of the registered modules (batch-norm statistics and the
    like): the next forward pass updates them in place, before any fence, so lazy staging copies
    them before ``snapshot()`` returns."""
    buffers = {b.untyped_storage().data_ptr()
               for module in registered_objects(state, (torch.nn.Module,))
               for b in module.buffers()}
    return {k for k, src in enumerate(sources) if src.storage.data_ptr() in buffers}
