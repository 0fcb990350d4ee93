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

This module is the only one that imports Accelerate; importing it checks that the installed
version is in ``SUPPORTED`` and that the private behaviour above is there (``IntegrationError``,
or a warning for a newer, untested major version).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Iterator, Optional, Sequence

import accelerate
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from packaging.version import Version

from ..engine import CheckpointEngine
from ..errors import IntegrationError

__all__ = ["AccelerateEngine", "SUPPORTED", "engine"]

SUPPORTED = ("1.16", "2")  # tested with 1.16; [first, before)

# Strategies whose state a rank does not hold whole, or that save it their own way.
_REFUSED = {
    DistributedType.FSDP: "FSDP shards the model and optimizer state",
    DistributedType.DEEPSPEED: "DeepSpeed saves its engine's state itself",
    DistributedType.MEGATRON_LM: "Megatron-LM saves its model's state itself",
    DistributedType.XLA: "XLA tensors cannot be staged here",
}


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
    if missing:
        raise IntegrationError(f"accelerate {version} lacks what async_ckpt.integrations."
                               f"accelerate relies on: {'; '.join(missing)}. Install "
                               f"accelerate>={first},<{before}")


_check_accelerate()


def engine(accelerator: Accelerator, directory, *, model=None, optimizer=None, scheduler=None,
           dataloader=None, **options) -> "AccelerateEngine":
    """An ``AccelerateEngine`` in ``directory`` over what ``accelerator`` prepared.

    ``model``, ``optimizer``, ``scheduler`` and ``dataloader`` are the objects
    ``accelerator.prepare()`` returned, each one object or a list of them (saved as ``model``,
    ``model_1``, ...). Saved with them: ``accelerator.scaler`` (the GradScaler of fp16 mixed
    precision), every object given to ``accelerator.register_for_checkpointing`` (as
    ``custom_0``, ...), ``accelerator.step`` (its gradient-accumulation counter), and each
    loader's position with the random state its iteration started from; the global RNG states
    as with any engine. Models are saved unwrapped (``accelerator.unwrap_model``), optimizers
    and schedulers as the torch objects inside Accelerate's wrappers.

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
    state: dict[str, Any] = {}
    state.update(_named("model", [accelerator.unwrap_model(m) for m in _listed(model)]))
    state.update(_named("optimizer", [o.optimizer if isinstance(o, AcceleratedOptimizer) else o
                                      for o in _listed(optimizer)]))
    state.update(_named("scheduler", [s.scheduler if isinstance(s, AcceleratedScheduler) else s
                                      for s in _listed(scheduler)]))
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
                                counters=counters, **options)
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
    return {name if i == 0 else f"{name}_{i}": obj for i, obj in enumerate(objects)}


class AccelerateEngine(CheckpointEngine):
    """A ``CheckpointEngine`` over an Accelerator's prepared objects; made by :func:`engine`.

    ``snapshot(step)`` and ``restore()`` are the engine's; ``restore()`` also sets
    ``accelerator.step`` and the loaders' positions, and ``epoch`` says which epoch the training
    loop continues in. ``close()`` also gives the loaders back their own ``__iter__``."""

    def __init__(self, directory, state, *, accelerator: Accelerator,
                 positions: list["_LoaderPosition"], counters: dict, **options):
        super().__init__(directory, state, **options)
        self._accelerator, self._positions, self._counters = accelerator, positions, counters

    @property
    def epoch(self) -> int:
        """The epoch the training loop continues in: the first loader's epoch at the restored
        snapshot, or the next one when the snapshot was taken after that epoch's last batch; 0
        before any restore or without a loader. Loop as ``for epoch in range(engine.epoch, n)``."""
        return self._positions[0].resume_epoch if self._positions else 0

    def snapshot(self, step: int, *, force: bool = False) -> bool:
        """Take a snapshot tagged ``step`` (the global step: ``accelerator.step`` counts micro
        steps, and is saved too); see ``CheckpointEngine.snapshot``."""
        self._counters["step"] = self._accelerator.step
        for position in self._positions:
            position.warn_if_inexact()
        return super().snapshot(step, force=force)

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
