"""Lightning's ModelParallelStrategy: a sharded save's cost on two CPU ranks (FSDP2) and a restore
of it on four, the adapter against the stock strategy (method: docs/integrations.md,
ModelParallelStrategy, "Cost"). Full runs only."""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist

from .compare import (fsync_all, interleaved, render_pair, restore_block, run_pair, slowest,
                      total)
from .measure import log, rotated
from .ranks import finish, torchrun

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters
QUICK = {"width": 512, "layers": 4, "rounds": 2}
SYSTEMS = ("adapter", "stock")


def run(root: str, quick: bool) -> dict:
    """Saving at 2 ranks, then restoring each system's last 2-rank checkpoint at 4 ranks."""
    config, directory = QUICK if quick else FULL, os.path.join(root, "lightning_sharded")
    block = run_pair("lightning sharded", "integrations_lightning_sharded", directory, config,
                     SYSTEMS)
    restored = torchrun("lightning sharded, restoring at 4 ranks",
                        "integrations_lightning_sharded", 4, directory, 0.0, config["rounds"],
                        "--width", str(config["width"]), "--layers", str(config["layers"]),
                        "--phase", "restore")
    block["restore"] = restore_block(restored["rounds"], SYSTEMS)
    return block


def render(block: dict) -> str:
    return render_pair(
        block, SYSTEMS,
        "Lightning ModelParallelStrategy: a sharded save's cost, the adapter against the "
        "stock strategy", "FSDP2", "of parameters and Adam moments",
        ("per save", "`AsyncCkptModelParallelStrategy`", "`ModelParallelStrategy`"),
        "durable (every shard fsynced)", "DCP's save, then an fsync of `meta.pt`",
        ("restore of the last 2-rank checkpoint on 4 ranks (resharded)", "DCP's load"))


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

    def restore(trainer, system: str, n: int) -> dict:
        """Load ``system``'s last checkpoint of the 2-rank run into this run's model and
        optimizer (laid out for its world size)."""
        path = os.path.join(args.dir, system, f"round{rounds - 1}")
        dist.barrier()
        start = time.perf_counter()
        if system == "adapter":
            trainer.strategy.load_checkpoint(path)
        else:
            ModelParallelStrategy.load_checkpoint(trainer.strategy, path)
        return {f"{system}_restore_s": slowest(time.perf_counter() - start)}

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

    class RestoreBoth(Callback):
        """Before the first step, with the model sharded and the optimizer made: the rounds."""

        def on_train_start(self, trainer, pl_module):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the data position moves with the world size
                found["rounds"] = interleaved(
                    "integrations_lightning_sharded: restore", SYSTEMS, rounds,
                    lambda system, n: restore(trainer, system, n))
            trainer.should_stop = True

    class SaveBoth(Callback):
        """At each batch's end (after the optimizer step): a round, both saves in rotated order."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            n = trainer.global_step - 1  # the round: batch_idx starts again in each epoch
            if n >= rounds:
                return
            if n == 0:
                found["state_bytes"] = int(total(sum(
                    t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                    for group in trainer.optimizers[0].state.values()
                    for t in group.values() if torch.is_tensor(t) and t.dim())
                    + sum(p.to_local().nbytes for p in pl_module.parameters())))
            figures = {}
            for system in rotated(SYSTEMS, n):
                figures.update(save(trainer, system, n))
            found["rounds"].append(figures)
            if trainer.is_global_zero:
                log(f"integrations_lightning_sharded: round {n + 1}/{rounds}: {figures}")
                if n < rounds - 1:  # the last is kept for the run that restores it
                    shutil.rmtree(os.path.join(args.dir, "stock", f"round{n}"))

    world = int(os.environ["WORLD_SIZE"])
    strategy = AsyncCkptModelParallelStrategy(os.path.join(args.dir, "engine"),
                                              data_parallel_size=world, tensor_parallel_size=1,
                                              process_group_backend="gloo")
    phase = RestoreBoth() if args.phase == "restore" else SaveBoth()
    trainer = L.Trainer(max_steps=rounds, accelerator="cpu", devices=world, strategy=strategy,
                        callbacks=[phase], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(ShardedMLP())
    finish(args.out, found)
