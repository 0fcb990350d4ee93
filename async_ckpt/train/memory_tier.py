"""The training process's side of the memory tier (``memory_every``, docs/memory_tier.md): which
staging slots the keeper holds, handing it each memory snapshot once staged, and its answers.

A memory snapshot is staged into a free slot as a disk one is; once its copy has ended, the slot
is handed to the keeper (``hold``), which seals it and then lets go of the oldest slot it held
beyond ``keep`` (one; two with several ranks). A slot the keeper holds, or is handed
(``Slot.held``), is neither staged nor read into until the keeper lets go of it, so what it holds
is never overwritten: at most ``keep`` sealed slots and those handed over since. Losing the
keeper (killed, out of memory) stops the tier with a warning: its slots come back to the pool,
and restores read the disk.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import re
import secrets
import warnings
from typing import Any, Optional

import torch

from ..errors import CheckpointDirError, LayoutError, MemoryTierError
from ..format.layout import Plan
from ..keeper.client import HeldMemory, KeeperClient, KeeperEvent, Sealed
from ..keeper.protocol import KEEP_MAX, Gone, layout_message
from ..storage.local import LocalStorage
from ..storage.names import memory_session_file_name
from ..tensors import is_dtensor, registered_objects
from .staging import Slot, StagingPool

log = logging.getLogger(__name__)
_MAX_SESSION_BYTES = 4096
_SESSION = re.compile(r"[0-9a-f]{32}")


SHARDED_REFUSED = ("memory_every does not hold sharded tensors (DTensor) yet; create the engine "
                   "with memory_every=None")


def refuse_sharded(state: Any) -> None:
    """LayoutError when a module or tensor registered in ``state`` is sharded: said when the
    engine is created rather than at its first memory snapshot (a DTensor that the state gains
    later is refused then)."""
    for obj in registered_objects(state, (torch.nn.Module, torch.Tensor)):
        named = (itertools.chain(obj.named_parameters(), obj.named_buffers())
                 if isinstance(obj, torch.nn.Module) else [("a registered tensor", obj)])
        for name, tensor in named:
            if is_dtensor(tensor):
                raise LayoutError(f"{name} is a sharded tensor: {SHARDED_REFUSED}")


def open_memory_tier(directory: LocalStorage, rank: int, world_size: int, pool: StagingPool,
                     idle_timeout: float, nice: int) -> "MemoryTier":
    """Greet ``rank``'s keeper of ``directory`` (started at niceness ``nice`` if none runs) with
    the directory's memory session: the token its session file names, or a new one where there
    is none (a new directory, or one emptied since) or where the job ran on another number of
    ranks (what rank ``rank`` held then is another part of the state). With a new session the
    keeper drops what it held for the old one. With several ranks the keeper holds the two
    newest sealed snapshots: a rank killed while staging step N leaves N-1 in its keeper while
    the others' hold N, and the ranks then agree on N-1."""
    name = memory_session_file_name(rank)
    previous = _read_session(directory, name)
    if previous is not None and previous["world_size"] != world_size:
        log.info("the memory tier held rank %d's state of a job of %d rank(s); this one has %d: "
                 "starting anew", rank, previous["world_size"], world_size)
        previous = None
    session = new_session() if previous is None else previous["session"]
    keep = KEEP_MAX if world_size > 1 else 1
    client = KeeperClient.open(*directory.identity(), rank, session, idle_timeout, nice, keep)
    tier = MemoryTier(client, pool, directory, name, session, world_size, keep)
    tier.lost_before = previous is not None and previous["open"] and client.started
    try:
        tier.record(open=True)
    except BaseException:
        client.close(quit=client.started)
        raise
    return tier


def new_session() -> str:
    """A memory session's token: what a trainer greets the keeper with (kept in the directory)."""
    return secrets.token_hex(16)


def _read_session(directory: LocalStorage, name: str) -> Optional[dict]:
    """The session file's contents, or None where it is missing or not one we wrote (then a
    new session begins: nothing held for another is served)."""
    try:
        doc = json.loads(directory.read_file(name, _MAX_SESSION_BYTES, CheckpointDirError))
    except (OSError, ValueError, RecursionError, CheckpointDirError):
        return None
    if not (isinstance(doc, dict) and type(doc.get("session")) is str
            and _SESSION.fullmatch(doc["session"]) and type(doc.get("open")) is bool
            and type(doc.get("world_size")) is int):
        return None
    return doc


