"""Asynchronous checkpoints for Hugging Face Accelerate training loops.

``accelerator.save_state()`` writes every prepared object to disk before it returns, and a
prepared loader resumed from its state redraws its shuffle and worker seeds from wherever the
random number generators happen to be. ``engine(accelerator, directory, model=..., optimizer=...,
scheduler=..., dataloader=...)`` returns an :class:`AccelerateEngine`, a ``CheckpointEngine``
over those objects: ``snapshot(step)`` copies them once into reused staging memory and returns
while a writer process commits them; ``restore()`` loads them all back and makes the prepared
loader continue with exactly the next batch and the random numbers of an uninterrupted run.

How the loader resumes exactly (Accelerate's prepared loader, ``DataLoaderShard``, wraps a
torchdata ``StatefulDataLoader`` when ``DataLoaderConfiguration(use_stateful_dataloader=True)``):

* its ``state_dict()`` counts the batches it yielded, not the one it has already fetched ahead
  (Accelerate's own correction; checked at import);
* an iteration starts by drawing from the random state: a seed for its workers, and the shuffle
  of a sampler without a generator of its own. A resumed iteration draws again, at another point
  of the random streams: its remaining order would differ and every later random draw (dropout)
  would shift. The engine notes the random state each iteration of the loader starts from and
  saves it; the first iteration after a mid-epoch restore starts from that saved state, skips
  Accelerate's start-of-iteration synchronisation of the ranks' generators (the saved state was
  synchronised when it was taken), and once it has fetched its first batch it hands back the
  random state it found, so training continues exactly where the snapshot was taken.

Each snapshot can also leave, once committed, the directory ``accelerator.save_state(dir)``
writes (``state_dir=``, or by default with Accelerate's automatic checkpoint naming): the models,
optimizers, schedulers and custom objects made by the writer from the committed snapshot,
Accelerate's small files (random states, scaler, loader states) written by its own
``save_accelerator_state`` at the snapshot, and a pointer to the snapshot; a stock
``load_state(dir)`` reads it. While the engine is open, the accelerator's ``save_state`` and
``load_state`` are the engine's (instance attributes; ``close()`` removes them).

This module is the only one that imports Accelerate; importing it checks that the installed
version is in ``SUPPORTED`` and that the private behaviour above is there (``IntegrationError``,
or a warning for a newer, untested major version).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import warnings
from typing import Any, Iterator, Optional, Sequence, Union

import accelerate
import torch
from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import (OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, WEIGHTS_NAME,
                              DistributedType)
from packaging.version import Version

from .. import Derived, Marker
from ..engine import CheckpointEngine
from ..errors import InvalidArgumentError, IntegrationError, NoSnapshotError
from .directories import files_written_by
from .pointer import pointer_file, read_pointer

__all__ = ["AccelerateEngine", "SUPPORTED", "engine"]

SUPPORTED = ("1.16", "2")  # tested with 1.16; [first, before)

# Strategies whose state a rank does not hold whole, or that save it their own way.
_REFUSED = {
    DistributedType.FSDP: "FSDP shards the model and optimizer state",
    DistributedType.DEEPSPEED: "DeepSpeed saves its engine's state itself",
    DistributedType.MEGATRON_LM: "Megatron-LM saves its model's state itself",
    DistributedType.XLA: "XLA tensors cannot be staged here",
}


_SAVE_ACCELERATOR_STATE = ("output_dir", "model_states", "optimizers", "schedulers",
                           "dataloaders", "process_index", "step", "scaler")
# Accelerate's names, in save_accelerator_state and save_custom_state
_CUSTOM_FILE = "custom_checkpoint_{}.pkl"
_AUTOMATIC_DIR = re.compile(r"checkpoint_([0-9]+)")  # what save_state names checkpoint_{iteration}


def _check_accelerate() -> None:
    """Refuse an Accelerate this adapter was not tested with, or one without what it relies on."""
    version, (first, before) = Version(accelerate.__version__), map(Version, SUPPORTED)
    if version < first:
        raise IntegrationError(
            f"async_ckpt.integrations.accelerate supports accelerate>={first},<{before}; "
            f"{version} is installed: upgrade it (pip install 'async_ckpt[accelerate]')")
    if version >= before:
        warnings.warn(f"async_ckpt.integrations.accelerate was tested with accelerate>={first},"
                      f"<{before}; {version} is installed: check that resumes stay exact",
                      RuntimeWarning, stacklevel=3)
    missing = []
    if "adjust_state_dict_for_prefetch" not in vars(DataLoaderShard):
        missing.append("DataLoaderShard.adjust_state_dict_for_prefetch (without it a stateful "
                       "loader's state counts the batch fetched ahead under several processes)")
    try:
        source = inspect.getsource(DataLoaderShard.__iter__)
    except (OSError, TypeError):  # no source installed: the check below cannot be made
        source = "self.base_dataloader.__iter__()"
    if "self.base_dataloader.__iter__()" not in source:
        missing.append("DataLoaderShard.__iter__ calling self.base_dataloader.__iter__() (where "
                       "the engine notes the random state an iteration starts from)")
    if not hasattr(Accelerator, "register_for_checkpointing"):
        missing.append("Accelerator.register_for_checkpointing")
    if tuple(inspect.signature(save_accelerator_state).parameters)[:8] != _SAVE_ACCELERATOR_STATE:
        missing.append(f"accelerate.checkpointing.save_accelerator_state("
                       f"{', '.join(_SAVE_ACCELERATOR_STATE)}, ...) (which writes the small files "
                       "of a save_state directory)")
    if missing:
        raise IntegrationError(f"accelerate {version} lacks what async_ckpt.integrations."
                               f"accelerate relies on: {'; '.join(missing)}. Install "
                               f"accelerate>={first},<{before}")


_check_accelerate()


def engine(accelerator: Accelerator, directory, *, model=None, optimizer=None, scheduler=None,
           dataloader=None, state_dir: Union[None, bool, str, os.PathLike] = None,
           **options) -> "AccelerateEngine":
    """An ``AccelerateEngine`` in ``directory`` over what ``accelerator`` prepared.

    ``model``, ``optimizer``, ``scheduler`` and ``dataloader`` are the objects
    ``accelerator.prepare()`` returned, each one object or a list of them (saved as ``model``,
    ``model_1``, ...). Saved with them: ``accelerator.scaler`` (the GradScaler of fp16 mixed
    precision), every object given to ``accelerator.register_for_checkpointing`` (as
    ``custom_0``, ...), ``accelerator.step`` (its gradient-accumulation counter), and each
    loader's position with the random state its iteration started from; the global RNG states
    as with any engine. Models are saved unwrapped (``accelerator.unwrap_model``), optimizers
    and schedulers as the torch objects inside Accelerate's wrappers.

    ``state_dir``: where each snapshot also leaves, once committed, a directory as
    ``accelerator.save_state(dir)`` writes it (``model.safetensors``, ``optimizer.bin``, ...;
    the writer process writes it): a path in which ``{step}`` is replaced by the snapshot's step;
    by default, with ``ProjectConfiguration(automatic_checkpoint_naming=True)``, save_state's own
    ``project_dir/checkpoints/checkpoint_{iteration}`` (counting ``iteration`` and applying
    ``total_limit`` as save_state does); ``False`` or, without automatic naming, None: none.
    While the engine is open, ``accelerator.save_state()`` and ``load_state()`` are the
    engine's (``AccelerateEngine.save_state``). Both need one process and every prepared model,
    optimizer and scheduler given here (``IntegrationError`` otherwise when ``state_dir`` is
    given, a warning when automatic naming asked for it).

    ``**options`` are ``CheckpointEngine``'s. ``keep_last`` defaults to
    ``ProjectConfiguration(total_limit=...)`` when that is set. With several processes (DDP)
    every rank runs an engine on the same directory, and the models, optimizers, schedulers and
    scaler are declared ``replicated`` (written once, checked identical on every rank) unless
    ``replicated=`` is given. FSDP, DeepSpeed, Megatron-LM and XLA are refused
    (``IntegrationError``).
    """
    refused = _REFUSED.get(accelerator.distributed_type)
    if refused is not None:
        raise IntegrationError(
            f"async_ckpt.integrations.accelerate does not support {accelerator.distributed_type}"
            f" ({refused}): use accelerator.save_state(), or register DCP's get_state_dict() "
            "with a CheckpointEngine (README, 'Sharded models')")
    models, optimizers, schedulers = _listed(model), _listed(optimizer), _listed(scheduler)
    state: dict[str, Any] = {}
    state.update(_named("model", [accelerator.unwrap_model(m) for m in models]))
    state.update(_named("optimizer", [o.optimizer if isinstance(o, AcceleratedOptimizer) else o
                                      for o in optimizers]))
    state.update(_named("scheduler", [s.scheduler if isinstance(s, AcceleratedScheduler) else s
                                      for s in schedulers]))
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    replicated = list(state)  # what DDP keeps identical on every rank
    custom = getattr(accelerator, "_custom_objects", None)
    if custom is None:
        raise IntegrationError("this Accelerator has no _custom_objects (the objects given to "
                               "register_for_checkpointing): install accelerate"
                               f">={SUPPORTED[0]},<{SUPPORTED[1]}")
    state.update({f"custom_{i}": obj for i, obj in enumerate(custom)})
    counters = {"step": accelerator.step}
    state["accelerator"] = counters
    layout = _SaveStateLayout.of(accelerator, directory, models, optimizers, schedulers,
                                 state_dir)
    total_limit = accelerator.project_configuration.total_limit
    if total_limit is not None:
        options.setdefault("keep_last", total_limit)
    if accelerator.num_processes > 1:
        options.setdefault("replicated", replicated)
    positions: list[_LoaderPosition] = []
    try:
        for loader in _listed(dataloader):
            positions.append(_LoaderPosition(loader, accelerator))
        state.update(_named("dataloader", positions))
        return AccelerateEngine(directory, state, accelerator=accelerator, positions=positions,
                                counters=counters, layout=layout, **options)
    except BaseException:
        for position in positions:
            position.unhook()
        raise


def _listed(objects) -> list:
    if objects is None:
        return []
    return list(objects) if isinstance(objects, (list, tuple)) else [objects]


def _named(name: str, objects: Sequence) -> dict:
    """Accelerate's naming of several objects of a kind: ``name``, ``name_1``, ``name_2``, ..."""
    return {_nth(name, i): obj for i, obj in enumerate(objects)}


