"""Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism applied in
``configure_model``) saving each rank's shards through async_ckpt.

Lightning's sharded strategies bypass ``CheckpointIO``: ``ModelParallelStrategy.save_checkpoint``
runs ``torch.distributed.checkpoint.save`` on every rank and ``torch.save`` of ``meta.pt`` (the
rest of Lightning's dict) on rank 0, blocking until both are on disk.
:class:`AsyncCkptModelParallelStrategy` is that strategy with ``save_checkpoint``,
``load_checkpoint`` and ``remove_checkpoint`` of its own::

    strategy = AsyncCkptModelParallelStrategy("ckpt/", data_parallel_size=2,
                                              tensor_parallel_size=1)
    trainer = L.Trainer(strategy=strategy, callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")

Every save is one snapshot of an engine per rank: each rank stages its own pieces of the model's
and the optimizers' ``DTensor``s (one copy into reused staging memory, then training goes on) and
rank 0's writer commits the snapshot once every rank's shard is durable. Lightning's metadata
(loops, callbacks, hyper-parameters, LR schedulers, ...) is rank 0's, as with the stock strategy:
broadcast to every rank and saved once, as a replicated entry. The checkpoint path Lightning
asked for (``epoch=0-step=4.ckpt``, ``last.ckpt``) appears only once the snapshot is committed,
as a directory holding ``meta.pt`` (what the stock strategy writes there: the metadata, in
torch's format) and a pointer to the snapshot (``pointer.POINTER_NAME``); until then the
save counts as a file for ``ModelCheckpoint``'s names, as with :class:`~.lightning.AsyncCkptIO`.
Loading a pointer's snapshot restores every rank's box of each tensor from the pieces that
overlap it, so a checkpoint saved on one number of ranks (or mesh) resumes on another; any other
checkpoint (a stock one: DCP shards, or a single file) is loaded by the stock strategy.

``python -m async_ckpt.integrations.lightning_sharded CHECKPOINT`` writes the single-file
checkpoint that Lightning's own ``consolidate_checkpoint`` is meant to make of a sharded one
(:func:`consolidate`).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from .. import CheckpointEngine, Derived, Marker, load
from ..errors import CheckpointError, EncodingError, PointerFileError, UnsupportedOptionError
from ..rng import GlobalRNG
from .pointer import Target, pointer_file, read_pointer
from .lightning import (DATA_POSITION_LOST, LAST_LINK_DANGLES, _count_saves_in_flight_as_files,
                        _encodable_hparams, _is_mid_epoch, _loses_data_position,
                        _read_named_or_newest, _restored_hparams, _stop_counting_saves_in_flight,
                        _unencodable)

__all__ = ["AsyncCkptModelParallelStrategy", "consolidate"]

PathLike = Union[str, os.PathLike]

# The snapshot's entries: Lightning's converted state as the stock strategy hands it to DCP
# ("state_dict", "optimizer_0", ...), its metadata (meta.pt: the loops hold the DataLoaders'
# position, so the engine, which looks for an entry named for one, does not warn that none is
# saved) and the parallel layout it was saved with (read back to say what a resume at another
# layout cannot make exact).
MODEL = "state_dict"
META = "metadata"
LAYOUT = "layout"
_KEEP_ALL = 2**62  # the engine keeps every snapshot: Lightning's save_top_k decides
# Engine settings the strategy decides: every rank saves whenever Lightning asks, Lightning
# retains, and the metadata is rank 0's, written once by rank 0 (meta.pt is made from its shard).
_FIXED_OPTIONS = {"rank", "world_size", "every", "keep_last", "keep_every", "when_busy",
                  "replicated", "spread_replicated"}


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"  # the stock strategy's DCP key of optimizer ``index``


class _Held:
    """A value as a stateful entry of a snapshot: what a save hands the engine (Lightning's dict
    is built anew at every save), and where a restore puts what was saved."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


