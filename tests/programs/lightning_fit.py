"""A Lightning training run for the adapter's tests: a small MLP with dropout, whose dataset adds
noise drawn from the global torch RNG in ``__getitem__`` (in this process: ``num_workers=0``),
Adam with a StepLR schedule, a torchdata ``StatefulDataLoader`` (shuffled), and
``ModelCheckpoint(every_n_train_steps=--every, save_top_k=3, monitor="train_loss",
save_last=True)`` saving through ``AsyncCkptIO(ROOT/engine)`` into ``ROOT/ckpts``.

Appends ``{"step", "loss"}`` per training step to --log (the loss as Python writes a float, so
equal records mean bit-identical losses).
``--resume`` is passed to ``trainer.fit(ckpt_path=...)``. ``--stop-writer-at N`` waits for the
saves before global step N to commit, then stops the writer process (SIGSTOP) just before the
saves of step N, so that they are staged but never committed: the test then kills the run.
``--kill-before-last N`` kills the run at a known point, in the middle of the saves of global
step N: after its top-k file is saved, before its ``last.ckpt`` is (which then still names the
save before), it waits for every save taken to commit (their pointers are written), then
SIGKILLs its whole process group (the writer too).

Usage: lightning_fit.py --root DIR --log FILE [--steps N] [--every K] [--resume last|PATH]
                        [--stop-writer-at N] [--kill-before-last N]
"""

import argparse
import json
import os
import signal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from async_ckpt.integrations.lightning import AsyncCkptIO

SAMPLES, BATCH = 48, 4  # 12 batches per epoch


class NoisyPoints(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 2, generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(8), self.y[i]


class DropoutMLP(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)]

    def train_dataloader(self):
        return StatefulDataLoader(NoisyPoints(), batch_size=BATCH, shuffle=True)


class LossLog(Callback):
    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        record = {"step": trainer.global_step, "loss": outputs["loss"].item()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class StopWriter(Callback):
    """Runs before ModelCheckpoint (Lightning calls checkpoint callbacks last)."""

    def __init__(self, io: AsyncCkptIO, step: int):
        self.io, self.step = io, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.io._engine.wait()  # the saves before are committed, their slots free
            os.kill(self.io._engine._writer.pid, signal.SIGSTOP)


class KillBeforeLast(AsyncCkptIO):
    """Lightning saves a global step's top-k file, then its last.ckpt: this IO dies in between,
    once the saves taken are committed, with its whole session (the tests start this program in
    a session of its own), as a SIGKILL from outside would."""

    def __init__(self, directory: str, step: int):
        super().__init__(directory)
        self.step = step

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if os.path.basename(path) == "last.ckpt" and checkpoint["global_step"] == self.step:
            self._engine.wait()
            os.killpg(os.getpgrp(), signal.SIGKILL)
        super().save_checkpoint(checkpoint, path, storage_options)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--stop-writer-at", type=int, default=None)
    parser.add_argument("--kill-before-last", type=int, default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread: losses compared across processes agree bit for bit
    L.seed_everything(0, verbose=False)
    engine_dir = os.path.join(args.root, "engine")
    io = (AsyncCkptIO(engine_dir) if args.kill_before_last is None
          else KillBeforeLast(engine_dir, args.kill_before_last))
    callbacks = [LossLog(args.log), io.callback,
                 ModelCheckpoint(dirpath=os.path.join(args.root, "ckpts"), monitor="train_loss",
                                 every_n_train_steps=args.every, save_top_k=3, save_last=True)]
    if args.stop_writer_at is not None:
        callbacks.append(StopWriter(io, args.stop_writer_at))
    trainer = L.Trainer(max_steps=args.steps, plugins=[io], callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", deterministic=True)
    trainer.fit(DropoutMLP(), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
