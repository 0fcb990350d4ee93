"""An Accelerate training loop checkpointed through async_ckpt.integrations.accelerate: an MLP with
dropout, AdamW, a step schedule, a shuffled prepared stateful loader (DataLoaderConfiguration(
use_stateful_dataloader=True)), a snapshot every ``--every`` steps and a final one at close.

Appends ``{"step", "epoch", "loss", "lr"}`` per step to --losses, one JSON object per line, and
``{"restored": step}`` after a restore. Killed at any instant and run again, it must reproduce an
uninterrupted run bit for bit. Under torchrun every rank logs to ``FILE.rank-R``.

``--freeze-writer-at S``: stop the writer process (SIGSTOP) just before snapshot(S), and once
snapshot(S) has returned, SIGKILL this whole process group (this rank and its writer): the
machine dying during a save. Under ``torchrun --max-restarts 1`` only the first attempt does, and
the restarted ranks resume.

``--state-dir T``: each snapshot also leaves save_state's directory at T (``{step}`` replaced).

Usage: accelerate_loop.py --ckpt-dir DIR --losses FILE [--epochs N] [--every K] [--workers W]
                          [--generator] [--freeze-writer-at S] [--state-dir T]
"""

import argparse
import json
import os
import signal

import psutil
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from async_ckpt.integrations import accelerate as accelerate_ckpt


def freeze_writer() -> None:
    for child in psutil.Process().children(recursive=True):
        if "async_ckpt.write.writer" in child.cmdline():
            child.send_signal(signal.SIGSTOP)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--losses", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--generator", action="store_true", help="give the DataLoader generator=")
    parser.add_argument("--freeze-writer-at", type=int, default=None)
    parser.add_argument("--state-dir", default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread: losses compared across processes agree bit for bit
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))  # cpu=True: several processes on CPU are MULTI_CPU (gloo)
    set_seed(0)
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(52, 6, generator=g), torch.randn(52, 1, generator=g))
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(1) if args.generator else None)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)

    log_path = args.losses if accelerator.num_processes == 1 else \
        f"{args.losses}.rank-{accelerator.process_index}"
    engine = accelerate_ckpt.engine(accelerator, args.ckpt_dir, model=model, optimizer=opt,
                                    scheduler=sched, dataloader=loader, every=args.every,
                                    state_dir=args.state_dir, heartbeat_interval=None)
    start = engine.restore()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    step = 0 if start is None else start + 1
    with open(log_path, "a") as log:
        if start is not None:
            log.write(json.dumps({"restored": start}) + "\n")
        for epoch in range(engine.epoch, args.epochs):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                log.write(json.dumps({"step": step, "epoch": epoch, "loss": loss.item(),
                                      "lr": sched.get_last_lr()[0]}) + "\n")
                log.flush()
                dying = step == args.freeze_writer_at and first_attempt
                if dying:
                    engine.wait()  # every slot free: snapshot(step) stages without the writer
                    freeze_writer()
                engine.snapshot(step)
                if dying:
                    os.killpg(0, signal.SIGKILL)
                step += 1
    engine.close(final_step=step - 1)


if __name__ == "__main__":
    main()
