"""What the framework parts share: an adapter's save against the framework's own in interleaved
rounds (the first a warm-up: it allocates what later rounds reuse), summarised alike; the
two-rank ones under torchrun, the slower rank's figures (method: docs/integrations.md, "Cost")."""

from __future__ import annotations

import os
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from .markdown import ms, ratio, section, table
from .measure import files_under, log, ratio_spread, rotated, spread
from .ranks import torchrun

RANKS = 2
KINDS = ("blocking", "durable")


def interleaved(what: str, systems: Sequence[str], rounds: int,
                measure: Callable[[str, int], dict]) -> list[dict]:
    """Each round's figures: ``measure(system, round)`` of every system, in ``rotated`` order."""
    found = []
    for n in range(rounds):
        figures = {}
        for system in rotated(systems, n):
            figures.update(measure(system, n))
        found.append(figures)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log(f"{what}: round {n + 1}/{rounds}: " + ", ".join(
                f"{key} {value:.3g}" for key, value in figures.items()
                if isinstance(value, float)))
    return found


def summarised(rounds: list[dict], keys: Iterable[str],
               ratios: Mapping[str, tuple[str, str]]) -> dict:
    """Each key's spread over the rounds after the warm-up (``figures``), and each named
    ``(key, reference)``'s ratio, round by round (``ratios``)."""
    measured = rounds[1:] or rounds

    def column(key: str) -> list[float]:
        return [r[key] for r in measured]

    return {"figures": {key: spread(column(key)) for key in keys},
            "ratios": {name: ratio_spread(column(key), column(reference))
                       for name, (key, reference) in ratios.items()}}


def run_pair(what: str, part: str, directory: str, config: dict,
             systems: tuple[str, str]) -> dict:
    """``part``'s workers on two ranks (``config``'s width, layers and rounds): each system's
    blocking and durable seconds, and the first's ratios to the second's."""
    return pair_block(torchrun(what, part, RANKS, directory, 0.0, config["rounds"], "--width",
                               str(config["width"]), "--layers", str(config["layers"])),
                      config, systems)


def pair_block(raw: dict, config: dict, systems: tuple[str, str]) -> dict:
    """The results block of the workers' ``raw`` rounds."""
    ours, theirs = systems
    return {"config": config, "ranks": RANKS, "state_bytes": raw["state_bytes"],
            "rounds": raw["rounds"], **summarised(
                raw["rounds"], [f"{s}_{kind}_s" for s in systems for kind in KINDS],
                {kind: (f"{ours}_{kind}_s", f"{theirs}_{kind}_s") for kind in KINDS})}


def restore_block(rounds: list[dict], systems: tuple[str, str]) -> dict:
    """The ``restore`` entry of a pair's block: each system's ``{system}_restore_s`` over the
    ``rounds`` and the first's ratio to the second's, round by round."""
    ours, theirs = systems
    return summarised(rounds, [f"{s}_restore_s" for s in systems],
                      {"restore": (f"{ours}_restore_s", f"{theirs}_restore_s")})


def render_pair(block: dict, systems: tuple[str, str], title: str, setup: str, contents: str,
                columns: tuple[str, str, str], durable_row: str, theirs_durable: str,
                restore_row: tuple[str, str] = ("", "")) -> str:
    """``run_pair``'s section: what ran (``setup``, ``contents``), a row per kind of figure;
    ``restore_row`` (what was restored, how the second system restores) where the block has a
    ``restore`` entry."""
    ours, theirs = systems
    kinds = [("training blocked", "blocking", block, ""),
             (durable_row, "durable", block, f" ({theirs_durable})")]
    if "restore" in block:
        kinds.append((restore_row[0], "restore", block["restore"], f" ({restore_row[1]})"))
    rows = [[label, ms(b["figures"][f"{ours}_{kind}_s"]),
             ms(b["figures"][f"{theirs}_{kind}_s"]) + note, ratio(b["ratios"][kind], 3)]
            for label, kind, b, note in kinds]
    return section(
        title,
        f"{setup} on {block['ranks']} ranks (CPU, gloo), {block['state_bytes'] / 1e6:.0f} MB "
        f"{contents} in all; median of {block['figures'][f'{theirs}_blocking_s']['n']} "
        "interleaved rounds after a warm-up (min–max); the slower rank's figure.",
        table([*columns, "ratio"], rows))


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective): the slowest rank's time."""
    return _all_reduced(seconds, dist.ReduceOp.MAX)


def total(value: float) -> float:
    """The sum of every rank's ``value`` (a collective): bytes of a state across the ranks."""
    return _all_reduced(value, dist.ReduceOp.SUM)


def _all_reduced(value: float, op) -> float:
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
