"""The Hugging Face Trainer's checkpoint save, stock against ``AsyncCkptTrainer``.

Per save, the time the training process is blocked in ``Trainer._save_checkpoint``: the stock
Trainer writes ``checkpoint-N/`` (safetensors weights, ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``, ``trainer_state.json``) before returning; ``AsyncCkptTrainer`` returns once the
same state is staged (eager staging, the default: copied; ``staging="lazy"``: the copy started,
the optimizer's next step waits for it), and its writer commits it (fsynced) afterwards, shown
as "save → committed". Same model for all: a GPT-2 built from a config (about 17M parameters:
200 MB of state with AdamW's moments; a tiny one with ``--quick``), one real training step first
so that the optimizer holds its state, ``save_total_limit=2`` on all (the stock rotation runs
inside its save; the adapter's at the next save, with ``engine.drop``). Each figure is the median of interleaved rounds (the order rotating, the
first round a warm-up) with its min-max spread; the ratio is taken round by round. The stock
Trainer does not fsync: its blocking time is to the page cache, the adapter's commit is durable.
"``checkpoint-N`` there after" is its directory's modification time less the wall time at which
the save began; "bytes written" what the save left on disk (``checkpoint-N``, and the adapter's
snapshot: a file linked into both counted once) over the state's bytes.

Self-contained (``run`` and ``render``). Run alone: ``python -m bench.integrations_transformers
[--quick]``.
"""

from __future__ import annotations

import glob
import os
import sys
import time
import warnings

import torch

from .markdown import milliseconds, spread_text, thousandths
from .measure import dir_bytes, log, ratio_spread, rotated, spread, standalone, timed

FULL = {"model": {"n_embd": 512, "n_layer": 4, "n_head": 8, "vocab_size": 8192}, "rounds": 4}
QUICK = {"model": {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512}, "rounds": 2}
KEY = "integrations_transformers"


VARIANTS = {  # name: (label, engine options); None: the stock Trainer
    "stock": ("`Trainer._save_checkpoint` (stock, page cache, no fsync)", None),
    "async": ("`AsyncCkptTrainer._save_checkpoint`", {}),
    "lazy": ("`AsyncCkptTrainer`, `staging=\"lazy\"`", {"staging": "lazy"}),
}


def _trained(output_dir: str, engine_options, model_config: dict):
    """A trainer of the benchmark model after one training step (the optimizer has its state)."""
    from transformers import (GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer,
                              TrainingArguments)

    from async_ckpt.integrations.transformers import AsyncCkptTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, bos_token_id=0, eos_token_id=0,
                                       **model_config))
    tokens = torch.randint(0, model_config["vocab_size"], (4, 32))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir=output_dir, max_steps=1, per_device_train_batch_size=2,
                             save_strategy="no", save_total_limit=2, report_to="none",
                             disable_tqdm=True, use_cpu=True)
    trainer = (Trainer(model=model, args=args, train_dataset=data) if engine_options is None
               else AsyncCkptTrainer(model=model, args=args, train_dataset=data,
                                     async_ckpt_options=engine_options))
    trainer.remove_callback(PrinterCallback)  # stdout holds only the report
    trainer.train()
    return trainer


def _save(name: str, trainer, step: int) -> dict:
    """One save at ``step``: seconds blocked, seconds until ``checkpoint-N`` is there, the bytes
    it wrote (``checkpoint-N`` and the adapter's snapshot, a file linked twice counted once),
    and for the adapter the seconds to its commit and what ``snapshot()`` alone took."""
    trainer.state.global_step = step
    started = time.time()
    blocked = timed(lambda: trainer._save_checkpoint(trainer.model, trial=None))
    engine = getattr(trainer, "checkpoint_engine", None)
    checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
    if engine is None:
        return {f"{name}_s": blocked, f"{name}_files_s": os.stat(checkpoint).st_mtime - started,
                f"{name}_bytes": dir_bytes(checkpoint)}
    committed = blocked + timed(engine.wait)
    figures = engine.stats()["snapshots"][-1]
    snapshot = max(glob.glob(os.path.join(engine.root, "step-*")))  # the newest: 20-digit steps
    return {f"{name}_s": blocked, f"{name}_commit_s": committed,
            f"{name}_snapshot_s": figures["blocking_s"], "state_bytes": figures["raw_bytes"],
            f"{name}_files_s": os.stat(checkpoint).st_mtime - started,
            f"{name}_bytes": dir_bytes(checkpoint, snapshot)}


def run(root: str, quick: bool) -> dict:
    """Build the trainers, measure the rounds; the results block of results.json."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = QUICK if quick else FULL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainers = {name: _trained(os.path.join(root, name), options, config["model"])
                    for name, (_, options) in VARIANTS.items()}
    rounds = []
    try:
        for n in range(config["rounds"]):
            figures = {}
            for name in rotated(list(trainers), n):
                figures.update(_save(name, trainers[name], step=n + 2))
            rounds.append(figures)
            log(f"transformers: round {n + 1}/{config['rounds']}: "
                + ", ".join(f"{name} {figures[f'{name}_s']:.3f} s" for name in VARIANTS))
    finally:
        for trainer in trainers.values():
            if hasattr(trainer, "close_checkpoints"):
                trainer.close_checkpoints()
    measured = rounds[1:] or rounds  # the first round faults in the staging memory
    keys = [key for key in rounds[0] if key.endswith("_s")]
    state = rounds[0]["state_bytes"]
    written = {f"{name}_bytes_x_state": spread([r[f"{name}_bytes"] / state for r in measured])
               for name in VARIANTS}
    return {"config": config, "state_bytes": state, "rounds": rounds,
            "figures": {**{key: spread([r[key] for r in measured]) for key in keys}, **written},
            "ratios": {name: ratio_spread([r[f"{name}_s"] for r in measured],
                                          [r["stock_s"] for r in measured])
                       for name in VARIANTS if name != "stock"}}


def render(results: dict) -> str:
    """The report's section; empty when the results hold no block of this benchmark."""
    block = results.get(KEY)
    if not block:
        return ""
    f, r, mb = block["figures"], block["ratios"], block["state_bytes"] / 1e6

    def cell(key: str) -> str:
        return spread_text(f[key], milliseconds, " ms") if key in f else "–"

    def times(key: str) -> str:
        return spread_text(f[key], lambda v: f"{v:.2f}×") if key in f else "–"

    lines = ["### Hugging Face Trainer: a checkpoint save", "",
             f"GPT-2 from a config with AdamW, {mb:.0f} MB of state; median of "
             f"{f['stock_s']['n']} interleaved rounds after a warm-up (min–max); the ratio is "
             "to the stock save, round by round.", "",
             "| per save | blocks training | ratio | of which `snapshot()` | save → committed "
             "(fsynced) | `checkpoint-N` there after | bytes written ÷ state |",
             "|---|---|---|---|---|---|---|",
             f"| {VARIANTS['stock'][0]} | {cell('stock_s')} | ×1 | | | "
             f"{cell('stock_files_s')} | {times('stock_bytes_x_state')} |"]
    for name, (label, _) in VARIANTS.items():
        if name != "stock":
            lines.append(f"| {label} | {cell(f'{name}_s')} | "
                         f"×{spread_text(r[name], thousandths)} | "
                         f"{cell(f'{name}_snapshot_s')} | {cell(f'{name}_commit_s')} | "
                         f"{cell(f'{name}_files_s')} | {times(f'{name}_bytes_x_state')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(standalone("integrations_transformers", KEY, run, render, __doc__))
