"""Incremental snapshots on a LoRA-style state (a frozen base, a trainable adapter): what the
frozen base costs each snapshot, against a state of the adapter alone (method:
docs/performance.md, "What runs")."""

from __future__ import annotations

import os
import sys

import torch

from .markdown import fixed, ms, ratio, section, spread_text, table
from .measure import ratio_spread, spread, timed
from .registry import OURS_ASYNC, OURS_INCREMENTAL
from .rounds import run_rounds
from .workloads import tensor_bytes

FULL = {"width": 4096, "layers": 16, "rank": 40, "repetitions": 9}  # 1 GiB base, 20 MiB adapter
QUICK = {"width": 256, "layers": 4, "rank": 4, "repetitions": 3}
TARGET_RATIO = 1.2


def lora_state(width: int, layers: int, rank: int, seed: int = 0) -> dict:
    """Frozen ``layers`` x (width x width) fp32 weights, a rank-``rank`` adapter per layer, and
    AdamW over the adapter (its state created by one step)."""
    torch.manual_seed(seed)
    base = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(layers)]).requires_grad_(False)
    adapter = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, rank, bias=False),
                                                      torch.nn.Linear(rank, width, bias=False))
                                  for _ in range(layers))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
    state = {"base": base, "adapter": adapter, "optimizer": optimizer}
    train_step(state)
    return state


def train_step(state: dict) -> None:
    for p in state["adapter"].parameters():
        p.grad = torch.randn_like(p)
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def measure(states: dict, root: str, repetitions: int, nbytes: int) -> dict:
    """Blocking time and shard bytes of ``repetitions`` snapshots after a warm-up one, for each
    run of ``states`` (name -> (state, the registry's system)), one snapshot of each per
    interleaved round, after the disk settled (for at most the time it takes to write ``nbytes``)."""
    systems = {name: spec.open(state, os.path.join(root, f"incremental-{name.replace(' ', '-')}"))
               for name, (state, spec) in states.items()}

    def snapshot(index: int, name: str, floor_hook) -> dict:
        train_step(states[name][0])
        took = timed(lambda: systems[name].save(index))
        systems[name].wait()
        return {"blocking_s": took}

    try:
        record = run_rounds(list(states), repetitions + 1, 0, dict, snapshot, name=str,
                            settle_bytes=nbytes)
        figures = {name: system.engine.stats()["snapshots"] for name, system in systems.items()}
    finally:
        for system in systems.values():
            system.close()
    return {name: {"blocking_s": spread([r["blocking_s"] for r in
                                         record["systems"][name]["runs"][1:]], samples=True),
                   "written_bytes": spread([float(f["shard_bytes"]) for f in snapshots[1:]],
                                           samples=True),
                   "first": {"blocking_s": snapshots[0]["blocking_s"],
                             "written_bytes": snapshots[0]["shard_bytes"]}}
            for name, snapshots in figures.items()}


def run(root: str, quick: bool) -> dict:
    """Both runs in fresh directories under ``root``; the results block of results.json."""
    config = QUICK if quick else FULL
    state = lora_state(config["width"], config["layers"], config["rank"])
    trainable = {"adapter": state["adapter"], "optimizer": state["optimizer"]}
    nbytes = {"base": sum(t.nbytes for t in state["base"].state_dict().values()),
              "trainable": tensor_bytes({"model": state["adapter"],
                                         "optimizer": state["optimizer"]})}
    print(f"incremental: base {nbytes['base'] / 1e6:.1f} MB, adapter and AdamW state "
          f"{nbytes['trainable'] / 1e6:.1f} MB", file=sys.stderr)
    runs = measure({"incremental": (state, OURS_INCREMENTAL),
                    "trainable only": (trainable, OURS_ASYNC)}, root, config["repetitions"],
                   nbytes["base"] + nbytes["trainable"])
    ratios = {key: ratio_spread(runs["incremental"][key]["samples"],
                                runs["trainable only"][key]["samples"])
              for key in ("blocking_s", "written_bytes")}  # pairwise: the runs take turns
    return {"config": config, "base_bytes": nbytes["base"], "trainable_bytes": nbytes["trainable"],
            "runs": runs, "ratios": ratios, "target_ratio": TARGET_RATIO}


def render(block: dict) -> str:
    rows = [[name, ms(r["blocking_s"], places=1),
             spread_text(r["written_bytes"], fixed(2, 1e6), " MB"),
             f"{r['first']['blocking_s'] * 1e3:.1f} ms, {r['first']['written_bytes'] / 1e6:.1f} MB"]
            for name, r in block["runs"].items()]
    ratios = block["ratios"]
    verdict = ("within" if max(r["median"] for r in ratios.values()) <= block["target_ratio"]
               else "OUTSIDE")
    return section(
        "Incremental snapshots (LoRA-style state)",
        f"Frozen base {block['base_bytes'] / 1e9:.3g} GB, adapter and its AdamW state "
        f"{block['trainable_bytes'] / 1e6:.3g} MB; median of "
        f"{len(block['runs']['incremental']['blocking_s']['samples'])} snapshots (min–max), each "
        "after one optimizer step and committed before the next; the first snapshot of each run "
        "(for the incremental run the full one) apart.",
        table(["run", "blocking per snapshot", "written per snapshot", "first snapshot"], rows),
        "Incremental / trainable only, snapshot by snapshot: blocking "
        f"{ratio(ratios['blocking_s'])}, written {ratio(ratios['written_bytes'])} (medians "
        f"{verdict} the ×{block['target_ratio']} target).")
