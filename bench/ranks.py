"""Two ranks under torchrun: blocking time and time to commit of async_ckpt and of DCP
``async_save``, on the same ranks, the same state and the same disk.

The state is the sweep's model + Adam (``workloads.build_state``), identical on both ranks as DDP
keeps it: async_ckpt declares it ``replicated`` (written once, by rank 0 or, spread, half by each
rank); DCP's default planner de-duplicates it too, spreading the writes over the ranks. The
systems run in interleaved rounds (``rounds.run_rounds``, the same rotating order on both ranks):
per round each system opens, takes a warm-up snapshot and one measured snapshot, each followed by
``wait()`` on both ranks and a barrier (so writes never overlap each other or a floor, and no
collective of ours runs while DCP's background thread runs its own), and closes. Per snapshot:

* blocking: the slower rank's ``save`` call (training waits for the slowest rank);
* time to commit: from rank 0's call until rank 0 sees the snapshot committed: async_ckpt's
  ``to_commit_s`` (its commit waits for every rank's shard), DCP's upload future (its metadata is
  written once every rank's data is).

Floors, on rank 0 once per round, next to the round's first system (before its cleanup) while rank
1 waits: ``copy_`` of one rank's state (what each rank must copy at least) and the disk floor, the
fastest way to make the state's bytes durable (``floors.Floors``; written once in all, on the one
disk both ranks share). Every figure of round
``i`` is paired with round ``i``'s floors and peers. ``run(root, quick)`` (called by ``python -m
bench``) starts ``torchrun --nproc-per-node 2 -m bench.ranks --worker ...`` and returns the
figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .floors import Floors
from .measure import log, ratio_spread, remove, spread, timed
from .rounds import FloorHook, run_rounds
from .systems import Engine, System, Unavailable
from .workloads import build_state

RANKS = 2
FULL = {"size_gb": 0.5, "rounds": 3}
QUICK = {"size_gb": 0.008, "rounds": 1}  # a smoke test: torchrun runs cost seconds each
REPLICATED = ("model", "optimizer")


def _ours(name: str, spread: bool) -> tuple[str, bool, Callable[[dict, str], System]]:
    return name, True, lambda state, d: Engine(state, d, name, "async", None,
                                               replicated=REPLICATED, spread_replicated=spread)


def _dcp(name: str, stager: str) -> tuple[str, bool, Callable[[dict, str], System]]:
    def open_(state: dict, directory: str) -> System:
        from .dcp import DcpAsync
        return DcpAsync(name, state, directory, "thread", stager)
    return name, False, open_


SYSTEMS = (
    _ours("async_ckpt async, replicated written by rank 0", spread=False),
    _ours("async_ckpt async, replicated spread over ranks", spread=True),
    _dcp("DCP async_save (default stager)", "default"),
    _dcp("DCP async_save (cached shm stager)", "cached"),
)


def run(root: str, quick: bool, rounds: Optional[int] = None) -> dict:
    """Run the workers under torchrun; the figures, or why they could not be measured."""
    preset = QUICK if quick else FULL
    rounds = preset["rounds"] if rounds is None else rounds
    out = os.path.join(root, "ranks.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={RANKS}", "-m", "bench.ranks", "--worker", "--dir",
               os.path.join(root, "ranks"), "--out", out, "--size-gb", str(preset["size_gb"]),
               "--rounds", str(rounds)]
    log(f"two ranks: {' '.join(command[2:])}")
    done = subprocess.run(command, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the two-rank benchmark failed ({done.returncode}):\n"
                           + done.stdout[-4000:])
    with open(out, encoding="utf-8") as f:
        return summarise(json.load(f))


def summarise(raw: dict) -> dict:
    """Medians with their min-max spread over the rounds, their ratios to the same round's floors
    (pairwise) and to the best peer (of medians)."""
    floors = {key: [s[key] for s in raw["floors"]] for key in ("copy_s", "durable_s")}
    ours = {name for name, is_ours, _ in SYSTEMS if is_ours}
    systems = {}
    for name, block in raw["systems"].items():
        if not block["available"]:
            systems[name] = block
            continue
        runs = block["runs"]
        systems[name] = {"available": True, "ours": name in ours,
                         "stored_bytes": runs[-1]["stored_bytes"],
                         "bytes_per_rank": runs[-1]["bytes_per_rank"]}
        for key, floor_key in (("blocking_s", "copy_s"), ("to_commit_s", "durable_s")):
            values = [r[key] for r in runs]
            systems[name][key] = spread(values)
            systems[name][key.replace("_s", "_x_floor")] = ratio_spread(
                values, [floors[floor_key][r["round"]] for r in runs])["median"]
    for key in ("blocking_s", "to_commit_s"):
        peers = [s[key]["median"] for s in systems.values() if s["available"] and not s["ours"]]
        for s in systems.values():
            if s["available"]:
                s[key.replace("_s", "_x_best_peer")] = s[key]["median"] / min(peers) if peers \
                    else None
    return {"ranks": RANKS, "state_bytes": raw["state_bytes"],
            "floors": {key: spread(values) for key, values in floors.items()},
            "floor_ways": [s["durable_way"] for s in raw["floors"]], "rounds": raw["rounds"],
            "systems": systems, "loads": raw["loads"], "raw": raw}


# --- the worker (one per rank, under torchrun) ---------------------------------------------------


def worker(directory: str, out: str, size_gb: float, rounds: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state, nbytes = build_state(size_gb)  # seeded: the same on both ranks
    os.makedirs(os.path.join(directory, "floors"), exist_ok=True)
    floors = Floors(os.path.join(directory, "floors"), nbytes) if rank == 0 else None

    def floor_sample() -> dict:
        sample = floors.measure() if floors is not None else {}
        dist.barrier()
        return sample

    names = [name for name, _, _ in SYSTEMS]

    def run_slot(index: int, system: tuple, floor_hook: FloorHook) -> dict:
        name, _, open_ = system
        slot = f"r{index}-s{names.index(name)}"  # one directory each: rank 0 removes it
        run = run_round(open_, state, os.path.join(directory, slot), floor_hook)
        if run["available"]:
            log(f"  {name}: blocking {run['blocking_s']:.3f} s, to commit {run['to_commit_s']} s")
        return run

    record = run_rounds(SYSTEMS, rounds, 0, floor_sample, run_slot, name=lambda system: system[0],
                        settle_bytes=nbytes)
    if rank == 0:
        floors.close()
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"state_bytes": nbytes, "rounds": rounds, **record}, f)
    gc.collect()  # objects that hold the group go while Python is alive, not at exit
    dist.destroy_process_group()


def run_round(open_: Callable[[dict, str], System], state: dict, directory: str,
              floor_hook: FloorHook) -> dict:
    """One system for one round on both ranks: a warm-up and a measured snapshot; the round's
    floor sample (``floor_hook``) runs before the system closes and its files go."""
    rank = dist.get_rank()
    try:
        system = open_(state, directory)
    except Unavailable as e:
        return {"available": False, "reason": str(e)}
    try:
        for step in range(2):  # step 0 is the warm-up
            dist.barrier()
            seconds = timed(lambda: system.save(step))
            system.wait()
            slowest = max(_gather(seconds))
        run = {"available": True, "blocking_s": slowest,
               "to_commit_s": system.to_commit_s() if rank == 0 else None,
               "stored_bytes": system.stored_bytes() if rank == 0 else None,
               "bytes_per_rank": _gather(_own_bytes(system, rank))}
        if floor_hook is not None:
            floor_hook()
    finally:
        system.close()
        dist.barrier()
        if rank == 0:
            remove(directory, settle=True)
    return run


def _own_bytes(system: System, rank: int) -> int:
    """Bytes this rank wrote of the newest snapshot (its shard; for DCP its data file)."""
    path = system.newest_path()
    mine = [n for n in os.listdir(path) if n.startswith((f"rank-{rank:05d}.", f"__{rank}_"))]
    return sum(os.path.getsize(os.path.join(path, n)) for n in mine)


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ranks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir")
    parser.add_argument("--out")
    parser.add_argument("--size-gb", type=float)
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)  # two ranks on this machine's cores
        worker(args.dir, args.out, args.size_gb, args.rounds)
        return
    root = tempfile.mkdtemp(prefix="bench-ranks-")
    try:
        print(json.dumps({k: v for k, v in run(root, args.quick).items() if k != "raw"}, indent=1))
    finally:
        remove(root)


if __name__ == "__main__":
    main()
