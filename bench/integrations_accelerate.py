"""Accelerate: a save's cost, the adapter's ``snapshot()`` against ``Accelerator.save_state()``
on the same prepared state (method: docs/integrations.md, Accelerate)."""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import time
import warnings

import torch

from .compare import interleaved, summarised
from .markdown import fixed, ms, ratio, section, spread_text, table
from .measure import dir_bytes

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters: 201 MB with AdamW
QUICK = {"width": 512, "layers": 4, "rounds": 2}
SYSTEMS = ("adapter", "save_state")


def _prepared(width: int, layers: int):
    """An Accelerator and the model, AdamW, scheduler and stateful loader it prepared."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    loader = DataLoader(TensorDataset(torch.randn(64, width)), batch_size=8, shuffle=True)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    return accelerator, model, opt, sched, loader


def _train_step(accelerator, model, opt, sched, batches) -> None:
    (x,) = next(batches)
    accelerator.backward(model(x).square().mean())
    opt.step()
    sched.step()
    opt.zero_grad()


def run(root: str, quick: bool) -> dict:
    from accelerate import Accelerator

    from async_ckpt.integrations import accelerate as accelerate_ckpt

    config = QUICK if quick else FULL
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13
        accelerator, model, opt, sched, loader = _prepared(config["width"], config["layers"])
        engine = accelerate_ckpt.engine(accelerator, os.path.join(root, "adapter"), model=model,
                                        optimizer=opt, scheduler=sched, dataloader=loader,
                                        state_dir=os.path.join(root, "adapter-state", "{step}"),
                                        keep_last=2, heartbeat_interval=None)
        batches = (batch for _ in itertools.count() for batch in loader)  # epoch after epoch
        steps = itertools.count(1)

        def save(system: str, n: int) -> dict:
            _train_step(accelerator, model, opt, sched, batches)
            step = next(steps)
            start = time.perf_counter()
            if system == "adapter":
                target = os.path.join(root, "adapter-state", str(step))
                engine.snapshot(step)
                figures = {"adapter_blocking_s": time.perf_counter() - start}
                engine.wait()
                figures["adapter_written_s"] = time.perf_counter() - start
                snapshot = max(glob.glob(os.path.join(engine.root, "step-*")))
                figures["adapter_bytes"] = dir_bytes(target, snapshot)  # a link counted once
            else:  # Accelerate's own (the engine's replaces the accelerator's)
                target = os.path.join(root, "save_state", f"step-{step}")
                Accelerator.save_state(accelerator, target)
                figures = {"save_state_s": time.perf_counter() - start,
                           "save_state_bytes": dir_bytes(target)}
            shutil.rmtree(target)
            return figures

        try:
            _train_step(accelerator, model, opt, sched, batches)  # the optimizer's moments
            state_bytes = sum(t.numel() * t.element_size() for t in
                              [*model.parameters(), *(v for s in opt.state.values()
                                                      for v in s.values() if torch.is_tensor(v))])
            rounds = interleaved("integrations_accelerate", SYSTEMS, config["rounds"], save)
        finally:
            engine.close()
    for r in rounds:
        r.update({f"{s}_bytes_x_state": r[f"{s}_bytes"] / state_bytes for s in SYSTEMS})
    return {"config": config, "state_bytes": state_bytes, "rounds": rounds, **summarised(
        rounds, ["adapter_blocking_s", "adapter_written_s", "save_state_s",
                 *(f"{s}_bytes_x_state" for s in SYSTEMS)],
        {"blocking": ("adapter_blocking_s", "save_state_s")})}


def render(block: dict) -> str:
    f, times = block["figures"], fixed(2, unit="×")
    return section(
        "Accelerate: a save's cost, the adapter against `save_state()`",
        f"{block['state_bytes'] / 1e6:.0f} MB of model and AdamW state, a scheduler and a "
        f"prepared stateful loader; median of {f['save_state_s']['n']} interleaved rounds after a "
        "warm-up (min–max). The adapter's snapshot leaves the directory `save_state()` writes "
        "(`state_dir=`).",
        table(["per save", "adapter `snapshot()`", "`Accelerator.save_state()`", "ratio"], [
            ["training process blocked", ms(f["adapter_blocking_s"]), ms(f["save_state_s"]),
             ratio(block["ratios"]["blocking"], 3)],
            ["directory written after the save",
             f"{ms(f['adapter_written_s'])}, durable (fsync, committed)",
             f"{ms(f['save_state_s'])}, never fsynced", ""],
            ["bytes written per save ÷ state", spread_text(f["adapter_bytes_x_state"], times),
             spread_text(f["save_state_bytes_x_state"], times), ""]]))
