"""Which rank writes what (replication.py) and rank 0's commit of multi-rank snapshots (commit.py),
driven directly: shards of the "other ranks" are written into the directory by the test."""

import os
import time
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_ckpt.storage.local import LocalStorage
from async_ckpt.write import commit
from async_ckpt.write.commit import Attempt, Committer, CommitWatcher
from async_ckpt.write.protocol import (Abandoned, CommitFigures, Committed, Failed, Marker,
                                       ShardFigures)
from async_ckpt.write.writer import _write_markers
from async_ckpt.errors import (CorruptSnapshotError, InternalError, ReplicaMismatchError,
                               SnapshotWriteError)
from async_ckpt.format.records import Replica
from async_ckpt.format.shard import ChunkEncoder, ShardWriter
from async_ckpt.storage.names import PARTIAL_SUFFIX, shard_file_name
from async_ckpt.format.manifest import ShardRecord, read_manifest
from async_ckpt.format.layout import Plan, Region, TensorRecord
from async_ckpt.format.layout import owners, shard_layout
from conftest import FakeClock

# --- replication ---------------------------------------------------------------------------------


def test_without_spreading_rank_0_owns_every_replica():
    assert owners([5, 1, 9], world_size=4, spread=False) == [0, 0, 0]


def test_spreading_balances_bytes_largest_first():
    assert owners([4, 4, 4, 1, 1], world_size=2, spread=True) == [0, 1, 0, 1, 1]
    assert owners([10, 1, 1, 1], world_size=3, spread=True) == [0, 1, 2, 1]


@given(st.lists(st.integers(1, 10**9), max_size=40), st.integers(1, 9))
def test_spreading_is_as_even_as_the_largest_replica_allows(sizes, world_size):
    owner = owners(sizes, world_size, spread=True)
    assert owner == owners(list(sizes), world_size, spread=True)  # the same on every rank
    load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(world_size)]
    assert all(0 <= o < world_size for o in owner)
    if sizes:
        assert max(load) - min(load) <= max(sizes)


def plan_of(kinds):
    """A plan with one region (and one tensor viewing it) per kind: None for rank-local state,
    a name for a replicated entry."""
    regions = tuple(Region(64 * i, 8 * (i + 1), 4, True, kind) for i, kind in enumerate(kinds))
    tensors = tuple(TensorRecord(i, 0, "float32", (2 * (i + 1),), (1,)) for i in range(len(kinds)))
    tensors += (TensorRecord(None, 0, "float32", (0,), (1,)),)
    return Plan(regions, tensors, 64 * len(kinds))


@given(st.lists(st.sampled_from([None, "model", "optimizer"]), max_size=12), st.integers(1, 5),
       st.booleans())
@settings(max_examples=200)
def test_every_tensor_is_found_in_exactly_one_shard(kinds, world_size, spread):
    plan = plan_of(kinds)
    layouts = [shard_layout(plan, r, world_size, spread) for r in range(world_size)]
    stored = [region for layout in layouts for region in layout.written]
    local = [i for i, k in enumerate(kinds) if k is None or world_size == 1]
    assert sorted(stored) == sorted(local * world_size + [i for i in range(len(kinds)) if i not in local])
    for rank, layout in enumerate(layouts):
        assert layout.uses_references == (world_size > 1 and any(kinds))
        for region, record in zip(range(len(kinds)), layout.tensors):
            owner = record.get("rank", rank)
            assert layouts[owner].written[record["storage"]] == region
            assert ("replica" in layouts[owner].replica_fields[record["storage"]]) == (region not in local)
        assert layout.tensors[-1]["storage"] is None  # an empty tensor has no storage


def test_one_rank_ignores_replication():
    layout = shard_layout(plan_of(["model", None]), 0, 1, spread=True)
    assert layout.written == (0, 1) and not layout.uses_references
    assert all("rank" not in t for t in layout.tensors)


# --- the committer -------------------------------------------------------------------------------

WORLD = 3


