"""Lightning's ModelParallelStrategy: a sharded save's cost, the adapter against the stock strategy.

Two ranks under torchrun (CPU, gloo), one Lightning fit of an MLP sharded with FSDP2 (Adam;
about 200 MB of parameters and moments in all, 13 MB with ``--quick``) whose strategy is
``AsyncCkptModelParallelStrategy``. At each round's batch a callback saves the same checkpoint
(Lightning's ``dump_checkpoint``) twice, in rotated order (the first round a warm-up, not
reported):

* **adapter**: ``trainer.save_checkpoint(path)``, which returns once this rank's pieces are
  staged; the checkpoint directory appears once every rank's shard is durable and the snapshot
  committed (its pointer file is written last);
* **stock**: ``ModelParallelStrategy.save_checkpoint``, Lightning's own sharded save on the same
  strategy object: ``torch.distributed.checkpoint.save`` (which fsyncs its files) and rank 0's
  ``meta.pt``, returning once written.

**Blocking** is the slower rank's call; **durable** for the adapter is until the directory has
appeared (every rank's shard fsynced, the snapshot committed), for the stock save its return
plus an fsync of ``meta.pt``. Medians of the measured rounds with their min-max spread, ratios
round by round. Not part of ``python -m bench --quick``. Alone: ``python -m
bench.integrations_lightning_sharded [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from . import adapter_pair
from .measure import log, rotated, standalone
from .ranks import finish, worker_arguments

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters
QUICK = {"width": 512, "layers": 4, "rounds": 2}
SYSTEMS = ("adapter", "stock")


def run(root: str, quick: bool) -> dict:
    """Run the workers under torchrun; the results block of results.json."""
    return adapter_pair.run("lightning sharded", "bench.integrations_lightning_sharded",
                            os.path.join(root, "lightning_sharded"), QUICK if quick else FULL,
                            SYSTEMS)


def render(results: dict) -> str:
    """The report's section; empty for results saved before this benchmark existed."""
    block = results.get("integrations_lightning_sharded")
    if not block:
        return ""
    return adapter_pair.render(
        block, SYSTEMS,
        "### Lightning ModelParallelStrategy: a sharded save's cost, the adapter against the "
        "stock strategy", "FSDP2", "of parameters and Adam moments",
        ("per save", "`AsyncCkptModelParallelStrategy`", "`ModelParallelStrategy`"),
        "durable (every shard fsynced)", "DCP's save, then an fsync of `meta.pt`")


# --- the worker (one per rank, under torchrun) ---------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from async_ckpt.integrations.directories import POINTER_NAME
    from async_ckpt.integrations.lightning_sharded import AsyncCkptModelParallelStrategy

    width, layers, rounds = int(args.width), int(args.layers), int(args.rounds)
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

    class SaveBoth(Callback):
        """At each batch's end (after the optimizer step): both saves, in rotated order."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= rounds:
                return
            if batch_idx == 0:
                found["state_bytes"] = int(adapter_pair.reduced(sum(
                    t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                    for group in trainer.optimizers[0].state.values()
                    for t in group.values() if torch.is_tensor(t) and t.dim())
                    + sum(p.to_local().nbytes for p in pl_module.parameters()),
                    dist.ReduceOp.SUM))
            figures = {}
            for system in rotated(SYSTEMS, batch_idx):
                path = os.path.join(args.dir, system, f"round{batch_idx}")
                dist.barrier()
                start = time.perf_counter()
                if system == "adapter":
                    trainer.save_checkpoint(path)
                    figures["adapter_blocking_s"] = adapter_pair.reduced(time.perf_counter() - start)
                    while not os.path.exists(os.path.join(path, POINTER_NAME)):
                        time.sleep(0.001)  # the marker, written once the snapshot is committed
                else:
                    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
                    ModelParallelStrategy.save_checkpoint(trainer.strategy, checkpoint, path)
                    figures["stock_blocking_s"] = adapter_pair.reduced(time.perf_counter() - start)
                    if trainer.is_global_zero:
                        adapter_pair.fsync_all(os.path.join(path, "meta.pt"))
                figures[f"{system}_durable_s"] = adapter_pair.reduced(time.perf_counter() - start)
            found["rounds"].append(figures)
            if trainer.is_global_zero:
                log(f"integrations_lightning_sharded: round {batch_idx + 1}/{rounds}: adapter "
                    f"blocks {figures['adapter_blocking_s'] * 1e3:.0f} ms (durable after "
                    f"{figures['adapter_durable_s']:.2f} s), stock "
                    f"{figures['stock_blocking_s']:.2f} s (durable after "
                    f"{figures['stock_durable_s']:.2f} s)")
                shutil.rmtree(os.path.join(args.dir, "stock", f"round{batch_idx}"))

    ranks = adapter_pair.RANKS
    strategy = AsyncCkptModelParallelStrategy(os.path.join(args.dir, "engine"),
                                              data_parallel_size=ranks, tensor_parallel_size=1,
                                              process_group_backend="gloo")
    trainer = L.Trainer(max_steps=rounds, accelerator="cpu", devices=ranks, strategy=strategy,
                        callbacks=[SaveBoth()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(ShardedMLP())
    finish(args.out, found)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(worker_arguments("--width", "--layers"))
    else:
        sys.exit(standalone("integrations_lightning_sharded", "integrations_lightning_sharded",
                            run, render, __doc__))
