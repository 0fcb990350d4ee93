"""The parts of ``python -m bench`` after the sweep and the training loop, registered once.

Each part is a module with ``run`` (its results block, kept in results.json under the module's
name) and ``render`` (its report section from results.json, "" where the part did not run);
``__main__`` runs them in this order and ``report`` renders them in this order.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import ModuleType

from . import (dcp, decode, direct, incremental, integrations_accelerate, integrations_deepspeed,
               integrations_lightning, integrations_lightning_sharded, integrations_torchtitan,
               integrations_transformers, lazy, memory_tier, ranks, remote, sharded)


@dataclass(frozen=True)
class Part:
    """``module``'s ``run`` and ``render``; ``quick``: it runs with ``--quick`` too (framework
    runs under torchrun cost a minute or more: full runs only); ``torchrun``: its runs start
    process groups of their own and take ``--rounds`` (with ``--quick``, their own unless
    given)."""

    module: ModuleType
    quick: bool = True
    torchrun: bool = False

    @property
    def key(self) -> str:
        return self.module.__name__.rsplit(".", 1)[1]

    def run(self, args: argparse.Namespace, root: str) -> dict:
        if not self.torchrun:
            return self.module.run(root, args.quick)
        dcp.shutdown()  # this process's process group goes first
        return self.module.run(root, args.quick, None if args.quick and not args.rounds_given
                               else args.rounds)

    def render(self, results: dict) -> str:
        return self.module.render(results)


PARTS = (Part(lazy), Part(memory_tier), Part(ranks, torchrun=True), Part(sharded, torchrun=True),
         Part(incremental), Part(decode), Part(direct), Part(remote), Part(integrations_lightning),
         Part(integrations_lightning_sharded, quick=False), Part(integrations_transformers),
         Part(integrations_accelerate),
         Part(integrations_deepspeed, quick=False), Part(integrations_torchtitan, quick=False))
BY_KEY = {part.key: part for part in PARTS}