def write_shard(root, name, rank, step, replicas=(), partial=False, world_size=WORLD,
                tensors=()):
    """What a rank's writer leaves: a durable shard under its final name (or still .partial),
    one 64-byte storage, ``tensors`` its tensor table."""
    os.makedirs(os.path.join(root, name), exist_ok=True)
    final = os.path.join(root, name, shard_file_name(rank))
    writer = ShardWriter(final + PARTIAL_SUFFIX, ChunkEncoder(None))
    writer.add_storage(memoryview(bytes([rank]) * 64), 1, False)
    size, digest = writer.finish({"step": step, "rank": rank, "world_size": world_size,
                                  "tensors": list(tensors), "tree": {"kind": "dict", "entries": {}},
                                  **({"replicas": list(replicas)} if replicas else {})})
    if not partial:
        os.rename(final + PARTIAL_SUFFIX, final)
    return ShardRecord(rank, shard_file_name(rank), size, digest)


def attempt(root, job, step, replicas=()):
    name = f"step-{step:020d}.{job:08x}"
    shard = write_shard(root, name, 0, step, replicas)
    return Attempt(job=job, step=step, dir=name, shard=shard,
                   replicas=[Replica.of(r) for r in replicas],
                   raw_bytes=64, figures=ShardFigures())


def outcomes(events):
    """Each event's type and job, in order."""
    return [(type(e), e.job) for e in events]


@pytest.fixture
def clock():
    """The commit stage's clock: its timeouts without sleeping."""
    return FakeClock(time.monotonic())


@pytest.fixture
def committer(tmp_path, clock):
    events = []
    c = Committer(LocalStorage(str(tmp_path)), WORLD, keep_last=5, keep_every=None, commit_timeout=60,
                  send=events.append, clock=clock)
    c.events = events
    return c


def test_a_step_commits_only_once_every_rank_is_durable(tmp_path, committer):
    a = attempt(str(tmp_path), 0, step=7)
    committer.add(a)
    write_shard(str(tmp_path), a.dir, 1, 7)
    write_shard(str(tmp_path), a.dir, 2, 7, partial=True)  # written, not yet renamed: not durable
    committer.poll(trainer_gone=False)
    assert committer.events == [] and read_manifest(LocalStorage(str(tmp_path))).steps() == []
    os.rename(os.path.join(tmp_path, a.dir, shard_file_name(2) + PARTIAL_SUFFIX),
              os.path.join(tmp_path, a.dir, shard_file_name(2)))
    committer.poll(trainer_gone=False)
    (event,) = committer.events
    assert isinstance(event, Committed) and event.job == 0
    record = read_manifest(LocalStorage(str(tmp_path))).find(7)
    assert [s.rank for s in record.shards] == [0, 1, 2] and record.world_size == WORLD
    assert record.stored_bytes == sum(s.bytes for s in record.shards) and record.raw_bytes == 3 * 64
    assert committer.pending == []


def test_a_later_complete_step_abandons_an_earlier_incomplete_one(tmp_path, committer):
    first, second = attempt(str(tmp_path), 0, step=1), attempt(str(tmp_path), 1, step=2)
    committer.add(first)
    write_shard(str(tmp_path), first.dir, 1, 1)  # rank 2 never writes step 1
    committer.add(second)
    for rank in (1, 2):
        write_shard(str(tmp_path), second.dir, rank, 2)
    committer.poll(trainer_gone=False)
    assert outcomes(committer.events) == [(Abandoned, 0), (Committed, 1)]
    assert "rank(s) [2]" in committer.events[0].message
    assert read_manifest(LocalStorage(str(tmp_path))).steps() == [2]
    assert not os.path.exists(os.path.join(tmp_path, first.dir))


def test_a_step_no_rank_makes_progress_on_is_abandoned_after_the_timeout(tmp_path, committer,
                                                                          clock):
    committer.commit_timeout = 0.3
    a = attempt(str(tmp_path), 0, step=3)
    committer.add(a)
    write_shard(str(tmp_path), a.dir, 1, 3)
    partial = os.path.join(tmp_path, a.dir, shard_file_name(2) + PARTIAL_SUFFIX)
    for _ in range(8):  # rank 2 keeps writing for 0.8 s, longer than the timeout: not abandoned
        with open(partial, "ab") as f:
            f.write(b"x")
        clock.advance(0.1)
        committer.poll(trainer_gone=False)
    assert committer.events == []
    clock.advance(0.29)  # rank 2 died: nothing changes
    committer.poll(trainer_gone=False)
    assert committer.events == []
    clock.advance(0.02)
    committer.poll(trainer_gone=False)
    assert outcomes(committer.events) == [(Abandoned, 0)]
    assert read_manifest(LocalStorage(str(tmp_path))).steps() == [] and not os.path.exists(os.path.join(tmp_path, a.dir))


