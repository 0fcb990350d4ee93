"""Two ranks under torchrun, replicated state as DDP keeps it: blocking and time to commit of
async_ckpt and of DCP ``async_save`` on the same ranks and disk (method: docs/performance.md,
"What runs"); ``save_rounds`` and ``torchrun`` serve the other torchrun parts too."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from typing import Optional, Sequence

import torch.distributed as dist

from .floors import Floors
from .markdown import median_range, number, section, table, with_ratios
from .measure import log, ratio_spread, remove, spread, timed
from .registry import RANK_SYSTEMS, SystemSpec
from .rounds import FloorHook, run_rounds
from .systems import System, Unavailable
from .workloads import build_state
from .worker import command as command_of

RANKS = 2
FULL = {"size_gb": 0.5, "rounds": 3}
QUICK = {"size_gb": 0.008, "rounds": 1}  # a smoke test: torchrun runs cost seconds each
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(root: str, quick: bool, rounds: Optional[int] = None) -> dict:
    """Run the workers under torchrun; the figures, or why they could not be measured."""
    preset = QUICK if quick else FULL
    rounds = preset["rounds"] if rounds is None else rounds
    return summarise(torchrun("two ranks", "ranks", RANKS, os.path.join(root, "ranks"),
                              preset["size_gb"], rounds))


def torchrun(what: str, part: str, world: int, directory: str, size_gb: float, rounds: int,
             *options: str) -> dict:
    """``part``'s worker (``bench/worker.py``) on ``world`` ranks under torchrun, from the
    repository root, working in ``directory``: what rank 0 wrote (``finish``). What the run
    printed is shown only if it fails."""
    out = directory + ".json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", *command_of(part, dir=directory, out=out,
                                                        size_gb=size_gb, rounds=rounds)[1:],
               *options]
    log(f"{what}: {' '.join(command[2:])}")
    done = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n" + done.stdout[-4000:])
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def summarise(raw: dict) -> dict:
    """Medians with their min-max spread over the rounds, their ratios to the same round's floors
    (pairwise: their median) and to the best peer (of medians)."""
    summary = summarise_saving(raw, RANK_SYSTEMS)
    systems = summary["systems"]
    for key in ("blocking_s", "to_commit_s"):
        peers = [s[key]["median"] for s in systems.values() if s["available"] and not s["ours"]]
        for s in systems.values():
            if s["available"]:
                s[key.replace("_s", "_x_floor")] = s[key.replace("_s", "_x_floor")]["median"]
                s[key.replace("_s", "_x_best_peer")] = s[key]["median"] / min(peers) if peers \
                    else None
    return {"ranks": RANKS, "state_bytes": raw["state_bytes"], "floors": summary["floors"],
            "floor_ways": summary["floor_ways"], "rounds": raw["rounds"], "systems": systems,
            "loads": raw["loads"], "raw": raw}


def summarise_saving(raw: dict, specs: Sequence[SystemSpec]) -> dict:
    """``save_rounds``' record as ``{"floors", "floor_ways", "systems"}``: per system, its bytes
    (the last round's: in all, per rank) and, for blocking and time to commit, the spread over the
    rounds and the spread of its per-round ratios to the round's floor (``*_x_floor``)."""
    floors = {key: [s[key] for s in raw["floors"]] for key in ("copy_s", "durable_s")}
    ours = {spec.name for spec in specs if spec.ours}
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
                values, [floors[floor_key][r["round"]] for r in runs])
    return {"floors": {key: spread(values) for key, values in floors.items()},
            "floor_ways": [s["durable_way"] for s in raw["floors"]], "systems": systems}


# --- the worker (one per rank, under torchrun) ---------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    state, nbytes = build_state(args.size_gb)  # seeded: the same on both ranks
    record = save_rounds(RANK_SYSTEMS, state, args.dir, args.rounds, nbytes, nbytes)
    finish(args.out, {"state_bytes": nbytes, "rounds": args.rounds, **record})


def finish(out: str, found: dict) -> None:
    """A worker's end: rank 0 writes what it found to ``out`` (``torchrun`` returns it); the
    process group goes while Python is alive, with the objects that hold it, not at exit."""
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(found, f)
    gc.collect()
    dist.destroy_process_group()


