"""A short training run with asynchronous snapshots, then a restore that is checked bit for bit.

    python examples/demo.py [--steps 60] [--every 10] [--dir DIR]

Prints, per snapshot, how long training was blocked and when the snapshot was committed.
"""

import argparse
import copy
import tempfile
import time

import torch
from torch.utils.data import TensorDataset

from async_ckpt import CheckpointEngine
from async_ckpt.data import ResumableLoader

BATCH = 64


def build(dataset: TensorDataset, seed: int = 0) -> dict:
    """The training state: model, optimizer, scheduler, the loader's position and the step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    loader = ResumableLoader(dataset, batch_size=BATCH, shuffle=True, seed=0)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader,
            "progress": {"step": 0}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary "
                        "one, removed at the end)")
    args = parser.parse_args()
    if args.dir is not None:
        run(args, args.dir)
        return
    with tempfile.TemporaryDirectory(prefix="async_ckpt_demo_") as directory:
        run(args, directory)


def run(args: argparse.Namespace, directory: str) -> None:
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(args.steps * BATCH, 1024, generator=generator),
                            torch.randint(0, 10, (args.steps * BATCH,), generator=generator))
    state = build(dataset)
    model, optimizer, scheduler, loader = (state[k] for k in ("model", "optimizer", "scheduler",
                                                              "loader"))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters; checkpoints in {directory}")
    reported = 0

    def report_commits(engine) -> None:
        nonlocal reported
        for record in engine.stats()["snapshots"][reported:]:
            print(f"    committed step {record['step']:4d}: training blocked "
                  f"{record['blocking_s'] * 1e3:6.1f} ms, durable {record['to_commit_s']:.2f} s "
                  f"after snapshot(), {record['stored_bytes'] / 1e6:.0f} MB")
            reported += 1

    with CheckpointEngine(directory, state, every=args.every) as engine:
        for step, (x, y) in enumerate(loader):  # one epoch: --steps batches
            t = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            loader.advance()  # one batch consumed: the snapshot records where the data is
            state["progress"]["step"] = step
            step_time = time.perf_counter() - t
            if engine.snapshot(step):
                print(f"step {step:4d}  loss {loss.item():.4f}  step {step_time * 1e3:5.1f} ms  -> snapshot")
            report_commits(engine)
        engine.close(final_step=args.steps - 1)  # the final state, whatever `every` says
        report_commits(engine)
        print(f"committed steps: {engine.committed_steps()}")
        expected = copy.deepcopy(model.state_dict())

    fresh = build(dataset, seed=1)
    with CheckpointEngine(directory, fresh) as engine:
        restored = engine.restore()
    identical = all(torch.equal(expected[k], v) for k, v in fresh["model"].state_dict().items())
    print(f"restored step {restored} into a fresh model: "
          f"{'bit-identical' if identical else 'DIFFERENT'} to the trained one")
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
