"""State across ranks under torchrun, against DCP on the same ranks and disk (method:
docs/performance.md, "What runs"): a replicated state as DDP keeps it on two ranks (``RANKS``),
and an FSDP2-sharded one saved at 2 and 4 ranks and restored at the other world size
(``SHARDED``, three torchrun runs: ``PLAN``)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Mapping, Optional, Sequence

import torch.distributed as dist

from .floors import Floors, copy_s
from .harness import (FloorHook, PartOf, finish, gather, log, ratio_spread, remove, run_rounds,
                      slowest, slowest_timed, spread, timed, torchrun)
from .markdown import factor, median_range, number, section, table, with_ratios
from .systems import (DCP_LOAD, DCP_SAVE, OURS_ASYNC, RANK_SYSTEMS, SHARDED_SYSTEMS, System,
                      SystemSpec, Unavailable)
from .workloads import build_state, sharded_state

FULL = {"size_gb": 0.5, "rounds": 3}
QUICK = {"size_gb": 0.008, "rounds": 1}  # a smoke test: torchrun runs cost seconds each
REPLICATED_WORLD = 2
PLAN = ((2, None, True), (4, 2, True), (2, 4, False))
"""The sharded part's torchrun runs in order: (world size, world size of the kept snapshots it
restores, whether it measures saving and keeps snapshots for a later run)."""
OURS = OURS_ASYNC.name
KEPT_STEP = 1
PEERS = tuple(spec.name for spec in SHARDED_SYSTEMS if not spec.ours)
RESTORERS = {OURS_ASYNC: "ours", DCP_LOAD: "dcp"}
"""Restoring on another world size: each system, opened on the directory of the snapshot kept at
the other world size (its key in kept.json)."""
SAVE_FLOORS = (("blocking_s", "copy_s"), ("to_commit_s", "durable_s"))
"""Each saving figure and the floor it is divided by, round by round."""


def _preset(quick: bool, rounds: Optional[int]) -> tuple[float, int]:
    """The state's GB and the rounds (``rounds``: ``--rounds`` where given)."""
    preset = QUICK if quick else FULL
    return preset["size_gb"], preset["rounds"] if rounds is None else rounds


# --- the runs and their summaries -----------------------------------------------------------------


def run_ranks(root: str, quick: bool, rounds: Optional[int] = None) -> dict:
    """The replicated state's workers under torchrun; medians with their min-max spread over the
    rounds, their ratios to the same round's floors (pairwise: their median) and to the best peer
    (of medians)."""
    size_gb, rounds = _preset(quick, rounds)
    raw = torchrun("two ranks", "distributed", REPLICATED_WORLD, os.path.join(root, "ranks"),
                   size_gb, rounds, "--mode", "replicated")
    summary = summarise_saving(raw, RANK_SYSTEMS)
    systems = summary["systems"]
    for key, _ in SAVE_FLOORS:
        peers = [s[key]["median"] for s in systems.values() if s["available"] and not s["ours"]]
        for s in systems.values():
            if s["available"]:
                x_floor = key.replace("_s", "_x_floor")
                s[x_floor] = s[x_floor]["median"]
                s[key.replace("_s", "_x_best_peer")] = (s[key]["median"] / min(peers) if peers
                                                        else None)
    return {"ranks": REPLICATED_WORLD, "state_bytes": raw["state_bytes"],
            "floors": summary["floors"], "floor_ways": summary["floor_ways"],
            "rounds": raw["rounds"], "systems": systems, "loads": raw["loads"], "raw": raw}


