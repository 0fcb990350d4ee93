"""The parts after the sweep and the training loop, in run and report order: each a module, a
``harness.PartOf`` or a ``frameworks.Framework``, with ``run`` (results.json's block
under its key) and ``render``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import ModuleType

from . import direct, lazy
from .distributed import RANKS, SHARDED
from .features import DECODE, INCREMENTAL, MEMORY_TIER, REMOTE
from .frameworks import (ACCELERATE, DEEPSPEED, LIGHTNING, LIGHTNING_SHARDED, TORCHTITAN,
                         TRANSFORMERS, Framework)
from .harness import PartOf
from .systems import shutdown_dcp


@dataclass(frozen=True)
class Part:
    """``quick``: also under ``--quick`` (not parts that cost minutes); ``torchrun``: starts its own
    process groups and takes ``--rounds``."""

    module: ModuleType | Framework | PartOf
    quick: bool = True
    torchrun: bool = False

    @property
    def key(self) -> str:
        if isinstance(self.module, ModuleType):
            return self.module.__name__.rsplit(".", 1)[1]
        return self.module.key

    def run(self, args: argparse.Namespace, root: str) -> dict:
        if not self.torchrun:
            return self.module.run(root, args.quick)
        shutdown_dcp()  # this process's process group goes first
        return self.module.run(root, args.quick, None if args.quick and not args.rounds_given
                               else args.rounds)

    def render(self, results: dict) -> str:
        """Its section of the report, "" where it did not run."""
        block = results.get(self.key)
        return self.module.render(block) if block else ""


PARTS = (Part(lazy), Part(MEMORY_TIER), Part(RANKS, torchrun=True), Part(SHARDED, torchrun=True),
         Part(INCREMENTAL), Part(DECODE), Part(direct), Part(REMOTE), Part(LIGHTNING),
         Part(LIGHTNING_SHARDED, quick=False), Part(TRANSFORMERS), Part(ACCELERATE),
         Part(DEEPSPEED, quick=False), Part(TORCHTITAN, quick=False))
BY_KEY = {part.key: part for part in PARTS}
