"""A Hugging Face Trainer run for tests/test_integration_transformers.py: a tiny GPT-2 built from a
config (dropout on), an in-memory dataset of 48 token sequences (12 steps an epoch, 3 epochs)
whose augmentation draws from a generator seeded by the sample, shuffled by a sampler that draws
each epoch's order from the global torch RNG (``use_seedable_sampler=False``: the case the stock
Trainer does not resume exactly), AsyncCkptTrainer saving every 5 steps, and
``train(resume_from_checkpoint=True)`` whenever a checkpoint exists.

Appends ``{"step", "loss", "lr", "grad_norm"}`` per step to --log.

Usage: hf_trainer.py --output-dir DIR --log FILE [--freeze-writer-at N]
  --freeze-writer-at N: stop the writer just before the save of step N, and SIGKILL the whole
  process group right after that save returns: a kill while a save is in flight.
"""

import argparse
import json
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built here
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import psutil
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments)
from transformers.trainer_utils import get_last_checkpoint

from async_ckpt.data import sample_generator
from async_ckpt.integrations.transformers import AsyncCkptTrainer

SAVE_STEPS, STEPS = 5, 36
THREADS = 1  # the tiny model gains nothing from more; on a loaded machine they stall each other


class TokenData(torch.utils.data.Dataset):
    """Fixed token sequences; each sample's augmentation (tokens masked to 0) is drawn from a
    generator seeded by (epoch, index), so it is the same after a resume."""

    def __init__(self, n: int = 48, length: int = 16, vocab: int = 64):
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (n, length), generator=generator)
        self.epoch = 0

    def set_epoch(self, epoch: int):  # called by the Trainer's loader at each epoch
        self.epoch = epoch

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        ids = self.tokens[i].clone()
        ids[torch.rand(len(ids), generator=sample_generator(0, self.epoch, i)) < 0.1] = 0
        return {"input_ids": ids, "labels": self.tokens[i]}


class GlobalRNGTokenData(TokenData):
    """The same data, with augmentation drawn from the global torch RNG: not replayable."""

    def __getitem__(self, i):
        ids = self.tokens[i].clone()
        ids[torch.rand(len(ids)) < 0.1] = 0
        return {"input_ids": ids, "labels": self.tokens[i]}


class LossLog(TrainerCallback):
    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"],
                                    "lr": logs["learning_rate"],
                                    "grad_norm": logs["grad_norm"]}) + "\n")


def build_trainer(output_dir: str, trainer_class=AsyncCkptTrainer, log=None, data=TokenData,
                  engine_options=None, **arguments):
    """The tiny GPT-2 and its Trainer; ``arguments`` override the TrainingArguments below,
    ``engine_options`` are AsyncCkptTrainer's ``async_ckpt_options``."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                       n_positions=16, bos_token_id=0, eos_token_id=0))
    settings = dict(per_device_train_batch_size=4, num_train_epochs=3, save_steps=SAVE_STEPS,
                    logging_steps=1, learning_rate=1e-3, seed=42, report_to="none",
                    disable_tqdm=True, use_cpu=True,
                    accelerator_config={"use_seedable_sampler": False})
    args = TrainingArguments(output_dir=output_dir, **{**settings, **arguments})
    extra = {} if engine_options is None else {"async_ckpt_options": engine_options}
    return trainer_class(model=model, args=args, train_dataset=data(), eval_dataset=TokenData(8),
                         callbacks=[LossLog(log)] if log else None, **extra)


class FreezingTrainer(AsyncCkptTrainer):
    """Stops the writer before the save of step ``freeze_at`` and kills everything after it."""

    freeze_at = None

    def _save_checkpoint(self, model, trial):
        freezing = self.state.global_step == self.freeze_at
        if freezing:
            self.checkpoint_engine.wait()  # the earlier saves are whole: only this one is cut
            for child in psutil.Process().children():
                os.kill(child.pid, signal.SIGSTOP)
        super()._save_checkpoint(model, trial)
        if freezing:
            os.killpg(0, signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--freeze-writer-at", type=int)
    options = parser.parse_args()
    torch.set_num_threads(THREADS)
    FreezingTrainer.freeze_at = options.freeze_writer_at
    trainer = build_trainer(options.output_dir, FreezingTrainer, options.log)
    resume = os.path.isdir(options.output_dir) and get_last_checkpoint(options.output_dir)
    trainer.train(resume_from_checkpoint=True if resume else None)


if __name__ == "__main__":
    main()
