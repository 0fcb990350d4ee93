"""Lightning's ModelParallelStrategy: a sharded save's cost, the adapter against the stock strategy
(FSDP2 on two CPU ranks; method: docs/integrations.md, ModelParallelStrategy, "Cost"). Full runs
only."""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist

from .compare import RANKS, fsync_all, render_pair, run_pair, slowest
from .measure import log, rotated
from .ranks import finish

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters
QUICK = {"width": 512, "layers": 4, "rounds": 2}
SYSTEMS = ("adapter", "stock")


def run(root: str, quick: bool) -> dict:
    return run_pair("lightning sharded", "integrations_lightning_sharded",
                    os.path.join(root, "lightning_sharded"), QUICK if quick else FULL, SYSTEMS)


def render(block: dict) -> str:
    return render_pair(
        block, SYSTEMS,
        "### Lightning ModelParallelStrategy: a sharded save's cost, the adapter against the "
        "stock strategy", "FSDP2", "of parameters and Adam moments",
        ("per save", "`AsyncCkptModelParallelStrategy`", "`ModelParallelStrategy`"),
        "durable (every shard fsynced)", "DCP's save, then an fsync of `meta.pt`")


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from async_ckpt.integrations.lightning_sharded import AsyncCkptModelParallelStrategy
    from async_ckpt.integrations.pointer import POINTER_NAME

    width, layers, rounds = args.width, args.layers, args.rounds
    found: dict = {"rounds": []}

    class ShardedMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def configure_model(self):
            if isinstance(self.net, FSDPModule):
                return
            for layer in self.net:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8 * (rounds + 1), width),
                                               batch_size=8)

    def save(trainer, system: str, n: int) -> dict:
        path = os.path.join(args.dir, system, f"round{n}")
        dist.barrier()
        start = time.perf_counter()
        if system == "adapter":
            trainer.save_checkpoint(path)
            blocking = slowest(time.perf_counter() - start)
            while not os.path.exists(os.path.join(path, POINTER_NAME)):
                time.sleep(0.001)  # the marker, written once the snapshot is committed
        else:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint()
            ModelParallelStrategy.save_checkpoint(trainer.strategy, checkpoint, path)
            blocking = slowest(time.perf_counter() - start)
            if trainer.is_global_zero:
                fsync_all(os.path.join(path, "meta.pt"))
        return {f"{system}_blocking_s": blocking,
                f"{system}_durable_s": slowest(time.perf_counter() - start)}

    class SaveBoth(Callback):
        """At each batch's end (after the optimizer step): a round, both saves in rotated order."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= rounds:
                return
            if batch_idx == 0:
                found["state_bytes"] = int(slowest(sum(
                    t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                    for group in trainer.optimizers[0].state.values()
                    for t in group.values() if torch.is_tensor(t) and t.dim())
                    + sum(p.to_local().nbytes for p in pl_module.parameters()),
                    dist.ReduceOp.SUM))
            figures = {}
            for system in rotated(SYSTEMS, batch_idx):
                figures.update(save(trainer, system, batch_idx))
            found["rounds"].append(figures)
            if trainer.is_global_zero:
                log(f"integrations_lightning_sharded: round {batch_idx + 1}/{rounds}: {figures}")
                shutil.rmtree(os.path.join(args.dir, "stock", f"round{batch_idx}"))

    strategy = AsyncCkptModelParallelStrategy(os.path.join(args.dir, "engine"),
                                              data_parallel_size=RANKS, tensor_parallel_size=1,
                                              process_group_backend="gloo")
    trainer = L.Trainer(max_steps=rounds, accelerator="cpu", devices=RANKS, strategy=strategy,
                        callbacks=[SaveBoth()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(ShardedMLP())
    finish(args.out, found)