def _nth(name: str, i: int) -> str:
    return name if i == 0 else f"{name}_{i}"


class _SaveStateLayout:
    """What the directories of ``accelerator.save_state`` need: where ``snapshot()`` puts them
    (``template``, ``automatic``), or why they cannot be written (``refused``)."""

    def __init__(self, accelerator: Accelerator, template: Optional[str], automatic: bool,
                 refused: Optional[str]):
        self.accelerator, self.template, self.automatic, self.refused = (
            accelerator, template, automatic, refused)

    @classmethod
    def of(cls, accelerator: Accelerator, directory, models: list, optimizers: list,
           schedulers: list, state_dir) -> "_SaveStateLayout":
        project = accelerator.project_configuration
        automatic = state_dir is None and project.automatic_checkpoint_naming
        template = None
        if state_dir not in (None, False):
            template = os.path.abspath(os.fspath(state_dir))
            try:
                template.format(step=0)
            except (KeyError, IndexError, ValueError) as e:
                raise InvalidArgumentError(f"state_dir={state_dir!r} is a path in which only "
                                           f"{{step}} is replaced ({type(e).__name__}: {e})")
        refused = _why_not_save_state(accelerator, directory, models, optimizers, schedulers)
        if refused is not None and template is not None:
            raise IntegrationError(f"state_dir= cannot be written: {refused}")
        if refused is not None and automatic:
            warnings.warn(f"ProjectConfiguration(automatic_checkpoint_naming=True): the engine "
                          f"writes no checkpoint_N directories, and accelerator.save_state() "
                          f"stays Accelerate's own: {refused}", RuntimeWarning, stacklevel=3)
            automatic = False
        return cls(accelerator, template, automatic, refused)

    @property
    def checkpoints(self) -> str:
        """Where save_state's automatic naming puts its ``checkpoint_N`` directories."""
        return os.path.abspath(os.path.join(self.accelerator.project_dir or ".", "checkpoints"))

    def snapshot_directory(self, step: int) -> Optional[str]:
        """Where the snapshot of ``step`` leaves its directory; None: nowhere."""
        if self.automatic:
            return self.automatic_directory()
        return None if self.template is None else self.template.format(step=step)

    def save_state_directory(self, output_dir) -> str:
        """Where ``save_state(output_dir)`` leaves its directory, as Accelerate's decides."""
        if self.refused is not None:
            raise IntegrationError(f"save_state() cannot write its directory: {self.refused}")
        if self.accelerator.project_configuration.automatic_checkpoint_naming:
            return self.automatic_directory()
        if output_dir is None:
            raise InvalidArgumentError("save_state() needs an output_dir without "
                                       "ProjectConfiguration(automatic_checkpoint_naming=True)")
        return os.path.abspath(os.path.expanduser(os.fspath(output_dir)))

    def automatic_directory(self) -> str:
        """save_state's ``checkpoints/checkpoint_{iteration}``, which must not exist yet (and
        ``checkpoints/`` made now, as save_state makes it)."""
        os.makedirs(self.checkpoints, exist_ok=True)
        path = os.path.join(self.checkpoints,
                            f"checkpoint_{self.accelerator.project_configuration.iteration}")
        if os.path.exists(path):
            raise InvalidArgumentError(
                f"Checkpoint directory {path} already exists: set accelerator."
                "project_configuration.iteration to the iteration to go on from (as "
                "Accelerator.save_state asks)")
        return path

    def continue_count(self) -> None:
        """With automatic naming, go on counting past the ``checkpoint_N`` already there (a
        resumed run), where save_state would refuse to save until told the iteration."""
        project = self.accelerator.project_configuration
        found = self._automatic_directories() if project.automatic_checkpoint_naming else []
        if found:
            project.iteration = max(project.iteration, found[-1][0] + 1)

    def newest(self) -> Optional[str]:
        """The ``checkpoint_N`` of the highest N in ``checkpoints`` (what save_state's automatic
        naming made), None when there is none."""
        found = self._automatic_directories()
        return found[-1][1] if found else None

    def _automatic_directories(self) -> list[tuple[int, str]]:
        """The ``checkpoint_N`` directories, lowest N first."""
        if not os.path.isdir(self.checkpoints):
            return []
        found = []
        for name in os.listdir(self.checkpoints):
            match = _AUTOMATIC_DIR.fullmatch(name)
            path = os.path.join(self.checkpoints, name)
            if match and os.path.isdir(path) and not os.path.islink(path):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def make_room(self, in_flight: int, room: int) -> None:
        """save_state's ``total_limit``: delete the oldest ``checkpoint_N`` so that those there,
        those of the ``in_flight`` saves and ``room`` more stay within the limit (a directory is
        deleted once written: with more saves in flight than that, there are more for a while);
        with no save in flight, also what a writer killed while writing one left (``.checkpoint_N``
        siblings, which save_state's own listing would take for checkpoints)."""
        if in_flight == 0 and os.path.isdir(self.checkpoints):
            for name in os.listdir(self.checkpoints):
                if name.startswith(".checkpoint_"):
                    shutil.rmtree(os.path.join(self.checkpoints, name), ignore_errors=True)
        limit = self.accelerator.project_configuration.total_limit
        if limit is None:
            return
        found = self._automatic_directories()
        for _, path in found[:max(0, len(found) + in_flight + room - limit)]:
            shutil.rmtree(path)

    def files(self, engine: "AccelerateEngine", directory: str, step: int,
              safe_serialization: bool) -> tuple:
        """The (name, content) pairs of the directory ``save_state(directory)`` would write now:
        the models, optimizers, schedulers and custom objects made by the writer from the
        snapshot of ``step``; the rest written now by Accelerate's own ``save_accelerator_state``
        (random states, scaler, loaders' states) and save-state hooks, small; and the pointer
        to the snapshot."""
        accelerator = self.accelerator
        hooks = list(accelerator._save_model_state_pre_hook.values())
        weights = [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models] \
            if hooks else []
        given = list(weights)

        def write(scratch: str) -> None:
            for hook in hooks:  # a hook may save a model its own way, taking it out of weights
                hook(accelerator._models, weights, scratch)
            save_accelerator_state(
                scratch, [], [], [], accelerator._dataloaders, accelerator.state.process_index,
                accelerator.step, accelerator.scaler,
                save_on_each_node=accelerator.project_configuration.save_on_each_node)

        small = files_written_by(write)
        kept = ([i for i, w in enumerate(given) if any(w is x for x in weights)] if hooks
                else range(len(accelerator._models)))
        weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
        files: list = [(weights_name if n == 0 else weights_name.replace(".", f"_{n}."),
                        Derived("safetensors" if safe_serialization else "torch", _nth("model", i)))
                       for n, i in enumerate(kept)]
        files += [(f"{_nth(OPTIMIZER_NAME, i)}.bin", Derived("torch", _nth("optimizer", i)))
                  for i in range(len(accelerator._optimizers))]
        files += [(f"{_nth(SCHEDULER_NAME, i)}.bin", Derived("torch", _nth("scheduler", i)))
                  for i in range(len(accelerator._schedulers))]
        files += [(_CUSTOM_FILE.format(i), Derived("torch", f"custom_{i}"))
                  for i in range(len(accelerator._custom_objects))]
        return (*files, *small, pointer_file(engine.directory, directory, step))