def run_sharded(root: str, quick: bool, rounds: Optional[int] = None) -> dict:
    """The three torchrun runs of ``PLAN`` under ``root``; medians with their min-max spread over
    the rounds, and ratios taken round by round: to the same round's floors and, for async_ckpt,
    to each DCP variant's value of the same round."""
    size_gb, rounds = _preset(quick, rounds)
    found: dict = {"save": {}, "restore": {}, "runs": []}
    for world, source, save in PLAN:
        options = [*(["--restore", _kept_dir(root, source)] if source is not None else []),
                   *(["--keep", _kept_dir(root, world)] if save else [])]
        started = time.perf_counter()
        raw = torchrun(f"sharded state at {world} ranks", "distributed", world,
                       os.path.join(root, f"sharded-{world}-{source}"), size_gb, rounds,
                       "--mode", "sharded", *options)
        raw["wall_s"] = time.perf_counter() - started
        found["runs"].append({"ranks": world, "restores_from": source, "saves": save,
                              "wall_s": raw["wall_s"]})
        if save:
            found["save"][str(world)] = raw["save"]
        if source is not None:
            found["restore"][f"{source}->{world}"] = raw["restore"]
    return {"save": {world: _summarise_sharded_saving(raw) for world, raw in found["save"].items()},
            "restore": {pair: _summarise_restoring(raw) for pair, raw in found["restore"].items()},
            "runs": found["runs"], "wall_s": sum(r["wall_s"] for r in found["runs"]), "raw": found}


def _kept_dir(root: str, world: int) -> str:
    return os.path.join(root, f"sharded-kept-{world}")


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
        for key, floor_key in SAVE_FLOORS:
            systems[name][key] = spread([r[key] for r in runs])
            systems[name][key.replace("_s", "_x_floor")] = _by_round(
                runs, dict(enumerate(floors[floor_key])), key)
    return {"floors": {key: spread(values) for key, values in floors.items()},
            "floor_ways": [s["durable_way"] for s in raw["floors"]], "systems": systems}


def _summarise_sharded_saving(raw: dict) -> dict:
    """``summarise_saving``, and async_ckpt's figures over each DCP variant's, round by round."""
    summary = summarise_saving(raw, SHARDED_SYSTEMS)
    blocks = raw["systems"]
    if blocks[OURS]["available"]:
        for key, _ in SAVE_FLOORS:
            summary["systems"][OURS][key.replace("_s", "_x_dcp")] = {
                peer: _paired(blocks[OURS]["runs"], blocks[peer]["runs"], key)
                for peer in PEERS if blocks.get(peer, {}).get("available")}
    return {"ranks": raw["world"], "state_bytes": raw["state_bytes"],
            "rank_bytes": raw["rank_bytes"], "rounds": raw["rounds"], "wall_s": raw["wall_s"],
            **summary}


def _summarise_restoring(raw: dict) -> dict:
    blocks = raw["systems"]
    systems = {name: ({"available": True, "restore_s": spread([r["restore_s"] for r in b["runs"]]),
                       "warmup_s": spread([r["warmup_s"] for r in b["runs"]])}
                      if b["available"] else b) for name, b in blocks.items()}
    both = all(b["available"] for b in blocks.values())
    return {"saved_at": raw["saved_at"], "restored_at": raw["world"],
            "state_bytes": raw["state_bytes"], "rounds": raw["rounds"], "wall_s": raw["wall_s"],
            "systems": systems,
            "x_dcp": _paired(blocks[OURS]["runs"], blocks[DCP_LOAD.name]["runs"], "restore_s")
            if both else None}


def _paired(runs: list[dict], references: list[dict], key: str) -> dict:
    """``key`` of ``runs`` over that of ``references``, round by round."""
    return _by_round(runs, {r["round"]: r[key] for r in references}, key)


def _by_round(runs: list[dict], references: Mapping[int, float], key: str) -> dict:
    """``ratio_spread`` of each run's ``key`` over its round's reference, in the rounds that have
    one."""
    both = [r for r in runs if r["round"] in references]
    return ratio_spread([r[key] for r in both], [references[r["round"]] for r in both])


def ranks_loads(block: dict) -> dict:
    """The two-rank part's machine load per round, for the report's "Machine load" table."""
    return {"two ranks": {"rounds": block["loads"], "vmstat_delta": None,
                          "settle": block["raw"]["settle"]}}


def sharded_loads(block: dict) -> dict:
    """The machine's load per round of each sharded run, for the report's "Machine load" table."""
    runs = {**{f"sharded, {w} ranks saving": r for w, r in block["raw"]["save"].items()},
            **{f"sharded, restore {pair}": r for pair, r in block["raw"]["restore"].items()}}
    return {label: {"rounds": r["loads"], "vmstat_delta": r["load"]["vmstat_delta"],
                    "settle": r["settle"]} for label, r in runs.items()}


# --- the report -----------------------------------------------------------------------------------


