"""Multi-rank training under torchrun (CPU, gloo): examples/train_ddp.py with 2 and 3 ranks.

Proves: every step is snapshotted, replicated state is stored once (or shared out with
``--spread``), a rank killed while writing never yields a restorable step and ``torchrun
--max-restarts`` resumes from the last step every rank committed, and a whole job killed at random
moments resumes with per-rank losses and final state bit-identical to an uninterrupted run.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.tools.cli import main as cli_main
from async_ckpt.data import DistributedResumableSampler
from async_ckpt.errors import WorldSizeMismatchError
from async_ckpt.format.shard import ShardReader
from async_ckpt.format.manifest import read_manifest
from conftest import assert_same

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, os.pardir, "examples", "train_ddp.py")
CHECKS = os.path.join(HERE, "programs", "ddp_checks.py")
STEPS = 40
REPLICATED = ("model", "optimizer", "scheduler")


def torchrun(script, nproc, *args, max_restarts=0, output=None):
    """Start ``script`` under torchrun in a session of its own (so the test can kill all of it)."""
    out = open(output, "ab") if output else subprocess.DEVNULL
    # torch 2.x: workers restarted by torchrun fail to connect an eagerly initialised gloo group
    # ("Connection refused", pytorch/pytorch#167288 shows the same with NCCL); lazy init avoids it.
    env = {**os.environ, "TORCH_GLOO_LAZY_INIT": "1"} if max_restarts else None
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", script, *args],
            start_new_session=True, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        if output:
            out.close()


def train_args(run_dir, *extra):
    return ["--ckpt-dir", os.path.join(run_dir, "ckpt"), "--log-dir", os.path.join(run_dir, "logs"),
            "--steps", str(STEPS), "--seed", "5", *extra]


def kill_everything(process):
    """SIGKILL torchrun, its workers (each in a session of its own) and their writers at once."""
    try:
        victims = [psutil.Process(process.pid)] + psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    process.wait()


def wait_done(process, run_dir, timeout=300):
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_everything(process)
        raise
    assert code == 0, f"torchrun exited with {code}; see {run_dir}/output.txt:\n" + tail(run_dir)
    return code


def tail(run_dir):
    path = os.path.join(run_dir, "output.txt")
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-40:])


def read_log(run_dir, rank):
    path = os.path.join(run_dir, "logs", f"rank-{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines(keepends=True) if line.endswith("\n")]


_references = {}


def reference(tmp_path_factory, nproc, *extra):
    """An uninterrupted run (made once per configuration)."""
    key = (nproc, extra)
    if key not in _references:
        run_dir = str(tmp_path_factory.mktemp(f"reference-{nproc}"))
        wait_done(torchrun(TRAIN, nproc, *train_args(run_dir, *extra),
                           output=os.path.join(run_dir, "output.txt")), run_dir)
        _references[key] = run_dir
    return _references[key]


def assert_same_run(run_dir, ref_dir, nproc, context=""):
    """Every logged step of every rank (replays included) equals the reference's, every step was
    logged, and the final snapshot of every rank is bit-identical."""
    for rank in range(nproc):
        expected = {r["step"]: r for r in read_log(ref_dir, rank)}
        records = read_log(run_dir, rank)
        assert {r["step"] for r in records} == set(range(STEPS)), f"rank {rank} {context}"
        for r in records:
            assert r == expected[r["step"]], f"rank {rank}, step {r['step']} differs {context}"
        step, state = load(os.path.join(run_dir, "ckpt"), rank=rank)
        ref_step, ref_state = load(os.path.join(ref_dir, "ckpt"), rank=rank)
        assert step == ref_step == STEPS - 1
        assert_same(state, ref_state, f"rank {rank} final state {context}")


def shard_indexes(ckpt):
    record = read_manifest(LocalStorage(ckpt)).snapshots[-1]
    indexes = []
    for shard in record.shards:
        with ShardReader(os.path.join(ckpt, record.dir, shard.file)) as reader:
            indexes.append(reader.index)
    return record, indexes


@pytest.mark.parametrize("nproc", [2, 3])
def test_every_step_is_committed_and_replicated_state_is_stored_once(tmp_path_factory, nproc):
    run_dir = reference(tmp_path_factory, nproc)
    ckpt = os.path.join(run_dir, "ckpt")
    for rank in range(nproc):
        assert [r["step"] for r in read_log(run_dir, rank)] == list(range(STEPS))
    manifest = read_manifest(LocalStorage(ckpt))
    assert manifest.steps() == [STEPS - 3, STEPS - 2, STEPS - 1]  # keep_last=3 of a snapshot per step
    assert manifest.next_seq == STEPS  # every step was committed
    record, indexes = shard_indexes(ckpt)
    assert record.world_size == nproc and [s.rank for s in record.shards] == list(range(nproc))
    replicated_bytes = sum(s["nbytes"] for s in indexes[0]["storages"] if "replica" in s)
    assert replicated_bytes > 100_000
    for rank, index in enumerate(indexes[1:], start=1):
        assert not any("replica" in s for s in index["storages"]), "a replica stored twice"
        assert sum(s["nbytes"] for s in index["storages"]) < replicated_bytes / 50
        referenced = [t for t in index["tensors"] if t.get("rank") == 0]
        assert len(referenced) == len([t for t in indexes[0]["tensors"]
                                       if "rank" not in t and t["storage"] is not None
                                       and "replica" in indexes[0]["storages"][t["storage"]]])
    states = [load(ckpt, rank=r)[1] for r in range(nproc)]
    for rank, state in enumerate(states):
        for key in REPLICATED:
            assert_same(state[key], states[0][key], f"rank {rank} {key}")
        assert state["sampler"]["rank"] == rank
    assert record.raw_bytes < 1.1 * replicated_bytes  # once, not nproc times


def test_the_command_line_reads_every_rank(tmp_path_factory, capsys):
    ckpt = os.path.join(reference(tmp_path_factory, 2), "ckpt")
    assert cli_main(["verify", ckpt, "--all"]) == 0
    assert cli_main(["inspect", ckpt, "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 of 2" in out and "in rank 0's shard" in out
    export = str(tmp_path_factory.mktemp("export") / "rank1.pt")
    assert cli_main(["export", ckpt, "--step", str(STEPS - 1), "--to", export, "--rank", "1"]) == 0
    exported = torch.load(export, weights_only=True)
    assert_same(exported["model"], load(ckpt, rank=0)[1]["model"])
    assert exported["sampler"]["rank"] == 1


def test_spread_shares_the_replicated_state_among_ranks(tmp_path_factory):
    run_dir = reference(tmp_path_factory, 2, "--spread", "--width", "1024")
    record, indexes = shard_indexes(os.path.join(run_dir, "ckpt"))
    replicas = [s["nbytes"] for index in indexes for s in index["storages"] if "replica" in s]
    owned = [sum(s["nbytes"] for s in index["storages"] if "replica" in s) for index in indexes]
    assert len(replicas) == len(indexes[0]["replicas"])  # each stored once, by one of the ranks
    # Whole storages are shared out, so the balance is as good as the largest one allows.
    assert all(owned) and max(owned) - min(owned) <= max(replicas), owned
    assert indexes[0]["replicas"] == indexes[1]["replicas"]  # the checksums agreed
    assert_same(load(os.path.join(run_dir, "ckpt"), rank=1)[1]["model"],
                load(os.path.join(run_dir, "ckpt"), rank=0)[1]["model"])


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_job_killed_at_random_moments_resumes_bit_identical(tmp_path, tmp_path_factory, nproc,
                                                              seeded_random):
    ref_dir = reference(tmp_path_factory, nproc)
    kill_points = sorted(seeded_random.sample(range(2, STEPS - 4), 2))
    run_dir = str(tmp_path)
    context = f"(kills after steps {kill_points} + random delays)"
    for point in kill_points + [None]:
        process = torchrun(TRAIN, nproc, *train_args(run_dir),
                           output=os.path.join(run_dir, "output.txt"))
        if point is None:
            wait_done(process, run_dir)
            break
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            if any(r["step"] >= point for r in read_log(run_dir, 0)):
                # any instant: mid-step, mid-snapshot, mid-commit
                time.sleep(seeded_random.uniform(0, 0.03))
                break
            time.sleep(0.002)
        assert process.poll() is None, f"the job ended before it could be killed {context}"
        kill_everything(process)
    assert_same_run(run_dir, ref_dir, nproc, context)


def rank_processes(process, rank):
    """(trainer, writer) of ``rank``: torchrun's worker process and that worker's writer."""
    trainer = writer = None
    for p in psutil.Process(process.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") != str(rank):
                continue
            if p.ppid() == process.pid:
                trainer = p
            elif "async_ckpt.write.writer" in p.cmdline():
                writer = p
        except psutil.Error:
            continue
    return trainer, writer


def test_a_rank_killed_while_writing_never_commits_that_step(tmp_path, tmp_path_factory):
    extra = ("--spread", "--width", "1024")
    ref_dir = reference(tmp_path_factory, 2, *extra)
    run_dir = str(tmp_path)
    ckpt = os.path.join(run_dir, "ckpt")
    process = torchrun(TRAIN, 2, *train_args(run_dir, *extra), max_restarts=1,
                       output=os.path.join(run_dir, "output.txt"))
    try:
        committed_dirs, killed_dir = kill_rank_1_mid_write(process, ckpt, run_dir, 300)
        wait_done(process, run_dir, timeout=1)
    finally:
        if process.poll() is None:
            kill_everything(process)
    assert killed_dir is not None, "never caught rank 1 writing"
    killed_step = int(killed_dir.split("-")[1].split(".")[0])
    assert killed_dir not in committed_dirs
    assert not os.path.exists(os.path.join(ckpt, killed_dir)), "the half snapshot was not cleaned up"
    assert killed_dir not in {s.dir for s in read_manifest(LocalStorage(ckpt)).snapshots}
    # Rank 1 logged the killed step before snapshotting it, so its log always shows the replay;
    # rank 0, stopped by torchrun, may not have logged it yet and then replays nothing.
    steps = [r["step"] for r in read_log(run_dir, 1)]
    resumed_at = next(s for prev, s in zip(steps, steps[1:]) if s <= prev)  # the first replayed step
    assert resumed_at <= killed_step, "the restarted job resumed after the step that never committed"
    assert any(d.startswith(f"step-{resumed_at - 1:020d}.") for d in committed_dirs)
    assert_same_run(run_dir, ref_dir, 2)


def kill_rank_1_mid_write(process, ckpt, run_dir, seconds) -> tuple:
    """Watch a two-rank job: once rank 1 logged 5 steps, SIGKILL it while its writer is caught
    half way through a shard; until the job ends (torchrun restarts it) or ``seconds`` pass.
    Returns every snapshot directory seen committed meanwhile and the one rank 1 was writing."""
    committed, killed_dir = set(), None
    deadline = time.monotonic() + seconds
    while process.poll() is None and time.monotonic() < deadline:
        if os.path.exists(os.path.join(ckpt, "manifest.json")):
            committed |= {s.dir for s in read_manifest(LocalStorage(ckpt)).snapshots}
        if killed_dir is None and len(read_log(run_dir, 1)) >= 5:
            killed_dir = stop_rank_mid_write(process, ckpt, rank=1)
        time.sleep(0.002)
    return committed, killed_dir


def stop_rank_mid_write(process, ckpt, rank):
    """Freeze ``rank``'s writer while its shard is half written, then SIGKILL it and its trainer.
    Returns the snapshot directory it was writing, or None when it was not caught writing."""
    trainer, writer = rank_processes(process, rank)
    if writer is None or trainer is None:
        return None
    partial = f"rank-{rank:05d}.ackpt.partial"
    for _ in range(2000):
        found = [d for d in os.listdir(ckpt) if os.path.exists(os.path.join(ckpt, d, partial))]
        if found:
            writer.send_signal(signal.SIGSTOP)
            still = [d for d in found if os.path.exists(os.path.join(ckpt, d, partial))]
            if still:  # frozen mid-write: the final name was never given
                writer.send_signal(signal.SIGKILL)
                trainer.send_signal(signal.SIGKILL)
                return still[0]
            writer.send_signal(signal.SIGCONT)
        time.sleep(0.0005)
    return None


def test_distributed_behaviours(tmp_path):
    """Replica mismatch, disagreeing settings, an unshared directory, preemption, restore
    agreement, node-local directories and ZeRO optimizer shards (tests/programs/ddp_checks.py),
    with 2 ranks."""
    run_dir = str(tmp_path)
    wait_done(torchrun(CHECKS, 2, run_dir, output=os.path.join(run_dir, "output.txt")), run_dir)
    results = []
    for rank in range(2):
        with open(os.path.join(run_dir, f"result-rank-{rank}.json")) as f:
            results.append(json.load(f))
    r0, r1 = results
    mismatch = r0["check_replica_mismatch"]
    assert mismatch["outcome"].startswith("ReplicaMismatchError") and "'model'" in mismatch["outcome"]
    assert mismatch["committed"] == [] and r1["check_replica_mismatch"]["committed"] == []
    for r in results:
        assert r["check_settings_must_agree"]["error"] == "DistributedSetupError"
        assert "every = 1 (rank 0), 2 (rank 1)" in r["check_settings_must_agree"]["message"]
        assert r["check_directory_must_be_shared"]["error"] == "CheckpointDirError"
        assert r["check_preemption_agrees"] == {"preempted_at": 3, "committed": [0, 3]}
    restore = [r["check_restore_agrees_on_a_step_every_rank_can_read"] for r in results]
    assert [r["restored"] for r in restore] == [2, 2]
    assert [r["mine"] for r in restore] == [2.0, 102.0]
    assert all(r["after_wait"] == [1, 2, 3] for r in restore)  # wait() means committed everywhere
    assert all(r["explicit_step_3"] in ("CorruptSnapshotError", "ChecksumMismatchError")
               for r in restore)
    zero = [r["check_zero_optimizer_shards_are_per_rank"] for r in results]
    assert all(z["same_losses"] for z in zero) and all(z["shard_entries"] > 0 for z in zero)
    # the restore right after the snapshot took each rank's stored bytes from its staging slot
    # (rank 0's shard holds the replicated model first: the slot's regions follow that order)
    assert all(z["slot_bytes"] == z["stored_here"] > 0 for z in zero)
    local = [r["check_node_local_directories"] for r in results]
    assert local == [{"restored": 3, "mine": 3.0}, {"restored": 3, "mine": 103.0}]


def test_another_world_size_loads_what_the_ranks_held_alike_and_refuses_per_rank_state(
        tmp_path, tmp_path_factory):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(reference(tmp_path_factory, 2), "ckpt"), ckpt)
    spec = importlib.util.spec_from_file_location("train_ddp", TRAIN)
    train_ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_ddp)
    model = train_ddp.build_model(256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    sampler = DistributedResumableSampler(240, num_replicas=1, rank=0, batch_size=8)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    sampler_before = sampler.state_dict()
    for replicated in (REPLICATED, ()):  # declared or not: what DDP kept identical loads
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with CheckpointEngine(ckpt, state, replicated=replicated) as engine:
            with pytest.raises(WorldSizeMismatchError, match="written by 2 rank.*sampler held "
                               "different state on each saved rank"):
                engine.restore()
            assert_same(model.state_dict(), before)  # nothing was loaded
            assert engine.restore(reshard=True) == STEPS - 1
        saved = load(ckpt, rank=1)[1]
        assert_same(dict(model.state_dict()), dict(saved["model"]))
        assert_same(optimizer.state_dict()["state"], saved["optimizer"]["state"])
        assert scheduler.state_dict()["last_epoch"] == saved["scheduler"]["last_epoch"]
        assert sampler.state_dict() == sampler_before  # per-rank state keeps its current state