def test_once_the_trainer_is_gone_the_wait_is_short(tmp_path, committer, monkeypatch, clock):
    monkeypatch.setattr(commit, "ORPHAN_QUIET_S", 0.1)
    committer.add(attempt(str(tmp_path), 0, step=3))
    clock.advance(0.15)
    committer.poll(trainer_gone=False)
    assert committer.events == []  # the trainer could still be waiting: commit_timeout applies
    committer.poll(trainer_gone=True)
    assert outcomes(committer.events) == [(Abandoned, 0)]


def test_differing_replicas_are_not_committed(tmp_path, committer):
    ours = [{"entry": "model", "owner": 0, "nbytes": 64, "xxh3": "00000000000000aa"}]
    theirs = [{**ours[0], "xxh3": "00000000000000bb"}]
    a = attempt(str(tmp_path), 0, step=4, replicas=ours)
    committer.add(a)
    write_shard(str(tmp_path), a.dir, 1, 4, ours)
    write_shard(str(tmp_path), a.dir, 2, 4, theirs)
    committer.poll(trainer_gone=False)
    (event,) = committer.events
    assert isinstance(event, Failed) and event.job == 0
    assert type(event.error) is ReplicaMismatchError
    assert "'model' differs between rank 0 and rank 2" in str(event.error)
    assert read_manifest(LocalStorage(str(tmp_path))).steps() == [] and not os.path.exists(os.path.join(tmp_path, a.dir))


@pytest.mark.parametrize("raised, expected", [
    (KeyError("shards"), InternalError), (OSError(5, "Input/output error"), SnapshotWriteError)])
def test_a_bug_in_the_commit_is_not_passed_off_as_an_i_o_error(tmp_path, committer, monkeypatch,
                                                                caplog, raised, expected):
    def broken(*args):
        raise raised

    monkeypatch.setattr(commit, "write_manifest", broken)
    a = attempt(str(tmp_path), 0, step=4)
    committer.add(a)
    for rank in (1, 2):
        write_shard(str(tmp_path), a.dir, rank, 4)
    committer.poll(trainer_gone=False)
    (event,) = committer.events
    assert isinstance(event, Failed) and type(event.error) is expected
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == (
        [KeyError] if expected is InternalError else [])
    assert not os.path.exists(os.path.join(tmp_path, a.dir))
    monkeypatch.setattr(commit.Manifest, "without", broken)
    assert type(committer.drop((4,)).error) is expected


def test_a_rank_with_a_root_of_its_own_commits_its_shard_alone(tmp_path, clock):
    """Ranks without a shared directory: rank 1 commits its shard into its own manifest as soon
    as it is durable; the other ranks' shards are never waited for."""
    events, root = [], str(tmp_path)
    own = Committer(LocalStorage(root), WORLD, keep_last=2, keep_every=None, commit_timeout=60,
                    send=events.append, clock=clock, own_root=1)
    for job, step in enumerate((3, 4, 5)):
        name = f"step-{step:020d}.{job:08x}"
        shard = write_shard(root, name, 1, step)
        own.add(Attempt(job=job, step=step, dir=name, shard=shard, replicas=[], raw_bytes=64,
                        figures=ShardFigures()))
    assert outcomes(events) == [(Committed, 0), (Committed, 1), (Committed, 2)]
    manifest = read_manifest(LocalStorage(root))
    assert manifest.rank == 1 and manifest.steps() == [4, 5]  # keep_last applies per rank
    assert [s.rank for s in manifest.snapshots[-1].shards] == [1]
    assert manifest.snapshots[-1].world_size == WORLD
    assert len(os.listdir(root)) == 3  # the two kept snapshots and the manifest


def test_a_root_of_the_whole_job_is_not_taken_for_a_ranks_own(tmp_path, committer, clock):
    root = str(tmp_path)
    a = attempt(root, 0, step=1)
    committer.add(a)
    for rank in (1, 2):
        write_shard(root, a.dir, rank, 1)
    committer.poll(trainer_gone=False)
    assert read_manifest(LocalStorage(root)).steps() == [1]
    events = []
    own = Committer(LocalStorage(root), WORLD, keep_last=2, keep_every=None, commit_timeout=60,
                    send=events.append, clock=clock, own_root=2)
    name = "step-00000000000000000002.00000009"
    own.add(Attempt(job=9, step=2, dir=name, shard=write_shard(root, name, 2, 2), replicas=[],
                    raw_bytes=64, figures=ShardFigures()))
    (event,) = events
    assert isinstance(event, Failed) and "holds the snapshots of all ranks" in str(event.error)
    assert read_manifest(LocalStorage(root)).steps() == [1]


