"""A small training job for the supervisor tests, which misbehaves once when told to.

It fits a weight vector by gradient descent on batches that are a function of the step, appends one
JSON line per step (``{"step": s, "loss": ...}``) to --loss-log, snapshots every step with
``CheckpointEngine`` (heartbeat every 0.5 s; ``--preemption``: SIGTERM/SIGUSR1 commit a snapshot
and exit 75) and restores the newest snapshot on start, so a resumed run reproduces the
uninterrupted run's losses bit for bit.

Misbehaviour, each at most once per --marker-dir (a marker file records that it happened, holding
the pid of the process that misbehaved):

- ``--hang-at STEP``: sleep forever on reaching STEP (with ``--preemption`` the engine's SIGTERM
  handler only sets a flag that the hung loop never sees, as in a job stuck in a collective: only
  SIGKILL ends it);
- ``--crash-at STEP``: exit 1 on reaching STEP, without closing anything;
- ``--always-crash``: exit 3 at start, every time.

Usage: flaky_job.py --ckpt-dir DIR --loss-log FILE [--steps N] [--marker-dir DIR] [misbehaviour]
"""

import argparse
import json
import os
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    # not --log: torchrun's parser takes it, after the script name, for an abbreviation of its own
    # --log-dir / --logs-specs and refuses it as ambiguous
    parser.add_argument("--loss-log", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of sleep per step")
    parser.add_argument("--marker-dir", help="where the once-only markers go (default: next to "
                        "--loss-log)")
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--preemption", action="store_true")
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--always-crash", action="store_true")
    return parser.parse_args()


def once(marker_dir: str, name: str) -> bool:
    """True the first time it is called with ``name`` (across processes), False afterwards."""
    try:
        fd = os.open(os.path.join(marker_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def main() -> None:
    args = parse_args()
    if args.always_crash:
        print("flaky_job: crashing at start", file=sys.stderr, flush=True)
        sys.exit(3)
    marker_dir = args.marker_dir or os.path.dirname(os.path.abspath(args.loss_log))

    import torch

    from async_ckpt import CheckpointEngine

    torch.set_num_threads(1)  # one thread: losses compared across processes agree bit for bit
    g = torch.Generator().manual_seed(7)
    target = torch.randn(8, generator=g, dtype=torch.float64)
    w = torch.zeros(8, dtype=torch.float64)
    with CheckpointEngine(args.ckpt_dir, {"w": w}, keep_last=2, heartbeat_interval=0.5,
                          preemption=args.preemption) as engine, \
            open(args.loss_log, "a") as log:
        start = engine.restore()
        first = 0 if start is None else start + 1
        print(f"flaky_job: pid {os.getpid()} starting at step {first}", file=sys.stderr, flush=True)
        for step in range(first, args.steps):
            if step == args.hang_at and once(marker_dir, f"hang-at-{step}"):
                print(f"flaky_job: hanging at step {step}", file=sys.stderr, flush=True)
                while True:
                    time.sleep(3600)
            if step == args.crash_at and once(marker_dir, f"crash-at-{step}"):
                print(f"flaky_job: crashing at step {step}", file=sys.stderr, flush=True)
                os._exit(1)
            g = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(16, 8, generator=g, dtype=torch.float64)
            y = x @ target + 0.01 * torch.randn(16, generator=g, dtype=torch.float64)
            err = x @ w - y
            loss = (err * err).mean()
            w -= 0.05 * (2.0 / len(y)) * (x.T @ err)
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            log.flush()
            engine.snapshot(step)
            time.sleep(args.step_time)


if __name__ == "__main__":
    main()
