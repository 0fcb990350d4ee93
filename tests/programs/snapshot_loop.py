"""A training process stand-in for crash tests: snapshots a state whose every byte is a function of
the step, forever, printing each committed step. Usage: snapshot_loop.py DIR MB [zstd]
[incremental]; with ``incremental`` the state also holds a frozen tensor (``frozen_at``) that
incremental snapshots refer to instead of writing."""

import sys

import torch

from async_ckpt import CheckpointEngine


def state_at(step: int, mb: int) -> dict:
    n = mb * (1 << 20) // 4
    g = torch.Generator().manual_seed(step)
    return {"weights": torch.randn(n, generator=g), "step_tensor": torch.full((3,), step),
            "meta": {"step": step, "name": f"step {step}"}}


def frozen_at(mb: int) -> torch.Tensor:
    return torch.randn(mb * (1 << 20) // 4, generator=torch.Generator().manual_seed(-1 % 2**32))


def main() -> None:
    directory, mb, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    compression = "zstd" if "zstd" in flags else None
    state = state_at(0, mb)
    if "incremental" in flags:
        state["frozen"] = frozen_at(mb)
    with CheckpointEngine(directory, state, keep_last=2, compression=compression,
                          incremental="incremental" in flags, full_every=3) as engine:
        start = engine.restore()
        step = 0 if start is None else start + 1
        while True:
            fresh = state_at(step, mb)
            state["weights"].copy_(fresh["weights"])
            state["step_tensor"].copy_(fresh["step_tensor"])
            state["meta"] = fresh["meta"]
            engine.snapshot(step)
            print(f"snapshot {step} committed {engine.committed_steps()[-1:]}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
