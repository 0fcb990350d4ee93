"""Lightning's ModelParallelStrategy saving through async_ckpt, under torchrun (CPU, gloo), for
tests/test_integration_lightning_sharded.py.

lightning_fit.py's model sharded with FSDP2 (dropout, and noise drawn from the global RNG in the
dataset's ``__getitem__``; Adam with a StepLR schedule), a shuffled torchdata
``StatefulDataLoader`` of each rank's part of the data, ``ModelCheckpoint(every_n_train_steps=5, save_top_k=2,
monitor="train_loss", save_last=True)`` and ``AsyncCkptModelParallelStrategy(ROOT/engine)``. Each
run appends ``{"step", "loss"}`` per training step to ``ROOT/rank-R.jsonl`` (the loss as Python
writes a float: equal records are bit-identical losses), and rank 0 writes the whole model and
optimizer state at the end of the fit as ``ROOT/full.pt`` (gathered with torch's
``full_state_dict``, independently of async_ckpt).

``--phase train`` (2 ranks): an uninterrupted run to step 15 in ``OUT/reference``, then the same
run in ``OUT/killed`` that stops rank 0's writer just before the saves of step 10 (they are
staged, never committed) and, once they are taken, writes ``OUT/killed/ready`` and waits for the
test to SIGKILL every process. ``--phase resume`` (2 ranks): ``fit(ckpt_path="last")`` in
``OUT/killed`` to step 15, after a fit from the explicit path of the step-5 top-k checkpoint
in ``OUT/explicit`` to step 10. ``--phase reshard`` (any number of ranks): ``fit(ckpt_path="last")`` in
``OUT/reshard``, a copy of ``OUT/killed``'s checkpoints and snapshots, to step 18, writing the whole state as it stands right after
the load as ``OUT/reshard/loaded.pt`` and the warnings of the fit as ``warnings.json``; with
``--consolidated FILE``, the same from that single file in ``OUT/from-file``.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import time
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

from async_ckpt.integrations.lightning_sharded import AsyncCkptModelParallelStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # imported by the tests too
from lightning_fit import BATCH, SAMPLES, DropoutMLP, NoisyPoints  # noqa: E402

STEPS = 15  # 6 batches per rank and epoch on 2 ranks
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ShardedMLP(DropoutMLP):
    """lightning_fit.py's model and data, sharded with FSDP2, each rank shuffling its part."""

    def configure_model(self):
        if self.device_mesh is None or isinstance(self.net, FSDPModule):
            return  # no Trainer (load_from_checkpoint), or sharded by an earlier stage
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def train_dataloader(self):
        # each rank shuffles its own part: Lightning's DistributedSampler inside a
        # StatefulDataLoader resumes mid-epoch at other samples (with the stock strategy too)
        part = torch.utils.data.Subset(NoisyPoints(), range(self.global_rank, SAMPLES,
                                                            self.trainer.world_size))
        return StatefulDataLoader(part, batch_size=BATCH, shuffle=True)


def whole_state(trainer) -> dict:
    """The whole model and optimizer state (a collective; rank 0 gets it, the others {})."""
    model = trainer.lightning_module
    optimizer = trainer.optimizers[0]
    return {"state_dict": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL)}


class Record(Callback):
    """Logs each step's loss; saves the whole state at the start (``loaded``) or the end."""

    def __init__(self, root: str, loaded: bool = False):
        self.root, self.loaded = root, loaded

    def on_train_start(self, trainer, pl_module):
        if self.loaded:
            self._save(trainer, "loaded.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(os.path.join(self.root, f"rank-{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": outputs["loss"].item()})
                    + "\n")

    def on_train_end(self, trainer, pl_module):
        self._save(trainer, "full.pt")

    def _save(self, trainer, name):
        state = whole_state(trainer)
        if trainer.is_global_zero:
            torch.save(state, os.path.join(self.root, name))


class KillAt(Callback):
    """Stops rank 0's writer before the saves of global step ``step`` (Lightning runs the
    checkpoint callbacks last), once the saves before are committed; after those saves, signals
    the test, which kills every process."""

    def __init__(self, root: str, step: int):
        self.root, self.step = root, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.is_global_zero:
            engine = trainer.strategy._engine
            engine.wait()  # the saves before are committed, their staging slots free
            os.kill(engine._writer.pid, signal.SIGSTOP)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.is_global_zero:
            open(os.path.join(self.root, "ready"), "w").close()
            time.sleep(600)  # the test kills every process meanwhile


def fit(root: str, steps: int, ckpt_path=None, engine=None, extra=(), loaded=False):
    os.makedirs(root, exist_ok=True)
    L.seed_everything(0, verbose=False)
    strategy = AsyncCkptModelParallelStrategy(engine or os.path.join(root, "engine"),
                                              data_parallel_size=dist.get_world_size(),
                                              tensor_parallel_size=1,
                                              process_group_backend="gloo")
    checkpoint = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), monitor="train_loss",
                                 every_n_train_steps=5, save_top_k=2, save_last=True)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=dist.get_world_size(),
                        strategy=strategy, callbacks=[Record(root, loaded), *extra, checkpoint],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ShardedMLP(), ckpt_path=ckpt_path)
    return trainer, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("train", "resume", "reshard"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--consolidated")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: losses compared across processes agree bit for bit
    dist.init_process_group("gloo")
    killed = os.path.join(args.out, "killed")
    if args.phase == "train":
        fit(os.path.join(args.out, "reference"), STEPS)
        fit(killed, STEPS, extra=[KillAt(killed, 10)])
    elif args.phase == "resume":  # the explicit path first: the resumed run's top-k drops it
        fit(os.path.join(args.out, "explicit"), 10, engine=os.path.join(killed, "engine"),
            ckpt_path=os.path.join(killed, "ckpts", "epoch=0-step=5.ckpt"))
        fit(killed, STEPS, ckpt_path="last")
    else:
        root = os.path.join(args.out, "reshard")
        if dist.get_rank() == 0:  # "last" is looked up where the callback saves: the killed
            for name in ("ckpts", "engine"):  # run's checkpoints and snapshots, moved there
                shutil.copytree(os.path.join(killed, name), os.path.join(root, name))
        dist.barrier()
        _, caught = fit(root, 18, loaded=True, ckpt_path="last")
        if dist.get_rank() == 0:
            with open(os.path.join(root, "warnings.json"), "w") as f:
                json.dump(caught, f)
        if args.consolidated:
            fit(os.path.join(args.out, "from-file"), 18, ckpt_path=args.consolidated,
                loaded=True, engine=os.path.join(args.out, "from-file", "engine"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
