"""A training loop written from the README alone: an MLP with dropout, AdamW, a cosine schedule,
``ResumableLoader(num_workers=2)`` over a dataset whose augmentation draws from the worker's global
torch RNG, a snapshot every ``--every`` steps and a final one at ``close(final_step=...)``.

Appends ``{"step", "loss", "lr"}`` per step to --log (the format ``async-ckpt compare-loss``
reads). Killed at any instant and run again, it must reproduce an uninterrupted run bit for bit.

Usage: readme_loop.py --ckpt-dir DIR --log FILE [--steps N] [--every K]
"""

import argparse
import json

import torch

import async_ckpt
from async_ckpt import CheckpointEngine
from async_ckpt.data import ResumableLoader


class Noisy(torch.utils.data.Dataset):
    """Fixed points with augmentation drawn the natural way: from the global torch RNG."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--staging", choices=["eager", "lazy"], default="eager")
    args = parser.parse_args()

    async_ckpt.deterministic()  # as the README says: one thread, so runs agree bit for bit
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader = ResumableLoader(Noisy(48), batch_size=8, shuffle=True, seed=0, num_workers=2)
    engine = CheckpointEngine(args.ckpt_dir, {"model": model, "optimizer": opt,
                                              "scheduler": sched, "loader": loader},
                              every=args.every, heartbeat_interval=None, staging=args.staging)
    start = engine.restore()
    step = 0 if start is None else start + 1
    with open(args.log, "a") as log:
        for _ in loader.epochs():
            if step >= args.steps:
                break
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                loader.advance()
                log.write(json.dumps({"step": step, "loss": loss.item(),
                                      "lr": sched.get_last_lr()[0]}) + "\n")
                log.flush()
                engine.snapshot(step)
                step += 1
                if step >= args.steps:
                    break
    engine.close(final_step=step - 1)


if __name__ == "__main__":
    main()
