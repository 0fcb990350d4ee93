"""Every part of a run, in run and report order, registered once: the sweep, the training loop,
then each module, ``harness.PartOf`` or ``frameworks.Framework`` with ``run(root, quick)`` and
``render(block)``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from . import direct, lazy, report
from .core import run_sweep, run_training
from .distributed import RANKS, SHARDED, ranks_loads, sharded_loads
from .features import DECODE, INCREMENTAL, MEMORY_TIER, REMOTE
from .frameworks import (ACCELERATE, DEEPSPEED, LIGHTNING, LIGHTNING_SHARDED, TORCHTITAN,
                         TRANSFORMERS)
from .systems import shutdown_dcp


@dataclass(frozen=True)
class Part:
    """``run(args, root)``: its block of results.json, under ``key``, or under ``"raw"`` where
    ``raw`` (the sweep and the training loop, from which ``core.summaries`` builds the report's
    figures); ``render(results, image_dir)``: its report section, "" where it did not run;
    ``loads(block)``: its load records by label, for the "Machine load" table; ``quick``: also
    under ``--quick`` (not parts that cost minutes)."""

    key: str
    run: Callable[[argparse.Namespace, str], dict]
    render: Callable[[dict, str], str]
    quick: bool = True
    raw: bool = False
    loads: Callable[[dict], dict] = lambda block: {}


def loop_steps(k: int, quick: bool) -> int:
    """Steps of one round's loop at interval K: snapshots enough to see a pattern over the rounds
    (8 at K=1, 3 at K=10, 1 at K=100; 4 and 3 at K=1, 3 with --quick) while every round of every
    system stays within minutes in all."""
    snapshots = max(2, round(4 / k ** 0.3)) if quick else max(1, round(8 / k ** 0.45))
    return k * snapshots


def _record_load(record: dict) -> dict:
    """A ``harness.run_rounds`` record's load per round, reclaim counters and settle waits."""
    return {"rounds": record["loads"], "vmstat_delta": record["load"]["vmstat_delta"],
            "settle": record["settle"]}


SWEEP = Part(
    "sweep", lambda args, root: run_sweep(
        args.preset.systems, [("fp32", s) for s in args.sizes]
        + [("bf16", s) for s in args.bf16_sizes], root, args.rounds),
    report.saving_and_restoring, raw=True,
    loads=lambda block: {f"sweep {label}": _record_load(case) for label, case in block.items()})
TRAINING = Part(
    "training", lambda args, root: run_training(
        args.preset.systems, root, args.ks, {k: loop_steps(k, args.quick) for k in args.ks},
        args.preset.workload, args.rounds),
    report.training_loop, raw=True, loads=lambda block: {"training loop": _record_load(block)})


def _part(module, quick: bool = True, torchrun: bool = False,
          loads: Callable[[dict], dict] = lambda block: {}) -> Part:
    """A module's or framework's part; ``torchrun``: it starts its own process groups and takes
    ``--rounds`` (``--quick``: once, unless given)."""
    key = module.__name__.rsplit(".", 1)[-1] if isinstance(module, ModuleType) else module.key

    def run(args: argparse.Namespace, root: str) -> dict:
        if not torchrun:
            return module.run(root, args.quick)
        shutdown_dcp()  # this process's process group goes first
        return module.run(root, args.quick, None if args.quick and not args.rounds_given
                          else args.rounds)

    return Part(key, run, lambda results, image_dir: module.render(results[key])
                if results.get(key) else "", quick, loads=loads)


PARTS = (SWEEP, TRAINING, _part(lazy), _part(MEMORY_TIER),
         _part(RANKS, torchrun=True, loads=ranks_loads),
         _part(SHARDED, torchrun=True, loads=sharded_loads), _part(INCREMENTAL), _part(DECODE),
         _part(direct), _part(REMOTE), _part(LIGHTNING), _part(LIGHTNING_SHARDED, quick=False),
         _part(TRANSFORMERS), _part(ACCELERATE), _part(DEEPSPEED, quick=False),
         _part(TORCHTITAN, quick=False))
BY_KEY = {part.key: part for part in PARTS}
