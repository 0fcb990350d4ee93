"""PyTorch Lightning saves through async_ckpt, and resumes through its own ``ckpt_path``.

Lightning hands every checkpoint to the ``CheckpointIO`` plugin of the Trainer's strategy: its
``ModelCheckpoint`` callback (``every_n_train_steps``, ``save_top_k``, ``save_last``) and
``trainer.save_checkpoint`` call ``save_checkpoint(dict, path)``, retention calls
``remove_checkpoint(path)``, and ``trainer.fit(ckpt_path="last" | path)`` calls
``load_checkpoint(path)``. :class:`AsyncCkptIO` is such a plugin::

    ckpt_io = AsyncCkptIO("ckpt/")
    trainer = L.Trainer(plugins=[ckpt_io], callbacks=[ckpt_io.callback, ModelCheckpoint(...)])
    trainer.fit(model, datamodule, ckpt_path="last")

Each save is a snapshot of the engine (one copy of the dict's tensors into reused staging memory,
then the call returns); the ``.ckpt`` file Lightning asked for is that snapshot in torch's own
file format, which the writer process writes from the committed shard only once the snapshot is
committed: ``torch.load(path, weights_only=True)`` and ``LightningModule.load_from_checkpoint``
read it in a process that knows nothing of async_ckpt, and it keeps a small record (a *pointer*:
``.data/async_ckpt`` in the archive, which torch ignores) naming the snapshot, which this
plugin loads instead, verified against its checksums. So every ``.ckpt`` Lightning sees (its ``ckpt_path="last"`` search, ``best_model_path``, the files
``save_top_k`` deletes) stands for a whole snapshot, whatever instant the job is killed at.

The engine's steps are a save counter, not Lightning's global step: Lightning saves the same
global step twice (a top-k file, then ``last.ckpt``, whose callback state differs). A snapshot is
dropped once no pointer names it any more (deleted by ``save_top_k``, or replaced, as
``last.ckpt`` is at every save), after the saves in flight, never racing a write.

Lightning treats a save as done when ``save_checkpoint`` returns, and a file as its name: the
adapter keeps the contracts that follow, whatever the ``.ckpt`` holds.

- *A save in flight is a file.* ``ModelCheckpoint`` picks a free name (``test.ckpt``, then
  ``test-v1.ckpt``...) and versions ``last`` by asking ``file_exists`` (its file system), and
  ``save_last="link"`` links to the save just made and removes the previous link. The callback
  sets, at ``setup``, each ``ModelCheckpoint``'s ``file_exists`` on the instance (taken off at
  ``teardown``): rank 0 asks the plugin first (a path saved to, or a link to one, exists; one
  whose removal is queued does not), then the file system, and the answer is shared across ranks
  as Lightning's own method shares it. Rejected: a placeholder file at the path at once (a job
  killed before the commit would leave a file that names no committed snapshot, which the
  ``ckpt_path="last"`` search and other readers would take for a checkpoint), and names reserved
  in the callback's state (a second bookkeeping of what the plugin knows). ``remove_checkpoint``
  of a link to a save in flight deletes the link in the drop's turn.
- *A load waits.* ``load_checkpoint`` of a path saved to in this stage (or a link to one) waits
  for the saves in flight (``engine.wait()``), then reads the committed file.
- *The engine lives as long as a stage.* It opens at the first save (at ``setup`` of a fit on
  rank 0) and closes at the strategy's teardown, which Lightning runs after an exception too
  (where the callbacks' ``teardown`` is not called). A save or removal with no stage running
  (``trainer.save_checkpoint`` before or after ``fit``, ``ddp_spawn``'s hand-over of the weights
  to the main process) waits for its commit and closes the engine: no teardown follows that
  would, and what runs next (a ``validate(ckpt_path=...)``, another Trainer on the directory)
  needs the file and the lock.
  Without the callback among the Trainer's callbacks the plugin cannot see stages, so every save
  is such a save (correct, training waits for each write; warned). A pickled copy (``ddp_spawn``,
  ``torch.save(trainer)``) has no engine: it opens its own.

The global RNG (Python, NumPy, torch, CUDA) is saved with every snapshot, and the callback sets
it back at ``on_train_start`` of the resumed fit: after Lightning has built and iterated the
DataLoaders (which draw from it), before the first batch, which is where the interrupted run
stood when it saved. Only global rank 0 saves (Lightning's rule); the engine is one rank.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import warnings
from typing import Any, Callable, Optional, Union

import torch

try:
    import lightning
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as e:  # the optional extra
    raise ImportError("async_ckpt.integrations.lightning needs the lightning package: "
                      "pip install 'async_ckpt[lightning]'") from e

from .. import CheckpointEngine, Derived, Marker, load
from ..errors import (CheckpointError, EncodingError, IntegrationError, NoSnapshotError,
                      PointerFileError, UnsupportedOptionError)
from ..rng import GlobalRNG
from .pointer import Pointer, is_count, read_pointer_file as read_pointer

__all__ = ["AsyncCkptIO", "AsyncCkptCallback", "Pointer", "read_pointer"]

PathLike = Union[str, os.PathLike]

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ((2, 5), (2, 7))  # lightning >= 2.5, < 2.7 (tested with 2.6.6)
_version = tuple(int(part) for part in re.findall(r"\d+", lightning.__version__)[:2])
if not SUPPORTED_VERSIONS[0] <= _version < SUPPORTED_VERSIONS[1]:
    warnings.warn(f"async_ckpt.integrations.lightning supports lightning >=2.5,<2.7; this is "
                  f"{lightning.__version__}: its CheckpointIO, ModelCheckpoint or strategies may "
                  "differ (pip install 'async_ckpt[lightning]' installs a supported version)",
                  RuntimeWarning, stacklevel=2)

_KEEP_ALL = 2**62  # the engine keeps every snapshot: Lightning's save_top_k decides
# Engine settings the adapter decides: one rank saves, every save is taken, Lightning retains.
_FIXED_OPTIONS = {"rank", "world_size", "every", "keep_last", "keep_every", "when_busy"}


class AsyncCkptIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` backed by a :class:`~async_ckpt.CheckpointEngine` writing
    into ``directory``; pass it as ``Trainer(plugins=[io], callbacks=[io.callback, ...])``.

    ``save_checkpoint`` returns once the dict's tensors are copied into staging memory (the
    live parameters and optimizer state may change right after); the ``.ckpt`` at ``path`` (the
    snapshot in torch's format, with its pointer) appears once the snapshot is committed (before
    the call returns when no Trainer stage runs: see the module's docstring).
    ``load_checkpoint`` reads a pointer's snapshot, waiting for a save in flight to it (any other
    file with Lightning's stock ``torch.load``, ``weights_only=True`` unless asked otherwise);
    ``remove_checkpoint`` deletes a pointer and drops its snapshot once no pointer names it;
    ``teardown`` waits for the saves in flight and stops the writer. ``storage_options`` are
    refused (``UnsupportedOptionError``).

    ``engine_options``: settings of the engine (``async_ckpt.options.EngineOptions``), such as
    ``compression``, ``slots``, ``mode="sync"`` or ``remote``; the adapter sets ``rank``,
    ``world_size``, ``every``, ``keep_last``, ``keep_every`` and ``when_busy`` itself.
    """

    def __init__(self, directory: PathLike, **engine_options: Any) -> None:
        fixed = sorted(_FIXED_OPTIONS & set(engine_options))
        if fixed:
            raise ValueError(f"AsyncCkptIO sets {', '.join(fixed)} itself: Lightning's global "
                             "rank 0 saves whenever ModelCheckpoint asks, and save_top_k decides "
                             "what is kept")
        super().__init__()
        self.directory = os.path.abspath(os.fspath(directory))
        self._engine_options = {"heartbeat_interval": None, **engine_options, "rank": 0,
                                "world_size": 1, "keep_last": _KEEP_ALL}
        self._engine: Optional[CheckpointEngine] = None
        self._next_step = 0
        # pointer path -> step of the newest save to it: its pointer is there once it commits
        self._saves: dict[str, int] = {}
        # pointers removed whose deletion is queued with their snapshot's drop: they name nothing
        self._removing: set[str] = set()
        # checkpoint directory -> {path: (stat signature, step it names or None)} (_release)
        self._scanned: dict[str, dict[str, tuple]] = {}
        self._trainer_attached = False  # a Trainer stage runs, with the callback among its own
        self._callback_seen = False  # the callback has run in a stage (it is in use)
        self._patched: list[ModelCheckpoint] = []  # whose file_exists sees the saves in flight
        self._resuming = False  # a fit on the saving rank, before its training starts
        self._rng_to_restore: Optional[dict] = None  # set back at on_train_start
        self._warned: set[str] = set()
        self.callback = AsyncCkptCallback(self)

    # --- CheckpointIO -----------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike,
                        storage_options: Optional[Any] = None) -> None:
        """Snapshot ``checkpoint`` (one copy of its tensors) and have its pointer written at
        ``path`` once it is committed; the snapshot that ``path`` named before is dropped after,
        unless another pointer names it. A ``path`` on another file system (an fsspec URL:
        ``s3://``, ``memory://``) is saved by Lightning's stock IO, blocking (warned once)."""
        given = path
        if storage_options is not None:
            raise UnsupportedOptionError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg "
                "is not supported for AsyncCkptIO: every save of a Trainer goes to the same "
                "engine, whose settings are given once, as AsyncCkptIO(directory, **options) "
                "(compression=, remote= for an object store, ...). Save without storage_options")
        path = self._local_path(path)
        if path is None:
            self._warn_not_local(given)
            TorchCheckpointIO().save_checkpoint(checkpoint, given)
            return
        engine = self._open()
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as the stock IO: a link may go there
        self._warn_unless_attached()
        if _loses_data_position(checkpoint):
            self._warn_once("data", DATA_POSITION_LOST)
        checkpoint = _encodable_hparams(checkpoint)
        replaced = None if path in self._removing else self._step_named_by(path)
        self._removing.discard(path)
        step = self._next_step
        pointer = Pointer(step, os.path.relpath(self.directory, os.path.dirname(path)),
                          _count_or_none(checkpoint.get("global_step")),
                          _count_or_none(checkpoint.get("epoch")))
        try:
            engine.snapshot(step, state=checkpoint, force=True,
                            markers=[Marker(path, Derived("torch", record=pointer.to_bytes()))])
        except EncodingError as e:
            raise _unencodable(e, "AsyncCkptIO(directory, allow_pickle=True)") from e
        self._next_step += 1
        self._saves[path] = step
        if replaced is not None:
            self._release(replaced, path)
        self._close_outside_a_stage()

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's checkpoint dict: the snapshot a pointer names, or any other checkpoint file
        read by Lightning's stock ``TorchCheckpointIO`` (``weights_only=True`` unless given).

        A damaged snapshot raises its typed error (``CorruptSnapshotError``...) naming the path,
        loading nothing, except for a ``last*.ckpt`` pointer (what ``ckpt_path="last"`` picks,
        standing for the newest state): then the newest committed snapshot that verifies is
        loaded instead, with a RuntimeWarning.

        Resuming a fit with the callback, on the rank that saves, the snapshot is read through
        the engine (opened at ``setup``, once a killed run's writer had finished), and its global
        RNG is set back at ``on_train_start``; anywhere else (other ranks, ``validate``,
        ``test``, another process reading a live run's checkpoints) engine-free, RNG untouched.
        """
        given, path = path, self._local_path(path)
        if path is None:
            return _stock_load(given, map_location, weights_only)
        if self._engine is not None and self._pending_step(path) is not None:
            self._engine.wait()  # a save to it (or to what it links to) may be in flight
        pointer = read_pointer(path)
        if pointer is None:  # the path as given: the stock IO's errors name it so
            return _stock_load(given, map_location, weights_only)
        self._check_directory(pointer, path)
        step, checkpoint = self._read_snapshot(pointer, path)
        if step == pointer.step:
            _check_saved_counts(pointer, checkpoint, path, self.directory)
        if self._resuming:
            self._rng_to_restore = GlobalRNG().state_dict()  # as load() set it: set again later
        return _to_device(_restored_hparams(checkpoint), map_location)

    def export(self, path: PathLike, destination: PathLike) -> None:
        """Write the checkpoint ``path`` stands for as a stock Lightning ``.ckpt`` (``torch.save``)
        at ``destination``, verified: for a ``.ckpt`` that earlier versions wrote as a JSON
        pointer (what this version writes is such a file already)."""
        TorchCheckpointIO().save_checkpoint(self.load_checkpoint(path), os.fspath(destination))

    def remove_checkpoint(self, path: PathLike) -> None:
        """Have the writer delete the pointer at ``path`` and drop its snapshot unless another
        pointer names it, in one turn queued behind the saves in flight (a save to ``path``
        still in flight is committed, its pointer written, and then both go): training does
        not wait, and a kill leaves a pointer with its snapshot or neither. Any other file is
        removed as Lightning's stock IO removes it."""
        given, path = path, self._local_path(path)
        if path is None:
            TorchCheckpointIO().remove_checkpoint(given)
            return
        step = self._step_named_by(path)
        if step is None:
            if os.path.islink(path):  # a link to nothing of ours: the stock IO keeps a dangling one
                os.unlink(path)
            else:
                TorchCheckpointIO().remove_checkpoint(path)
            return
        self._open()
        self._saves.pop(path, None)
        self._removing.add(path)
        self._release(step, path, remove=True)
        self._close_outside_a_stage()

    def teardown(self) -> None:
        """The end of a Trainer stage (the strategy's teardown, after an exception too, and the
        callback's): wait for the saves in flight (their pointers are written), then stop the
        writer and free the directory (its lock), the staging memory and the engine's threads.
        The ModelCheckpoints get their own ``file_exists`` back, and a save from here on (a hook
        after the strategy's teardown, ``trainer.save_checkpoint`` after the fit) waits for its
        commit, until the next stage's ``setup``."""
        self._trainer_attached = self._resuming = False
        self._rng_to_restore = None
        _stop_counting_saves_in_flight(self._patched)
        if self._engine is not None:
            engine, self._engine = self._engine, None
            self._saves.clear()
            self._removing.clear()
            self._scanned.clear()
            engine.close()

    def __getstate__(self) -> dict:
        """A copy (pickled into ``ddp_spawn``'s workers, ``torch.save(trainer)``) has no engine:
        an engine is its process's own (its writer, lock and staging memory stay with it); the
        copy opens its own on its first save."""
        return {**self.__dict__, "_engine": None, "_saves": {}, "_removing": set(),
                "_scanned": {}, "_patched": []}

    # --- the engine and its steps -----------------------------------------------------------

    def _open(self) -> CheckpointEngine:
        """The engine, started on first use (on the rank that saves): numbering of saves goes
        on past the snapshots already committed in the directory."""
        if self._engine is None:
            self._engine = CheckpointEngine(self.directory, {}, **self._engine_options)
            self._next_step = max(self._engine.committed_steps(), default=-1) + 1
        return self._engine

    def _read_snapshot(self, pointer: Pointer, path: str) -> tuple[int, dict]:
        """Read the snapshot ``pointer`` names, through the engine when resuming a fit (it sets
        the saved global RNG), else with the engine-free reader; past damage only for a "last"
        pointer, by the engine's own fallback rule (the same step on every rank)."""
        read: Callable[[Optional[int]], tuple[int, dict]]
        if self._resuming:
            def read(step):
                loaded = self._engine.load(step)
                if loaded is None:
                    raise NoSnapshotError(f"{self.directory} holds no committed snapshot")
                return loaded
        else:
            def read(step):
                return load(self.directory, step, allow_pickle=self._engine_options.get(
                    "allow_pickle", False))
        return _read_named_or_newest(
            read, pointer.step, path, self.directory,
            lambda loaded: f"snapshot {loaded[0]} (global step {loaded[1].get('global_step')})")

    def _step_named_by(self, path: str) -> Optional[int]:
        """The snapshot the pointer at ``path`` names, or will once the saves in flight commit."""
        step = self._pending_step(path)
        if step is not None:
            return step
        pointer = self._own_pointer(path)
        return None if pointer is None else pointer.step

    def _pending_step(self, path: str) -> Optional[int]:
        """The step of this engine's newest save to ``path``, or to the file ``path`` is a
        symbolic link to (``save_last="link"`` links to a save that may still be in flight):
        its pointer is there, or will be once it commits. None for anything else."""
        step = self._saves.get(path)
        if step is None and os.path.islink(path):
            step = self._saves.get(os.path.realpath(path))
        return step

    def _exists(self, path: str, fs: Any) -> bool:
        """Whether ``ModelCheckpoint`` should see a file at ``path`` (``fs``: its file system),
        as it would with a CheckpointIO that writes before it returns: a save in flight there
        (or to the file it links to) is a file, one whose removal is queued is none."""
        local = self._local_path(path)
        if local is None:  # another file system's URL: nothing of ours
            return fs.exists(path)
        if self._pending_step(local) is not None:
            return True
        return local not in self._removing and fs.exists(path)

    def _own_pointer(self, path: str) -> Optional[Pointer]:
        """The pointer at ``path`` if it names a snapshot of this directory, else None: a file of
        another IO, another directory's pointer or a damaged one names nothing of this engine
        (a save replaces it, a removal deletes it)."""
        try:
            pointer = read_pointer(path)
        except (PointerFileError, OSError) as e:
            log.warning("%s", e)
            return None
        if pointer is None or not self._names_this_directory(pointer, path):
            return None
        return pointer

    def _release(self, step: int, path: str, remove: bool = False) -> None:
        """Drop snapshot ``step``, whose pointer at ``path`` is being replaced (or, ``remove``,
        deleted: by the writer, in the drop's turn, so that a kill leaves the pointer and its
        snapshot together), unless another pointer in that directory names it (a copy, or a
        symlink to a pointer that is still there); queued behind the saves in flight, so never
        before they are written. A pointer the writer is writing (``NAME.tmp-PID``, renamed over
        NAME once written; left there if the writer was killed in between) names nothing: the
        pointer it replaces, or the one it becomes, does."""
        directory = os.path.dirname(path)
        known, self._scanned[directory] = self._scanned.get(directory, {}), {}
        named_elsewhere = False
        for entry in os.scandir(directory):
            if (entry.path != path and entry.path not in self._removing
                    and not Marker.is_being_written(entry.name)):
                named_elsewhere |= self._step_of(entry, known, self._scanned[directory]) == step
        if remove or not named_elsewhere:
            self._engine.drop([] if named_elsewhere else [step], wait=False,
                              files=[path] if remove else [])

    def _step_of(self, entry: os.DirEntry, known: dict, seen: dict) -> Optional[int]:
        """The step ``entry`` names if it is a pointer of this directory. A pointer this engine
        saves names the step of its newest save (or will, once that commits); any other file is
        read again only when it changed, since a directory of thousands of checkpoints
        (``save_top_k=-1``) is scanned at every save that replaces ``last.ckpt``."""
        if entry.path in self._saves:
            return self._saves[entry.path]
        if entry.is_symlink() and os.path.realpath(entry.path) in self._saves:
            return self._saves[os.path.realpath(entry.path)]  # a link to a save in flight
        try:
            info = entry.stat()  # through a symlink: the pointer it links to
        except OSError:
            return None  # a dangling symlink
        if not stat.S_ISREG(info.st_mode):
            return None
        signature = (info.st_ino, info.st_mtime_ns, info.st_size)
        cached = known.get(entry.path)
        if cached is None or cached[0] != signature:
            pointer = self._own_pointer(entry.path)
            cached = (signature, None if pointer is None else pointer.step)
        seen[entry.path] = cached
        return cached[1]

    def _names_this_directory(self, pointer: Pointer, path: str) -> bool:
        named = os.path.join(os.path.dirname(path), pointer.directory)
        return os.path.realpath(named) == os.path.realpath(self.directory)

    def _check_directory(self, pointer: Pointer, path: str) -> None:
        if not self._names_this_directory(pointer, path):
            named = os.path.normpath(os.path.join(os.path.dirname(path), pointer.directory))
            raise PointerFileError(
                f"{path} names snapshot {pointer.step} of the checkpoint directory {named}, "
                f"and this AsyncCkptIO writes to {self.directory}: load it with "
                f"AsyncCkptIO({named!r})")

    @staticmethod
    def _local_path(path: PathLike) -> Optional[str]:
        """``path`` made absolute, or None for a URL of another file system (fsspec's
        ``s3://``, ``memory://``...), which the writer process cannot write to."""
        path = os.fspath(path)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) and not path.startswith("file://"):
            return None
        return os.path.abspath(path.removeprefix("file://"))

    def _warn_not_local(self, path: PathLike) -> None:
        self._warn_once("not local", f"AsyncCkptIO saves {path} with Lightning's stock "
                        "TorchCheckpointIO, which blocks training for the whole write: the "
                        "engine's writer writes local files only. For an object store, give "
                        "ModelCheckpoint a local dirpath and AsyncCkptIO(directory, "
                        "remote='s3://bucket/prefix'), which uploads committed snapshots")

    # --- the callback's part: the right moment for the RNG, strategies, warnings -------------

    def _attach(self, trainer: "lightning.Trainer") -> None:
        strategy = type(trainer.strategy)
        for method in ("save_checkpoint", "load_checkpoint"):
            if getattr(strategy, method) is not getattr(Strategy, method):
                raise IntegrationError(
                    f"{strategy.__name__} has a {method} of its own that does not (only) go "
                    "through the CheckpointIO plugin (FSDP, ModelParallel, DeepSpeed and XLA "
                    "strategies save sharded or with their own library): AsyncCkptIO would save "
                    "checkpoints it cannot load or never be called. Use it with a strategy that "
                    "saves through CheckpointIO (single device, DDP); for ModelParallelStrategy "
                    "(FSDP2, tensor parallel) use async_ckpt.integrations.lightning_sharded."
                    "AsyncCkptModelParallelStrategy instead of this plugin; else that strategy's "
                    "own checkpointing")
        if any(getattr(c, "save_last", None) == "link" for c in trainer.checkpoint_callbacks):
            self._warn_once("link", LAST_LINK_DANGLES)
        self._patched += _count_saves_in_flight_as_files(trainer, self)
        self._trainer_attached = self._callback_seen = True
        if trainer.state.fn == TrainerFn.FITTING and _global_rank() == 0:
            self._open()  # waits for a killed run's writer to finish; spares the first save
            self._resuming = True

    def _close_outside_a_stage(self) -> None:
        """A save or removal with no Trainer stage running (``trainer.save_checkpoint`` before or
        after ``fit``, ``ddp_spawn``'s hand-over of the weights) is synchronous: committed, its
        file written and the engine closed before the call returns, since no teardown follows
        that would close it, and what runs next (``validate(ckpt_path=...)``, another Trainer on
        the same directory) expects the file there and the directory free."""
        if not self._trainer_attached:
            self.teardown()

    def _restore_rng(self) -> None:
        self._resuming = False
        if self._rng_to_restore is not None:
            GlobalRNG().load_state_dict(self._rng_to_restore)
            self._rng_to_restore = None

    def _warn_unless_attached(self) -> None:
        if not self._callback_seen:
            self._warn_once("callback", "AsyncCkptIO saved with no Trainer stage running its "
                            "callback (a save before the first fit, or AsyncCkptIO.callback is "
                            "not among the Trainer's callbacks): such a save waits for its "
                            "commit. If the callback is missing, every save waits so; a resumed "
                            "run does not get the saved global RNG back (it must be set after "
                            "Lightning builds and iterates the DataLoaders, which draw from it), "
                            "so it draws other random numbers (dropout) than the run it "
                            "continues; and strategies that bypass CheckpointIO are not "
                            "detected. Pass Trainer(plugins=[io], callbacks=[io.callback, ...])")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


class AsyncCkptCallback(Callback):
    """The part of :class:`AsyncCkptIO` a plugin cannot do: check the strategy at ``setup`` and
    set the resumed run's global RNG back at ``on_train_start`` (exact resume of random draws)."""

    def __init__(self, io: AsyncCkptIO) -> None:
        self.io = io

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.io._attach(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self.io._restore_rng()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.io.teardown()  # the strategy's teardown did; this one comes after every stage hook


class _FileExists:
    """``ModelCheckpoint.file_exists`` while a stage runs with an adapter that saves
    asynchronously (:class:`AsyncCkptIO`, ``lightning_sharded.AsyncCkptModelParallelStrategy``):
    global rank 0 decides with the adapter's ``_exists(path, fs)`` (a save in flight is a file),
    and the decision is shared as Lightning's own method shares it, so that every rank picks the
    same versioned name. Set on the instance at ``setup``, taken off at ``teardown``."""

    def __init__(self, checkpoint: ModelCheckpoint, owner: Any) -> None:
        self.checkpoint, self.owner = checkpoint, owner

    def __call__(self, filepath, trainer) -> bool:
        local = (self.owner._exists(filepath, self.checkpoint._fs) if trainer.is_global_zero
                 else False)
        return trainer.strategy.reduce_boolean_decision(local, all=False)


def _count_saves_in_flight_as_files(trainer: "lightning.Trainer", owner: Any
                                    ) -> list[ModelCheckpoint]:
    """Give each of the Trainer's ``ModelCheckpoint``s a ``file_exists`` that asks ``owner``
    first (:class:`_FileExists`); returns those changed, for
    :func:`_stop_counting_saves_in_flight`."""
    patched = []
    for checkpoint in trainer.checkpoint_callbacks:
        if isinstance(checkpoint, ModelCheckpoint) and "file_exists" not in vars(checkpoint):
            checkpoint.file_exists = _FileExists(checkpoint, owner)
            patched.append(checkpoint)
    return patched


def _stop_counting_saves_in_flight(patched: list[ModelCheckpoint]) -> None:
    for checkpoint in patched:
        vars(checkpoint).pop("file_exists", None)
    patched.clear()


LAST_LINK_DANGLES = (
    "ModelCheckpoint(save_last='link') links last.ckpt to a checkpoint that is committed only "
    "later: a run killed in between finds no last checkpoint (a dangling link) and "
    "ckpt_path='last' starts over from scratch. Use save_last=True")

DATA_POSITION_LOST = (
    "a checkpoint is saved in the middle of an epoch, and the training DataLoader cannot save "
    "its position (it has no state_dict/load_state_dict): a run resumed from it goes on with a "
    "fresh, reshuffled pass over the data instead of the batches that were left, and ends that "
    "epoch early. Use torchdata's StatefulDataLoader (or give the loader "
    "state_dict/load_state_dict), or save at epoch ends only")


def _is_mid_epoch(checkpoint: dict) -> bool:
    """Whether Lightning's ``checkpoint`` was saved in the middle of a training epoch."""
    progress = (checkpoint.get("loops", {}).get("fit_loop", {})
                .get("epoch_loop.batch_progress", {}))
    return (not progress.get("is_last_batch", True)
            and progress.get("current", {}).get("processed", 0) > 0)


def _loses_data_position(checkpoint: dict) -> bool:
    """A save in the middle of an epoch whose training DataLoader cannot save its position:
    Lightning resumes it with a fresh pass over the data, not the batches that were left."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return _is_mid_epoch(checkpoint) and "combined_loader" not in fit_loop.get("state_dict", {})


def _unencodable(error: EncodingError, pickling: str) -> EncodingError:
    """``error`` (a value of Lightning's checkpoint with no safe encoding) with what to do about
    it; ``pickling``: how the adapter is created to pickle such values."""
    return EncodingError(
        f"{error}. In a Lightning checkpoint such a value is most often a hyperparameter "
        "(save_hyperparameters) or a callback's state: give it as a str, number, list or dict, "
        f"or create {pickling} to pickle it (loading it then runs code stored in the file)")


def _global_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _count_or_none(value) -> Optional[int]:
    return value if is_count(value) else None


def _is_last_checkpoint(path: str) -> bool:
    """Whether ``path`` is a file that Lightning's ``ckpt_path="last"`` search picks from."""
    stem, suffix = os.path.splitext(os.path.basename(path))
    return (suffix == ModelCheckpoint.FILE_EXTENSION
            and re.match(rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-(\d+))?", stem) is not None)


def _read_named_or_newest(read: Callable[[Optional[int]], Any], step: int, path: str,
                          directory: str, shown: Callable[[Any], str]) -> Any:
    """``read(step)``: the snapshot the checkpoint at ``path`` names. Where that is damaged or
    gone, its typed error naming ``path``, unless ``path`` is a ``last*.ckpt`` (it stands for the
    newest state): then ``read(None)``, the newest committed snapshot that verifies (by the
    engine's own fallback rule: the same step on every rank), with a RuntimeWarning naming what
    was loaded (``shown`` of what ``read`` returned)."""
    try:
        return read(step)
    except CheckpointError as e:
        if not (e.is_damage or isinstance(e, NoSnapshotError)):
            raise
        cause = e
    where = f"{path} names snapshot {step} of {directory}, which {_why(cause)}"
    if not _is_last_checkpoint(path):
        raise type(cause)(f"{where}. Lightning asked for this checkpoint, so no other is "
                          "loaded in its place: resume with ckpt_path='last' (which falls "
                          "back to the newest snapshot that verifies) or pass another "
                          "checkpoint's path") from cause
    loaded = read(None)
    warnings.warn(f"{where}; it stands for the newest state, so the newest committed snapshot "
                  f"that verifies was loaded instead: {shown(loaded)}", RuntimeWarning,
                  stacklevel=4)
    return loaded


def _why(error: CheckpointError) -> str:
    return ("is not committed (dropped or never written)" if isinstance(error, NoSnapshotError)
            else f"is damaged: {error}")


def _check_saved_counts(pointer: Pointer, checkpoint: dict, path: str, directory: str) -> None:
    """The snapshot holds the global step and epoch its pointer was written with; else the
    pointer belongs to another run that used a directory of the same name."""
    for key, saved in (("global_step", pointer.global_step), ("epoch", pointer.epoch)):
        if saved is not None and checkpoint.get(key) != saved:
            raise PointerFileError(
                f"{path} names snapshot {pointer.step} of {directory} as {key} {saved}, but that "
                f"snapshot holds {key} {checkpoint.get(key)!r}: the pointer was written by "
                "another run into a checkpoint directory of the same name")


# Where Lightning's dict holds hyperparameters, and their type when they are an omegaconf config.
_HPARAMS = tuple((owner.CHECKPOINT_HYPER_PARAMS_KEY, owner.CHECKPOINT_HYPER_PARAMS_TYPE)
                 for owner in (LightningModule, LightningDataModule))


def _omegaconf_classes() -> dict[str, type]:
    """omegaconf's config classes by qualified name; none without omegaconf."""
    try:
        from omegaconf import DictConfig, ListConfig
    except ImportError:
        return {}
    return {f"{c.__module__}.{c.__qualname__}": c for c in (DictConfig, ListConfig)}


def _encodable_hparams(checkpoint: dict) -> dict:
    """``checkpoint`` with hyperparameters that are an omegaconf config (Hydra's), which Lightning
    saves as the config and its class (no safe encoding holds either), as the config's plain
    container (interpolations kept as strings) and the class's qualified name: Lightning's own
    loading of the ``.ckpt`` takes a name for hparams of an ``AttributeDict``, and
    :func:`_restored_hparams` makes the config again."""
    classes, encodable = _omegaconf_classes(), None
    for key, type_key in _HPARAMS:
        kind = checkpoint.get(type_key)
        name = f"{kind.__module__}.{kind.__qualname__}" if isinstance(kind, type) else None
        if name in classes and isinstance(checkpoint.get(key), classes[name]):
            from omegaconf import OmegaConf
            encodable = dict(checkpoint) if encodable is None else encodable
            encodable[key] = OmegaConf.to_container(checkpoint[key], resolve=False)
            encodable[type_key] = name
    return checkpoint if encodable is None else encodable


def _restored_hparams(checkpoint: dict) -> dict:
    """The omegaconf configs :func:`_encodable_hparams` saved as plain containers, made again:
    the name in the file is looked up among omegaconf's two config classes, never imported."""
    classes = _omegaconf_classes()
    for key, type_key in _HPARAMS:
        kind = checkpoint.get(type_key)
        if isinstance(kind, str) and kind in classes and isinstance(checkpoint.get(key),
                                                                     (dict, list)):
            from omegaconf import OmegaConf
            config = OmegaConf.create(checkpoint[key])
            if isinstance(config, classes[kind]):  # a DictConfig from a dict, a ListConfig...
                checkpoint[key], checkpoint[type_key] = config, classes[kind]
    return checkpoint


def _stock_load(path: PathLike, map_location: Optional[Any], weights_only: Optional[bool]) -> dict:
    """A checkpoint that is not ours, read by Lightning's stock IO (``weights_only=True`` unless
    asked otherwise)."""
    stock = {} if map_location is None else {"map_location": map_location}
    return TorchCheckpointIO().load_checkpoint(
        path, weights_only=True if weights_only is None else weights_only, **stock)


def _to_device(checkpoint: dict, map_location: Optional[Any]) -> dict:
    """The snapshot's tensors (CPU) moved to ``map_location`` (a device or a device string);
    Lightning itself passes none and moves the state when it loads it into the model."""
    if map_location is None:
        return checkpoint
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError("AsyncCkptIO.load_checkpoint takes map_location as a device or a device "
                        f"string, not {type(map_location).__name__}")
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))
