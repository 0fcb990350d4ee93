"""A training stand-in with preemption handling on: prints "step N" before each snapshot() call and
"returned N" after it, so a test can send a signal at a known point. Usage: preemptible.py DIR MB EVERY."""

import sys

import torch

from async_ckpt import CheckpointEngine


def main() -> None:
    directory, mb, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    state = {"t": torch.zeros(mb * (1 << 18))}
    with CheckpointEngine(directory, state, every=every, preemption=True) as engine:
        step = 0
        while True:
            state["t"].fill_(step)
            print(f"step {step}", flush=True)
            engine.snapshot(step)
            print(f"returned {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