def _why_not_save_state(accelerator: Accelerator, directory, models: list, optimizers: list,
                        schedulers: list) -> Optional[str]:
    """Why this engine cannot write save_state's directories: None when it can."""
    if accelerator.num_processes > 1:
        return (f"with {accelerator.num_processes} processes every rank's writer would write the "
                "same directory (call Accelerator.save_state(accelerator, dir) for it)")
    lists = {"model": "_models", "optimizer": "_optimizers", "scheduler": "_schedulers"}
    for (kind, attribute), given in zip(lists.items(), (models, optimizers, schedulers)):
        prepared = getattr(accelerator, attribute, None)
        if prepared is None:
            return f"this Accelerator has no {attribute}: install accelerate>={SUPPORTED[0]}"
        if len(prepared) != len(given) or any(a is not b for a, b in zip(prepared, given)):
            return (f"load_state() loads every {kind} accelerator.prepare() returned, in order: "
                    f"give them all as {kind}=[...] ({len(prepared)} prepared, {len(given)} "
                    "given)")
    wrapped = [i for i, m in enumerate(models) if accelerator.unwrap_model(m) is not m]
    if wrapped:
        return (f"model {wrapped[0]} is wrapped (torch.compile, DDP): save_state saves the "
                "wrapper's state dict, whose names the unwrapped model saved here lacks")
    if not hasattr(accelerator, "_save_model_state_pre_hook"):
        return f"this Accelerator has no save-state hooks: install accelerate>={SUPPORTED[0]}"
    checkpoints = os.path.realpath(os.path.join(accelerator.project_dir or ".", "checkpoints"))
    if (accelerator.project_configuration.automatic_checkpoint_naming
            and os.path.dirname(os.path.realpath(os.fspath(directory))) == checkpoints):
        return (f"the engine's directory is in {checkpoints}, where load_state() would take it "
                "for a checkpoint_N: put it elsewhere")
    if "save_state" in vars(accelerator):
        return "another open engine has this Accelerator's save_state(): close that one first"
    return None