def test_a_shard_of_another_job_is_refused(tmp_path, committer):
    a = attempt(str(tmp_path), 0, step=5)
    committer.add(a)
    write_shard(str(tmp_path), a.dir, 1, 5)
    write_shard(str(tmp_path), a.dir, 2, 5, world_size=4)
    committer.poll(trainer_gone=False)
    (event,) = committer.events
    assert isinstance(event, Failed) and event.job == 0
    assert type(event.error) is CorruptSnapshotError and "share" in str(event.error)
    assert read_manifest(LocalStorage(str(tmp_path))).steps() == []


def test_retention_removes_every_rank_s_files_of_a_dropped_step(tmp_path, committer):
    committer.keep_last = 1
    dirs = []
    for job, step in enumerate((10, 11)):
        a = attempt(str(tmp_path), job, step)
        dirs.append(a.dir)
        for rank in (1, 2):
            write_shard(str(tmp_path), a.dir, rank, step)
        committer.add(a)
    assert read_manifest(LocalStorage(str(tmp_path))).steps() == [11]
    assert committer.events[-1].figures.dropped_steps == (10,)
    assert not os.path.exists(os.path.join(tmp_path, dirs[0]))


# --- the other ranks' watch -----------------------------------------------------------------------


@pytest.fixture
def watcher(tmp_path, clock):
    events = []
    w = CommitWatcher(LocalStorage(str(tmp_path)), commit_timeout=60, send=events.append, clock=clock)
    w.events = events
    return w


def rank1_attempt(root, job, step):
    name = f"step-{step:020d}.{job:08x}"
    shard = write_shard(root, name, 1, step)
    return Attempt(job=job, step=step, dir=name, shard=shard, replicas=[], raw_bytes=64,
                   figures=ShardFigures(shard_bytes=shard.bytes))


def test_a_rank_learns_of_the_commit_from_the_manifest(tmp_path, watcher, committer):
    mine = rank1_attempt(str(tmp_path), 0, step=6)
    watcher.add(mine)
    assert watcher.events == [] and watcher.pending == [mine]  # durable, not yet committed
    ours = Attempt(job=9, step=6, dir=mine.dir, shard=write_shard(str(tmp_path), mine.dir, 0, 6),
                   replicas=[], raw_bytes=64, figures=ShardFigures())
    write_shard(str(tmp_path), mine.dir, 2, 6)
    committer.add(ours)  # rank 0's writer commits
    watcher.poll(trainer_gone=False)
    (event,) = watcher.events
    assert isinstance(event, Committed) and event.job == 0
    assert event.figures.stored_bytes == read_manifest(LocalStorage(str(tmp_path))).find(6).stored_bytes
    assert watcher.pending == []


def test_a_rank_learns_that_rank_0_gave_its_shard_up(tmp_path, watcher, committer, clock):
    mine = rank1_attempt(str(tmp_path), 0, step=6)
    watcher.add(mine)
    committer.commit_timeout = 0
    committer.add(Attempt(job=9, step=6, dir=mine.dir, replicas=[], raw_bytes=64,
                          figures=ShardFigures(),
                          shard=write_shard(str(tmp_path), mine.dir, 0, 6)))
    clock.advance(0.01)
    committer.poll(trainer_gone=False)  # rank 2 never wrote: rank 0 gives the step up
    watcher.poll(trainer_gone=False)
    assert outcomes(watcher.events) == [(Abandoned, 0)]


def test_a_rank_gives_up_when_rank_0_commits_nothing(tmp_path, watcher, clock):
    watcher.give_up_s = 0.05
    watcher.add(rank1_attempt(str(tmp_path), 0, step=6))
    clock.advance(0.1)
    watcher.poll(trainer_gone=False)
    assert outcomes(watcher.events) == [(Abandoned, 0)]
    assert "writer still running" in watcher.events[0].message


