"""A tiny training loop for the tests of ``async-ckpt compare-loss`` on real runs: an MLP with Adam,
``async_ckpt.deterministic()`` first (so two runs agree bit for bit unless told otherwise), a
snapshot every 2 steps, one ``{"step", "loss"}`` line per step appended to --log.

- ``--stop-after K``: leave after step K, as an interrupted run (its last snapshot is the one of
  the last even step, so a run that resumes from it logs the steps after it again);
- ``--noise``: add to every batch a noise term of about 1e-5 drawn without a seed (from
  ``os.urandom``): two runs are then not reproducible, as on a machine whose BLAS splits products
  by its load;
- ``--forget-optimizer``: register the model but not the optimizer, so a resumed run restarts
  Adam's moments: a resume that truly differs;
- ``--mark-resume``: after a restore, write ``{"resumed_from": step}`` to the log.

Usage: resume_check.py --ckpt-dir DIR --log FILE [--steps N] [--stop-after K] [--noise]
[--forget-optimizer] [--mark-resume]
"""

import argparse
import json
import os

import torch

import async_ckpt
from async_ckpt import CheckpointEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--noise", action="store_true")
    parser.add_argument("--forget-optimizer", action="store_true")
    parser.add_argument("--mark-resume", action="store_true")
    args = parser.parse_args()

    async_ckpt.deterministic()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=data), torch.randn(32, 1, generator=data)
    unseeded = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    state = {"model": model} if args.forget_optimizer else {"model": model, "optimizer": opt}
    with CheckpointEngine(args.ckpt_dir, state, every=2, heartbeat_interval=None) as engine, \
            open(args.log, "a") as log:
        restored = engine.restore()
        if restored is not None and args.mark_resume:
            log.write(json.dumps({"resumed_from": restored}) + "\n")
        step = 0 if restored is None else restored + 1
        while step < args.steps:
            rows = slice(step % 4 * 8, step % 4 * 8 + 8)
            xb = x[rows]
            if args.noise:
                xb = xb + 1e-5 * torch.randn(xb.shape, generator=unseeded)
            loss = torch.nn.functional.mse_loss(model(xb), y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            log.flush()
            engine.snapshot(step)
            if step == args.stop_after:
                break
            step += 1


if __name__ == "__main__":
    main()
