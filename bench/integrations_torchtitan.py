"""torchtitan: a save's cost and a resharded restore's time, our checkpoint manager against
torchtitan's own (DCP), both driven as torchtitan's trainer drives them (method:
docs/integrations.md, torchtitan, "Cost"). Full runs only, where torchtitan is installed."""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import ranks
from .compare import interleaved, slowest, summarised
from .markdown import ms, ratio, section, table
from .measure import log

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters: 201 MB with AdamW
QUICK = {"width": 512, "layers": 4, "rounds": 2}  # not in --quick (``parts.PARTS``): by hand
OURS, THEIRS = "AsyncCkptCheckpointManager", "torchtitan CheckpointManager"
SIDES = ("ours", "theirs")
KEYS = ("blocking", "durable", "restore")


def run(root: str, quick: bool) -> dict:
    if importlib.util.find_spec("torchtitan") is None:
        log("integrations_torchtitan: skipped, torchtitan is not installed")
        return {"skipped": "torchtitan is not installed"}
    config = QUICK if quick else FULL
    directory = os.path.join(root, "torchtitan")
    options = ("--width", str(config["width"]), "--layers", str(config["layers"]))
    saved = ranks.torchrun("torchtitan, saving at 2 ranks", "integrations_torchtitan", 2,
                           directory, 0, config["rounds"], "--phase", "save", *options)
    loaded = ranks.torchrun("torchtitan, restoring at 4 ranks", "integrations_torchtitan",
                            4, directory, 0, config["rounds"], "--phase", "restore", *options)
    # one round's figures of both runs side by side: their warm-ups are both round 0
    rounds = [{**save, **load} for save, load in zip(saved["rounds"], loaded["rounds"])]
    summary = summarised(rounds, [f"{key}_{side}" for key in KEYS for side in SIDES],
                         {key: (f"{key}_ours", f"{key}_theirs") for key in KEYS})
    return {"config": config, "state_bytes": saved["state_bytes"], **summary,
            "rounds": {"save": saved["rounds"], "restore": loaded["rounds"]}}


def render(block: dict) -> str:
    title = "torchtitan: the checkpoint manager against torchtitan's own"
    if "skipped" in block:
        return section(title, f"Not measured: {block['skipped']} (pip install "
                       "'async_ckpt[torchtitan]', in an environment without the transformers "
                       "extra).")
    f = block["figures"]
    rows = [[label, f"{ms(f[key + '_ours'])}, {ours}", f"{ms(f[key + '_theirs'])}, {theirs}",
             ratio(block["ratios"][key], 3)] for label, key, ours, theirs in (
        ("training process blocked per save (2 ranks)", "blocking", "staged",
         "staged by `dcp.async_save`"),
        ("save to durable (2 ranks)", "durable", "committed", "DCP metadata written"),
        ("restore of the 2-rank checkpoint on 4 ranks", "restore", "resharded", "`dcp.load`"))]
    return section(
        f"{title} (`async` mode)",
        f"{block['state_bytes'] / 1e6:.0f} MB of FSDP2 model and AdamW state in torchtitan's "
        f"containers, on CPU ranks (gloo); median of {f['blocking_ours']['n']} interleaved rounds "
        "after a warm-up (min–max); the ratio round by round.",
        table(["", f"`{OURS}`", f"`{THEIRS}`", "ratio"], rows))


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


def _rounds(job: _Job, directory: str, rounds: int, what: str,
            measure: Callable[[object, str], dict], **options) -> list:
    """``interleaved`` rounds of ``measure(manager, side)``, each side's manager on its own
    folder under ``directory``."""
    managers = {side: job.manager(side == "ours", os.path.join(directory, side), **options)
                for side in SIDES}
    try:
        return interleaved(f"integrations_torchtitan: {what}", SIDES, rounds,
                           lambda side, n: measure(managers[side], side))
    finally:
        for manager in managers.values():
            manager.close()


def _save(job: _Job) -> Callable[[object, str], dict]:
    def measure(manager, side: str) -> dict:
        job.step()
        dist.barrier()
        start = time.perf_counter()
        manager.save(job.train_state.step)
        blocking = slowest(time.perf_counter() - start)
        manager.maybe_wait_for_saving()
        durable = time.perf_counter() - start  # rank 0's is kept
        dist.barrier()
        return {f"blocking_{side}": blocking, f"durable_{side}": durable}
    return measure


def _restore(manager, side: str) -> dict:
    dist.barrier()
    start = time.perf_counter()
    manager.load()
    return {f"restore_{side}": slowest(time.perf_counter() - start)}


def worker(args) -> None:
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