def render_ranks(ranks: dict) -> str:
    floors = ranks["floors"]
    rows = [[name, f"n/a ({s['reason']})", "", ""] if not s["available"] else [
        name, *(with_ratios(s[f"{key}_s"], s[f"{key}_x_floor"], s[f"{key}_x_best_peer"])
                for key in ("blocking", "to_commit")),
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


def render_sharded(block: dict) -> str:
    save_rows, floor_notes = [], []
    for world, w in block["save"].items():
        floors = w["floors"]
        floor_notes.append(f"{world} ranks: `copy_` of a rank's {w['rank_bytes'][0] / 1e6:.3g} MB "
                           f"{median_range(floors['copy_s'])} s, disk floor of "
                           f"{w['state_bytes'] / 1e6:.3g} MB {median_range(floors['durable_s'])} s "
                           f"({', '.join(w['floor_ways'])})")
        for name, s in w["systems"].items():
            if not s["available"]:
                save_rows.append([world, name, f"n/a ({s['reason']})", "", "", "", ""])
                continue
            cells = [world, name]
            for key in ("blocking", "to_commit"):
                by_peer = s.get(f"{key}_x_dcp", {})
                cells += [f"{median_range(s[f'{key}_s'])} · "
                          f"{median_range(s[f'{key}_x_floor'], fmt=factor)}",
                          " / ".join(median_range(by_peer.get(p), fmt=factor) for p in PEERS)
                          if s["ours"] else "–"]
            cells.append(" + ".join(f"{b / 1e6:.3g}" for b in s["bytes_per_rank"]))
            save_rows.append(cells)
    restore_rows = [[f"{r['saved_at']} → {r['restored_at']}",
                     *(median_range(s["restore_s"]) if s["available"] else f"n/a ({s['reason']})"
                       for s in (r["systems"][OURS], r["systems"][DCP_LOAD.name])),
                     median_range(r["x_dcp"], fmt=factor)] for r in block["restore"].values()]
    first = next(iter(block["save"].values()))
    peers = " / ".join(f"×DCP {p.split('(')[1].split()[0]}" for p in PEERS)  # ×DCP default...
    return section(
        f"Sharded state (FSDP2) under torchrun (gloo), {first['state_bytes'] / 1e6:.3g} MB "
        "across the ranks",
        "An MLP + AdamW `fully_shard`-ed over a CPU mesh, registered through "
        "`get_state_dict`/`set_state_dict` (DTensors): every rank writes only its pieces. Medians "
        f"(min–max) of {first['rounds']} interleaved rounds, one measured snapshot per system "
        "and round after a warm-up; every ratio is taken round by round, then its median "
        "(min–max). Blocking is the slowest rank's call (×floor: one `copy_` of a rank's share); "
        "time to commit runs from rank 0's call until rank 0 sees the snapshot committed, every "
        "rank's part durable (×floor: the fastest way to make the whole state's bytes "
        "durable, its way per round in parentheses). Floors: "
        + "; ".join(floor_notes) + ".",
        table(["ranks", "system", "blocking s (min–max) · ×copy", f"blocking {peers}",
               "time to commit s (min–max) · ×disk floor", f"time to commit {peers}",
               "MB written per rank"], save_rows),
        "Restoring on another world size (warm page cache), into the live model and optimizer "
        "laid out for the new world size: async_ckpt `engine.restore()` of its snapshot against "
        "DCP `load` of a `dcp.save` of the same state at the same world size; the slowest "
        "rank's time, a warm-up restore first in every round.",
        table(["saved at → restored at (ranks)", f"{OURS} restore s (min–max)",
               f"{DCP_LOAD.name} s (min–max)", "async_ckpt / DCP (min–max)"], restore_rows))


RANKS = PartOf("ranks", run_ranks, render_ranks)
SHARDED = PartOf("sharded", run_sharded, render_sharded)


# --- the worker (one per rank, under torchrun) ----------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """``--mode replicated``: the two-rank part's rounds; ``sharded``: one run of ``PLAN``."""
    dist.init_process_group("gloo")
    if args.mode == "replicated":
        state, nbytes = build_state(args.size_gb)  # seeded: the same on both ranks
        record = save_rounds(RANK_SYSTEMS, state, args.dir, args.rounds, nbytes, nbytes)
        finish(args.out, {"state_bytes": nbytes, "rounds": args.rounds, **record})
        return
    world = dist.get_world_size()
    state, own = sharded_state(args.size_gb, world)
    rank_bytes = gather(own)
    common = {"world": world, "state_bytes": sum(rank_bytes), "rank_bytes": rank_bytes,
              "rounds": args.rounds}
    found = {}
    if args.restore:
        started = time.perf_counter()
        found["restore"] = {**restore_rounds(state, args.restore, args.rounds), **common,
                            "wall_s": time.perf_counter() - started}
    if args.keep:
        started = time.perf_counter()
        found["save"] = {**save_rounds(SHARDED_SYSTEMS, state, args.dir, args.rounds,
                                       sum(rank_bytes), rank_bytes[0]), **common}
        keep(state, args.keep)
        found["save"]["wall_s"] = time.perf_counter() - started  # with the kept snapshots
    finish(args.out, found)


def save_rounds(specs: Sequence[SystemSpec], state: dict, directory: str, rounds: int,
                nbytes: int, share: int) -> dict:
    """``harness.run_rounds`` of ``run_round`` for each of ``specs``, on every rank. Floors, on
    rank 0 while the others wait: ``copy_`` of ``share`` bytes (what each rank must copy at
    least) and the disk floor of the ``nbytes`` the ranks write in all, on the one disk."""
    os.makedirs(os.path.join(directory, "floors"), exist_ok=True)
    floors = Floors(os.path.join(directory, "floors"), nbytes) if dist.get_rank() == 0 else None

    def floor_sample() -> dict:
        sample = {}
        if floors is not None:
            sample = {**floors.measure(),
                      "copy_s": copy_s([floors.src[:share]], [floors.dst[:share]])}
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
    """One system for one round on every rank: a warm-up and a measured snapshot; the round's
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
            blocking = slowest(seconds)
        run = {"available": True, "blocking_s": blocking,
               "to_commit_s": system.to_commit_s() if rank == 0 else None,
               "stored_bytes": system.stored_bytes() if rank == 0 else None,
               "bytes_per_rank": gather(_own_bytes(system, rank))}
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


def keep(state: dict, directory: str) -> None:
    """One snapshot of ``state`` by async_ckpt and one ``dcp.save`` of it, under ``directory``,
    for a run at another world size to restore; rank 0 writes where they are to kept.json."""
    ours = OURS_ASYNC.open(state, os.path.join(directory, "ours"))
    try:
        ours.save(KEPT_STEP)
        ours.wait()
    finally:
        ours.close()
    theirs = DCP_SAVE.open(state, os.path.join(directory, "dcp"))
    theirs.save(KEPT_STEP)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "kept.json"), "w", encoding="utf-8") as f:
            json.dump({"world": dist.get_world_size(), "step": KEPT_STEP, "ours": ours.directory,
                       "dcp": theirs.directory}, f)


def restore_rounds(state: dict, directory: str, rounds: int) -> dict:
    """Interleaved rounds of a warm-up and a measured restore by each of ``RESTORERS`` from
    the snapshots ``keep`` left in ``directory``; the slowest rank's times."""
    with open(os.path.join(directory, "kept.json"), encoding="utf-8") as f:
        kept = json.load(f)

    def run_slot(index: int, spec: SystemSpec, floor_hook: FloorHook) -> dict:
        restorer = spec.open(state, kept[RESTORERS[spec]])
        try:
            restored, seconds = [], []
            for _ in range(2):  # the first is the warm-up
                seconds.append(slowest_timed(lambda: restored.append(restorer.restore())))
        finally:
            restorer.close()
            dist.barrier()
        if restored != [kept["step"]] * 2:
            raise RuntimeError(f"{spec.name} restored steps {restored}, not {kept['step']}")
        log(f"  restore {kept['world']} -> {dist.get_world_size()} ranks, {spec.name}: "
            f"{seconds[1]:.3f} s (warm-up {seconds[0]:.3f} s)")
        return {"restore_s": seconds[1], "warmup_s": seconds[0]}

    record = run_rounds(list(RESTORERS), rounds, 0, dict, run_slot)
    return {**record, "saved_at": kept["world"]}
