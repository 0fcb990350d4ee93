"""torchtitan's checkpoint managers around an FSDP2 model on CPU ranks (gloo), for
tests/test_integration_torchtitan.py. Started by torchrun:

    torchtitan_job.py --root ROOT --phase train    (2 ranks, torchrun --max-restarts 1)
    torchtitan_job.py --root ROOT --phase reshard  (4 ranks, on what the first phase left)

``train``: the first attempt trains with ``AsyncCkptCheckpointManager`` (lazy staging, a save
every 2 steps, keep_latest_k=2) and rank 1 SIGKILLs itself mid-run; torchrun restarts both
ranks, which resume from the newest committed step and finish. The second attempt then runs the
same job uninterrupted with torchtitan's own ``CheckpointManager`` (DCP, ``async_mode=
"disabled"``: a restarted gloo job cannot connect the group its ``"async"`` mode creates), whose
DCP checkpoints are loaded through ours (the folder's ``step-M``, imported) and trained on, and
exports our newest snapshot for torchtitan's manager to load. ``reshard``: 4 ranks restore the
2-rank snapshot with ``exclude_from_loading=["dataloader"]``, import the 2-rank DCP checkpoint
and load the export with torchtitan's manager in ``"async"`` mode.

Each rank logs ``{"step", "loss", "attempt"}`` lines to ROOT/run/logs/rank-R.jsonl; rank 0
writes what it checked to ROOT/<phase>.json.
"""

import argparse
import contextlib
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from async_ckpt.integrations.torchtitan import AsyncCkptCheckpointManager, export_dcp

STEPS, KILL_AT, IMPORT_AT = 12, 7, 6  # the second attempt resumes from step 6


class Samples(IterableDataset):
    """Each data-parallel rank's own endless stream, a function of its rank alone; stateful, as
    torchtitan's datasets are (its position is in the loader's state)."""

    def __init__(self, rank: int):
        self.rank, self.next = rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.rank * 1_000_003 + self.next)
            self.next += 1
            yield torch.randn(8, generator=g), torch.randn(2, generator=g)

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