class AccelerateEngine(CheckpointEngine):
    """A ``CheckpointEngine`` over an Accelerator's prepared objects; made by :func:`engine`.

    ``snapshot(step)`` and ``restore()`` are the engine's; ``restore()`` also sets
    ``accelerator.step`` and the loaders' positions, and ``epoch`` says which epoch the training
    loop continues in. Snapshots leave save_state's directories where ``state_dir`` says, and
    ``save_state()``/``load_state()`` (the accelerator's, while the engine is open) take
    Accelerate's arguments. ``close()`` also gives the loaders back their own ``__iter__`` and
    the accelerator its own ``save_state``/``load_state``."""

    def __init__(self, directory, state, *, accelerator: Accelerator,
                 positions: list["_LoaderPosition"], counters: dict, layout: _SaveStateLayout,
                 **options):
        super().__init__(directory, state, **options)
        self._accelerator, self._positions, self._counters = accelerator, positions, counters
        self._layout = layout
        self._automatic = False  # it wrote checkpoint_N directories: total_limit applies
        committed = self.committed_steps()
        self._last_step = committed[-1] if committed else None  # of the newest snapshot
        if layout.refused is None:  # code written for Accelerate's own save_state gets this one
            accelerator.save_state, accelerator.load_state = self.save_state, self.load_state
            layout.continue_count()

    @property
    def epoch(self) -> int:
        """The epoch the training loop continues in: the first loader's epoch at the restored
        snapshot, or the next one when the snapshot was taken after that epoch's last batch; 0
        before any restore or without a loader. Loop as ``for epoch in range(engine.epoch, n)``."""
        return self._positions[0].resume_epoch if self._positions else 0

    def snapshot(self, step: int, *, force: bool = False) -> bool:
        """Take a snapshot tagged ``step`` (the global step: ``accelerator.step`` counts micro
        steps, and is saved too); see ``CheckpointEngine.snapshot``. Once committed, it leaves
        save_state's directory where ``state_dir`` says."""
        taken = force or step % self.options.every == 0  # else no directory to prepare
        directory = self._layout.snapshot_directory(step) if taken else None
        return self._snapshot(step, directory, force=force)

    def save_state(self, output_dir=None, safe_serialization: bool = True,
                   **save_model_func_kwargs) -> str:
        """``Accelerator.save_state`` through the engine: a snapshot (its step one past the
        newest one's) that leaves ``output_dir`` (with automatic checkpoint naming,
        ``checkpoints/checkpoint_{iteration}``) as save_state writes it, once committed; returns
        once staged, with the directory's path. ``wait()`` waits for the directory.
        ``save_model_func_kwargs`` are DeepSpeed's, which the engine refuses: ignored."""
        directory = self._layout.save_state_directory(output_dir)
        step = 0 if self._last_step is None else self._last_step + 1
        self._snapshot(step, directory, force=True, safe_serialization=safe_serialization)
        return directory

    def _snapshot(self, step: int, directory: Optional[str], *, force: bool,
                  safe_serialization: bool = True) -> bool:
        self._counters["step"] = self._accelerator.step
        for position in self._positions:
            position.warn_if_inexact()
        layout, markers = self._layout, []
        automatic = directory is not None and os.path.dirname(directory) == layout.checkpoints
        if automatic:
            self._automatic = True
            layout.make_room(self.stats()["in_flight"], room=1)
        if directory is not None:
            markers.append(Marker(directory, files=layout.files(self, directory, step,
                                                                safe_serialization)))
        taken = super().snapshot(step, force=force, markers=markers)
        if taken:
            self._last_step = step
            if automatic:  # save_state counts its saves so
                self._accelerator.project_configuration.iteration += 1
        return taken

    def load_state(self, input_dir=None, load_kwargs: Optional[dict] = None,
                   **load_model_func_kwargs) -> None:
        """``Accelerator.load_state`` through the engine: waits for the saves in flight; a
        directory this engine wrote (its pointer names one of its committed snapshots) is
        restored from that snapshot, checked, the loaders exactly where they were (``restore``);
        any other directory, or one given Accelerate's load options or load-state hooks, by
        Accelerate's own load_state from its files. ``input_dir`` None: the newest
        ``checkpoint_N`` with automatic checkpoint naming, as Accelerate's."""
        self.wait()
        if input_dir is None and self._accelerator.project_configuration \
                .automatic_checkpoint_naming:
            input_dir = self._layout.newest()
            if input_dir is None:
                raise NoSnapshotError(f"no checkpoint_N in {self._layout.checkpoints} to load")
        pointer = None if input_dir is None else read_pointer(os.path.expanduser(input_dir))
        if (pointer is not None and not (load_kwargs or load_model_func_kwargs
                                         or self._accelerator._load_model_state_pre_hook)
                and os.path.realpath(pointer.directory) == os.path.realpath(self.directory)
                and pointer.step in self.committed_steps()):
            self.restore(pointer.step)
            return
        Accelerator.load_state(self._accelerator, input_dir, load_kwargs,
                               **load_model_func_kwargs)

    def wait(self, remote: bool = False, timeout: Optional[float] = None) -> None:
        """``CheckpointEngine.wait``; then, all directories written, ``total_limit`` applies."""
        super().wait(remote, timeout)
        if self._automatic:
            self._layout.make_room(0, room=0)

    def restore(self, step: Optional[int] = None, *, strict: bool = True,
                reshard: bool = False) -> Optional[int]:
        """``CheckpointEngine.restore``, then ``accelerator.step`` and each loader's position,
        once the whole snapshot has loaded (a snapshot that does not fit changes nothing)."""
        restored = super().restore(step, strict=strict, reshard=reshard)
        if restored is not None:
            self._accelerator.step = self._counters["step"]
            for position in self._positions:
                position.resume()
        return restored

    def close(self, final_step: Optional[int] = None, **kwargs) -> None:
        try:
            super().close(final_step, **kwargs)
        finally:
            for position in self._positions:
                position.unhook()
            for name in ("save_state", "load_state"):
                if vars(self._accelerator).get(name) == getattr(self, name):
                    delattr(self._accelerator, name)