def save_rounds(specs: Sequence[SystemSpec], state: dict, directory: str, rounds: int,
                nbytes: int, share: int) -> dict:
    """``rounds.run_rounds`` of ``run_round`` for each of ``specs``, on every rank. Floors, on
    rank 0 while the others wait: ``copy_`` of ``share`` bytes (what each rank must copy at
    least) and the disk floor of the ``nbytes`` the ranks write in all, on the one disk."""
    os.makedirs(os.path.join(directory, "floors"), exist_ok=True)
    floors = Floors(os.path.join(directory, "floors"), nbytes) if dist.get_rank() == 0 else None

    def floor_sample() -> dict:
        sample = {}
        if floors is not None:
            sample = {**floors.measure(),
                      "copy_s": timed(lambda: floors.dst[:share].copy_(floors.src[:share]))}
        dist.barrier()
        return sample

    names = [spec.name for spec in specs]

    def run_slot(index: int, spec: SystemSpec, floor_hook: FloorHook) -> dict:
        slot = f"r{index}-s{names.index(spec.name)}"  # one directory each: rank 0 removes it
        run = run_round(spec, state, os.path.join(directory, slot), floor_hook)
        if run["available"]:
            log(f"  {dist.get_world_size()} ranks, {spec.name}: blocking {run['blocking_s']:.3f} "
                f"s, to commit {run['to_commit_s']} s")
        return run

    try:
        return run_rounds(specs, rounds, 0, floor_sample, run_slot, settle_bytes=nbytes)
    finally:
        if floors is not None:
            floors.close()


def run_round(spec: SystemSpec, state: dict, directory: str, floor_hook: FloorHook) -> dict:
    """One system for one round on both ranks: a warm-up and a measured snapshot; the round's
    floor sample (``floor_hook``) runs before the system closes and its files go."""
    rank = dist.get_rank()
    try:
        system = spec.open(state, directory)
    except Unavailable as e:
        return {"available": False, "reason": str(e)}
    try:
        for step in range(2):  # step 0 is the warm-up
            dist.barrier()
            seconds = timed(lambda: system.save(step))
            system.wait()
            slowest = max(gather(seconds))
        run = {"available": True, "blocking_s": slowest,
               "to_commit_s": system.to_commit_s() if rank == 0 else None,
               "stored_bytes": system.stored_bytes() if rank == 0 else None,
               "bytes_per_rank": gather(_own_bytes(system, rank))}
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


def gather(value) -> list:
    """``value`` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def render(ranks: dict) -> str:
    floors = ranks["floors"]
    rows = [[name, f"n/a ({s['reason']})", "", ""] if not s["available"] else [
        name, with_ratios(s["blocking_s"], s["blocking_x_floor"], s["blocking_x_best_peer"]),
        with_ratios(s["to_commit_s"], s["to_commit_x_floor"], s["to_commit_x_best_peer"]),
        f"{number(s['stored_bytes'] / 1e6)} "
        f"({' + '.join(number(b / 1e6) for b in s['bytes_per_rank'])})"]
        for name, s in ranks["systems"].items()]
    return section(
        f"{ranks['ranks']} ranks under torchrun (gloo), {ranks['state_bytes'] / 1e6:.3g} MB "
        "replicated state",
        "The same model + Adam state on every rank, as DDP keeps it; medians (min–max) of "
        f"{ranks['rounds']} interleaved rounds, one measured snapshot per system per round. "
        "Blocking is the slower rank's call (floor: one `copy_` of a rank's state, "
        f"{median_range(floors['copy_s'])} s); time to commit runs from rank 0's call until "
        "rank 0 sees the snapshot committed, every rank's part durable (floor: the fastest way "
        f"to make the state's bytes durable once, {median_range(floors['durable_s'])} s; per "
        f"round: {', '.join(ranks['floor_ways'])}).",
        table(["system", "blocking s (min–max) · ×floor · ×best peer",
               "time to commit s (min–max) · ×floor · ×best peer", "MB written (per rank)"], rows))