class TrainState:
    """The trainer's own state (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class Job:
    """What torchtitan's trainer builds and hands its checkpoint manager: the model sharded with
    FSDP2 over every rank under torch.distributed, else whole (one process, on ``device``)."""

    def __init__(self, seed=0, device="cpu"):
        sharded = dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 2)).to(device)
        if sharded:
            fully_shard(self.model, mesh=init_device_mesh("cpu", (world,)))
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop").build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
            optimizers=self.optimizers, training_steps=STEPS)
        self.dataloader = ParallelAwareDataloader(Samples(rank), dp_rank=rank, dp_world_size=world,
                                                  batch_size=4, generator=torch.Generator())
        self.train_state = TrainState()

    def manager(self, config, base_folder):
        return config.build(dataloader=self.dataloader, model_parts=[self.model],
                            optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                            states={"train_state": self.train_state}, sd_adapter=None,
                            base_folder=base_folder)

    def train(self, checkpointer, log=None, attempt=0):
        """torchtitan's loop: the manager's staging fence before the optimizer step, a save
        after every step (its interval decides)."""
        losses, data = {}, iter(self.dataloader)
        while self.train_state.step < STEPS:
            self.train_state.step += 1
            step = self.train_state.step
            x, y = (t.to(self.model[0].weight.device) for t in next(data))
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            losses[step] = loss.item()
            if log is not None:
                log.write(json.dumps({"step": step, "loss": losses[step], "attempt": attempt})
                          + "\n")
                log.flush()
            checkpointer.save(step, last_step=step == STEPS)
            if log is not None and attempt == 0 and step == KILL_AT and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-run, the step-6 snapshot in flight
        return losses

    def full_state(self):
        """Everything the managers save, whole, on the CPU (a collective: every rank calls
        it)."""
        def whole(value):
            value = value.full_tensor() if isinstance(value, DTensor) else value
            return value.cpu() if isinstance(value, torch.Tensor) else value
        return {"model": {k: whole(v) for k, v in self.model.state_dict().items()},
                "optimizer": {k: whole(v) for k, v in self.optimizers.state_dict().items()},
                "lr_scheduler": self.lr_schedulers.state_dict(),
                "train_state": self.train_state.state_dict()}


def same(a, b):
    """Bit for bit (tensors by their bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def ours(**options):
    return AsyncCkptCheckpointManager.Config(**{
        "enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 2,
        "last_save_model_only": False, **options})


def torchtitans(**options):
    return CheckpointManager.Config(**{
        "enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 0,
        "last_save_model_only": False, **options})


def phase_train(root):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, found = dist.get_rank(), {}
    os.makedirs(os.path.join(root, "run", "logs"), exist_ok=True)
    job = Job()
    checkpointer = job.manager(ours(async_mode="async_with_pinned_mem"), os.path.join(root, "run"))
    with open(os.path.join(root, "run", "logs", f"rank-{rank}.jsonl"), "a") as log:
        found["loaded"] = checkpointer.load()
        found["resumed_from"] = job.train_state.step
        job.train(checkpointer, log, attempt)
    checkpointer.close()
    final = job.full_state()
    found["loader"] = job.dataloader.state_dict()
    del job

    # the same job uninterrupted, checkpointed by torchtitan's own manager (DCP)
    reference = Job()
    stock = reference.manager(torchtitans(async_mode="disabled"), os.path.join(root, "reference"))
    found["losses"] = reference.train(stock)
    stock.close()
    found["same_final_state"] = same(final, reference.full_state())
    found["same_loader_state"] = found.pop("loader") == reference.dataloader.state_dict()

    # its step-6 DCP checkpoint, found in the folder, loads through ours; training goes on alike
    imported = Job()
    checkpointer = imported.manager(ours(load_step=IMPORT_AT), os.path.join(root, "reference"))
    checkpointer.load(step=IMPORT_AT)
    found["imported_at"] = imported.train_state.step
    found["losses_after_import"] = imported.train(checkpointer)
    checkpointer.close()

    # our newest snapshot as DCP, loaded by torchtitan's manager with every rank's data position
    if rank == 0:
        os.makedirs(os.path.join(root, "exported", "ckpt"))
        export_dcp(os.path.join(root, "run", "ckpt"),
                   os.path.join(root, "exported", "ckpt", f"step-{STEPS}"))
    dist.barrier()
    loaded = Job()
    stock = loaded.manager(torchtitans(async_mode="disabled"), os.path.join(root, "exported"))
    stock.load()
    found["export_loads_exactly"] = same(final, loaded.full_state())
    found["export_keeps_loader"] = (loaded.dataloader.state_dict()
                                    == reference.dataloader.state_dict())
    stock.close()
    if rank == 0:
        torch.save(final, os.path.join(root, "final.pt"))
    return found


def phase_reshard(root):
    found, final = {}, torch.load(os.path.join(root, "final.pt"), weights_only=True)
    run = os.path.join(root, "run")

    job = Job()
    checkpointer = job.manager(ours(exclude_from_loading=["dataloader"]), run)
    checkpointer.load()
    found["resharded_exactly"] = same(final, job.full_state())
    checkpointer.close()

    imported, dcp = Job(), os.path.join(root, "reference", "ckpt", f"step-{STEPS}")
    checkpointer = imported.manager(ours(initial_load_path=dcp, initial_load_model_only=False,
                                         exclude_from_loading=["dataloader"], folder="imported"),
                                    root)
    checkpointer.load()
    found["import_reshards_exactly"] = same(final, imported.full_state())
    checkpointer.close()

    stock_job = Job()
    stock = stock_job.manager(torchtitans(async_mode="async", exclude_from_loading=["dataloader"]),
                              os.path.join(root, "exported"))
    stock.load()
    found["export_reshards_exactly"] = same(final, stock_job.full_state())
    stock.close()
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--phase", choices=("train", "reshard"), required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        found = (phase_train if args.phase == "train" else phase_reshard)(args.root)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        if dist.get_rank() == 0:
            with open(os.path.join(args.root, f"{args.phase}.json"), "w") as f:
                json.dump(everyone, f)
    finally:
        import gc
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
