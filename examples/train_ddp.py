"""Data-parallel training under torchrun with asynchronous snapshots, resumable after any crash.

    torchrun --nproc-per-node 2 examples/train_ddp.py --ckpt-dir DIR --log-dir LOGS [--steps N]
        [--every K] [--seed S] [--width W] [--spread]

Every rank runs its own CheckpointEngine on the same directory. The DDP model, its optimizer and
the LR schedule are identical on every rank, so they are declared ``replicated`` and written once
(by rank 0, or shared among the ranks with ``--spread``); each rank's data position and RNG states
(dropout draws differ per rank) go into that rank's own shard. A step is restorable only once every
rank's part of it is durable. Started again (by hand or by ``torchrun --max-restarts``) the job
restores the newest step all ranks committed and appends to the logs, one JSON line per step per
rank in ``LOGS/rank-R.jsonl`` ({"step", "loss", "lr"}).
"""

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from async_ckpt import CheckpointEngine
from async_ckpt.data import DistributedResumableSampler

SAMPLES, BATCH, FEATURES, CLASSES = 240, 8, 32, 10


class SyntheticFeatures(Dataset):
    """Fixed random features whose class depends on a random projection (the same on every rank)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def build_model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=256, help="hidden width of the model")
    parser.add_argument("--spread", action="store_true",
                        help="share the writing of the replicated state among the ranks")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # CPU here; "nccl" with one GPU per rank works the same way
    try:
        train(args)
    finally:
        # The DDP model holds the group and sits in reference cycles: collect it while Python is
        # alive, or the group's threads are torn down at interpreter exit, which aborts the
        # process ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.set_num_threads(1)  # the same kernels in every run, so results are bit-identical
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed + rank)  # dropout masks differ per rank; DDP syncs the weights

    model = build_model(args.width)
    # DDP broadcasts rank 0's initial weights. It also re-orders its gradient buckets once,
    # after the first iteration of each process; with 3 or more ranks the bucket layout changes
    # the order in which the allreduce adds floats, so a resumed process would differ from an
    # uninterrupted one in the last bits. find_unused_parameters=True keeps the first layout for
    # good (at the cost of one autograd graph walk per step, and a warning) and makes resumes
    # bit-identical.
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    sampler = DistributedResumableSampler(SAMPLES, shuffle=True, seed=args.seed,
                                          batch_size=BATCH, drop_last=True, drop_last_batch=True)
    loader = DataLoader(SyntheticFeatures(args.seed), batch_size=BATCH, sampler=sampler,
                        drop_last=True, generator=torch.Generator())
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}

    os.makedirs(args.log_dir, exist_ok=True)
    with CheckpointEngine(args.ckpt_dir, state, every=args.every, keep_last=3,
                          replicated=["model", "optimizer", "scheduler"],
                          spread_replicated=args.spread) as engine, \
            open(os.path.join(args.log_dir, f"rank-{rank}.jsonl"), "a") as log:
        restored = engine.restore()  # the newest step every rank committed, on every rank
        step = 0 if restored is None else restored + 1
        while step < args.steps:
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                sampler.advance()
                log.write(json.dumps({"step": step, "loss": loss.item(),
                                      "lr": scheduler.get_last_lr()[0]}) + "\n")
                log.flush()
                engine.snapshot(step, force=step == args.steps - 1)  # on every rank, every step
                step += 1
                if step == args.steps:
                    break


if __name__ == "__main__":
    main()
