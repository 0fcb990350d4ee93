"""Sharded training (FSDP2, optionally x tensor parallel) with asynchronous snapshots, resumable
after any crash and on another number of ranks.

    torchrun --nproc-per-node N examples/train_fsdp.py --ckpt-dir DIR --log-dir LOGS [--steps S]
        [--tp T] [--width W] [--seed S]

The model is sharded with ``fully_shard`` over all ranks (or over ``N / T`` ranks, each group of
``T`` ranks splitting its layers with ``ColwiseParallel``/``RowwiseParallel``); its parameters and
AdamW's moments are DTensors. ``AppState`` hands them to the engine through
``torch.distributed.checkpoint.state_dict``, so every rank writes only its own pieces. Started again
(by hand, by ``torchrun --max-restarts``, or with another ``--nproc-per-node``) the job restores the
newest step every rank committed, re-split for the new layout, and appends to the logs, one JSON
line per step per rank in ``LOGS/rank-R.jsonl`` ({"step", "loss"}). Each step's batch is a
function of the seed, the step and the rank, so a resumed run on the same ranks is bit-identical
to an uninterrupted one (dropout included: the RNG states are in each rank's shard).
"""

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from async_ckpt import CheckpointEngine

FEATURES, CLASSES, BATCH = 24, 10, 8


class AppState:
    """Model and optimizer through DCP's state-dict helpers, which give FSDP2/TP state as
    DTensors and load it back into the sharded parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def build_model(width: int, tp: int) -> torch.nn.Module:
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(width, CLASSES))
    world = dist.get_world_size()
    if tp == 1:  # a 1-D mesh over every rank uses the default group (see docs/distributed.md)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        return model
    if world % tp:
        raise SystemExit(f"--tp {tp} does not divide the world size {world}")
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--width", type=int, default=256, help="hidden width (a multiple of --tp)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # CPU here; "nccl" with torch.cuda.set_device(local_rank)
    try:
        train(args)
    finally:
        # FSDP and DTensor objects sit in reference cycles that hold the group: collect them
        # while Python is alive, or the group's threads are torn down at interpreter exit, which
        # aborts the process ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.set_num_threads(1)  # the same kernels in every run, so results are bit-identical
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args.width, args.tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(args.seed + rank)  # dropout masks differ per rank
    os.makedirs(args.log_dir, exist_ok=True)
    with CheckpointEngine(args.ckpt_dir, {"app": AppState(model, optimizer)}, keep_last=3) as engine, \
            open(os.path.join(args.log_dir, f"rank-{rank}.jsonl"), "a") as log:
        restored = engine.restore()  # on every rank; re-split when the layout changed
        for step in range(0 if restored is None else restored + 1, args.steps):
            x, y = batch(args.seed, step, rank)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            log.flush()
            engine.snapshot(step, force=step == args.steps - 1)  # on every rank, every step


if __name__ == "__main__":
    main()