class _LoaderPosition:
    """The position of a loader ``accelerator.prepare()`` returned, as a stateful object for the
    engine, and the random state its iteration started from.

    While the engine is open, the loader's underlying loader has this object's
    ``_begin_iteration`` as its ``__iter__`` (an instance attribute: ``DataLoaderShard`` calls
    ``base_dataloader.__iter__()`` explicitly), which notes the random state every iteration
    starts from and replays a saved one after a mid-epoch restore."""

    def __init__(self, loader, accelerator: Accelerator):
        base = getattr(loader, "base_dataloader", None)
        if base is None or not hasattr(loader, "set_epoch"):
            raise IntegrationError(f"dataloader= takes the loaders accelerator.prepare() returned, "
                                   f"not a {type(loader).__name__}")
        if "__iter__" in vars(base):
            raise IntegrationError("this loader is already followed by another open engine: "
                                   "close that one first")
        self.loader, self.base = loader, base
        self.stateful = hasattr(base, "state_dict")  # a torchdata StatefulDataLoader
        self.resume_epoch = 0  # the epoch the loop continues in, set by resume()
        self._gradient_state = accelerator.gradient_state
        self._epoch_start: Optional[dict] = None  # random state the current iteration began with
        self._loaded: Optional[dict] = None  # a snapshot's position, applied by resume()
        self._replay: Optional[dict] = None  # the random state the next iteration starts from
        self._held_sync = None  # the loader's rng_types, set aside for a replayed iteration
        self._warned = False
        base.__iter__ = self._begin_iteration
        if self.stateful:
            # prepare() already created the first epoch's iterator (to read an initial state),
            # drawing its seed then; without it every epoch's iteration starts alike.
            self._start_afresh()
        workers = getattr(base, "num_workers", 0)
        if self.stateful and workers:
            warnings.warn(
                f"the prepared loader runs {workers} worker processes, which torchdata's "
                "StatefulDataLoader seeds afresh at a resume: random draws in the dataset "
                "(augmentation) differ after a mid-epoch resume. Draw them from "
                "async_ckpt.data.sample_generator(seed, epoch, index) instead",
                RuntimeWarning, stacklevel=3)

    # --- what the engine saves and loads ------------------------------------------------------

    def _in_epoch(self) -> bool:
        """Whether an iteration of the loader is under way (Accelerate lists it meanwhile)."""
        return any(ref is self.loader for ref in self._gradient_state.dataloader_references)

    def state_dict(self) -> dict:
        in_epoch = self._in_epoch()
        return {"position": self.loader.state_dict() if self.stateful else None,
                "epoch": self.loader.iteration,
                "in_epoch": in_epoch,
                "at_end": in_epoch and bool(self.loader.end_of_dataloader),
                "epoch_start": self._epoch_start,
                "generators": {path: g.get_state() for path, g in _generators(self.loader).items()}}

    def load_state_dict(self, state: dict) -> None:
        self._loaded = dict(state)  # applied by resume(), once the whole snapshot has loaded

    def resume(self) -> None:
        """Put the loader where the loaded snapshot left it: the same epoch, the same batch, the
        same generators; a mid-epoch position with the random state its iteration began with."""
        state, self._loaded = self._loaded, None
        if state is None:
            return
        self._replay = None  # an earlier restore's, never iterated: replaced
        self._give_back_sync()
        mid_epoch = state["in_epoch"] and not state["at_end"]
        self.resume_epoch = state["epoch"] + (1 if state["at_end"] else 0)
        _set_random_state(self.loader, state["generators"])
        self.loader.set_epoch(self.resume_epoch)
        if not self.stateful:
            if mid_epoch:
                self._warn_not_stateful()
            return
        if mid_epoch:
            self.loader.load_state_dict(state["position"])
            self._replay = state["epoch_start"]
            sync = getattr(self.loader, "rng_types", None)
            if sync:  # several processes: their generators are synchronised as each epoch starts
                self._held_sync, self.loader.rng_types = sync, None
        else:
            self._start_afresh()

    def _start_afresh(self) -> None:
        """Make the next iteration start an epoch: drop the underlying loader's iterator and any
        position loaded into it but not yet used (torchdata keeps it in ``next_iter_state``)."""
        self.base.load_state_dict({})
        self.base.next_iter_state = None

    def warn_if_inexact(self) -> None:
        """Before a snapshot: say once why a resume from it could not continue exactly."""
        if self._warned or not self._in_epoch() or self.loader.end_of_dataloader:
            return
        if not self.stateful:
            self._warn_not_stateful()
        elif self._epoch_start is None:
            self._warned = True
            warnings.warn("the prepared loader's iteration began before the engine was created, "
                          "so a resume in this epoch cannot replay the random state it began "
                          "with: create the engine before the training loop", RuntimeWarning,
                          stacklevel=3)

    def _warn_not_stateful(self) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            "the prepared loader is not stateful, so a snapshot taken mid-epoch cannot resume at "
            "its next batch: a resume starts the epoch again from its first batch and trains "
            "those batches twice. Pass dataloader_config=DataLoaderConfiguration("
            "use_stateful_dataloader=True) to Accelerator (needs torchdata)",
            RuntimeWarning, stacklevel=4)

    # --- the loader's iterations ---------------------------------------------------------------

    def _begin_iteration(self) -> Iterator:
        """The underlying loader's ``__iter__``: note the random state the iteration starts from;
        after a mid-epoch restore, start from the saved one instead and give back the random
        state found here once the first batch is fetched (the shuffle of a sampler without a
        generator is drawn only then)."""
        if self._replay is None:
            self._epoch_start = _random_state(self.loader)
            return type(self.base).__iter__(self.base)
        found, self._epoch_start = _random_state(self.loader), self._replay
        _set_random_state(self.loader, self._replay)
        self._replay = None
        self._give_back_sync()
        return _AfterFirstBatch(type(self.base).__iter__(self.base),
                                lambda: _set_random_state(self.loader, found))

    def unhook(self) -> None:
        """Give the loader back its own ``__iter__`` and start-of-iteration synchronisation."""
        if vars(self.base).get("__iter__") == self._begin_iteration:
            del self.base.__iter__
        self._give_back_sync()
        self._replay = None

    def _give_back_sync(self) -> None:
        if self._held_sync:
            self.loader.rng_types, self._held_sync = self._held_sync, None


