"""``python -m bench.worker PART [options]``: the code of a part that runs in a process of its own
(a torchrun rank, a child confined to some cores, a trainer to be killed): ``bench.PART.worker``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch


def command(part: str, **options) -> list[str]:
    """The command line of ``part``'s worker: ``size_gb=1`` becomes ``--size-gb 1``."""
    return [sys.executable, "-m", "bench.worker", part,
            *(text for key, value in options.items()
              for text in (f"--{key.replace('_', '-')}", str(value)))]


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.worker")
    parser.add_argument("part")
    for option in ("--dir", "--out", "--phase", "--restore", "--keep", "--log", "--workload",
                   "--mode"):
        parser.add_argument(option)
    for option in ("--rounds", "--width", "--layers"):
        parser.add_argument(option, type=int)
    parser.add_argument("--size-gb", type=float, default=0.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = _arguments(sys.argv[1:])
    if "LOCAL_RANK" in os.environ:  # under torchrun: several ranks share this machine's cores
        torch.set_num_threads(1)
    importlib.import_module(f"bench.{args.part}").worker(args)
