"""What ``CheckpointEngine.stats()`` reports: the figures of each snapshot and the engine's counts.

The engine updates these objects as snapshots are taken and committed; ``stats()`` turns them into
the plain dict it has always returned (``as_dict``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from .write.protocol import CommitFigures


@dataclasses.dataclass
class SnapshotFigures:
    """One snapshot, from ``snapshot()`` called to committed: what ``snapshot()`` measured
    (seconds, bytes), the writer's figures of the commit (``writer``), and what follows from
    both. ``CheckpointEngine.stats()`` lists the keys
    of ``as_dict``; ``blocking_s`` runs until the commit in sync mode.
    """

    step: int
    called_at: float  # time.monotonic() when snapshot() was called; not reported
    blocking_s: float
    wait_slot_s: float
    capture_s: float
    staging_s: float
    staged_bytes: int
    committed: bool = False
    writer: Optional[CommitFigures] = None
    to_commit_s: Optional[float] = None
    committed_at: Optional[float] = None

    def record_commit(self, writer: CommitFigures, *,
                      monotonic: Callable[[], float] = time.monotonic,
                      unix_time: Callable[[], float] = time.time) -> None:
        """Take the writer's figures of the commit; its ``committed_at`` is a ``time.monotonic()``
        of this machine, turned into Unix time here by reading both clocks (tests pass their
        own)."""
        self.writer = writer
        self.committed = True
        self.to_commit_s = writer.committed_at - self.called_at
        self.committed_at = unix_time() - (monotonic() - writer.committed_at)

    def as_dict(self) -> dict:
        """One entry of ``stats()["snapshots"]`` (only committed snapshots are reported)."""
        shard = self.writer.shard
        return {
            "step": self.step, "blocking_s": self.blocking_s, "wait_slot_s": self.wait_slot_s,
            "capture_s": self.capture_s, "staging_s": self.staging_s,
            "staged_bytes": self.staged_bytes, **self.writer.as_dict(),
            "committed_at": self.committed_at, "committed": self.committed,
            "to_commit_s": self.to_commit_s,
            "staging_gbps": self.staged_bytes / max(self.staging_s, 1e-9) / 1e9,
            "durable_gbps": shard.shard_bytes / max(shard.write_s + shard.fsync_s, 1e-9) / 1e9,
        }


@dataclasses.dataclass
class EngineCounts:
    """Snapshots by outcome since the engine started (``stats()`` reports each by its name).

    ``committed``; ``failed`` (a write failed, or was in flight when the writer died);
    ``skipped`` (``when_busy="skip"`` found no free slot); ``abandoned`` (another rank never
    wrote its part); ``writer_behind`` (snapshots that waited longer than ``slow_writer_s`` for a
    slot); ``consecutive_failures`` (failures since the last commit).
    """

    committed: int = 0
    failed: int = 0
    skipped: int = 0
    abandoned: int = 0
    writer_behind: int = 0
    consecutive_failures: int = 0

    def record_commit(self) -> None:
        self.committed += 1
        self.consecutive_failures = 0

    def record_failure(self) -> None:
        self.failed += 1
        self.consecutive_failures += 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
