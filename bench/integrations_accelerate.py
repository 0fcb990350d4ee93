"""Accelerate: what a save costs, the adapter against ``save_state()``.

The same prepared training state (an MLP whose parameters and AdamW moments make about 200 MB;
13 MB with ``--quick``, a scheduler, a prepared stateful loader) is saved by both, alternately,
in interleaved rounds (the first round a warm-up, not reported):

* **adapter**: ``engine.snapshot(step)`` of ``async_ckpt.integrations.accelerate`` with
  ``state_dir=``: the time the call blocks (the copy into reused staging memory, and
  Accelerate's own small files: random states, the loader's state); the writer process then
  commits the snapshot and writes save_state's directory from it, durable (fsync) and renamed
  into place;
* **save_state**: Accelerate's own ``Accelerator.save_state(dir)``, which returns once every
  file is written (safetensors for the model, ``torch.save`` for the rest; no fsync, so not yet
  durable).

**Directory written after the save** is the time from the save's start until the directory is
there: for the adapter until ``engine.wait()`` returns (the writer reports a commit once the
snapshot's directory is written), for save_state its own duration. **Bytes written per save ÷
state** is what a save left on disk (the directory, and for the adapter the snapshot's files,
a file linked into both counted once) over the bytes of the parameters and AdamW moments. Each figure is the median of the measured
rounds with its min-max spread; the ratio is taken round by round (``ratio_spread``).
Self-contained (``run`` and ``render``). Run alone:
``python -m bench.integrations_accelerate [--quick]``.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import sys
import time
import warnings

import torch

from .markdown import milliseconds, spread_text, thousandths
from .measure import dir_bytes, log, ratio_spread, rotated, spread, standalone

FULL = {"width": 2048, "layers": 4, "rounds": 4}  # 16.8 M parameters: 201 MB with AdamW
QUICK = {"width": 512, "layers": 4, "rounds": 2}
SYSTEMS = ("adapter", "save_state")


def _prepared(width: int, layers: int):
    """An Accelerator and the model, AdamW, scheduler and stateful loader it prepared, after one
    step (so that the optimizer holds its moments)."""
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
    """Measure the rounds; the results block of results.json."""
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
        rounds, step = [], 0
        try:
            batches = (batch for _ in itertools.count() for batch in loader)  # epoch after epoch
            _train_step(accelerator, model, opt, sched, batches)
            state_bytes = sum(t.numel() * t.element_size() for t in
                              [*model.parameters(), *(v for s in opt.state.values()
                                                      for v in s.values() if torch.is_tensor(v))])
            for n in range(config["rounds"]):
                figures = {}
                for system in rotated(SYSTEMS, n):
                    _train_step(accelerator, model, opt, sched, batches)
                    step += 1
                    if system == "adapter":
                        target = os.path.join(root, "adapter-state", str(step))
                        start = time.perf_counter()
                        engine.snapshot(step)
                        figures["adapter_blocking_s"] = time.perf_counter() - start
                        engine.wait()
                        figures["adapter_written_s"] = time.perf_counter() - start
                        snapshot = max(glob.glob(os.path.join(engine.root, "step-*")))
                        figures["adapter_bytes"] = dir_bytes(target, snapshot)  # links once
                    else:  # Accelerate's own (the engine's replaces the accelerator's)
                        target = os.path.join(root, "save_state", f"step-{step}")
                        start = time.perf_counter()
                        Accelerator.save_state(accelerator, target)
                        figures["save_state_s"] = time.perf_counter() - start
                        figures["save_state_bytes"] = dir_bytes(target)
                    shutil.rmtree(target)
                rounds.append(figures)
                log(f"integrations_accelerate: round {n + 1}/{config['rounds']}: adapter blocks "
                    f"{figures['adapter_blocking_s'] * 1e3:.0f} ms (directory written after "
                    f"{figures['adapter_written_s']:.2f} s), save_state "
                    f"{figures['save_state_s']:.2f} s")
        finally:
            engine.close()
    measured = rounds[1:] or rounds  # the first round allocates the staging memory
    return {"config": config, "state_bytes": state_bytes,
            "figures": {**{key: spread([r[key] for r in measured]) for key in
                           ("adapter_blocking_s", "adapter_written_s", "save_state_s")},
                        **{f"{system}_bytes_x_state": spread([r[f"{system}_bytes"] / state_bytes
                                                             for r in measured])
                           for system in SYSTEMS}},
            "ratios": {"blocking": ratio_spread([r["adapter_blocking_s"] for r in measured],
                                                [r["save_state_s"] for r in measured])},
            "rounds": rounds}


def render(results: dict) -> str:
    """The report's section; empty for results saved before this benchmark existed."""
    block = results.get("integrations_accelerate")
    if not block:
        return ""
    f, r, mb = block["figures"], block["ratios"], block["state_bytes"] / 1e6

    def cell(key: str) -> str:
        return spread_text(f[key], milliseconds, " ms")

    def ratio(key: str) -> str:
        return spread_text(f[key], lambda x: f"{x:.2f}×") if key in f else "–"

    written = (f"{cell('adapter_written_s')}, durable (fsync, committed)"
               if "adapter_written_s" in f else "–")
    return "\n".join([
        "### Accelerate: a save's cost, the adapter against `save_state()`", "",
        f"{mb:.0f} MB of model and AdamW state, a scheduler and a prepared stateful loader; "
        f"median of {f['save_state_s']['n']} interleaved rounds after a warm-up (min–max). The "
        "adapter's snapshot leaves the directory `save_state()` writes (`state_dir=`).", "",
        "| per save | adapter `snapshot()` | `Accelerator.save_state()` | ratio |",
        "|---|---|---|---|",
        f"| training process blocked | {cell('adapter_blocking_s')} | {cell('save_state_s')} | "
        f"×{spread_text(r['blocking'], thousandths)} |",
        f"| directory written after the save | {written} | {cell('save_state_s')}, never "
        "fsynced | |",
        f"| bytes written per save ÷ state | {ratio('adapter_bytes_x_state')} | "
        f"{ratio('save_state_bytes_x_state')} | |"])


if __name__ == "__main__":
    sys.exit(standalone("integrations_accelerate", "integrations_accelerate", run, render, __doc__))
