"""A tiny training loop for the memory tier's kill tests (tests/test_memory_tier.py): an MLP with
dropout and Adam on batches drawn from the global RNG, ``async_ckpt.deterministic()`` first, a
disk snapshot every 50 steps and a memory snapshot every step, ~10 ms a step. It restores what
``restore()`` picks and appends JSON lines to LOG: first ``{"pid", "restored", "tier",
"keeper", "warnings"}``, then per step ``{"step", "loss", "memory_step", "committed"}`` (what
the engine knew after that step's snapshot), and leaves through ``close(final_step)``. The test
trains the same steps in its own process (``build``, ``train_step``) for the uninterrupted run.

Under torchrun (gloo) each rank trains its own model, seeded by its rank, logs to LOG.rankR, waits
after each step until its keeper sealed that step, and meets the other ranks at a barrier, so
that the keepers' steps are known when one rank dies: with KILL_AT, rank 1 of the first attempt
SIGKILLs itself after training step KILL_AT, before its snapshot (as if killed while staging it),
while rank 0 snapshots it; torchrun then restarts the job.

Usage: memory_loop.py DIR LOG STEPS [KILL_AT]
"""

import json
import os
import signal
import sys
import time
import warnings

import torch

import async_ckpt
from async_ckpt import CheckpointEngine


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer, from the global RNG seeded anew."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One step on a batch drawn from the global RNG (as dropout's mask is); its loss."""
    x = torch.randn(8, 16)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main() -> None:
    directory, log_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    ranks = "RANK" in os.environ
    rank = 0
    if ranks:
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
        log_path = f"{log_path}.rank{rank}"
    async_ckpt.deterministic()
    model, optimizer = build(seed=rank)
    progress = {"next_step": 0}
    state = {"model": model, "optimizer": optimizer, "progress": progress}
    with CheckpointEngine(directory, state, every=50, memory_every=1, slots=3,
                          heartbeat_interval=None) as engine, open(log_path, "a") as log:
        def write(record: dict) -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = engine.restore()
        stats = engine.stats()
        write({"pid": os.getpid(), "restored": restored, "tier": stats["restored_from"],
               "keeper": stats["keeper_pid"], "warnings": [str(w.message) for w in caught]})
        for step in range(progress["next_step"], steps):
            loss = train_step(model, optimizer)
            progress["next_step"] = step + 1
            if (step == kill_at and rank == 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
            engine.snapshot(step)
            if ranks:
                sealed(engine, step)
            committed = engine.committed_steps()
            write({"step": step, "loss": loss, "memory_step": engine.stats()["memory_step"],
                   "committed": committed[-1] if committed else None})
            if ranks:
                torch.distributed.barrier()
            time.sleep(0.01)
        engine.close(final_step=steps - 1)


def sealed(engine: CheckpointEngine, step: int) -> None:
    """Wait until the keeper sealed ``step`` (each step's slot is then free again: no memory
    snapshot is skipped, and every rank's keeper holds the same step at the barrier)."""
    deadline = time.monotonic() + 120
    while engine.stats()["memory_step"] != step:
        if time.monotonic() > deadline:
            raise SystemExit(f"the keeper did not seal step {step} in 120 s")
        time.sleep(0.002)


if __name__ == "__main__":
    main()
