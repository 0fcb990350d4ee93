"""DeepSpeed: a save's cost, the adapter against DeepSpeed's own torch checkpoint engine (ZeRO-2
on two CPU ranks; method: docs/integrations.md, DeepSpeed, "Cost"). Full runs only."""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist

from .compare import (fsync_all, interleaved, render_pair, restore_block, run_pair, slowest,
                      total)
from .ranks import finish

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters
QUICK = {"width": 512, "layers": 4, "rounds": 2}
SYSTEMS = ("adapter", "torch")


def run(root: str, quick: bool) -> dict:
    """The pair's block, and the restores the workers timed in the same rounds (DeepSpeed loads
    ZeRO state only at the data-parallel size it was saved at: no resharded restore)."""
    block = run_pair("deepspeed", "integrations_deepspeed", os.path.join(root, "deepspeed"),
                     QUICK if quick else FULL, SYSTEMS)
    block["restore"] = restore_block(block["rounds"], SYSTEMS)
    return block


def render(block: dict) -> str:
    return render_pair(
        block, SYSTEMS,
        "DeepSpeed: a save's cost, the adapter against DeepSpeed's torch engine",
        "ZeRO stage 2", "of fp32 parameters, ZeRO fp32 partitions and Adam moments",
        ("per `save_checkpoint`", "adapter", "`TorchCheckpointEngine`"),
        "durable (every file and `latest` fsynced)", "its save, then an fsync of its files",
        ("`load_checkpoint` of that save on the same 2 ranks", "its files, from the page cache"))


def _engine(width: int, layers: int):
    """A ZeRO-2 DeepSpeed engine over the MLP, seeded alike on every rank."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))
    return engine


def _step(engine, width: int) -> None:
    engine.backward(engine(torch.randn(8, width)).square().mean())
    engine.step()


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    from async_ckpt.integrations.deepspeed import install

    # The CPU accelerator compiles a shared-memory all-reduce when it starts (a minute the first
    # time); the benchmark's collectives are few and small, gloo's suffice.
    deepspeed.ops.__compatible_ops__ = {**deepspeed.ops.__compatible_ops__,
                                        "deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    engines = {system: _engine(args.width, args.layers) for system in SYSTEMS}
    ours = install(engines["adapter"], os.path.join(args.dir, "adapter", "async_ckpt"),
                   keep_last=2, heartbeat_interval=None)
    for engine in engines.values():
        _step(engine, args.width)
    optimizer = engines["torch"].optimizer  # ZeRO's: this rank's fp32 partition and its moments
    partition = [*optimizer.single_partition_of_fp32_groups,
                 *(v for s in optimizer.optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim())]
    state_bytes = int(sum(p.numel() * p.element_size() for p in engines["torch"].parameters())
                      + total(sum(t.numel() * t.element_size() for t in partition)))

    def save(system: str, n: int) -> dict:
        engine, save_dir, tag = engines[system], os.path.join(args.dir, system), f"round{n}"
        _step(engine, args.width)
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(save_dir, tag=tag)
        blocking = slowest(time.perf_counter() - start)
        if system == "adapter":
            ours.wait()
        else:
            fsync_all(os.path.join(save_dir, tag))
            fsync_all(os.path.join(save_dir, "latest"))
        durable = slowest(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        engine.load_checkpoint(save_dir, tag=tag)
        restore = slowest(time.perf_counter() - start)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(save_dir, tag))
        return {f"{system}_blocking_s": blocking, f"{system}_durable_s": durable,
                f"{system}_restore_s": restore}

    rounds = interleaved("integrations_deepspeed", SYSTEMS, args.rounds, save)
    ours.close()
    finish(args.out, {"state_bytes": state_bytes, "rounds": rounds})
