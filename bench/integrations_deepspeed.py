"""DeepSpeed: what a save costs, the adapter against DeepSpeed's own torch checkpoint engine.

Two ranks under torchrun (CPU accelerator, gloo), ZeRO stage 2, each system on a DeepSpeed
engine of its own over the same model (an MLP whose fp32 parameters, ZeRO's fp32 partitions and
Adam moments make about 270 MB in all; 17 MB with ``--quick``), saved alternately in interleaved
rounds (the first a warm-up, not reported), one training step before each save:

* **adapter**: ``engine.save_checkpoint(dir)`` with ``async_ckpt.integrations.deepspeed``
  installed; it returns once every rank's files are staged, and the writers commit the snapshot,
  link the files into the tag and write ``latest``;
* **torch**: DeepSpeed's ``TorchCheckpointEngine`` (its default), whose ``save_checkpoint``
  returns once every file is written (``torch.save`` of tensors it first clones; no fsync).

**Blocking** is the slower rank's ``save_checkpoint`` call. **Time to durable**: for the adapter
until ``wait()`` has returned on every rank (committed, every file and ``latest`` in place, all
fsynced); for the torch engine, its save plus an fsync of every file it wrote (what it would
take to survive a power cut). Medians of the measured rounds with their min-max spread, and the
ratios round by round. ``run(root, quick)`` starts ``torchrun --nproc-per-node 2 -m
bench.integrations_deepspeed --worker ...``. Not part of ``python -m bench --quick``. Alone:
``python -m bench.integrations_deepspeed [--quick]``.
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
SYSTEMS = ("adapter", "torch")


def run(root: str, quick: bool) -> dict:
    """Run the workers under torchrun; the results block of results.json."""
    return adapter_pair.run("deepspeed", "bench.integrations_deepspeed",
                            os.path.join(root, "deepspeed"), QUICK if quick else FULL, SYSTEMS)


def render(results: dict) -> str:
    """The report's section; empty for results saved before this benchmark existed."""
    block = results.get("integrations_deepspeed")
    if not block:
        return ""
    return adapter_pair.render(
        block, SYSTEMS,
        "### DeepSpeed: a save's cost, the adapter against DeepSpeed's torch engine",
        "ZeRO stage 2", "of fp32 parameters, ZeRO fp32 partitions and Adam moments",
        ("per `save_checkpoint`", "adapter", "`TorchCheckpointEngine`"),
        "durable (every file and `latest` fsynced)", "its save, then an fsync of its files")


# --- the worker (one per rank, under torchrun) ---------------------------------------------------


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
    loss = engine(torch.randn(8, width)).square().mean()
    engine.backward(loss)
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
    width, layers = int(args.width), int(args.layers)
    engines = {system: _engine(width, layers) for system in SYSTEMS}
    ours = install(engines["adapter"], os.path.join(args.dir, "adapter", "async_ckpt"),
                   keep_last=2, heartbeat_interval=None)
    for engine in engines.values():
        _step(engine, width)
    optimizer = engines["torch"].optimizer  # ZeRO's: this rank's fp32 partition and its moments
    partition = [*optimizer.single_partition_of_fp32_groups,
                 *(v for s in optimizer.optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim())]
    state_bytes = int(sum(p.numel() * p.element_size() for p in engines["torch"].parameters())
                      + adapter_pair.reduced(sum(t.numel() * t.element_size() for t in partition),
                                 dist.ReduceOp.SUM))
    rounds = []
    for n in range(args.rounds):
        figures = {}
        for system in rotated(SYSTEMS, n):
            engine = engines[system]
            _step(engine, width)
            save_dir = os.path.join(args.dir, system)
            tag = f"round{n}"
            dist.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(save_dir, tag=tag)
            figures[f"{system}_blocking_s"] = adapter_pair.reduced(time.perf_counter() - start)
            if system == "adapter":
                ours.wait()
            else:
                adapter_pair.fsync_all(os.path.join(save_dir, tag))
                adapter_pair.fsync_all(os.path.join(save_dir, "latest"))
            figures[f"{system}_durable_s"] = adapter_pair.reduced(time.perf_counter() - start)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(os.path.join(save_dir, tag))
        rounds.append(figures)
        if dist.get_rank() == 0:
            log(f"integrations_deepspeed: round {n + 1}/{args.rounds}: adapter blocks "
                f"{figures['adapter_blocking_s'] * 1e3:.0f} ms (durable after "
                f"{figures['adapter_durable_s']:.2f} s), torch engine "
                f"{figures['torch_blocking_s']:.2f} s (durable after "
                f"{figures['torch_durable_s']:.2f} s)")
    ours.close()
    finish(args.out, {"state_bytes": state_bytes, "rounds": rounds})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(worker_arguments("--width", "--layers"))
    else:
        sys.exit(standalone("integrations_deepspeed", "integrations_deepspeed", run, render,
                            __doc__))
