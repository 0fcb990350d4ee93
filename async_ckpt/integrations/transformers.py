"""Asynchronous checkpoints for the Hugging Face ``transformers.Trainer``.

``AsyncCkptTrainer`` is a ``Trainer`` whose ``_save_checkpoint`` snapshots the model, optimizer,
scheduler, scaler, ``TrainerState`` and the global RNG states into a ``CheckpointEngine`` and
returns once they are staged (one copy into reused memory); the writer process writes and commits
the snapshot, and only then writes ``checkpoint-N/`` through a directory ``Marker``: the files the
stock Trainer writes there (``model.safetensors``, ``optimizer.pt`` and ``scheduler.pt`` made by
the writer from the committed snapshot; the config, generation config, tokenizer,
``training_args.bin``, ``rng_state.pth`` and ``scaler.pt`` by the Trainer's own methods, small)
and a pointer naming the snapshot. ``from_pretrained(checkpoint-N)`` and a stock Trainer
resuming from it work as with the stock Trainer's checkpoints. So ``get_last_checkpoint`` and
``train(resume_from_checkpoint=True)`` only ever see committed steps, and the Trainer's resume
path reads everything back from the snapshot through the load methods overridden here.

Exactness of a resume, measured on the stock Trainer (transformers 5.25, accelerate 1.16): its
mid-epoch resume is bit-exact when the sampler is accelerate's seedable one (the default) and the
data path draws no random numbers. This adapter keeps that, and also makes exact what the stock
resume gets wrong: an epoch's shuffle drawn from the global torch RNG
(``use_seedable_sampler=False``; the RNG as it was at the epoch's start is saved and set before
the resumed loader starts), and a dataset whose randomness depends on the epoch (accelerate's
skipping loader does not pass the epoch on to the dataset; the adapter does). What it cannot
replay (a dataset or collator drawing from the global RNGs, or dataset workers) is warned about
when it happens.

Unsupported set-ups (DeepSpeed, FSDP, several processes, ...) fall back to the Trainer's own
checkpoints, with a warning at construction.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import random
import re
import warnings
from typing import Optional

import numpy as np
import torch

from .. import CheckpointEngine, Derived, Marker, load
from ..errors import (CheckpointError, CorruptSnapshotError, IntegrationError, NoSnapshotError,
                      PointerFileError)
from ..rng import GlobalRNG, check_torch_state
from .directories import files_written_by
from .pointer import POINTER_NAME, pointer_file, read_pointer

SUPPORTED_VERSIONS = ("5.25", "6")  # [lowest tested, first unsupported major)

try:
    import transformers
    from packaging.version import Version
    from transformers import Trainer, TrainerCallback
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
    from transformers.utils import (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
                                    WEIGHTS_INDEX_NAME, WEIGHTS_NAME)
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as e:
    raise IntegrationError(
        f"async_ckpt.integrations.transformers needs transformers >={SUPPORTED_VERSIONS[0]},"
        f"<{SUPPORTED_VERSIONS[1]} and accelerate: pip install 'async_ckpt[transformers]' ({e})"
    ) from e

__all__ = ["AsyncCkptTrainer", "POINTER_NAME", "SUPPORTED_VERSIONS", "default_engine_dir"]

log = logging.getLogger(__name__)

# What an empty state dict makes save_pretrained write, replaced by the snapshot's own weights.
_WEIGHT_FILES = {SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME}
_CHECKPOINT_NAME = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")  # as get_last_checkpoint's
_KEEP_ALL = 2**31 - 1  # the engine keeps every snapshot: the Trainer's save_total_limit decides
_OWNED_OPTIONS = {"every": "save_steps", "keep_last": "save_total_limit",
                  "keep_every": "save_total_limit", "rng": "the adapter (RNG states are saved)"}

# The Trainer methods this module overrides or calls, with the parameters it relies on.
_TRAINER_METHODS = {
    "train": ("resume_from_checkpoint", "trial"),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_scaler": ("checkpoint",),
    "_load_rng_state": ("checkpoint",),
    "_save": ("output_dir", "state_dict"),
    "_save_rng_state": ("output_dir",),
    "_save_scaler": ("output_dir",),
    "_load_best_model": (),
    "_finalize_training": ("trial", "num_train_samples", "start_time"),
    "get_resumed_dataloader": ("dataloader", "num_batches"),
    "_issue_warnings_after_load": ("load_result",),
    "store_flos": (),
}


def _check_transformers() -> None:
    """Refuse a Trainer that lacks a method this adapter overrides or calls (IntegrationError);
    warn when the version is outside the tested range but the methods are all there."""
    changed = []
    for name, params in _TRAINER_METHODS.items():
        method = getattr(Trainer, name, None)
        found = () if method is None else tuple(inspect.signature(method).parameters)[1:]
        if method is None or found[:len(params)] != params:
            changed.append(f"Trainer.{name}({', '.join(params)})")
    if changed:
        raise IntegrationError(
            f"transformers {transformers.__version__}'s Trainer lacks or changed "
            f"{', '.join(changed)}, which AsyncCkptTrainer overrides; it supports transformers "
            f">={SUPPORTED_VERSIONS[0]},<{SUPPORTED_VERSIONS[1]}: install one of those")
    low, high = (Version(v) for v in SUPPORTED_VERSIONS)
    if not low <= Version(transformers.__version__) < high:
        warnings.warn(f"AsyncCkptTrainer was tested with transformers >={low},<{high}, not "
                      f"{transformers.__version__}; the methods it overrides are there, but "
                      "check a resume against an uninterrupted run", RuntimeWarning, stacklevel=3)


_check_transformers()


def default_engine_dir(output_dir: str | os.PathLike) -> str:
    """Where :class:`AsyncCkptTrainer` keeps its snapshots unless told: beside ``output_dir``,
    named after it (``out`` -> ``out.async_ckpt``). Not inside it, so that ``output_dir`` lists
    what the stock Trainer's does (only its ``checkpoint-N``, model and log files), for the
    Trainer's own listings and for every tool or script that lists it."""
    return os.path.abspath(output_dir) + ".async_ckpt"


class AsyncCkptTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints are asynchronous async_ckpt snapshots.

    ``train(resume_from_checkpoint=True)`` resumes from the newest ``checkpoint-N`` whose snapshot
    verifies, falling back past a damaged one with a warning; ``train(resume_from_checkpoint=
    path)`` loads exactly that one or raises its typed error (``CorruptSnapshotError``, ...). A
    ``checkpoint-N`` written by the stock Trainer (no pointer file) is loaded the stock way.

    Args (besides the Trainer's):
        async_ckpt_dir: the engine's directory; default :func:`default_engine_dir`, beside
            ``output_dir``. One per ``output_dir``: its snapshots that no ``checkpoint-N``
            there names are dropped.
        async_ckpt_options: ``CheckpointEngine`` options (``slots``, ``compression``,
            ``reserve_bytes``, ``incremental``, ...). When to save and what to keep are the
            Trainer's (``save_steps``, ``save_total_limit``): ``every``, ``keep_last``,
            ``keep_every`` and ``rng`` are refused.
    """

    def __init__(self, *args, async_ckpt_dir: Optional[str | os.PathLike] = None,
                 async_ckpt_options: Optional[dict] = None, **kwargs):
        options = dict(async_ckpt_options or {})
        owned = sorted(_OWNED_OPTIONS.keys() & options.keys())
        if owned:
            raise ValueError(f"async_ckpt_options {owned} are set by the Trainer's arguments ("
                             f"{', '.join(_OWNED_OPTIONS[k] for k in owned)}); leave them out")
        super().__init__(*args, **kwargs)
        self.async_ckpt_options = options
        self._engine: Optional[CheckpointEngine] = None
        self._resume: Optional[_Resume] = None
        self._last_snapshot_step: Optional[int] = None
        # the model's configs when its files were last written, and those files (see below)
        self._model_files: Optional[tuple[tuple[str, ...], tuple[tuple[str, bytes], ...]]] = None
        self._epoch_start = _EpochStart()
        unsupported = self._unsupported_features()
        if unsupported:
            warnings.warn(f"AsyncCkptTrainer does not cover {', '.join(unsupported)}: checkpoints "
                          "are saved and loaded by the Trainer's own (blocking) code",
                          RuntimeWarning, stacklevel=2)
            self.async_ckpt_dir = None
        else:
            self.async_ckpt_dir = os.path.abspath(
                async_ckpt_dir or default_engine_dir(self.args.output_dir))
            self.add_callback(self._epoch_start)

    def _unsupported_features(self) -> list[str]:
        """What this adapter does not save or load itself: the Trainer's own code does."""
        args = self.args
        return [name for used, name in [
            (self.is_deepspeed_enabled, "DeepSpeed"),
            (self.is_fsdp_enabled or bool(self.is_fsdp_xla_enabled), "FSDP"),
            (args.world_size > 1, f"several processes (world_size={args.world_size})"),
            (is_sagemaker_mp_enabled(), "SageMaker model parallelism"),
            (is_torch_xla_available(), "XLA devices"),
            (self.is_distributed_loading_by_transformers, "a model sharded when loaded (tp_plan)"),
            (args.push_to_hub, "push_to_hub (checkpoints are pushed from their files)"),
            (args.save_only_model, "save_only_model"),
        ] if used]

    @property
    def checkpoint_engine(self) -> Optional[CheckpointEngine]:
        """The engine of the ``train()`` call in progress (or of saves made outside one), for
        ``stats()`` and ``wait()``; None before the first save."""
        return self._engine

    def close_checkpoints(self) -> None:
        """Wait for the saves in flight to commit and stop the writer. ``train()`` does this when
        it returns; call it after saving outside ``train()``."""
        self._close(None)

    def _close(self, error: Optional[BaseException]) -> None:
        """Close the engine (committing what is in flight); after ``error``, a failure to close
        is logged rather than raised over it."""
        engine, self._engine = self._engine, None
        self._last_snapshot_step, self._resume = None, None
        if engine is not None:
            engine.__exit__(None if error is None else type(error), error,
                            None if error is None else error.__traceback__)

    # --- training ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's ``train``; ``resume_from_checkpoint=True`` picks the newest checkpoint
        that can be resumed (see the class). Returns once every save is committed."""
        if self.async_ckpt_dir is not None and resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_resumable_checkpoint() or True  # True: none
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as e:
            self._close(e)
            raise
        self._close(None)
        return output

    def _save_checkpoint(self, model, trial) -> None:
        """Snapshot the training state, returning once it is staged; ``checkpoint-N`` appears
        once step N is committed. Retention runs first, when no save is in flight."""
        if self.async_ckpt_dir is None or trial is not None:
            super()._save_checkpoint(model, trial)
            return
        if self.hp_search_backend is None:
            self.store_flos()
        step = self.state.global_step
        checkpoint = os.path.join(os.path.abspath(self.args.output_dir),
                                  f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self._track_best_checkpoint(step)
        self._export_callback_states()
        trainer_state = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        engine = self._open_engine()
        self._apply_retention_if_idle(engine)
        files = ((TRAINER_STATE_NAME, trainer_state.encode()),
                 pointer_file(self.async_ckpt_dir, checkpoint, step),
                 (SAFE_WEIGHTS_NAME, Derived("safetensors", "model")),
                 (OPTIMIZER_NAME, Derived("torch", "optimizer")),
                 (SCHEDULER_NAME, Derived("torch", "scheduler")), *self._small_stock_files())
        if engine.snapshot(step, force=True, state=self._training_state(trainer_state),
                           markers=[Marker(checkpoint, files=files)]):
            self._last_snapshot_step = step  # else skipped (when_busy="skip"), and logged

    def _small_stock_files(self) -> tuple[tuple[str, bytes], ...]:
        """The files of the Trainer's own checkpoint but the weights, optimizer and scheduler
        (made by the writer from the snapshot), written by the Trainer's own methods and read
        back: the model's config and generation config, the tokenizer or processor and
        ``training_args.bin`` (the model saved with no weights; kept while the model's configs
        stay the same, as saving them costs several milliseconds), ``rng_state.pth`` and
        ``scaler.pt``."""
        configs = tuple(config.to_json_string() for config in (
            getattr(self.model, "config", None), getattr(self.model, "generation_config", None))
            if hasattr(config, "to_json_string"))
        if self._model_files is None or self._model_files[0] != configs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # about the empty state dict it is given
                self._model_files = (configs, files_written_by(
                    lambda directory: self._save(directory, state_dict={}), _WEIGHT_FILES))
        return self._model_files[1] + files_written_by(
            lambda directory: (self._save_rng_state(directory), self._save_scaler(directory)))

    def _open_engine(self) -> CheckpointEngine:
        if self._engine is None:
            self._engine = CheckpointEngine(self.async_ckpt_dir, {}, keep_last=_KEEP_ALL,
                                            rng=False, **self.async_ckpt_options)
        return self._engine

    def _training_state(self, trainer_state: str) -> dict:
        """What a checkpoint holds; its tensors are the live ones, staged by ``snapshot()``."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.lr_scheduler.state_dict(), "trainer_state": trainer_state,
                 "rng": GlobalRNG(), "epoch_start_rng": self._epoch_start.rng_state}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        return state

    def _track_best_checkpoint(self, step: int) -> None:
        """The Trainer's ``best_model_checkpoint`` update, which also counts the checkpoint being
        saved now (its directory appears only once committed)."""
        best = self.state.best_global_step
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH,
                                       SaveStrategy.BEST) and best:
            path = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
            if best == step or os.path.exists(path):
                self.state.best_model_checkpoint = path

    def _export_callback_states(self) -> None:
        """Record the stateful callbacks' states in ``TrainerState``, as the Trainer's save does."""
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, ExportableState):
                name, exported = type(callback).__name__, callback.state()
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(exported)
                else:
                    self.state.stateful_callbacks[name] = exported

    # --- retention --------------------------------------------------------------------------

    def _apply_retention_if_idle(self, engine: CheckpointEngine) -> None:
        """Retention, unless the previous save is still in flight (a disk slower than the save
        interval): then it waits for a later save, so that a save never waits for the disk."""
        if self._last_snapshot_step is not None and (
                self._last_snapshot_step not in engine.committed_steps()):
            return
        engine.wait()  # a commit is reported once its checkpoint-N is written: no race with it
        self._apply_retention(engine)

    def _apply_retention(self, engine: CheckpointEngine) -> None:
        """The Trainer's ``save_total_limit`` over the committed checkpoints, then drop the
        snapshots that no ``checkpoint-N`` names any more (rotated away, deleted by the user or
        the Trainer, or committed by a writer killed before it wrote the directory). A directory
        goes before its snapshot, so no checkpoint-N ever names a dropped snapshot. Never call
        it with a snapshot in flight: its directory is not there yet."""
        rotate_checkpoints(output_dir=self.args.output_dir,
                           save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        named = self._steps_named_in(self.args.output_dir)
        unnamed = [step for step in engine.committed_steps() if step not in named]
        if unnamed:
            engine.drop(unnamed)

    def _steps_named_in(self, output_dir: str) -> set[int]:
        """The steps of this engine's snapshots that a checkpoint-N in ``output_dir`` names."""
        steps = set()
        here = os.path.realpath(self.async_ckpt_dir)
        for checkpoint in _checkpoints_newest_first(output_dir):
            try:
                pointer = read_pointer(checkpoint)
            except PointerFileError:
                continue
            if pointer is not None and os.path.realpath(pointer.directory) == here:
                steps.add(pointer.step)
        return steps

    def _finalize_training(self, trial, num_train_samples, start_time):
        """Wait for the saves in flight (the Trainer's end of training reads the checkpoint
        directories: best model, ``save_total_limit=1``), then apply retention after it."""
        if self._engine is not None:
            self._engine.wait()
        output = super()._finalize_training(trial, num_train_samples, start_time)
        if self._engine is not None:
            self._apply_retention(self._engine)
        return output

    # --- resuming ---------------------------------------------------------------------------

    def _newest_resumable_checkpoint(self) -> Optional[str]:
        """The newest checkpoint-N in ``output_dir`` whose snapshot verifies (or that the stock
        Trainer wrote); a damaged one is skipped with a warning. None when there is none."""
        unusable = []
        for checkpoint in _checkpoints_newest_first(self.args.output_dir):
            try:
                self._resume_state(checkpoint)
                return checkpoint
            except CheckpointError as e:
                if not (e.is_damage or isinstance(e, (NoSnapshotError, PointerFileError))):
                    raise
                reason = f"{checkpoint}: {type(e).__name__}: {e}"
                warnings.warn(f"AsyncCkptTrainer: cannot resume from {reason}; falling back to "
                              "the previous checkpoint", RuntimeWarning, stacklevel=3)
                unusable.append(reason)
        if unusable:
            raise NoSnapshotError(f"no checkpoint in {self.args.output_dir} can be resumed: "
                                  + "; ".join(unusable))
        return None

    def _resume_state(self, checkpoint: Optional[str]) -> Optional[dict]:
        """The snapshot that ``checkpoint`` names, read and checked once per resume (the load
        methods below take their parts from it); None for a checkpoint of the stock Trainer."""
        if self.async_ckpt_dir is None or checkpoint is None:
            return None
        path = os.path.abspath(checkpoint)
        if self._resume is None or self._resume.checkpoint != path:
            state = _read_checkpoint(path)
            if state is None:
                return None
            self._resume = _Resume(path, state)
        return self._resume.state

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        state = self._resume_state(resume_from_checkpoint)
        if state is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        model = self.model if model is None else model
        self._issue_warnings_after_load(model.load_state_dict(state.pop("model"), False))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        state = self._resume_state(checkpoint)
        if state is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self.optimizer.load_state_dict(state.pop("optimizer"))
        self.lr_scheduler.load_state_dict(state.pop("scheduler"))

    def _load_scaler(self, checkpoint) -> None:
        state = self._resume_state(checkpoint)
        if state is None:
            super()._load_scaler(checkpoint)
            return
        scaler, saved = getattr(self.accelerator, "scaler", None), state.pop("scaler", None)
        if scaler is not None and saved is not None:
            scaler.load_state_dict(saved)

    def _load_rng_state(self, checkpoint) -> None:
        """The Trainer calls this where the interrupted run's RNG stood at the save: at the
        epoch's start, or after the first batch past the skipped ones."""
        state = self._resume_state(checkpoint)
        if state is None:
            super()._load_rng_state(checkpoint)
            return
        GlobalRNG().load_state_dict(state["rng"])
        if not self._resume.mid_epoch:  # resumed at an epoch's start: this is that start's RNG
            self._epoch_start.rng_state = torch.get_rng_state()

    def get_resumed_dataloader(self, dataloader, num_batches):
        """The Trainer's loader past the batches already trained, started with the global torch
        RNG of the interrupted epoch's start (see ``_ResumedEpoch``)."""
        loader = super().get_resumed_dataloader(dataloader, num_batches)
        if self._resume is None:
            return loader
        self._resume.mid_epoch = True
        epoch_start_rng = self._resume.state["epoch_start_rng"]
        self._epoch_start.rng_state = epoch_start_rng  # and in this epoch's later snapshots
        if self.args.dataloader_num_workers > 0:
            warnings.warn(
                f"AsyncCkptTrainer resumed mid-epoch with dataloader_num_workers="
                f"{self.args.dataloader_num_workers}: random numbers the dataset draws in its "
                "workers (augmentation) differ from the interrupted run's, because the workers "
                "are re-seeded at the resume and fetch other batches; the shuffle and the "
                f"model's own randomness are replayed. {_PER_SAMPLE_ADVICE}", RuntimeWarning,
                stacklevel=2)
        return _ResumedEpoch(loader, epoch_start_rng)

    def _load_best_model(self) -> None:
        state = None if self.async_ckpt_dir is None else _read_checkpoint(
            self.state.best_model_checkpoint)
        if state is None:
            super()._load_best_model()
            return
        log.info("loading the best model from %s (score: %s)", self.state.best_model_checkpoint,
                 self.state.best_metric)
        self._issue_warnings_after_load(self.model.load_state_dict(state["model"], False))


_PER_SAMPLE_ADVICE = ("To resume bit for bit, draw them from a generator seeded by the sample: "
                      "async_ckpt.data.sample_generator(seed, epoch, index) (the Trainer's loader "
                      "calls the dataset's set_epoch(epoch) when it has one).")


@dataclasses.dataclass
class _Resume:
    """The snapshot being resumed from; the load methods pop what they applied."""

    checkpoint: str  # absolute path of its checkpoint-N
    state: dict
    mid_epoch: bool = False  # the Trainer skips the batches already trained in this epoch


class _EpochStart(TrainerCallback):
    """Keeps the global torch RNG state as it was when the epoch in progress began: the epoch's
    loader draws its workers' base seed, and the shuffle of a sampler without a generator of its
    own, from it. Saved with each snapshot, so that a mid-epoch resume draws them again."""

    def __init__(self):
        self.rng_state: Optional[torch.Tensor] = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.rng_state = torch.get_rng_state()


class _ResumedEpoch:
    """The rest of a resumed epoch: the Trainer's skipping loader, whose iterator starts with the
    global torch RNG set as it was at the interrupted epoch's start, so that it draws the same
    shuffle and workers' seed, and whose ``set_epoch`` reaches the dataset. The Trainer then sets
    the saved RNG after the first batch. If
    fetching that batch drew other random numbers from the global RNGs (a dataset or collator
    that draws them), the data and the model's draws after it differ from the interrupted run's:
    that is warned about, naming the cause."""

    def __init__(self, loader, epoch_start_rng: torch.Tensor):
        self._loader = loader
        self._epoch_start_rng = epoch_start_rng

    def __getattr__(self, name):  # batch_sampler, dataset, ... of the Trainer's loader
        return getattr(self._loader, name)

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch``, and the dataset's: accelerate's skipping loader does not
        forward the epoch to a dataset when its sampler takes one (the seedable sampler, the
        default), so a dataset whose randomness depends on the epoch would draw that of another
        epoch in the rest of a resumed one."""
        self._loader.set_epoch(epoch)
        if hasattr(self._loader.dataset, "set_epoch"):
            self._loader.dataset.set_epoch(epoch)

    def __len__(self):
        return len(self._loader)

    def __iter__(self):
        torch.set_rng_state(self._epoch_start_rng)
        python_before, numpy_before = random.getstate(), np.random.get_state()
        iterator = iter(self._loader)
        try:
            first = next(iterator)
        except StopIteration:
            return
        if (random.getstate() != python_before
                or not _same_numpy_state(np.random.get_state(), numpy_before)
                or not _only_seeds_drawn(self._epoch_start_rng, torch.get_rng_state())):
            warnings.warn("AsyncCkptTrainer resumed mid-epoch, but fetching the first batch drew "
                          "random numbers from the global RNGs (the dataset or the collate "
                          "function draws them: random augmentation, masking): the Trainer's "
                          "loader fetches a batch ahead and sets the RNG back only after it, so "
                          "these draws, and the model's after them, differ from the interrupted "
                          f"run's. {_PER_SAMPLE_ADVICE}", RuntimeWarning, stacklevel=2)
        yield first
        yield from iterator


def _only_seeds_drawn(start: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether the global torch RNG moved from ``start`` to ``now`` by what a loader's iterator
    draws itself: its workers' base seed, and the shuffle seed of a sampler without a generator
    (one 64-bit draw each)."""
    generator = torch.Generator()
    generator.set_state(start)
    for _ in range(2):
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        if torch.equal(generator.get_state(), now):
            return True
    return False


def _same_numpy_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def _checkpoints_newest_first(output_dir: str) -> list[str]:
    """The checkpoint-N directories in ``output_dir``, highest N first (as
    ``get_last_checkpoint`` ranks them)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_NAME.fullmatch(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found, reverse=True)]


def _read_checkpoint(checkpoint: str) -> Optional[dict]:
    """The snapshot ``checkpoint`` names, read and verified, or None when it names none. Raises
    PointerFileError when its pointer is damaged, CorruptSnapshotError when the snapshot is
    damaged or does not match the directory's trainer_state.json, NoSnapshotError when its step
    is not committed."""
    pointer = read_pointer(checkpoint)
    if pointer is None:
        return None
    _, state = load(*pointer)
    kinds = {"model": dict, "optimizer": dict, "scheduler": dict, "trainer_state": str,
             "epoch_start_rng": torch.Tensor}
    wrong = [key for key, kind in kinds.items() if not isinstance(state.get(key), kind)]
    if wrong:
        raise CorruptSnapshotError(f"the snapshot of {checkpoint} has no usable {wrong}: it was "
                                   "not written by AsyncCkptTrainer")
    GlobalRNG.check_state(state.get("rng"))
    check_torch_state(state["epoch_start_rng"], torch.device("cpu"))
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
            same = f.read() == state["trainer_state"]
    except (OSError, ValueError):
        same = False
    if not same:
        raise CorruptSnapshotError(f"{checkpoint}/{TRAINER_STATE_NAME} is missing or differs from "
                                   "the copy in its snapshot")
    return state