class _AfterFirstBatch:
    """An iterator that runs ``then`` once its first item has been fetched (or failed)."""

    def __init__(self, iterator: Iterator, then):
        self._iterator, self._then = iterator, then

    def __iter__(self) -> "_AfterFirstBatch":
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        finally:
            if self._then is not None:
                self._then, then = None, self._then
                then()


def _generators(loader) -> dict[str, torch.Generator]:
    """The torch generators a prepared loader draws its order and worker seeds from, by where
    they sit (one generator may sit in several places)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()

    def visit(path: str, obj: Any) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator):
            found[f"{path}.generator"] = generator
        for attribute in ("sampler", "batch_sampler"):
            visit(f"{path}.{attribute}", getattr(obj, attribute, None))

    visit("base", loader.base_dataloader)
    synchronized = getattr(loader, "synchronized_generator", None)
    if isinstance(synchronized, torch.Generator):
        found["synchronized_generator"] = synchronized
    return found


def _random_state(loader) -> dict:
    """What an iteration of ``loader`` draws from: the global torch RNG and its generators."""
    return {"torch": torch.get_rng_state(),
            **{path: g.get_state() for path, g in _generators(loader).items()}}


def _set_random_state(loader, state: dict) -> None:
    """Set what ``state`` holds (``_random_state``'s keys; generators created since are left)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    for path, generator in _generators(loader).items():
        if path in state:
            generator.set_state(state[path])
