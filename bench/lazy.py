"""Lazy staging in a training loop whose forward and backward take longer than one copy of the
state: its variants against eager staging and DCP's cached stager, every step and every 10
(``core.run_training``'s loop; method: docs/performance.md, "The data path's choices")."""

from __future__ import annotations

import numpy as np

from .harness import ratio_spread, spread
from .markdown import fixed, over_one, ratio, section, spread_text, table
from .systems import LAZY_SYSTEMS, OURS_ASYNC, OURS_LAZY_FEWER
from .core import run_training

FULL = {"workload": {"width": 768, "depth": 10, "batch": 16}, "ks": (1, 10),
        "steps": {1: 24, 10: 40}, "rounds": 3}
QUICK = {"workload": {"width": 128, "depth": 2, "batch": 8}, "ks": (1, 10),
         "steps": {1: 4, 10: 10}, "rounds": 1}
FEWER = OURS_LAZY_FEWER.name


def run(root: str, quick: bool) -> dict:
    """The results block of results.json: ``run_training``'s, plus the figures ``render`` shows."""
    config = QUICK if quick else FULL
    raw = run_training(LAZY_SYSTEMS, root, config["ks"], config["steps"], config["workload"],
                       config["rounds"])
    copy_floor = [f["copy_s"] for f in raw["floors"]]
    eager = raw["systems"][OURS_ASYNC.name]
    figures = {}
    for name, block in raw["systems"].items():
        if not block["available"]:
            figures[name] = {"available": False, "reason": block["reason"]}
            continue
        runs = block["runs"]
        per_k = {}
        for k in map(str, config["ks"]):
            step = [r["loops"][k]["step_s"] for r in runs]
            per_k[k] = {
                "step_s": spread(step),
                "overhead": ratio_spread(step, [r["loops"][k]["baseline"]["step_s"] for r in runs]),
                "blocking_s": spread([float(np.median(r["loops"][k]["blocking_s"])) for r in runs]),
                "blocking_x_copy": ratio_spread(
                    [float(np.median(r["loops"][k]["blocking_s"])) for r in runs],
                    [copy_floor[r["round"]] for r in runs])}
            if name == FEWER and eager["available"]:
                full = {r["round"]: r["loops"][k]["baseline"]["step_s"] for r in eager["runs"]}
                per_k[k]["overhead_vs_full_threads"] = ratio_spread(
                    step, [full[r["round"]] for r in runs])
        figures[name] = {"available": True, "ks": per_k}
    return {"config": {**config, "steps": {str(k): v for k, v in config["steps"].items()}},
            "state_bytes": raw["state_bytes"], "copy_floor_s": spread(copy_floor),
            "figures": figures, "raw": raw}


def render(block: dict) -> str:
    ks = list(block["figures"][OURS_ASYNC.name]["ks"]) if block["figures"][OURS_ASYNC.name][
        "available"] else []
    tenths_ms = fixed(1, 1e-3)

    def cell(c: dict) -> str:
        extra = (f" ({spread_text(c['overhead_vs_full_threads'], over_one)} against the "
                 "full-thread loop without checkpointing)" if "overhead_vs_full_threads" in c
                 else "")
        return (f"{spread_text(c['overhead'], over_one)}{extra} · {ratio(c['blocking_x_copy'])} "
                f"({tenths_ms(c['blocking_s']['median'])} ms)")

    rows = [[name, *(cell(f["ks"][k]) for k in ks)] if f["available"]
            else [name, f"n/a: {f['reason']}"] for name, f in block["figures"].items()]
    floor = block["copy_floor_s"]
    return section(
        "Lazy staging in the training loop",
        f"A {block['state_bytes'] / 1e6:.3g} MB state (MLP + AdamW) whose forward and backward "
        f"take longer than one `copy_` of it ({tenths_ms(floor['median'])} ms, "
        f"{tenths_ms(floor['min'])}–{tenths_ms(floor['max'])}); a snapshot every K steps. Step "
        "overhead: each round's loop over the loop without checkpointing just before it, median "
        "(min–max) over the rounds; blocking: the median `snapshot()` call over the round's copy "
        "floor.",
        table(["system", *(f"K={k}: step overhead · blocking ×copy" for k in ks)], rows))
