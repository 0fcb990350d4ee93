"""torchtitan: what a save costs and how long a resharded restore takes, our checkpoint manager
against torchtitan's own (DCP), both driven as torchtitan's trainer drives them.

The state: torchtitan's containers around an MLP of ``Linear(W, W)`` layers ``fully_shard``-ed
(FSDP2) over the CPU ranks (gloo), AdamW (torchtitan's ``OptimizersContainer``) after a real
step, its ``LRSchedulersContainer``, a ``ParallelAwareDataloader`` and a train state: about
200 MB of tensors across the ranks. Two torchrun runs:

1. 2 ranks, interleaved rounds (the first a warm-up, not reported), each a training step then a
   save by each system: ``AsyncCkptCheckpointManager`` (``async_mode="async"``: returns once
   staged) against torchtitan's ``CheckpointManager`` in its ``"async"`` mode (``dcp.async_save``
   from the training thread), each on its own folder. **Blocking** is the slowest rank's
   ``save()``; **durable** runs from the save's start until ``maybe_wait_for_saving()`` returns
   on rank 0 (every rank's part written: committed for ours, DCP's metadata written for its).
2. 4 ranks: ``load()`` of each system's newest 2-rank checkpoint into the state laid out for 4
   ranks (``exclude_from_loading=["dataloader"]``, as 4 ranks need), a warm-up and measured
   rounds; the slowest rank's time.

Ratios are taken round by round. Not run by ``python -m bench --quick``, nor where torchtitan is
not installed (``pip install 'async_ckpt[torchtitan]'``, in an environment without the
``[transformers]`` extra: pyproject.toml). Alone: ``python -m bench.integrations_torchtitan``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import ranks
from .markdown import milliseconds, spread_text, thousandths
from .measure import log, ratio_spread, rotated, spread, standalone

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters: 201 MB with AdamW
QUICK = {"width": 512, "layers": 4, "rounds": 2}  # not in --quick (``parts.PARTS``): by hand
OURS, THEIRS = "AsyncCkptCheckpointManager", "torchtitan CheckpointManager"
SIDES = ("ours", "theirs")


def run(root: str, quick: bool) -> dict:
    """The two torchrun runs; the results block of results.json."""
    if importlib.util.find_spec("torchtitan") is None:
        log("integrations_torchtitan: skipped, torchtitan is not installed")
        return {"skipped": "torchtitan is not installed"}
    config = QUICK if quick else FULL
    directory = os.path.join(root, "torchtitan")
    options = ("--width", str(config["width"]), "--layers", str(config["layers"]))
    saved = ranks.torchrun("torchtitan, saving at 2 ranks", "bench.integrations_torchtitan", 2,
                           directory, 0, config["rounds"], "--phase", "save", *options)
    loaded = ranks.torchrun("torchtitan, restoring at 4 ranks", "bench.integrations_torchtitan",
                            4, directory, 0, config["rounds"], "--phase", "restore", *options)
    measured = saved["rounds"][1:]
    restores = loaded["rounds"][1:]
    figures = {f"{key}_{side}": spread([r[f"{key}_{side}"] for r in rounds]) for key, rounds in
               (("blocking", measured), ("durable", measured), ("restore", restores))
               for side in SIDES}
    return {"config": config, "state_bytes": saved["state_bytes"], "figures": figures,
            "ratios": {key: ratio_spread([r[f"{key}_ours"] for r in rounds],
                                         [r[f"{key}_theirs"] for r in rounds])
                       for key, rounds in (("blocking", measured), ("durable", measured),
                                           ("restore", restores))},
            "rounds": {"save": saved["rounds"], "restore": loaded["rounds"]}}


def render(results: dict) -> str:
    """The report's section; empty when it did not run."""
    block = results.get("integrations_torchtitan")
    if not block:
        return ""
    if "skipped" in block:
        return ("### torchtitan: the checkpoint manager against torchtitan's own\n\nNot measured: "
                f"{block['skipped']} (pip install 'async_ckpt[torchtitan]', in an environment "
                "without the transformers extra).")
    f, r, mb = block["figures"], block["ratios"], block["state_bytes"] / 1e6

    def cell(key: str) -> str:
        return spread_text(f[key], milliseconds, " ms")

    rows = [("training process blocked per save (2 ranks)", "blocking",
             "staged", "staged by `dcp.async_save`"),
            ("save to durable (2 ranks)", "durable", "committed", "DCP metadata written"),
            ("restore of the 2-rank checkpoint on 4 ranks", "restore", "resharded", "`dcp.load`")]
    return "\n".join([
        "### torchtitan: the checkpoint manager against torchtitan's own (`async` mode)", "",
        f"{mb:.0f} MB of FSDP2 model and AdamW state in torchtitan's containers, on CPU ranks "
        f"(gloo); median of {f['blocking_ours']['n']} interleaved rounds after a warm-up "
        "(min–max); the ratio round by round.", "",
        f"| | `{OURS}` | `{THEIRS}` | ratio |", "|---|---|---|---|",
        *[f"| {label} | {cell(key + '_ours')}, {ours} | {cell(key + '_theirs')}, {theirs} | "
          f"×{spread_text(r[key], thousandths)} |" for label, key, ours, theirs in rows]])


