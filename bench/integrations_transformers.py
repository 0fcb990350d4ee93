"""The Hugging Face Trainer's checkpoint save, stock against ``AsyncCkptTrainer`` (eager and lazy
staging) on a GPT-2 built from a config (method: docs/integrations.md, Hugging Face, "Cost").
The stock Trainer does not fsync: its time is to the page cache, the adapter's commit durable."""

from __future__ import annotations

import glob
import os
import time
import warnings

import torch

from .compare import interleaved, summarised
from .markdown import fixed, ms, ratio, section, spread_text, table
from .measure import dir_bytes, timed

FULL = {"model": {"n_embd": 512, "n_layer": 4, "n_head": 8, "vocab_size": 8192}, "rounds": 4}
QUICK = {"model": {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512}, "rounds": 2}


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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = QUICK if quick else FULL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainers = {name: _trained(os.path.join(root, name), options, config["model"])
                    for name, (_, options) in VARIANTS.items()}
    try:
        rounds = interleaved("integrations_transformers", list(VARIANTS), config["rounds"],
                             lambda name, n: _save(name, trainers[name], step=n + 2))
    finally:
        for trainer in trainers.values():
            if hasattr(trainer, "close_checkpoints"):
                trainer.close_checkpoints()
    state = rounds[0]["state_bytes"]
    for r in rounds:
        r.update({f"{name}_bytes_x_state": r[f"{name}_bytes"] / state for name in VARIANTS})
    return {"config": config, "state_bytes": state, "rounds": rounds, **summarised(
        rounds, [key for key in rounds[0] if key.endswith(("_s", "_x_state"))],
        {name: (f"{name}_s", "stock_s") for name in VARIANTS if name != "stock"})}


def render(block: dict) -> str:
    f, times = block["figures"], fixed(2, unit="×")
    rows = [[VARIANTS["stock"][0], ms(f["stock_s"]), "×1", "", "", ms(f["stock_files_s"]),
             spread_text(f["stock_bytes_x_state"], times)]]
    rows += [[label, ms(f[f"{name}_s"]), ratio(block["ratios"][name], 3),
              ms(f[f"{name}_snapshot_s"]), ms(f[f"{name}_commit_s"]), ms(f[f"{name}_files_s"]),
              spread_text(f[f"{name}_bytes_x_state"], times)]
             for name, (label, _) in VARIANTS.items() if name != "stock"]
    return section(
        "Hugging Face Trainer: a checkpoint save",
        f"GPT-2 from a config with AdamW, {block['state_bytes'] / 1e6:.0f} MB of state; median of "
        f"{f['stock_s']['n']} interleaved rounds after a warm-up (min–max); the ratio is to the "
        "stock save, round by round.",
        table(["per save", "blocks training", "ratio", "of which `snapshot()`",
               "save → committed (fsynced)", "`checkpoint-N` there after",
               "bytes written ÷ state"], rows))
