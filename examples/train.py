"""A complete small training program that resumes exactly where it stopped, after any crash.

    python examples/train.py --ckpt-dir DIR --log FILE [--steps N] [--every K] [--seed S]

Synthetic image-like data with random augmentation, a DataLoader with 2 workers, AdamW with a
warm-up schedule, a GradScaler, dropout, and an EMA model; an asynchronous snapshot every K steps.
Started again after a crash it restores the newest committed snapshot by itself and appends to the
same log, one JSON line per step ({"step", "loss", "lr"}), starting with the first step after the
restored one. Run it twice, once killed and restarted, and `async-ckpt compare-loss` the two logs.

What makes the resumed run the same run:
- every piece of state is registered with the engine (model, optimizer, scheduler, scaler, EMA,
  sampler position); the engine adds the global RNG states (dropout draws from them);
- the sampler's order is a function of (seed, epoch) and its position counts consumed batches;
- augmentation draws from a generator seeded by (seed, epoch, sample index), so it does not depend
  on which worker loads a sample or on worker seeds;
- the DataLoader gets a generator of its own, so creating its iterator does not consume the
  global torch RNG.
"""

import argparse
import json

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset

from async_ckpt import CheckpointEngine
from async_ckpt.data import ResumableSampler, sample_generator

SAMPLES, BATCH, CLASSES = 96, 8, 10


class SyntheticImages(Dataset):
    """3x16x16 images with a class-dependent pattern, augmented per (seed, epoch, index)."""

    def __init__(self, seed: int, sampler: ResumableSampler):
        self.seed, self.sampler = seed, sampler

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, item):
        epoch, index = item
        base = torch.Generator().manual_seed(self.seed * 100003 + index)
        label = index % CLASSES
        image = torch.randn(3, 16, 16, generator=base) * 0.5
        image[label % 3, label:label + 4, :] += 1.0
        g = sample_generator(self.seed, epoch, index)  # augmentation: a function of (epoch, index)
        if torch.rand((), generator=g) < 0.5:
            image = image.flip(-1)
        shift = int(torch.randint(-2, 3, (), generator=g))
        image = image.roll(shift, dims=-2) + 0.05 * torch.randn(image.shape, generator=g)
        return image, label


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, CLASSES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staging", choices=["eager", "lazy"], default="eager")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the same kernels in every run, so results are bit-identical
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=7)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    sampler = ResumableSampler(SAMPLES, shuffle=True, seed=args.seed, batch_size=BATCH,
                               drop_last=True, with_epoch=True)
    loader = DataLoader(SyntheticImages(args.seed, sampler), batch_size=BATCH, sampler=sampler,
                        num_workers=2, generator=torch.Generator())
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
             "ema": ema, "sampler": sampler}

    with CheckpointEngine(args.ckpt_dir, state, every=args.every, keep_last=3,
                          staging=args.staging) as engine, \
            open(args.log, "a") as log:
        restored = engine.restore()
        step = 0 if restored is None else restored + 1
        while step < args.steps:
            for images, labels in loader:
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                scheduler.step()
                ema.update_parameters(model)
                sampler.advance()
                log.write(json.dumps({"step": step, "loss": loss.item(),
                                      "lr": scheduler.get_last_lr()[0]}) + "\n")
                log.flush()
                engine.snapshot(step, force=step == args.steps - 1)
                step += 1
                if step == args.steps:
                    break


if __name__ == "__main__":
    main()
