"""What the two-rank framework parts share (``integrations_deepspeed``,
``integrations_lightning_sharded``): an adapter's save against the framework's own, each round's
blocking and durable times of the slower rank, summarised and rendered alike."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .markdown import milliseconds, spread_text, thousandths
from .measure import files_under, ratio_spread, spread
from .ranks import torchrun

RANKS = 2
KINDS = ("blocking", "durable")


def run(what: str, module: str, directory: str, config: dict, systems: tuple[str, str]) -> dict:
    """``module``'s workers on two ranks under torchrun, with ``config``'s width, layers and
    rounds, in ``directory``; the results block of their rounds (the first a warm-up, not
    summarised): each system's medians and spreads, and the first's ratios to the second's."""
    raw = torchrun(what, module, RANKS, directory, 0.0, config["rounds"],
                   "--width", str(config["width"]), "--layers", str(config["layers"]))
    measured = raw["rounds"][1:] or raw["rounds"]  # the first round allocates the staging memory
    ours, theirs = systems
    return {"config": config, "ranks": RANKS, "state_bytes": raw["state_bytes"],
            "figures": {f"{system}_{kind}_s": spread([r[f"{system}_{kind}_s"] for r in measured])
                        for system in systems for kind in KINDS},
            "ratios": {kind: ratio_spread([r[f"{ours}_{kind}_s"] for r in measured],
                                          [r[f"{theirs}_{kind}_s"] for r in measured])
                       for kind in KINDS},
            "rounds": raw["rounds"]}


def render(block: dict, systems: tuple[str, str], heading: str, setup: str, contents: str,
           columns: tuple[str, str, str], durable_row: str, theirs_durable: str) -> str:
    """The section: ``heading``, ``setup`` (what ran) and ``contents`` (what the state's bytes
    are), a table whose ``columns`` name the step and the two systems, with the durable row's
    label and how the second system's durable time was measured."""
    f, r = block["figures"], block["ratios"]
    ours, theirs = systems

    def cell(key: str) -> str:
        return spread_text(f[key], milliseconds, " ms")

    return "\n".join([
        heading, "",
        f"{setup} on {block['ranks']} ranks (CPU, gloo), {block['state_bytes'] / 1e6:.0f} MB "
        f"{contents} in all; median of {f[f'{theirs}_blocking_s']['n']} interleaved rounds "
        "after a warm-up (min–max); the slower rank's figure.", "",
        f"| {columns[0]} | {columns[1]} | {columns[2]} | ratio |", "|---|---|---|---|",
        f"| training blocked | {cell(f'{ours}_blocking_s')} | {cell(f'{theirs}_blocking_s')} | "
        f"×{spread_text(r['blocking'], thousandths)} |",
        f"| {durable_row} | {cell(f'{ours}_durable_s')} | {cell(f'{theirs}_durable_s')} "
        f"({theirs_durable}) | ×{spread_text(r['durable'], thousandths)} |"])


def reduced(value: float, op=dist.ReduceOp.MAX) -> float:
    """Every rank's ``value`` reduced by ``op`` (a collective): the slowest rank's by default."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def fsync_all(path: str) -> None:
    """fsync ``path`` (every file under it, if a directory) and its parent directory."""
    for name in files_under(path) + [path, os.path.dirname(path)]:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