class MemoryTier:
    """The keeper's connection and what it holds, as this trainer knows it."""

    def __init__(self, client: KeeperClient, pool: StagingPool, directory: LocalStorage,
                 name: str, session: str, world_size: int, keep: int):
        self.client: Optional[KeeperClient] = client
        self.pool = pool
        self.lost_before = False  # a keeper of this session was expected, and is gone
        self._directory, self._name, self._session = directory, name, session
        self._world_size = world_size
        self.keeper_pid = client.pid
        self.keep = keep  # how many sealed snapshots the keeper holds
        self.sealed: collections.deque[int] = collections.deque()  # our buffers it holds sealed
        self.step: Optional[int] = client.step  # the newest step the keeper holds sealed
        self.newest: Optional[int] = client.step  # the newest step handed to it, sealed or not
        self.held_bytes = client.held_bytes
        self.pending: dict[int, int] = {}  # buffer -> step: handed over, not answered yet
        self.snapshots = self.skipped = self.superseded = self.refused = 0
        self.lost: Optional[str] = None  # why the keeper is gone, once it is
        self._plan: Optional[Plan] = None  # the plan of the last layout handed over

    @property
    def active(self) -> bool:
        return self.client is not None

    def hold(self, slot: Slot, plan: Plan, tree: dict, step: int,
             checksums: Optional[tuple[Optional[tuple[str, ...]], ...]]) -> None:
        """Hand over ``slot`` (staged, held already) with the snapshot of ``step`` in it, and
        each region's chunk checksums where the copy made them all (else the keeper does)."""
        if self.client is None:
            self.pool.release_held(slot.buffer_id)
            return
        layout = None if plan == self._plan else layout_message(
            [(r.offset, r.nbytes) for r in plan.regions],
            [t.to_json(t.region) for t in plan.tensors])
        try:
            self.client.hold(slot.buffer_id, slot.fd, step, tree, layout,
                             None if checksums is None or None in checksums else checksums)
        except Gone as e:
            self.pool.release_held(slot.buffer_id)
            self._lose(f"it closed the connection ({e})")
            return
        self._plan = plan
        self.pending[slot.buffer_id] = step
        self.newest = step

    def poll(self, timeout: Optional[float] = 0) -> None:
        """Take the keeper's answers so far, waiting up to ``timeout`` seconds for the first."""
        if self.client is None:
            return
        try:
            events = self.client.events(timeout)
        except (Gone, MemoryTierError) as e:
            self._lose(str(e))
            return
        for event in events:
            self._handle(event)

    def query(self, step: Optional[int] = None) -> Optional[HeldMemory]:
        """What the keeper holds of ``step`` (None: its newest), after it sealed what it was
        handed; None when it holds nothing (of that step)."""
        if self.client is None:
            return None
        try:
            events, held = self.client.query(step)
        except (Gone, MemoryTierError) as e:
            self._lose(str(e))
            return None
        for event in events:
            self._handle(event)
        return held

    def _handle(self, event: KeeperEvent) -> None:
        self.pending.pop(event.buffer, None)
        if isinstance(event, Sealed):
            self.sealed.append(event.buffer)
            while len(self.sealed) > self.keep:  # the keeper lets go of these, as it does
                self.pool.release_held(self.sealed.popleft())
            self.step, self.held_bytes = event.step, event.held_bytes
            self.snapshots += 1
            return
        self.pool.release_held(event.buffer)
        if event.error is None:
            self.superseded += 1
            return
        self.refused += 1
        if self.refused == 1:
            log.warning("the memory tier's keeper refused a snapshot: %s", event.error)

    def _lose(self, why: str) -> None:
        """The keeper is gone: its slots come back, and the tier stops."""
        message = (f"the memory tier's keeper (pid {self.keeper_pid}) is gone: {why}. Memory "
                   "snapshots stop for this engine, and a restore reads the disk")
        log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.lost = why
        self.pool.release_held()
        self.sealed.clear()
        self.step, self.newest, self.held_bytes = None, None, 0
        self.pending.clear()
        client, self.client = self.client, None
        if client is not None:
            client.close(quit=False)

    def figures(self) -> dict:
        """What ``stats()`` reports of the tier (``CheckpointEngine.stats`` documents each)."""
        return {"memory_step": self.step, "memory_bytes": self.held_bytes,
                "memory_snapshots": self.snapshots, "memory_skipped": self.skipped,
                "memory_superseded": self.superseded, "memory_refused": self.refused,
                "keeper_pid": None if self.client is None else self.keeper_pid}

    def record(self, open: bool) -> None:
        """Write the session file: its token, and whether a keeper holds its state (``open``;
        once it was told to quit, a next engine finding no keeper has lost nothing)."""
        try:
            self._directory.publish(self._name, json.dumps(
                {"session": self._session, "open": open,
                 "world_size": self._world_size}).encode())
        except OSError as e:
            raise MemoryTierError(f"cannot write {self._directory.location(self._name)} "
                                  f"({e.strerror}): the memory tier needs it to find its keeper "
                                  "again after a restart. Check the directory's permissions "
                                  "and free space") from e

    def close(self, quit: bool) -> None:
        """Let go of the keeper; ``quit``: it exits (what it holds is on disk too)."""
        client, self.client = self.client, None
        if client is None:
            return
        client.close(quit)
        if quit:
            self.record(open=False)