# --- the worker (one per rank, under torchrun) ---------------------------------------------------

class _Job:
    """What torchtitan's trainer hands its checkpoint manager, for ``width`` x ``layers``."""

    def __init__(self, width: int, layers: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.utils.data import IterableDataset
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        class Batches(IterableDataset):
            def __iter__(self):
                while True:
                    yield torch.randn(8, width)

        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-4})],
            implementation="foreach").build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=1000)
        self.loader = ParallelAwareDataloader(Batches(), dp_rank=rank, dp_world_size=world,
                                              batch_size=None, generator=torch.Generator())
        self.batches = iter(self.loader)
        self.train_state = _TrainState()

    def step(self) -> None:
        self.model(next(self.batches)).square().mean().backward()
        self.optimizers.step()
        self.schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.step += 1

    def manager(self, ours: bool, folder: str, **options):
        from torchtitan.components.checkpoint import CheckpointManager

        from async_ckpt.integrations.torchtitan import AsyncCkptCheckpointManager

        cls = AsyncCkptCheckpointManager if ours else CheckpointManager
        config = cls.Config(enable=True, folder=folder, interval=1, keep_latest_k=2,
                            async_mode="async", last_save_model_only=False, **options)
        return config.build(dataloader=self.loader, model_parts=[self.model],
                            optimizers=self.optimizers, lr_schedulers=self.schedulers,
                            states={"train_state": self.train_state}, sd_adapter=None)

    def state_bytes(self) -> int:
        """The model's and the optimizer's tensors, all ranks' pieces."""
        tensors = [*self.model.parameters(), *(v for v in self.optimizers.state_dict().values()
                                                if isinstance(v, torch.Tensor))]
        own = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)
        total = torch.tensor([own])
        dist.all_reduce(total)
        return int(total.item())


class _TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _rounds(job: _Job, directory: str, rounds: int, what: str,
            measure: Callable[[object, str], dict], **options) -> list:
    """``rounds`` interleaved rounds of ``measure(manager, side)`` on each system's manager (its
    own folder under ``directory``); each round's figures."""
    managers = {side: job.manager(side == "ours", os.path.join(directory, side), **options)
                for side in SIDES}
    found = []
    try:
        for n in range(rounds):
            figures = {}
            for side in rotated(SIDES, n):
                figures.update(measure(managers[side], side))
            found.append(figures)
            log(f"integrations_torchtitan: {what} round {n + 1}/{rounds}: " + ", ".join(
                f"{k} {v * 1e3:.0f} ms" for k, v in figures.items()))
    finally:
        for manager in managers.values():
            manager.close()
    return found


def _save(job: _Job) -> Callable[[object, str], dict]:
    def measure(manager, side: str) -> dict:
        job.step()
        dist.barrier()
        start = time.perf_counter()
        manager.save(job.train_state.step)
        blocking = _slowest(time.perf_counter() - start)
        manager.maybe_wait_for_saving()
        durable = time.perf_counter() - start  # rank 0's is kept
        dist.barrier()
        return {f"blocking_{side}": blocking, f"durable_{side}": durable}
    return measure


def _restore(manager, side: str) -> dict:
    dist.barrier()
    start = time.perf_counter()
    manager.load()
    return {f"restore_{side}": _slowest(time.perf_counter() - start)}


def worker() -> None:
    args = ranks.worker_arguments("--phase", "--width", "--layers")
    dist.init_process_group("gloo")
    job = _Job(int(args.width), int(args.layers))
    job.step()  # the optimizer's moments exist
    if args.phase == "save":
        found = {"rounds": _rounds(job, args.dir, args.rounds, "save", _save(job)),
                 "state_bytes": job.state_bytes()}
    else:
        found = {"rounds": _rounds(job, args.dir, args.rounds, "restore", _restore,
                                   exclude_from_loading=["dataloader"], load_only=True)}
    del job
    ranks.finish(args.out, found)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(standalone("integrations_torchtitan", "integrations_torchtitan", run, render,
                            __doc__))
