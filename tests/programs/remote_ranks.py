"""Two ranks (torchrun, gloo) with a remote tier: ``--phase save`` trains a replicated model and a
per-rank tensor, snapshots three steps and waits until the bucket names the newest; every rank
saves what it holds as the reference. ``--phase restore`` (run after the local directory was
wiped) restores from the bucket and writes whether each rank got back its reference bit for bit.
Usage: remote_ranks.py --phase save|restore --dir DIR --remote URL --out DIR"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from async_ckpt import CheckpointEngine


def state(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    return {"model": model, "mine": torch.full((1000,), float(rank))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "restore"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--remote", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    current = state(rank)
    reference = os.path.join(args.out, f"reference-{rank}.pt")
    with CheckpointEngine(args.dir, current, remote=args.remote, replicated=["model"]) as engine:
        if args.phase == "save":
            for step in range(3):
                with torch.no_grad():
                    current["model"].weight.add_(step + 1)
                    current["mine"].add_(rank + step)
                engine.snapshot(step)
            engine.wait(remote=True)
            torch.save({"model": current["model"].state_dict(), "mine": current["mine"]}, reference)
            result = {"remote_step": engine.stats()["remote_step"]}
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
