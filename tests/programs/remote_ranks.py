"""Two ranks (torchrun, gloo) with a remote tier: ``--phase save`` trains a replicated model and a
per-rank tensor, snapshots three steps and waits until the bucket names the newest; with
``--pause PID`` rank 0 then stops the store's process (SIGSTOP), both ranks snapshot two more
steps and record their figures while it is stopped, and rank 0 lets it go on (SIGCONT) before
they wait for the bucket again; every rank saves what it holds as the reference. ``--phase
restore`` (run after the local directories were wiped) restores from the bucket and writes
whether each rank got back its reference bit for bit, and which shard files it downloaded.
``--own-dirs``: each rank gets a directory of its own (``DIR/nodeR``), as on nodes without a
shared file system.
Usage: remote_ranks.py --phase save|restore --dir DIR --remote URL --out DIR [--own-dirs]
                       [--pause PID]"""

import argparse
import json
import logging
import os
import signal

import torch
import torch.distributed as dist

from async_ckpt import CheckpointEngine


def state(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    return {"model": model, "mine": torch.full((1000,), float(rank))}


def train(engine: CheckpointEngine, current: dict, rank: int, steps: range) -> None:
    for step in steps:
        with torch.no_grad():
            current["model"].weight.add_(step + 1)
            current["mine"].add_(rank + step)
        engine.snapshot(step)


def while_the_store_is_stopped(engine: CheckpointEngine, current: dict, rank: int,
                               pid: int) -> dict:
    """Snapshot steps 3 and 4 with the store's process stopped; the figures seen meanwhile."""
    dist.barrier()
    if rank == 0:
        os.kill(pid, signal.SIGSTOP)
    dist.barrier()
    try:
        train(engine, current, rank, range(3, 5))
        engine.wait()  # committed locally: nothing here waits for the store
        figures = {k: engine.stats()[k] for k in ("committed", "remote_step", "upload_lag_steps",
                                                  "upload_pending_bytes")}
        dist.barrier()
    finally:
        if rank == 0:
            os.kill(pid, signal.SIGCONT)
    return figures


def main() -> None:
    logging.basicConfig(level=logging.INFO)  # the uploads' progress, in the log a failed test shows
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "restore"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--remote", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--own-dirs", action="store_true")
    parser.add_argument("--pause", type=int, help="the store's process id")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    current = state(rank)
    reference = os.path.join(args.out, f"reference-{rank}.pt")
    directory = os.path.join(args.dir, f"node{rank}") if args.own_dirs else args.dir
    with CheckpointEngine(directory, current, remote=args.remote, replicated=["model"]) as engine:
        if args.phase == "save":
            train(engine, current, rank, range(3))
            engine.wait(remote=True)
            result = {"remote_step": engine.stats()["remote_step"]}
            if args.pause is not None:
                result["stopped"] = while_the_store_is_stopped(engine, current, rank, args.pause)
                engine.wait(remote=True)
                result["remote_step"] = engine.stats()["remote_step"]
            torch.save({"model": current["model"].state_dict(), "mine": current["mine"]}, reference)
        else:
            step = engine.restore()
            saved = torch.load(reference)
            same = (torch.equal(saved["mine"], current["mine"]) and all(
                torch.equal(v, current["model"].state_dict()[k]) for k, v in saved["model"].items()))
            result = {"step": step, "same": same,
                      "downloaded": sorted(os.path.relpath(os.path.join(d, f), args.dir)
                                           for d, _, files in os.walk(args.dir) for f in files
                                           if f.endswith(".ackpt"))}
    with open(os.path.join(args.out, f"{args.phase}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