def test_a_rank_whose_trainer_is_gone_still_learns_of_a_commit_that_has_markers(
        tmp_path, committer):
    """Its markers (a framework's files of that rank) are written once the commit is known, so
    the job it belongs to is watched on; the others are dropped as before."""
    events = []
    watcher = CommitWatcher(LocalStorage(str(tmp_path)), commit_timeout=60, send=events.append,
                            outlives_trainer=lambda job: job == 1)
    marked, plain = rank1_attempt(str(tmp_path), 1, step=6), rank1_attempt(str(tmp_path), 2, 7)
    watcher.add(marked)
    watcher.add(plain)
    watcher.poll(trainer_gone=True)
    assert watcher.pending == [marked]
    write_shard(str(tmp_path), marked.dir, 2, 6)
    committer.add(Attempt(job=9, step=6, dir=marked.dir, replicas=[], raw_bytes=64,
                          figures=ShardFigures(),
                          shard=write_shard(str(tmp_path), marked.dir, 0, 6)))
    watcher.poll(trainer_gone=True)
    assert outcomes(events) == [(Committed, 1)] and watcher.pending == []


def test_a_marker_waits_for_the_files_it_comes_after(tmp_path):
    """A marker ``after`` other ranks' files is written once each is there keeping its record;
    one still missing (or another save's) at the deadline fails it, naming the file."""
    def torch_file(path, record):
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/.data/async_ckpt", record)

    others = [(str(tmp_path / f"part{r}.pt"), f"step 3 rank {r}".encode()) for r in (1, 2)]
    torch_file(others[0][0], others[0][1])
    torch_file(others[1][0], b"step 2 rank 2")  # an earlier save's file, not yet replaced
    latest = Marker(str(tmp_path / "latest"), b"tag3", after=tuple(others))
    committed = Committed(4, CommitFigures(ShardFigures(), 0.0, 0.0, 0, 0, 0))
    event = _write_markers(committed, (latest,), None, {}, timeout=0)
    assert isinstance(event, Failed) and "part2.pt" in str(event.error)
    assert not os.path.exists(latest.path)
    torch_file(others[1][0], others[1][1])
    assert _write_markers(committed, (latest,), None, {}, timeout=0) is committed
    assert (tmp_path / "latest").read_bytes() == b"tag3"


# --- agreement helpers without a process group ------------------------------------------------


def test_without_torch_distributed_one_rank_agrees_with_itself():
    from async_ckpt.distributed import Coordinator, newest_common_step, resolve_ranks
    from async_ckpt.errors import CheckpointDirError

    assert resolve_ranks(None, None) == (0, 1)
    assert resolve_ranks(0, 1) == (0, 1)
    with pytest.raises(ValueError):
        resolve_ranks(None, 2)
    alone = Coordinator(0, 1)
    assert alone.gather("x") == ["x"] and alone.max(7) == 7
    assert alone.from_rank0(lambda: 41 + 1) == 42
    with pytest.raises(CheckpointDirError, match="^the problem$"):
        alone.raise_if_any("the problem", CheckpointDirError, "context")
    alone.raise_if_any(None, CheckpointDirError, "context")
    assert newest_common_step([3, 1, 2]) == 2  # commit order, not the largest step
    assert newest_common_step([]) is None


def test_a_step_committed_and_dropped_between_two_polls_is_reported_committed(tmp_path, watcher):
    """Retention (keep_last=1) removes a commit before this rank's watcher looked: it must not
    report that committed step as given up."""
    rank0 = Committer(LocalStorage(str(tmp_path)), WORLD, keep_last=1, keep_every=None, commit_timeout=60,
                      send=lambda event: None)
    mine = [rank1_attempt(str(tmp_path), job, step) for job, step in ((0, 6), (1, 7))]
    for attempt in mine:
        watcher.pending.append(attempt)  # durable here; the watcher has not polled yet
        write_shard(str(tmp_path), attempt.dir, 2, attempt.step)
        rank0.add(Attempt(job=9, step=attempt.step, dir=attempt.dir, replicas=[], raw_bytes=64,
                          figures=ShardFigures(),
                          shard=write_shard(str(tmp_path), attempt.dir, 0, attempt.step)))
    assert read_manifest(LocalStorage(str(tmp_path))).steps() == [7]
    assert not os.path.exists(os.path.join(tmp_path, mine[0].dir))  # dropped by retention
    watcher.poll(trainer_gone=False)
    assert outcomes(watcher.events) == [(Committed, 0), (Committed, 1)]
