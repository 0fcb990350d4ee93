"""Multi-rank behaviours that need a real process group, checked in one torchrun launch.

Usage: torchrun --nproc-per-node N ddp_checks.py BASE. Each check runs in its own directory under
BASE on every rank; each rank writes what it observed to BASE/result-rank-R.json for the test to
assert on.
"""

import gc
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from async_ckpt import CheckpointEngine, errors
from async_ckpt.distributed import newest_common_step
from async_ckpt.format.manifest import read_manifest
from async_ckpt.format.shard import ShardReader
from async_ckpt.storage.local import LocalStorage


def replicated_state(rank: int) -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(8, 8), "mine": torch.full((16,), float(rank))}


def check_replica_mismatch(base: str, rank: int) -> dict:
    """A replicated entry that differs on one rank: the step is not committed, rank 0 is told."""
    state = replicated_state(rank)
    if rank == dist.get_world_size() - 1:
        with torch.no_grad():
            state["model"].weight[0, 0] += 1.0
    with CheckpointEngine(base, state, replicated=["model"], commit_timeout=30) as engine:
        engine.snapshot(0)
        try:
            engine.wait()
            outcome = "ok"
        except errors.CheckpointError as e:
            outcome = type(e).__name__ + ": " + str(e)
        dist.barrier()
        return {"outcome": outcome, "committed": engine.committed_steps()}


def check_settings_must_agree(base: str, rank: int) -> dict:
    try:
        CheckpointEngine(base, replicated_state(rank), every=1 + rank).close()
        return {"error": None}
    except errors.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}


def check_directory_must_be_shared(base: str, rank: int) -> dict:
    try:
        CheckpointEngine(os.path.join(base, f"rank{rank}"), replicated_state(rank)).close()
        return {"error": None}
    except errors.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}


def check_preemption_agrees(base: str, rank: int) -> dict:
    """Only rank 0 gets the signal; every rank stops at the same step, which is committed."""
    state = replicated_state(rank)
    with CheckpointEngine(base, state, every=10, preemption=True, replicated=["model"]) as engine:
        for step in range(100):
            if rank == 0 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            try:
                engine.snapshot(step)
            except errors.Preempted as p:
                dist.barrier()
                return {"preempted_at": p.step, "committed": engine.committed_steps()}
    return {"preempted_at": None}


def check_restore_agrees_on_a_step_every_rank_can_read(base: str, rank: int) -> dict:
    """Rank 1's shard of the newest step is damaged: every rank falls back to the previous step."""
    state = replicated_state(rank)
    with CheckpointEngine(base, state, replicated=["model"]) as engine:
        for step in range(4):
            state["mine"].fill_(100 * rank + step)
            engine.snapshot(step)
        engine.wait()  # on every rank: committed, not only this rank's part durable
        after_wait = engine.committed_steps()
    dist.barrier()
    if rank == 0:
        record = read_manifest(LocalStorage(base)).snapshots[-1]
        path = os.path.join(base, record.dir, record.shards[1].file)
        with ShardReader(path) as reader:  # a byte of its first chunk (not the padding before it)
            at = next(s["chunks"][0]["offset"] for s in reader.index["storages"] if s.get("chunks"))
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    state["mine"].zero_()
    with CheckpointEngine(base, state, replicated=["model"]) as engine:
        restored = engine.restore()
        try:
            engine.restore(step=3)
            explicit = "ok"
        except errors.CheckpointError as e:
            explicit = type(e).__name__
    return {"restored": restored, "mine": state["mine"][0].item(), "explicit_step_3": explicit,
            "after_wait": after_wait}


def check_node_local_directories(base: str, rank: int) -> dict:
    """One single-rank engine per rank, each in its own directory (as on node-local disks): the
    ranks restore the newest step all of them committed."""
    state = replicated_state(rank)
    directory = os.path.join(base, f"rank{rank}")
    with CheckpointEngine(directory, state, rank=0, world_size=1) as engine:
        for step in range(4 if rank else 5):  # rank 0 committed one step more before the crash
            state["mine"].fill_(100 * rank + step)
            engine.snapshot(step)
    state["mine"].zero_()
    with CheckpointEngine(directory, state, rank=0, world_size=1) as engine:
        step = newest_common_step(engine.committed_steps())
        engine.restore(step=step)
    return {"restored": step, "mine": state["mine"][0].item()}


def check_zero_optimizer_shards_are_per_rank(base: str, rank: int) -> dict:
    """ZeroRedundancyOptimizer: each rank's shard of the optimizer state is its own entry; a
    restore brings every rank's shard back, and training continues exactly."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    data = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 8, generator=data) for _ in range(6)]

    def train(batch) -> float:
        loss = ddp(batch).square().mean()
        loss.backward()
        zero.step()
        zero.zero_grad()
        return loss.item()

    state = {"model": model, "optimizer_shard": zero.optim}  # zero.optim: this rank's shard
    with CheckpointEngine(base, state, replicated=["model"]) as engine:
        for step in range(3):
            train(batches[step])
        engine.snapshot(2)
        after = [train(b) for b in batches[3:]]
        shard_entries = len(zero.optim.state)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        engine.restore()
        slot_bytes = engine.stats()["restore_slot_bytes"]  # this rank's shard, from its slot
        record = read_manifest(LocalStorage(base)).snapshots[-1]
        with ShardReader(os.path.join(base, record.dir, record.shards[rank].file)) as reader:
            stored_here = sum(s.nbytes for s in reader.storages if s.chunks)
    again = [train(b) for b in batches[3:]]
    return {"same_losses": after == again, "shard_entries": shard_entries,
            "slot_bytes": slot_bytes, "stored_here": stored_here}


CHECKS = [check_replica_mismatch, check_settings_must_agree, check_directory_must_be_shared,
          check_preemption_agrees, check_restore_agrees_on_a_step_every_rank_can_read,
          check_node_local_directories, check_zero_optimizer_shards_are_per_rank]


def main() -> None:
    base = sys.argv[1]
    torch.set_num_threads(1)  # one thread: losses compared before and after a restore agree
    dist.init_process_group("gloo")
    try:  # a process left with a live gloo group aborts at exit ("terminate called ...")
        rank = dist.get_rank()
        results = {}
        for check in CHECKS:
            results[check.__name__] = check(os.path.join(base, check.__name__), rank)
            dist.barrier()
        with open(os.path.join(base, f"result-rank-{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        # DDP and ZeroRedundancyOptimizer objects of the checks sit in reference cycles and hold
        # the gloo group: collected at interpreter exit, they tear its threads down too late
        # ("terminate called without an active exception"). Collect them while Python is alive.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
