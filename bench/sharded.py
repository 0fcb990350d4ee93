"""Sharded state (FSDP2) under torchrun: async_ckpt against DCP saving at 2 and 4 ranks, and
restores on another world size (three torchrun runs, ``PLAN``; method: docs/performance.md,
"What runs")."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import ranks
from .markdown import factor, median_range, section, table
from .measure import log, ratio_spread, spread, timed
from .registry import DCP_SAVE, OURS_ASYNC, SHARDED_SYSTEMS
from .rounds import FloorHook, run_rounds
from .workloads import layer_bytes, width_for

FULL = {"size_gb": 0.5, "rounds": 3}
QUICK = {"size_gb": 0.008, "rounds": 1}  # a smoke test: torchrun runs cost seconds each
PLAN = ((2, None, True), (4, 2, True), (2, 4, False))
"""The torchrun runs in order: (world size, world size of the kept snapshots it restores, whether
it measures saving and keeps snapshots for a later run)."""
OURS = OURS_ASYNC.name
DCP_LOAD = "DCP load"
KEPT_STEP = 1
PEERS = tuple(spec.name for spec in SHARDED_SYSTEMS if not spec.ours)


RESTORERS = ((OURS, OURS_ASYNC, "ours"), (DCP_LOAD, DCP_SAVE, "dcp"))
"""Restoring on another world size: (name, the registry's system, its directory in kept.json),
each opened on the directory of the snapshot it kept at the other world size."""


# --- the runs -------------------------------------------------------------------------------------


def run(root: str, quick: bool, rounds: Optional[int] = None) -> dict:
    """The three torchrun runs of ``PLAN`` under ``root``; the summarised figures."""
    preset = QUICK if quick else FULL
    rounds = preset["rounds"] if rounds is None else rounds
    found: dict = {"save": {}, "restore": {}, "runs": []}
    for world, source, save in PLAN:
        raw = _torchrun(root, world, preset["size_gb"], rounds, source, save)
        found["runs"].append({"ranks": world, "restores_from": source, "saves": save,
                              "wall_s": raw["wall_s"]})
        if save:
            found["save"][str(world)] = raw["save"]
        if source is not None:
            found["restore"][f"{source}->{world}"] = raw["restore"]
    return summarise(found)


def _torchrun(root: str, world: int, size_gb: float, rounds: int, source: Optional[int],
              save: bool) -> dict:
    options = [*(["--restore", _kept_dir(root, source)] if source is not None else []),
               *(["--keep", _kept_dir(root, world)] if save else [])]
    started = time.perf_counter()
    raw = ranks.torchrun(f"sharded state at {world} ranks", "sharded", world,
                         os.path.join(root, f"sharded-{world}-{source}"), size_gb, rounds, *options)
    raw["wall_s"] = time.perf_counter() - started
    return raw


def _kept_dir(root: str, world: int) -> str:
    return os.path.join(root, f"sharded-kept-{world}")


# --- the summary ----------------------------------------------------------------------------------


def summarise(found: dict) -> dict:
    """Medians with their min-max spread over the rounds, and ratios taken round by round: to the
    same round's floors and, for async_ckpt, to each DCP variant's value of the same round."""
    saving = {world: _summarise_saving(raw) for world, raw in found["save"].items()}
    restoring = {pair: _summarise_restoring(raw) for pair, raw in found["restore"].items()}
    return {"save": saving, "restore": restoring, "runs": found["runs"],
            "wall_s": sum(r["wall_s"] for r in found["runs"]), "raw": found}


def _summarise_saving(raw: dict) -> dict:
    """``ranks.summarise_saving``, and async_ckpt's figures over each DCP variant's, round by
    round."""
    summary = ranks.summarise_saving(raw, SHARDED_SYSTEMS)
    blocks = raw["systems"]
    if blocks[OURS]["available"]:
        for key in ("blocking_s", "to_commit_s"):
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
            "x_dcp": _paired(blocks[OURS]["runs"], blocks[DCP_LOAD]["runs"], "restore_s")
            if both else None}


def _paired(runs: list[dict], references: list[dict], key: str) -> dict:
    """``ratio_spread`` of ``key`` over the rounds both lists ran, round by round."""
    theirs = {r["round"]: r[key] for r in references}
    mine = [r for r in runs if r["round"] in theirs]
    return ratio_spread([r[key] for r in mine], [theirs[r["round"]] for r in mine])


def loads(block: dict) -> dict:
    """The machine's load per round of each run, for the report's "Machine load" table."""
    parts = {f"sharded, {w} ranks saving": raw for w, raw in block["raw"]["save"].items()}
    parts.update({f"sharded, restore {pair}": raw for pair, raw in block["raw"]["restore"].items()})
    return {label: {"rounds": raw["loads"], "vmstat_delta": raw["load"]["vmstat_delta"],
                    "settle": raw["settle"]} for label, raw in parts.items()}


# --- the report -----------------------------------------------------------------------------------


def render(block: dict) -> str:
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
                       for s in (r["systems"][OURS], r["systems"][DCP_LOAD])),
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
               f"{DCP_LOAD} s (min–max)", "async_ckpt / DCP (min–max)"], restore_rows))


# --- the worker (one per rank, under torchrun) -------------------------------------------------------


class AppState:
    """DCP's ``Stateful`` pattern for FSDP2 (PyTorch's checkpoint tutorial; a user of the engine
    writes the same, as examples/train_fsdp.py does): model and optimizer through
    ``get_state_dict``/``set_state_dict``, as DTensors, for every system alike."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def sharded_state(size_gb: float, world: int) -> tuple[dict, int]:
    """``{"app": AppState}`` of about ``size_gb`` GB over ``world`` ranks (one real AdamW step
    taken), and the bytes of this rank's share of it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    width = width_for(size_gb)
    layers = max(1, round(size_gb * 1e9 / layer_bytes(width)))
    model = torch.nn.Sequential(*[m for _ in range(layers)
                                  for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values()
                                      if isinstance(t, torch.Tensor))]
    own = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)
    return {"app": AppState(model, optimizer)}, own


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    state, own = sharded_state(args.size_gb, world)
    rank_bytes = ranks.gather(own)
    common = {"world": world, "state_bytes": sum(rank_bytes), "rank_bytes": rank_bytes,
              "rounds": args.rounds}
    found = {}
    if args.restore:
        started = time.perf_counter()
        found["restore"] = {**restore_rounds(state, args.restore, args.rounds), **common,
                            "wall_s": time.perf_counter() - started}
    if args.keep:
        started = time.perf_counter()
        found["save"] = {**ranks.save_rounds(SHARDED_SYSTEMS, state, args.dir, args.rounds,
                                             sum(rank_bytes), rank_bytes[0]), **common}
        keep(state, args.keep)
        found["save"]["wall_s"] = time.perf_counter() - started  # with the kept snapshots
    ranks.finish(args.out, found)


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

    def run_slot(index: int, system: tuple, floor_hook: FloorHook) -> dict:
        name, spec, key = system
        restorer = spec.open(state, kept[key])
        try:
            restored, seconds = [], []
            for _ in range(2):  # the first is the warm-up
                dist.barrier()
                took = timed(lambda: restored.append(restorer.restore()))
                seconds.append(max(ranks.gather(took)))
        finally:
            restorer.close()
            dist.barrier()
        if restored != [kept["step"]] * 2:
            raise RuntimeError(f"{name} restored steps {restored}, not {kept['step']}")
        log(f"  restore {kept['world']} -> {dist.get_world_size()} ranks, {name}: "
            f"{seconds[1]:.3f} s (warm-up {seconds[0]:.3f} s)")
        return {"restore_s": seconds[1], "warmup_s": seconds[0]}

    record = run_rounds(RESTORERS, rounds, 0, dict, run_slot, name=lambda s: s[0])
    return {**record, "saved_at": kept["world"]}

