"""The figures behind CheckpointEngine.stats(): one record per snapshot, counts by outcome."""

import pytest

from async_ckpt.stats import EngineCounts, SnapshotFigures
from async_ckpt.write.protocol import CommitFigures, ShardFigures


def _taken(called_at: float) -> SnapshotFigures:
    return SnapshotFigures(7, called_at, blocking_s=0.5, wait_slot_s=0.1, capture_s=0.2,
                           staging_s=0.2, staged_bytes=4_000_000)


def test_a_committed_snapshot_reports_the_trainers_and_the_writers_figures_in_order():
    monotonic_now, unix_now = 500.0, 1_700_000_000.0  # the clocks record_commit reads, stopped
    figures = _taken(called_at=monotonic_now - 3.0)
    writer = CommitFigures(ShardFigures(queue_s=0.1, write_s=0.3, fsync_s=0.1,
                                        shard_bytes=8_000_000),
                           committed_at=monotonic_now - 1.0, commit_s=0.05,
                           raw_bytes=4_000_000, stored_bytes=4_000_000, disk_free_bytes=10**12)
    figures.record_commit(writer, monotonic=lambda: monotonic_now, unix_time=lambda: unix_now)
    report = figures.as_dict()
    assert list(report) == ["step", "blocking_s", "wait_slot_s", "capture_s", "staging_s",
                            "staged_bytes", *writer.as_dict(), "committed", "to_commit_s",
                            "staging_gbps", "durable_gbps"]
    assert report["committed"] is True and report["step"] == 7
    assert report["to_commit_s"] == 2.0
    assert report["committed_at"] == unix_now - 1.0  # the writer's monotonic time, as Unix time
    assert report["staging_gbps"] == pytest.approx(0.02)
    assert report["durable_gbps"] == pytest.approx(0.02)
    assert "wait_ranks_s" not in report and "dropped_steps" not in report  # rank 0's only


def test_counts_reset_consecutive_failures_at_a_commit():
    counts = EngineCounts()
    counts.record_failure()
    counts.record_failure()
    assert (counts.failed, counts.consecutive_failures) == (2, 2)
    counts.record_commit()
    assert counts.as_dict() == {"committed": 1, "failed": 2, "skipped": 0, "abandoned": 0,
                                "writer_behind": 0, "consecutive_failures": 0}
