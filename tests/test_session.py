"""A rank's session: the lock held, leftovers removed, one token agreed through session.json."""

import json
import os

import pytest

from async_ckpt.distributed import Coordinator
from async_ckpt.errors import CheckpointDirError, DirectoryInUseError, DistributedSetupError
from async_ckpt.storage.local import LocalStorage
from async_ckpt.storage.names import SESSION_NAME, snapshot_dir_step
from async_ckpt.storage.locks import take_rank_lock
from async_ckpt.train import session
from async_ckpt.train.session import start_session

SETTINGS = {"every": 1, "mode": "async"}


class TwoRanks(Coordinator):
    """Rank ``rank`` of two, the other rank simulated: it was created with ``their_settings``,
    reports no problem, and (as rank 0) drew ``their_token``."""

    def __init__(self, rank, their_settings=SETTINGS, their_token="0" * 16):
        self.rank, self.world_size = rank, 2
        self.their_settings, self.their_token = their_settings, their_token

    def gather(self, value):
        theirs = self.their_settings if isinstance(value, dict) else None  # else a problem: none
        return [value, theirs] if self.rank == 0 else [theirs, value]

    def from_rank0(self, compute):
        return compute() if self.rank == 0 else self.their_token

    def raise_if_any(self, problem, error_type, what):
        if problem:
            raise error_type(f"{what}: {problem}")


def test_one_rank_holds_its_lock_and_cleans_leftovers(tmp_path):
    root = str(tmp_path)
    os.mkdir(os.path.join(root, "step-00000000000000000001.0badc0de"))  # never committed
    first = start_session(root, Coordinator(0, 1), SETTINGS, lock_timeout=1)
    try:
        assert len(first.token) == 16 and int(first.token, 16) >= 0
        assert not os.path.exists(os.path.join(root, "step-00000000000000000001.0badc0de"))
        assert not os.path.exists(os.path.join(root, SESSION_NAME))  # one rank: nothing to share
        with pytest.raises(DirectoryInUseError):
            take_rank_lock(root, 0, timeout=0.1)
    finally:
        first.close()
    second = start_session(root, Coordinator(0, 1), SETTINGS, lock_timeout=1)
    second.close()
    assert second.token != first.token


def test_rank0_publishes_the_token_and_rank1_must_see_it(tmp_path):
    root = str(tmp_path)
    started = start_session(root, TwoRanks(0), SETTINGS, lock_timeout=1)
    started.close()
    with open(os.path.join(root, SESSION_NAME)) as f:
        assert json.load(f)["token"] == started.token
    joined = start_session(root, TwoRanks(1, their_token=started.token), SETTINGS, lock_timeout=1)
    joined.close()
    with pytest.raises(CheckpointDirError, match="does not hold rank 0's session.json"):
        start_session(root, TwoRanks(1, their_token="f" * 16), SETTINGS, lock_timeout=1)
    os.close(take_rank_lock(root, 1, timeout=0))  # the refused rank released its lock


def test_ranks_created_with_different_settings_are_refused(tmp_path):
    with pytest.raises(DistributedSetupError, match=r"every = 1 \(rank 0\), 2 \(rank 1\)"):
        start_session(str(tmp_path), TwoRanks(0, {"every": 2, "mode": "async"}), SETTINGS, 1)


@pytest.mark.parametrize("plant", ["directory", "fifo", "not a dict", "huge", "symlink"])
def test_a_hostile_session_file_reads_as_no_token(tmp_path, plant):
    path = os.path.join(tmp_path, SESSION_NAME)
    if plant == "directory":
        os.mkdir(path)
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "not a dict":
        with open(path, "w") as f:
            json.dump(["token"], f)
    elif plant == "huge":
        with open(path, "w") as f:
            f.write(json.dumps({"token": "a" * 16, "pad": "x" * 10**6}))
    else:
        os.symlink("/dev/zero", path)
    assert session._published_token(LocalStorage(str(tmp_path))) is None


def test_ranks_that_share_no_directory_each_get_a_root_of_their_own(tmp_path):
    """Rank 1 on a node of its own does not see rank 0's session.json: with an object store to
    commit through, it keeps its snapshots in DIR/rank-00001, without its old leftovers;
    without one, the job is refused."""
    node1 = tmp_path / "node1"
    leftover = node1 / "rank-00001" / "step-00000000000000000004.0badc0de"
    leftover.mkdir(parents=True)
    with pytest.raises(CheckpointDirError, match="or pass remote="):
        start_session(str(node1), TwoRanks(1), SETTINGS, lock_timeout=1)
    joined = start_session(str(node1), TwoRanks(1), SETTINGS, lock_timeout=1, own_roots=True)
    joined.close()
    assert joined.own_root and joined.root == str(node1 / "rank-00001")
    assert joined.token == "0" * 16 and not leftover.exists()
    (tmp_path / "node0").mkdir()
    shared = start_session(str(tmp_path / "node0"), TwoRanks(0), SETTINGS, 1, own_roots=True)
    shared.close()  # rank 0 sees its own session.json; the other rank reports no problem
    assert not shared.own_root and shared.root == str(tmp_path / "node0")


def test_every_attempt_at_a_step_gets_a_fresh_snapshot_directory(tmp_path):
    """Named by the token, the step and the attempt: the same on every rank, never reused."""
    started = start_session(str(tmp_path), Coordinator(0, 1), SETTINGS, lock_timeout=1)
    started.close()
    first, second, other = (started.snapshot_dir(5), started.snapshot_dir(5),
                            started.snapshot_dir(6))
    assert len({first, second, other}) == 3
    assert [snapshot_dir_step(d) for d in (first, second, other)] == [5, 5, 6]
    again = start_session(str(tmp_path), Coordinator(0, 1), SETTINGS, lock_timeout=1)
    again.close()
    assert again.snapshot_dir(5) not in (first, second)  # a new session: a new token


def test_the_directory_is_created_and_must_be_writable(tmp_path):
    nested = tmp_path / "a" / "b"
    started = start_session(str(nested), Coordinator(0, 1), SETTINGS, lock_timeout=1)
    started.close()
    assert nested.is_dir() and started.root == str(nested)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointDirError, match="exists and is not a directory"):
        start_session(str(tmp_path / "file"), Coordinator(0, 1), SETTINGS, lock_timeout=1)