class _ModelState:
    """The sharded model as the engine restores it: its state dict now (the ``DTensor`` layout
    each rank reads its box for), loaded as the stock strategy loads a sharded checkpoint."""

    def __init__(self, module: torch.nn.Module, strict: bool) -> None:
        self.module, self.strict = module, strict

    def state_dict(self) -> dict:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state, strict=self.strict)


class _OptimizerState:
    """An optimizer of the sharded model as the engine restores it: its state dict keyed by
    parameter names (``get_optimizer_state_dict`` creates the state of a fresh optimizer, laid out
    like its parameters), loaded as the stock strategy loads it."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, optim_state_dict=state)


class AsyncCkptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose checkpoints are async_ckpt snapshots in
    ``directory`` (one engine per rank, shared by every checkpoint path of the Trainer).

    ``save_checkpoint`` returns once this rank's pieces are staged; the checkpoint directory at
    the path appears once every rank's shard is durable and the snapshot committed (before the
    call returns when no Trainer stage runs: ``trainer.save_checkpoint`` after ``fit``).
    ``load_checkpoint`` restores a pointer's snapshot into the model and optimizers as they are
    laid out now (any world size or mesh) and returns Lightning's metadata; ``remove_checkpoint``
    deletes the directory and drops its snapshot once the saves before it are committed.

    The other arguments are ``ModelParallelStrategy``'s; ``save_distributed_checkpoint=False``
    (a full state gathered on rank 0) is refused. ``engine_options``: settings of the engine
    (``async_ckpt.options.EngineOptions``) such as ``compression`` or ``slots``; the strategy
    sets ``rank``, ``world_size``, ``every``, ``keep_last``, ``keep_every``, ``when_busy``,
    ``replicated`` and ``spread_replicated`` itself.
    """

    def __init__(self, directory: PathLike,
                 data_parallel_size: Union[Literal["auto"], int] = "auto",
                 tensor_parallel_size: Union[Literal["auto"], int] = "auto",
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout,
                 **engine_options: Any) -> None:
        fixed = sorted(_FIXED_OPTIONS & set(engine_options))
        if fixed:
            raise ValueError(f"AsyncCkptModelParallelStrategy sets {', '.join(fixed)} itself: "
                             "every rank saves whenever Lightning asks, save_top_k decides what "
                             "is kept, and Lightning's metadata is rank 0's, written once")
        if not save_distributed_checkpoint:
            raise UnsupportedOptionError(
                "AsyncCkptModelParallelStrategy saves each rank's shards "
                "(save_distributed_checkpoint=True): save_distributed_checkpoint=False gathers "
                "the whole state on rank 0 and writes one file, which is what asynchronous "
                "per-rank saves avoid. Leave it True (`python -m "
                "async_ckpt.integrations.lightning_sharded CHECKPOINT` makes a single file of a "
                "checkpoint afterwards), or use the stock ModelParallelStrategy")
        super().__init__(data_parallel_size, tensor_parallel_size, True, process_group_backend,
                         timeout)
        self.directory = os.path.abspath(os.fspath(directory))
        self._engine_options = {"heartbeat_interval": None, **engine_options,
                                "keep_last": _KEEP_ALL, "replicated": [META, LAYOUT],
                                "spread_replicated": False}
        self._engine: Optional[CheckpointEngine] = None
        self._held: dict[str, _Held] = {}  # the engine's entries a restore puts the saved values in
        self._next_step = 0
        self._saves: dict[str, int] = {}  # path -> step of this stage's newest save to it
        self._removing: set[str] = set()  # rank 0: paths whose removal is queued behind saves
        self._in_stage = False  # between setup and teardown of a Trainer stage
        self._patched: list = []  # ModelCheckpoints whose file_exists sees the saves in flight
        self._rng_to_restore: Optional[dict] = None  # a resumed fit's RNG, set at on_train_start
        self._warned: set[str] = set()

    # --- the Trainer's stages -----------------------------------------------------------------

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self._in_stage = True
        if any(getattr(c, "save_last", None) == "link" for c in trainer.checkpoint_callbacks):
            self._warn_once("link", LAST_LINK_DANGLES)
        self._patched += _count_saves_in_flight_as_files(trainer, self)
        if trainer.state.fn == TrainerFn.FITTING:
            self._open()  # waits for a killed run's writers; the first save does not pay for it

    def on_train_start(self) -> None:
        """Set the RNG a resumed fit restored back: Lightning drew from it since (it builds and
        iterates the DataLoaders after loading), and the interrupted run stood here when it
        saved; right before the first batch."""
        super().on_train_start()
        if self._rng_to_restore is not None:
            GlobalRNG().load_state_dict(self._rng_to_restore)
            self._rng_to_restore = None

    def teardown(self) -> None:
        """Wait for the saves in flight (their checkpoint directories are written), then stop the
        writers; runs after an exception too. A save from here on waits for its commit."""
        self._in_stage = False
        self._rng_to_restore = None
        _stop_counting_saves_in_flight(self._patched)
        self._close()
        super().teardown()

    # --- what Lightning saves -----------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict where it lives (the stock strategy copies it to the
        CPU first): the engine copies each rank's pieces once, into its staging memory."""
        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike,
                        storage_options: Optional[Any] = None) -> None:
        """Snapshot ``checkpoint``: every rank stages its pieces of the model and optimizers,
        rank 0's metadata goes to every rank and is saved once; the directory at ``filepath``
        appears once the snapshot is committed, and the snapshot it named before is dropped
        after that."""
        if storage_options is not None:
            raise UnsupportedOptionError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                "AsyncCkptModelParallelStrategy: its engine's settings are given once, as "
                "AsyncCkptModelParallelStrategy(directory, ..., **options). Save without "
                "storage_options")
        path = os.path.abspath(os.fspath(self.broadcast(filepath)))  # rank 0's path, as stock
        engine = self._open()
        state = {MODEL: _Held(checkpoint.pop("state_dict"))}
        for index, optimizer in enumerate(checkpoint.pop("optimizer_states", [])):
            state[_optimizer_key(index)] = _Held(optimizer)
        meta = _encodable_hparams(self.broadcast(checkpoint))  # rank 0's, as the stock meta.pt
        if _loses_data_position(meta):
            self._warn_once("data", DATA_POSITION_LOST)
        state[META], state[LAYOUT] = _Held(meta), _Held(self._layout())
        step = self._next_step
        replaced = self._replaced_by_save(path)
        markers = []
        if self.is_global_zero:
            os.makedirs(os.path.dirname(path), exist_ok=True)  # as stock: a link may go there
            markers.append(Marker(path, files=((_METADATA_FILENAME, Derived("torch", entry=META)),
                                               pointer_file(self.directory, path, step))))
        try:
            engine.snapshot(step, state=state, force=True, markers=markers)
        except EncodingError as e:
            raise _unencodable(e, "AsyncCkptModelParallelStrategy(directory, ..., "
                                  "allow_pickle=True)") from e
        self._next_step += 1
        self._saves[path] = step
        self._removing.discard(path)
        if replaced is not None:
            engine.drop([replaced], wait=False)  # queued: once the new snapshot is committed
        if not self._in_stage:
            self._close()

    def remove_checkpoint(self, filepath: PathLike) -> None:
        """Delete the checkpoint directory at ``filepath`` and drop its snapshot, in one turn of
        rank 0's writer queued behind the saves in flight (so a kill leaves both or neither,
        and a save still in flight is committed first); anything else (a link, a stock
        checkpoint) is removed as the stock strategy removes it."""
        path = os.path.abspath(os.fspath(filepath))
        pending = self._saves.pop(path, None)
        engine = self._open()  # on every rank, as Lightning calls this (opening agrees)
        if self.is_global_zero and os.path.islink(path):
            os.unlink(path)  # save_last="link": the link only, never what it points to
        elif self.is_global_zero:
            step = pending if pending is not None else self._own_step(path)
            if step is None:
                TorchCheckpointIO().remove_checkpoint(path)
            else:
                self._removing.add(path)
                engine.drop([step], wait=False, files=[path])
        if not self._in_stage:
            self._close()

    # --- what Lightning loads -----------------------------------------------------------------

    def load_checkpoint(self, checkpoint_path: PathLike,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore the snapshot the checkpoint directory names into the model and optimizers
        (each rank reads its box of every tensor: any world size and mesh) and return Lightning's
        metadata; any other checkpoint is loaded by the stock strategy. A damaged or dropped
        snapshot raises its typed error, except for a ``last*.ckpt`` (``ckpt_path="last"``):
        then the newest committed snapshot that verifies is loaded, with a warning."""
        path = os.path.abspath(os.fspath(self.broadcast(checkpoint_path)))
        if self.is_global_zero and self._engine is not None:
            self._engine.wait()  # a save to it may be in flight: its directory comes at commit
        found = self.broadcast(_pointer_or_error(path) if self.is_global_zero else None)
        if isinstance(found, CheckpointError):
            raise found
        if found is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        directory, step = found
        if os.path.realpath(directory) != os.path.realpath(self.directory):
            raise PointerFileError(
                f"{path} names snapshot {step} of the checkpoint directory {directory}, and this "
                f"strategy's is {self.directory}: load it with "
                f"AsyncCkptModelParallelStrategy({directory!r}, ...)")
        engine = self._open()
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        rng = None if fitting else GlobalRNG().state_dict()  # restore() sets the saved one
        _read_named_or_newest(lambda s: engine.restore(s, strict=fitting), step, path,
                              self.directory, lambda restored: f"snapshot {restored}")
        if fitting:
            self._rng_to_restore = GlobalRNG().state_dict()  # as restore set it: set again later
        else:  # validate, test, predict: the RNG stays as it was, as with the stock strategy
            GlobalRNG().load_state_dict(rng)
        meta = _restored_hparams(dict(self._held[META].value))
        self._warn_if_data_position_moves(self._held[LAYOUT].value, meta)
        return meta

    # --- the engine ---------------------------------------------------------------------------

    def _open(self) -> CheckpointEngine:
        """The engine of this rank (all ranks open theirs together): what it restores into is
        the model and the optimizers as they are now. Saves are numbered on past the snapshots
        rank 0 finds committed."""
        if self._engine is None:
            strict = self.lightning_module.strict_loading
            self._held = {META: _Held({}), LAYOUT: _Held({})}
            state: dict[str, Any] = {MODEL: _ModelState(self.model, strict)}
            for index, optimizer in enumerate(self.optimizers):
                state[_optimizer_key(index)] = _OptimizerState(self.model, optimizer)
            self._engine = CheckpointEngine(self.directory, {**state, **self._held},
                                            **self._engine_options)
            self._next_step = self.broadcast(max(self._engine.committed_steps(), default=-1) + 1)
        return self._engine

    def _close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            self._saves.clear()
            self._removing.clear()
            engine.close()

    def _layout(self) -> dict:
        return {"world_size": self.world_size,
                "data_parallel_size": self.device_mesh["data_parallel"].size(),
                "tensor_parallel_size": self.device_mesh["tensor_parallel"].size()}

    def _replaced_by_save(self, path: str) -> Optional[int]:
        """On rank 0: the snapshot the checkpoint at ``path`` names, which a save to it replaces
        (to be dropped once the new one is committed); None elsewhere, for a link (the save
        replaces the link, not what it points to) and for anything not of this engine."""
        if not self.is_global_zero or os.path.islink(path) or path in self._removing:
            return None
        step = self._saves.get(path)
        return step if step is not None else self._own_step(path)

    def _own_step(self, path: str) -> Optional[int]:
        """The step the checkpoint directory at ``path`` names in this engine's directory, or
        None (none of ours, another directory's, a damaged pointer: nothing to drop)."""
        found = _pointer_or_error(path)
        if found is None or isinstance(found, CheckpointError):
            return None
        directory, step = found
        return step if os.path.realpath(directory) == os.path.realpath(self.directory) else None

    def _exists(self, path: PathLike, fs: Any) -> bool:
        """Whether ``ModelCheckpoint`` should see a checkpoint at ``path`` (rank 0 decides): a
        save in flight there (or to what it links to) is one, one whose removal is queued is
        none."""
        local = os.path.abspath(os.fspath(path))
        if local in self._saves or (os.path.islink(local)
                                    and os.path.realpath(local) in self._saves):
            return True
        return local not in self._removing and fs.exists(path)

    def _warn_if_data_position_moves(self, saved: dict, meta: dict) -> None:
        """A checkpoint saved in the middle of an epoch, resumed with another number of
        data-parallel ranks: Lightning restores the loop's batch count, which splits the epoch
        differently now, so the rest of that epoch is not the samples the saved run had left."""
        before, now = saved.get("data_parallel_size"), self._layout()["data_parallel_size"]
        if before is not None and before != now and _is_mid_epoch(meta):
            warnings.warn(
                f"this checkpoint was saved in the middle of an epoch with {before} data-parallel "
                f"rank(s), and resumes with {now}: the model, optimizer and loops are restored "
                "exactly, but the DataLoaders' position counts batches of the old split, so the "
                "rest of this epoch repeats or skips samples (as with Lightning's own sharded "
                "checkpoints). Resume with the same data-parallel size, or reshard from a "
                "checkpoint saved at an epoch's end", RuntimeWarning, stacklevel=3)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _pointer_or_error(path: str) -> Union[None, Target, CheckpointError]:
    """What the checkpoint directory at ``path`` names, None for a
    checkpoint that is not ours, or the error a damaged pointer raises (to be shared)."""
    try:
        return read_pointer(path)
    except CheckpointError as e:
        return e


# --- one file of a sharded checkpoint ---------------------------------------------------------

def consolidate(checkpoint: PathLike, output_file: PathLike) -> None:
    """Write the checkpoint directory ``checkpoint`` (of :class:`AsyncCkptModelParallelStrategy`)
    as one file at ``output_file``: Lightning's metadata with the whole model state as
    ``state_dict`` and each optimizer's whole state in ``optimizer_states``, what Lightning's
    ``consolidate_checkpoint`` is meant to make of a sharded checkpoint. ``torch.load``
    (``weights_only=True``), ``LightningModule.load_from_checkpoint`` and a Trainer with the
    stock ``ModelParallelStrategy`` read it. The snapshot is verified while read; its tensors are
    assembled whole in this process's memory."""
    checkpoint = os.fspath(checkpoint)
    found = read_pointer(checkpoint)
    if found is None:
        raise PointerFileError(f"{checkpoint} is not a checkpoint directory written by "
                               "AsyncCkptModelParallelStrategy (no pointer to a snapshot in it)")
    directory, step = found
    _, state = load(directory, step, mmap=True, verify=True)
    optimizers = []
    while _optimizer_key(len(optimizers)) in state:
        optimizers.append(state[_optimizer_key(len(optimizers))])
    whole = {**state[META], MODEL: state[MODEL]}
    if optimizers:
        whole["optimizer_states"] = optimizers
    target = os.path.abspath(os.fspath(output_file))
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:  # created anew (never through a link planted there), then renamed: no half file
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            torch.save(whole, f)
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m async_ckpt.integrations.lightning_sharded",
        description="Write a checkpoint directory of AsyncCkptModelParallelStrategy as one file "
                    "that torch.load and Lightning read (what Lightning's consolidate_checkpoint "
                    "makes of a sharded checkpoint).")
    parser.add_argument("checkpoint_folder", help="the checkpoint directory (e.g. last.ckpt)")
    parser.add_argument("--output_file", help="the file to write (new; default: the directory's "
                                              "name with '.consolidated' appended)")
    args = parser.parse_args(argv)
    output = args.output_file or args.checkpoint_folder.rstrip(os.sep) + ".consolidated"
    if os.path.lexists(output):
        parser.error(f"{output} exists; pass another --output_file, or move it first")
    try:
        consolidate(args.checkpoint_folder, output)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
