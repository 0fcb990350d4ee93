"""Takes one snapshot into a checkpoint directory that does not exist yet, for tests that watch its
system calls (tests/test_durability.py). Usage: durable_snapshot.py DIR. Prints the committed
steps."""

import sys

import torch

from async_ckpt import CheckpointEngine


def main() -> None:
    engine = CheckpointEngine(sys.argv[1], {"t": torch.zeros(4)}, heartbeat_interval=None)
    engine.snapshot(1)
    engine.close()
    print("committed", engine.committed_steps(), flush=True)


if __name__ == "__main__":
    main()
